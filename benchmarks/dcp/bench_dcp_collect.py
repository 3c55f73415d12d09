"""postprocess_dynamic_cp_batch (verl_ops.integrations.verl_dcp) against verl's own, over gloo (CPU)
or NCCL.

    python benchmarks/dcp/bench_dcp_collect.py [--world 2] [--backend gloo|nccl] [--out results_dcp.md]

A dynamic-CP step's outputs: 256 sequences with log-normal lengths (median 600, clipped to
[16, 8192]), split over the ranks in micro-batches of 8 sequences (each micro-batch held by a group
of one rank, i.e. every rank is the leader of its micro-batches), each micro-batch's outputs
``log_probs`` and ``entropy`` (fp32, one value per token, jagged) and a dense ``values [n, 1]``,
on the device under NCCL (as the model returns them) and on the CPU under gloo. Both functions
collect every rank's outputs in sample order on every rank (verl: each sample's part copied to the
host and all-gathered as Python objects, the nested tensors built on the host and copied back;
verl_ops: the parts' bytes in one tensor all-gather, the nested tensors built on the device). verl's
function is read from the installed verl (tests/test_verl_dcp_collect.py's loader). Wall time of
one call on rank 0 (median of the repeats, every rank calling in step), results compared first.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

BATCH, PER_MB = 256, 8


def _outputs(rank, world, device, seed=0):
    import torch

    rng = random.Random(seed)
    lens = [min(8192, max(16, int(600 * math.exp(rng.gauss(0, 1))))) for _ in range(BATCH)]
    mbs = [list(range(i, min(BATCH, i + PER_MB))) for i in range(0, BATCH, PER_MB)]
    out = []
    for m, ids in enumerate(mbs):
        if m % world != rank:
            continue
        g = torch.Generator().manual_seed(seed * 1000 + m)
        model_output = {
            key: torch.nested.nested_tensor_from_jagged(
                torch.randn(sum(lens[i] for i in ids), generator=g).to(device),
                torch.tensor([0, *torch.tensor([lens[i] for i in ids]).cumsum(0).tolist()], device=device),
            )
            for key in ("log_probs", "entropy")
        }
        model_output["values"] = torch.randn(len(ids), 1, generator=g).to(device)
        out.append({"_dcp_group_leader": True, "_dcp_sample_ids": ids, "model_output": model_output,
                    "loss": torch.tensor(float(m), device=device), "metrics": {"mb": m}})
    return out, sum(lens)


def bench_rank(rank, world_size, backend, reps):
    import torch
    import torch.distributed as dist
    from test_verl_dcp_collect import _owner_module, _same, verl_functions

    from verl_ops.integrations import verl_dcp

    try:
        theirs, append = verl_functions()
    except LookupError:
        return None
    _owner_module(append)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    outputs, tokens = _outputs(rank, world_size, device)
    group = dist.group.WORLD
    equal = True
    try:
        _same(verl_dcp.postprocess_dynamic_cp_batch(outputs, BATCH, group), theirs(outputs, BATCH, group))
    except AssertionError:
        equal = False
    times = {}
    for name, fn in (("verl", theirs), ("verl_ops", verl_dcp.postprocess_dynamic_cp_batch)):
        ts = []
        for _ in range(reps):
            dist.barrier(group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(outputs, BATCH, group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
    return equal, times, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from _dist import DistPool

    pool = DistPool(args.world, args.backend, pg_timeout_s=120.0)
    where = "on the CPU" if args.backend == "gloo" else f"({torch.cuda.get_device_name(0)} each)"
    lines = [f"### postprocess_dynamic_cp_batch vs verl's, {args.world} {args.backend} ranks {where} "
             f"(torch {torch.__version__})", "",
             "| outputs | verl | verl_ops | speedup | results equal |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    try:
        res = pool.run("bench_dcp_collect:bench_rank", args.backend, args.reps, timeout_s=900)
        if res[0] is None:
            print("verl's postprocess_dynamic_cp_batch not loadable (needs verl installed)")
            return 1
        equal, t, tokens = res[0]
        ok = all(r[0] for r in res)
        row = (f"| {BATCH} sequences, {tokens} tokens: log_probs + entropy fp32 jagged, values [256, 1] | "
               f"{t['verl'] * 1e3:.1f} ms | {t['verl_ops'] * 1e3:.1f} ms | {t['verl'] / t['verl_ops']:.1f}x | "
               f"{'yes' if ok else 'NO'} |")
        lines.append(row)
        print(row, flush=True)
    finally:
        pool.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
