"""dynamic_cp_merge's cost per call across 2 ranks, back to back (bench_dist.py's first case: 256
sequences of log-normal float32 outputs, local_cp_size 1, 2 groups).

    python benchmarks/dcp/prof_merge_dist.py [--backend nccl|gloo] [--profile OUT_DIR]

Per rank: the API on a nested output, the registered op with validate on and off (20 calls back
to back, best of 5 rounds, the ranks released together by a barrier), and the floor of the op's
header exchange alone (an all-gather of an int64 header of the same size, then its host read;
the op runs two such exchanges since the fixed-size agreement of the ranks came before it). With
--profile, rank 0 also writes cProfile listings of the op and the API and a torch.profiler table
to OUT_DIR/prof_merge_rank0.txt.
"""
import argparse
import datetime
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout


def work(rank, world, init_file, backend, out):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=dev, timeout=datetime.timedelta(seconds=120))
        sync = torch.cuda.synchronize
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        sync = lambda: None  # noqa: E731
    from bench_dist import lognormal_lengths

    from verl_ops import DynamicCPGroups, dynamic_cp_merge, dynamic_cp_split
    from verl_ops.dynamic_cp import group_name_of

    groups = DynamicCPGroups.for_group()
    B, median = 256, 1024
    out_lengths = lognormal_lengths(random.Random(B * 7 + median), B, median, 1.0, 16 * median)
    in_lengths = [1] * B
    in_lengths[0] = 10**6
    split = dynamic_cp_split(torch.zeros(sum(in_lengths), dtype=torch.int8, device=dev), 10**6,
                             lengths=in_lengths, groups=groups)
    g = torch.Generator().manual_seed(B)
    full = [torch.randn((n,), generator=g) for n in out_lengths]
    local = torch.nested.nested_tensor([full[i] for i in split.plan.sample_ids], layout=torch.jagged).to(dev)
    vals, lens = local.values(), local.offsets().diff()
    ids = torch.tensor(split.plan.sample_ids, device=dev)
    name = group_name_of(groups)
    ops = torch.ops.verl_ops
    fns = {
        "API, nested output": lambda: dynamic_cp_merge(local, split),
        "registered op": lambda: ops.dynamic_cp_merge(vals, lens, ids, B, 1, name, True, 0),
        "registered op, validate=False": lambda: ops.dynamic_cp_merge(vals, lens, ids, B, 1, name, False, 0),
    }
    hdr = torch.zeros(9 + 2 * B, dtype=torch.int64, device=dev)
    gathered = torch.empty(world * hdr.numel(), dtype=torch.int64, device=dev)

    def floor():
        dist.all_gather_into_tensor(gathered, hdr)
        gathered.cpu()

    fns["floor: header all-gather + host read"] = floor
    lines = []
    for k, fn in fns.items():
        for _ in range(10):
            fn()
        res = []
        for _ in range(5):
            dist.barrier()
            sync()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            sync()
            res.append((time.perf_counter() - t) / 20 * 1e6)
        lines.append(f"rank {rank} {k}: {min(res):.0f} us/call (best of 5 x 20; median {statistics.median(res):.0f})")
    print("\n".join(lines), flush=True)
    if out and rank == 0:
        import cProfile
        import io
        import pstats

        from torch.profiler import ProfilerActivity, profile
        for k in ("registered op", "API, nested output"):
            sync()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                fns[k]()
            sync()
            pr.disable()
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(22)
            lines += [f"=== cProfile, {k} (20 calls)", sio.getvalue()]
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend == "nccl" else [])
        with profile(activities=acts) as p:
            for _ in range(10):
                fns["registered op"]()
            sync()
        lines.append(p.key_averages().table(sort_by="cpu_time_total", row_limit=35))
        with open(os.path.join(out, "prof_merge_rank0.txt"), "w") as f:
            f.write("\n".join(lines))
    elif out:
        # the other rank joins rank 0's profiled calls
        for _ in range(40 + 10):
            fns["registered op" if _ < 20 or _ >= 40 else "API, nested output"]()
        sync()
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--profile", default=None, metavar="OUT_DIR")
    args = ap.parse_args()
    mp.spawn(work, args=(2, tempfile.mktemp(), args.backend, args.profile), nprocs=2)


if __name__ == "__main__":
    main()
