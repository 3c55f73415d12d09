"""Host profile of dynamic_cp_merge's op on one device (no group: the merge path without collectives)."""
import cProfile, pstats, sys, time, random
import torch, verl_ops
ops = torch.ops.verl_ops
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
B = 256
rng = random.Random(0)
lens = [max(1, int(rng.lognormvariate(6.9, 1.0))) for _ in range(B)]
values = torch.randn(sum(lens), device=dev)
lengths = torch.tensor(lens, device=dev)
ids = torch.arange(B, device=dev)
f = lambda: ops.dynamic_cp_merge(values, lengths, ids, B, 1)
for _ in range(20): f()
torch.cuda.synchronize() if dev.type == "cuda" else None
t = time.perf_counter()
for _ in range(200): f()
torch.cuda.synchronize() if dev.type == "cuda" else None
print(f"dynamic_cp_merge op, no group, B={B}: {(time.perf_counter() - t) / 200 * 1e6:.1f} us/call")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): f()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(20)
