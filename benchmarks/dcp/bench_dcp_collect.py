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

import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)

common.use_tests_dir()

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
    times = {
        name: common.stepped_wall_time(lambda fn=fn: fn(outputs, BATCH, group), reps, group, device)
        for name, fn in (("verl", theirs), ("verl_ops", verl_dcp.postprocess_dynamic_cp_batch))
    }
    return equal, times, tokens


def main():
    args = common.dist_arguments(__doc__).parse_args()
    task = ("bench_dcp_collect:bench_rank", (args.backend, args.reps),
            lambda tokens: f"{BATCH} sequences, {tokens} tokens: log_probs + entropy fp32 jagged, values [256, 1]")
    return common.compare_with_verl(
        args, "postprocess_dynamic_cp_batch", ["outputs", "results equal"], [task],
        "verl's postprocess_dynamic_cp_batch not loadable (needs verl installed)")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
