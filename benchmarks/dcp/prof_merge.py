"""Host profile of dynamic_cp_merge's op on one device (no group: the merge path without collectives).

Usage: python benchmarks/dcp/prof_merge.py [device (default cuda)] [B (default 256)]

Times the op on B sequences of log-normal lengths (mean ~1600 rows), then on B sequences of 0-3
rows, where the row copy is negligible: on the CPU, whose copy is synchronous, that second time is
the host cost of the header, the reorder index and the checks. The profile is of the second case.
"""
import cProfile, pstats, sys, time, random
import torch, verl_ops
ops = torch.ops.verl_ops
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
B = int(sys.argv[2]) if len(sys.argv) > 2 else 256
rng = random.Random(0)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def case(lens):
    values = torch.randn(sum(lens), device=dev)
    lengths = torch.tensor(lens, device=dev)
    ids = torch.arange(B, device=dev)
    return lambda: ops.dynamic_cp_merge(values, lengths, ids, B, 1)


def per_call(fn, n, rounds):
    best = float("inf")
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(n): fn()
        sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


long_ = case([max(1, int(rng.lognormvariate(6.9, 1.0))) for _ in range(B)])
short = case([rng.randint(0, 3) for _ in range(B)])
for _ in range(20): long_(); short()
print(f"dynamic_cp_merge op, no group, B={B}: {per_call(long_, 20, 10):.1f} us/call "
      f"(log-normal lengths), {per_call(short, 100, 10):.1f} us/call (0-3 rows per sequence)")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): short()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(20)
