"""MLA attention (causal, Dqk=192 / Dv=128, bf16) under context parallelism, per-rank time on NCCL.

One RL-ragged batch (log-normal lengths, median 1500, sigma 0.9, clipped to [64, 8192], ~32k
tokens, fixed seed; common.py's rl_ragged_lengths, as bench_mla.py's) with 16 and 128 heads, zigzag CP layout,
at every CP size the ranks allow (2, 4, 8: the world cut into CP groups of that size, all groups
running at once). Methods, each timed forward and forward+backward:

  ours (all-gather)    verl_ops.mla_cp_attention (cp_comm_type="all_gather"): K and V all-gathered
                       over the CP group, one varlen call per rank with the native Dv=128;
                       backward: K and V gathered again, dK/dV reduce-scattered
  all-gather, V padded the same with V zero-padded to 192 before the call (so the gather moves and
                       the kernels read 192-wide V) and the output trimmed to 128: what Megatron
                       does when it pads V for MLA, i.e. the cost of the pad
  ring (p2p)           verl_ops.mla_cp_attention(cp_comm_type="p2p"), Megatron's `p2p`: K/V blocks
                       passed around the ring with dist.batch_isend_irecv (the next block's
                       transfer overlapping this block's attention), one varlen call per step
                       (zigzag: step 0 causal on the own block; a block from a lower rank: all
                       local queries against its first chunks; from a higher rank: the local
                       second chunks against the whole block), partial outputs merged by
                       log-sum-exp in PyTorch elementwise ops (not fused); backward: the same ring,
                       dK/dV accumulators travelling with the blocks
  K/V all-gather alone the two all-gathers (forward) and two reduce-scatters (backward) of ours,
                       without attention: the communication floor of the all-gather methods
  single GPU / cp      mla_forward_padded over the whole batch on one GPU, divided by cp: the
                       ideal per-rank time (no communication, perfect balance)

Every method's output and q/k/v gradients are checked against the single-GPU full attention's rows
before timing (a method that fails is reported, not timed). Timing: the ranks start each repeat
together (barrier), CUDA events around the call, median of the repeats, the slowest rank's median.

    torchrun --nproc_per_node 4 benchmarks/megatron/bench_mla_cp.py --out results_mla_cp.json
    torchrun --nproc_per_node 2 benchmarks/megatron/bench_mla_cp.py --tiny     # CPU / gloo / float32 smoke test
    python3 benchmarks/megatron/bench_mla_cp.py --tiny --nproc 2              # the same, spawning the ranks
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402,F401

import torch.distributed as dist  # noqa: E402

from common import rl_ragged_lengths  # noqa: E402

from verl_ops import DynamicCPGroups, ThdLayout  # noqa: E402

_ops = torch.ops.verl_ops
DQK, DV = 192, 128

# --------------------------------------------------------------------------------------------
# Timing (common.ranked_time, as bench_dist.py's: barrier before each repeat, CUDA events, median,
# slowest rank).


def timeit(fn, device, repeats, warmup):
    return common.ranked_time(fn, device, repeats, warmup)


# --------------------------------------------------------------------------------------------
# One batch.


def saved_bytes(fn, q, k, v):
    """Bytes of the tensors autograd keeps for the backward of fn(q, k, v), beyond q, k and v
    themselves (each storage counted once)."""
    sizes = {}

    def pack(t):
        st = t.untyped_storage()
        sizes[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, k, v)
    for x in (q, k, v):
        sizes.pop(x.untyped_storage().data_ptr(), None)
    del out
    return sum(sizes.values())


def _rel_err(got, want):
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


def bench_case(rank, world, device, dtype, cp, heads, lengths, args, rows):
    groups = DynamicCPGroups.for_group()
    group = groups.cp_group(cp)
    r = dist.get_rank(group)
    layout = ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout="zigzag")
    cu_cpu = layout.cu_seqlens_padded_cpu
    cu_padded = cu_cpu.tolist()
    cu = cu_cpu.to(device)
    total, max_seqlen = layout.total_padded, layout.max_seqlen
    scale = 1.0 / math.sqrt(DQK)
    dqk, dv = DQK, DV

    # The full batch, the same on every rank (seeded), and this rank's zigzag rows.
    g = torch.Generator(device=device).manual_seed(1000 + heads)
    q, k = (torch.randn(total, heads, dqk, device=device, dtype=dtype, generator=g) for _ in range(2))
    v, grad = (torch.randn(total, heads, dv, device=device, dtype=dtype, generator=g) for _ in range(2))
    idx = []
    for a, b in zip(cu_padded[:-1], cu_padded[1:]):
        c = (b - a) // (2 * cp)
        idx += [torch.arange(a + r * c, a + (r + 1) * c), torch.arange(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c)]
    idx = torch.cat(idx).to(device)
    ql, kl, vl, gl = (x.index_select(0, idx).contiguous() for x in (q, k, v, grad))

    def full(q_, k_, v_):
        return verl_ops.mla_forward_padded(q_, k_, v_, cu, cu, max_seqlen, max_seqlen, causal=True,
                                           softmax_scale=scale, validate=False)

    def ours(q_, k_, v_):
        return verl_ops.mla_cp_attention(q_, k_, v_, cu, max_seqlen, cp_group=group, cp_layout="zigzag",
                                         softmax_scale=scale)

    def padded_v(q_, k_, v_):
        out = verl_ops.mla_cp_attention(q_, k_, F.pad(v_, (0, dqk - dv)), cu, max_seqlen, cp_group=group,
                                        cp_layout="zigzag", softmax_scale=scale)
        return out[..., :dv]

    def ring(q_, k_, v_):
        return verl_ops.mla_cp_attention(q_, k_, v_, cu, max_seqlen, cp_group=group, cp_layout="zigzag",
                                         softmax_scale=scale, cp_comm_type="p2p")

    kg = torch.empty((cp * kl.shape[0],) + tuple(kl.shape[1:]), dtype=dtype, device=device)
    vg = torch.empty((cp * vl.shape[0],) + tuple(vl.shape[1:]), dtype=dtype, device=device)
    ks, vs = torch.empty_like(kl), torch.empty_like(vl)
    gloo = dist.get_backend(group) == "gloo"

    def comm_fwd():
        dist.all_gather_into_tensor(kg, kl, group=group)
        dist.all_gather_into_tensor(vg, vl, group=group)

    def comm_all():
        comm_fwd()
        if gloo:  # gloo has no reduce-scatter: all-reduce (what mla_cp_attention does there)
            dist.all_reduce(kg, group=group)
            dist.all_reduce(vg, group=group)
        else:
            dist.reduce_scatter_tensor(ks, kg, group=group)
            dist.reduce_scatter_tensor(vs, vg, group=group)

    # The reference: single-device attention over the whole batch, this rank's rows.
    qf, kf, vf = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = full(qf, kf, vf)
    ref.backward(grad)
    want = [x.index_select(0, idx) for x in (ref.detach(), qf.grad, kf.grad, vf.grad)]
    del qf, kf, vf, ref
    tol = 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4

    def fwd_bwd_of(fn, qg, kg_, vg_):
        def step():
            o = fn(qg, kg_, vg_)
            o.backward(gl)
            qg.grad = kg_.grad = vg_.grad = None
        return step

    label = f"{heads}"
    results = {}
    for name, fn in (("ours (all-gather)", ours), ("all-gather, V padded to 192", padded_v), ("ring (p2p)", ring)):
        row = {"method": name, "cp": cp, "heads": heads}
        try:
            qg, kg_, vg_ = (x.detach().clone().requires_grad_(True) for x in (ql, kl, vl))
            o = fn(qg, kg_, vg_)
            o.backward(gl)
            errs = [_rel_err(a, b) for a, b in zip((o.detach(), qg.grad, kg_.grad, vg_.grad), want)]
            row["max_err"] = max(errs)
            if not max(errs) < tol:
                raise RuntimeError(f"mismatch against the single-device attention: errors out/dq/dk/dv {errs}")
            qg.grad = kg_.grad = vg_.grad = None
            row["saved_mb"] = saved_bytes(fn, qg, kg_, vg_) / 1e6
            with torch.no_grad():
                row["fwd_s"] = timeit(lambda: fn(ql, kl, vl), device, args.repeats, args.warmup)
            row["all_s"] = timeit(fwd_bwd_of(fn, qg, kg_, vg_), device, args.repeats, args.warmup)
        except Exception as e:  # report, keep going (every rank reaches the same point: same checks)
            row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            if os.environ.get("BENCH_MLA_CP_TRACE"):
                traceback.print_exc()
        results[name] = row
    comm = {"method": "K/V all-gather alone (comm floor of the all-gathers)", "cp": cp, "heads": heads}
    comm["fwd_s"] = timeit(comm_fwd, device, args.repeats, args.warmup)
    comm["all_s"] = timeit(comm_all, device, args.repeats, args.warmup)
    # Every rank runs it at once (each on its own device); the slowest rank's median is reported.
    single = {"method": "single device, whole batch / cp (ideal)", "cp": cp, "heads": heads}
    qf, kf, vf = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    with torch.no_grad():
        single["fwd_s"] = timeit(lambda: full(q, k, v), device, args.repeats, args.warmup) / cp

    def full_step():
        o = full(qf, kf, vf)
        o.backward(grad)
        qf.grad = kf.grad = vf.grad = None

    single["all_s"] = timeit(full_step, device, args.repeats, args.warmup) / cp
    single["saved_mb"] = saved_bytes(full, qf, kf, vf) / 1e6 / cp
    del qf, kf, vf
    base = results["ours (all-gather)"]
    for row in (*results.values(), comm, single):
        for key in ("fwd", "all"):
            if f"{key}_s" in row and f"{key}_s" in base:
                row[f"{key}_ratio"] = row[f"{key}_s"] / base[f"{key}_s"]
        row["batch"] = f"{len(lengths)} seqs, {sum(lengths)} tokens, H{label}"
        rows.append(row)


def summary(rows):
    """One line per (cp, heads): each method's time over ours, and ours over the ideal."""
    lines = []
    keys = sorted({(r["cp"], r["heads"]) for r in rows})
    for cp, heads in keys:
        by = {r["method"]: r for r in rows if (r["cp"], r["heads"]) == (cp, heads) and "error" not in r}
        parts = []
        for name, short in (("ring (p2p)", "ring"), ("all-gather, V padded to 192", "V padded"),
                            ("single device, whole batch / cp (ideal)", "ideal")):
            if name in by and "fwd_ratio" in by[name]:
                parts.append(f"{short} / ours: fwd {by[name]['fwd_ratio']:.2f}x, fwd+bwd {by[name]['all_ratio']:.2f}x")
            elif name in {r["method"] for r in rows if (r["cp"], r["heads"]) == (cp, heads)}:
                parts.append(f"{short}: failed (see the table)")
        lines.append(f"- cp={cp}, {heads} heads: " + "; ".join(parts))
    return lines


