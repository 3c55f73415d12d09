"""Context-parallel collectives across GPUs: dynamic_cp_merge and postprocess_thd over a group.

1. dynamic_cp_merge (tensor collectives: a lengths header, one all-gather of the values, one
   jagged_gather) against verl's merge (all_gather_object of each rank's nested outputs over the
   whole DP group, keep one rank per CP group, rebuild a nested tensor), for micro-batches with
   log-normal output lengths, at every local_cp_size that leaves more than one group.
2. postprocess_thd(packed, layout, cp_rank, group=...) at cp 2 and 4 (as many as the GPUs allow)
   against the floor (a bare all_gather_into_tensor of the same shards) and a verl-style
   postprocess (all_gather into a list, then a Python loop over sequences and ranks).

Outputs are checked against each other before timing. Timing: CUDA events around each call
(host work included), the ranks start each repeat together (barrier), median of the repeats,
and the slowest rank's median is reported.

    python3 benchmarks/dcp/bench_dist.py --nproc 4 --out results_dist.md        # spawns the ranks
    torchrun --nproc-per-node 4 benchmarks/dcp/bench_dist.py --out results_dist.md
    python3 benchmarks/dcp/bench_dist.py --nproc 2 --backend gloo --quick      # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402,F401

import torch.distributed as dist  # noqa: E402

from verl_ops import DynamicCPGroups, ThdLayout, dynamic_cp_merge, dynamic_cp_split  # noqa: E402

# --------------------------------------------------------------------------------------------
# Timing.


def timeit(fn, device, repeats, warmup):
    """Barrier before each repeat, CUDA events, median per rank, the slowest rank's (common.ranked_time)."""
    return common.ranked_time(fn, device, repeats, warmup)


