"""pp_gather (verl_ops.integrations.verl_pp) against verl's own pp_gather, over gloo (CPU) or NCCL.

    python benchmarks/dcp/bench_pp_gather.py [--world 2] [--backend gloo|nccl] [--out results_pp.md]

Each rank is one pipeline stage holding its own MoE layers' router map; both functions gather
them into the map of every layer on the CPU, as verl records them (verl: an all-gather of layer counts plus a padded
tensor all-gather for dense maps, all_gather_object (pickles) for jagged ones; verl_ops: two
fixed-layout tensor all-gathers). Maps: an RL micro-batch of 256 sequences with log-normal lengths
(median 600, clipped to [16, 8192]) as a jagged [B, j, L_local, 8] int16 map, and a dense
[16, 4096, L_local, 8] int16 map; 24 MoE layers per stage. verl's function is read from the
installed verl (tests/test_verl_pp.py's loader). Wall time of one call on rank 0 (median of the
repeats, every rank calling in step), outputs compared element by element first. Under NCCL
(one GPU per rank) the maps stay CPU tensors, as verl records them: both functions move them to the
GPU for the collectives and return the gathered map on the CPU, so the copies are timed too.
"""

from __future__ import annotations

import math
import os
import random
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)

common.use_tests_dir()


def _maps(kind, pp_world, layers, seed=0):
    import torch

    rng = random.Random(seed)
    if kind == "jagged":
        lens = [min(8192, max(16, int(600 * math.exp(rng.gauss(0, 1))))) for _ in range(256)]
        out = []
        for r in range(pp_world):
            g = torch.Generator().manual_seed(seed + r)
            vals = torch.randint(0, 256, (sum(lens), layers, 8), generator=g).to(torch.int16)
            offs = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
            out.append(torch.nested.nested_tensor_from_jagged(vals, offs))
        return out
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (16, 4096, layers, 8), generator=g).to(torch.int16) for _ in range(pp_world)]


def bench_rank(rank, world_size, backend, device, kind, layers, reps):
    import torch
    from test_verl_pp import _rank_setup

    from verl_ops.integrations import verl_pp as pp

    group, pp_rank, theirs = _rank_setup(world_size, None, "cuda" if backend == "nccl" else "cpu")
    if theirs is None:
        return None
    tf = types.SimpleNamespace(pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=None)
    local = _maps(kind, world_size, layers)[pp_rank]
    a, b = pp.pp_gather(local, tf), theirs(local, tf)
    if a.is_nested:
        equal = torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values())
    else:
        equal = a.shape == b.shape and torch.equal(a, b)
    times = {
        name: common.stepped_wall_time(lambda fn=fn: fn(local, tf), reps, group)
        for name, fn in (("verl", theirs), ("verl_ops", pp.pp_gather))
    }
    return equal, times, tuple(a.shape) if not a.is_nested else (a.size(0), "j", *a.shape[2:])


def main():
    ap = common.dist_arguments(__doc__)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    tasks = [
        ("bench_pp_gather:bench_rank", (args.backend, "cpu", kind, args.layers, args.reps),
         lambda shape, kind=kind: f"{kind} int16, {args.layers} layers/stage | {shape}")
        for kind in ("jagged", "dense")
    ]
    return common.compare_with_verl(
        args, "pp_gather", ["map", "gathered shape", "outputs equal"], tasks,
        "verl's pp_gather not loadable (needs verl and megatron-core installed)")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