def fmt_ms(s):
    return f"{s * 1e3:.3f}" if s is not None else "—"


def markdown(rows):
    lines = common.md_table(["method", "cp", "heads", "fwd ms", "fwd+bwd ms", "fwd / ours", "fwd+bwd / ours",
                             "saved for bwd MB/rank", "max err"], [])
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['cp']} | {r['heads']} | error: {r['error']} | | | | | |")
            continue
        err = f"{r['max_err']:.1e}" if "max_err" in r else ""
        saved = f"{r['saved_mb']:.1f}" if "saved_mb" in r else ""
        lines.append(
            f"| {r['method']} | {r['cp']} | {r['heads']} | {fmt_ms(r.get('fwd_s'))} | {fmt_ms(r.get('all_s'))} "
            f"| {r.get('fwd_ratio', float('nan')):.2f}x | {r.get('all_ratio', float('nan')):.2f}x | {saved} | {err} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def run(rank, world, args, init_file=None):
    backend = "gloo" if args.tiny else "nccl"
    if backend == "nccl":
        dtype = torch.bfloat16
    else:
        dtype = torch.float32
        torch.set_num_threads(1)
    device = common.init_ranks(rank, world, backend, init_file, timeout_s=600)
    if args.tiny:
        lengths = rl_ragged_lengths(args.seed, tokens=384, median=60, sigma=0.9, lo=4, hi=200)
        heads_list = [2, 4]
    else:
        lengths = rl_ragged_lengths(args.seed, tokens=args.tokens)
        heads_list = [int(h) for h in args.heads.split(",")]
    groups = DynamicCPGroups.for_group()
    cps = [c for c in (2, 4, 8) if c <= world and c in groups.sizes]
    if args.cp:
        cps = [c for c in cps if c in {int(x) for x in args.cp.split(",")}]
    rows = []
    for cp in cps:
        for heads in heads_list:
            bench_case(rank, world, device, dtype, cp, heads, lengths, args, rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        dev = common.gpu_name(device)
        head = [
            f"## MLA attention under CP, {world} x {dev}, {backend}, {str(dtype).replace('torch.', '')}",
            "",
            f"{datetime.date.today()}, torch {torch.__version__}, commit {common.commit()}, command: "
            f"`{common.command()}`. Causal, Dqk={DQK} / Dv={DV}, zigzag layout; "
            f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {lengths}. Per-rank time: median of "
            f"{args.repeats} repeats after {args.warmup} warm-up, slowest rank; each CP group of the world runs "
            "at once. Measured: forward and forward+backward of every method (the ring's backward included); "
            "the ring's log-sum-exp merges are unfused PyTorch ops. 'saved for bwd': bytes autograd keeps "
            "for the backward beyond q, k, v (each storage once; the single-device row divided by cp). "
            "max err: largest |error| / max(|reference|, 1) of out, dq, dk, dv against the single-device "
            "attention's rows. Not measured: a ring with fused merges (TransformerEngine's), a2a / "
            "hierarchical CP, overlap with other layers' work.",
            "",
        ]
        text = "\n".join(head) + markdown(rows) + "\n\n" + "\n".join(summary(rows))
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": dev, "world": world, "backend": backend, "dtype": str(dtype),
                           "torch": torch.__version__, "date": str(datetime.date.today()), "commit": common.commit(),
                           "command": common.command(), "lengths": lengths,
                           "repeats": args.repeats, "warmup": args.warmup, "rows": rows, "markdown": text}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, float32, a few hundred tokens (a smoke test)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: every GPU; 2 with --tiny); "
                    "ignored under torchrun")
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cp", default=None, help="comma-separated CP sizes (default: 2, 4, 8 up to the world size)")
    ap.add_argument("--repeats", type=int, default=None, help="default 20 (tiny: 3)")
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (tiny: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows (and the markdown table) as JSON here")
    args = ap.parse_args()
    args.repeats = args.repeats or (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    nproc = args.nproc or (2 if args.tiny else torch.cuda.device_count())
    common.launch(run, args, nproc, "bench_mla_cp: needs at least 2 ranks (2 GPUs without --tiny)")


if __name__ == "__main__":
    main()