def fmt(s):
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def lognormal_lengths(rng, n, median, sigma, cap):
    return [min(cap, max(1, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# 1. Merge.


def verl_merge(local_nested, dp_rank, dp_size, local_cp_size, device):
    """verl's dynamic_cp_merge_output for one output key (all_gather_object over the DP group)."""
    objects = [None] * dp_size
    dist.all_gather_object(objects, local_nested)
    to_merge = objects[dp_rank % local_cp_size :: local_cp_size]
    return torch.nested.nested_tensor(sum([list(x.to(device).unbind()) for x in to_merge], []), layout=torch.jagged)


def bench_merge(rank, world, device, args, rows):
    groups = DynamicCPGroups.for_group()
    cases = [(256, 1024, torch.float32, ()), (512, 2048, torch.float32, ()), (256, 1024, torch.bfloat16, (64,))]
    if args.quick:
        cases = [(32, 64, torch.float32, ()), (32, 64, torch.bfloat16, (8,))]
    for B, median, dtype, feat in cases:
        for local_cp_size in [s for s in groups.sizes if world // s > 1]:
            rng = random.Random(B * 7 + median)
            out_lengths = lognormal_lengths(rng, B, median, 1.0, 16 * median)
            # Input lengths pick local_cp_size: one sequence of local_cp_size * max_per tokens.
            max_per = 10**6
            in_lengths = [1] * B
            in_lengths[0] = max_per * local_cp_size
            split = dynamic_cp_split(torch.zeros(sum(in_lengths), dtype=torch.int8, device=device), max_per,
                                     lengths=in_lengths, groups=groups)
            assert split.local_cp_size == local_cp_size
            g = torch.Generator(device="cpu").manual_seed(B)
            full = [torch.randn((n, *feat), generator=g).to(dtype) for n in out_lengths]
            ids = split.plan.sample_ids
            local = torch.nested.nested_tensor([full[i] for i in ids], layout=torch.jagged).to(device)
            ours = dynamic_cp_merge(local, split)
            theirs = verl_merge(local, rank, world, local_cp_size, device)
            expected = torch.cat(full).to(device)
            assert torch.equal(ours.values(), expected) and torch.equal(theirs.values(), expected)
            assert torch.equal(ours.offsets().cpu(), theirs.offsets().cpu())
            t_ours = timeit(lambda: dynamic_cp_merge(local, split), device, args.repeats, args.warmup)
            t_verl = timeit(lambda: verl_merge(local, rank, world, local_cp_size, device), device, max(3, args.repeats // 4), 1)
            # Floor: the values all-gather alone (largest group's bytes from every group).
            G = world // local_cp_size
            row_bytes = math.prod(feat) * torch.tensor([], dtype=dtype).element_size()
            max_total = max(sum(out_lengths[i] for i in grp) for grp in split.plan.groups)
            buf = torch.empty(max_total * row_bytes, dtype=torch.uint8, device=device)
            out = torch.empty(G * buf.numel(), dtype=torch.uint8, device=device)
            mg = groups.merge_group(local_cp_size)
            t_floor = timeit(lambda: dist.all_gather_into_tensor(out, buf, group=mg), device, args.repeats, args.warmup)
            rows.append(
                f"| {B} | {sum(out_lengths)} | {str(dtype).replace('torch.', '')}{list(feat) if feat else ''} | {local_cp_size} | {G} "
                f"| {G * max_total * row_bytes / 1e6:.1f} MB | {fmt(t_floor)} | {fmt(t_ours)} | {fmt(t_verl)} | {t_verl / t_ours:.1f}x |"
            )


# --------------------------------------------------------------------------------------------
# 2. postprocess_thd over a CP group.


def verl_postprocess(local, layout, cp_rank, cp, group):
    """verl's postprocess_packed_seqs for cp > 1, zigzag: all_gather to a list, then a loop."""
    shards = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(shards, local, group=group)
    shards[cp_rank] = local
    cu_padded = layout.cu_seqlens_padded_cpu.tolist()
    out = []
    for i, n in enumerate(layout.lengths):
        padded = cu_padded[i + 1] - cu_padded[i]
        half = padded // (2 * cp)
        start = cu_padded[i] // cp
        chunks = [None] * (2 * cp)
        for r in range(cp):
            o = shards[r]
            chunks[r] = o[start : start + half]
            chunks[2 * cp - 1 - r] = o[start + half : start + 2 * half]
        out.append(torch.cat(chunks)[:n])
    return torch.cat(out)


def bench_postprocess(rank, world, device, args, rows):
    groups = DynamicCPGroups.for_group()
    cases = [(64, 2048, torch.float32, ()), (256, 2048, torch.float32, ()), (32, 1024, torch.bfloat16, (4096,))]
    if args.quick:
        cases = [(16, 64, torch.float32, ()), (8, 32, torch.bfloat16, (64,))]
    for cp in [s for s in (2, 4, 8) if s <= world and s in groups.sizes]:
        group = groups.cp_group(cp)
        cp_rank = dist.get_rank(group)
        for B, median, dtype, feat in cases:
            rng = random.Random(B + median)
            lengths = lognormal_lengths(rng, B, median, 1.0, 16 * median)
            layout = ThdLayout.from_lengths(lengths, cp_size=cp, device=device)
            g = torch.Generator(device="cpu").manual_seed(B)
            values = torch.randn((sum(lengths), *feat), generator=g).to(dtype).to(device)
            packed, _ = verl_ops.preprocess_thd(values, layout, cp_rank)
            ours = verl_ops.postprocess_thd(packed, layout, cp_rank, group=group, as_nested=False)
            theirs = verl_postprocess(packed, layout, cp_rank, cp, group)
            assert torch.equal(ours, values) and torch.equal(theirs, values)
            t_check = timeit(lambda: verl_ops.postprocess_thd(packed, layout, cp_rank, group=group, as_nested=False),
                             device, args.repeats, args.warmup)
            t_ours = timeit(lambda: verl_ops.postprocess_thd(packed, layout, cp_rank, group=group, as_nested=False,
                                                             validate=False), device, args.repeats, args.warmup)
            t_verl = timeit(lambda: verl_postprocess(packed, layout, cp_rank, cp, group), device, max(3, args.repeats // 4), 1)
            flat = packed.reshape(-1)
            gathered = torch.empty(cp * flat.numel(), dtype=dtype, device=device)
            t_floor = timeit(lambda: dist.all_gather_into_tensor(gathered, flat, group=group), device, args.repeats,
                             args.warmup)
            nbytes = gathered.numel() * gathered.element_size()
            rows.append(
                f"| {cp} | {B} | {sum(lengths)} | {str(dtype).replace('torch.', '')}{list(feat) if feat else ''} "
                f"| {nbytes / 1e6:.1f} MB | {fmt(t_floor)} | {fmt(t_ours)} ({t_ours / t_floor:.2f}x) | {fmt(t_check)} "
                f"| {fmt(t_verl)} | {t_verl / t_ours:.1f}x |"
            )


# --------------------------------------------------------------------------------------------


def run(rank, world, args, init_file=None):
    device = common.init_ranks(rank, world, args.backend, init_file, timeout_s=300)
    merge_rows, post_rows = [], []
    if args.only in (None, "merge"):
        bench_merge(rank, world, device, args, merge_rows)
    if args.only in (None, "post"):
        bench_postprocess(rank, world, device, args, post_rows)
    if rank == 0:
        dev = common.gpu_name(device)
        lines = [
            f"## Context-parallel collectives, {world} x {dev}, {args.backend}",
            "",
            f"{datetime.date.today()}, torch {torch.__version__}, commit {common.commit()}, "
            f"command: `{common.command()}`. Median of {args.repeats} repeats "
            "(verl paths: a quarter of that), slowest rank, host work included.",
            "",
            "### dynamic_cp_merge vs verl's all_gather_object merge (contiguous assignment)",
            "",
            "| seqs | output tokens | output | local_cp_size | groups | gathered | values all-gather alone "
            "| dynamic_cp_merge | verl merge | speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *merge_rows,
            "",
            "### postprocess_thd over the CP group (zigzag) vs verl-style gather + loop",
            "",
            "| cp | seqs | tokens | output | gathered | all_gather_into_tensor alone (floor) | postprocess_thd "
            "(validate=False, x floor) | postprocess_thd (default: + layout check) | verl-style | speedup |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *post_rows,
        ]
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: every GPU); ignored under torchrun")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small cases (a smoke test)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--only", default=None, choices=["merge", "post"], help="run one of the two tables")
    args = ap.parse_args()
    nproc = args.nproc or (torch.cuda.device_count() if args.backend == "nccl" else 2)
    common.launch(run, args, nproc, "bench_dist: needs at least 2 ranks (2 GPUs for nccl)")


if __name__ == "__main__":
    main()
