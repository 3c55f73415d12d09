"""Benchmark of verl_ops.mla_forward_padded (THD attention, MLA head dims Dqk=192 / Dv=128).

    python benchmarks/mla/bench_mla.py --out benchmarks/results_mla.md
    python benchmarks/mla/bench_mla.py --quick            # two small shapes, few repeats
    python benchmarks/mla/bench_mla.py --batches ragged   # only the ragged batches

Uniform batches: 4 x 4096 tokens x 16 heads, 1 x 16384 x 16, 16 x 1024 x 16,
4 x 4096 x 128. Ragged batches: RL-ragged (lengths drawn log-normal, median 1500,
sigma 0.9, clipped to [64, 8192], until the batch holds 32k tokens; fixed seed; ~20 sequences)
with 16 and 128 heads, and 64 short sequences (lengths uniform in [64, 1024], fixed seed, 16
heads); their lengths are printed. Causal, bf16, Dqk=192, Dv=128, packed THD rows, one
cu_seqlens tensor for q and kv (self-attention, as Megatron passes it).

Methods, each timed forward and forward+backward (CUDA events, median of repeats after warm-up):
  ours padded       mla_forward_padded(backend="padded"): one pad kernel + torch's varlen
                    FlashAttention, output as a view (no trim copy)
  ours native       mla_forward_padded(backend="native"): cuDNN SDPA with Dv != Dqk through the
                    dense (graph-cached) aten::_cudnn_attention_forward on a zero-copy view
  ours varlen       mla_forward_padded(backend="varlen"): cuDNN's fused attention on the packed
                    rows through the cuDNN frontend (builds with the frontend only)
  ours auto         mla_forward_padded(backend="auto")
  megatron path     F.pad(v) + aten::_flash_attention_forward (varlen) + [..., :Dv] (Megatron/verl)
  aten cudnn varlen aten::_cudnn_attention_forward with cum_seq offsets (torch's ragged cuDNN path;
                    rebuilds its cuDNN graph on every call in torch 2.11, a few repeats only)
  aten efficient    aten::_efficient_attention_forward with cu_seqlens and Dv=128 (no padding)
  sdpa <backend>    F.scaled_dot_product_attention on dense [B, H, S, D] views, one backend each
                    (flash, efficient, cudnn); a backend that rejects the shapes is reported as such
                    (uniform batches only)
  fa4 varlen        FlashAttention-4's flash_attn.cute.flash_attn_varlen_func with Dv=128 (the peer;
                    when flash-attn-4 is importable, else reported as missing)

FLOPs (useful work, causal, summed over the sequences, length S, H heads; a multiply-add counts 2):
  forward   = H * S^2 * (Dqk + Dv)        [QK^T: 2*S*S*Dqk*H/2, PV: 2*S*S*Dv*H/2]
  backward  = H * S^2 * (3*Dqk + 2*Dv)    [recompute QK^T, dP = dO V^T, dV, dQ, dK]
  fwd+bwd   = H * S^2 * (4*Dqk + 3*Dv)
TFLOP/s = FLOPs / median time; the floor is a bf16 8192^3 matmul measured in the same run.
Every method's output is checked first (rows of the longest sequence against a float32 reference);
a method that fails or errors is reported, never timed, and does not stop the script.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402
from common import matmul_tflops, rl_ragged_lengths, sustain, time_cuda  # noqa: E402,F401  (prof_mla_ops, bench_mla_cp use them from here too)

DQK, DV = 192, 128
SHAPES = [(4, 4096, 16), (1, 16384, 16), (16, 1024, 16), (4, 4096, 128)]
QUICK_SHAPES = [(2, 1024, 16), (4, 512, 16)]


def short_lengths(seed=0, count=64, lo=64, hi=1024):
    r = random.Random(seed)
    return [r.randint(lo, hi) for _ in range(count)]


def batches(kind, seed):
    """(label, lengths, heads) per batch."""
    uniform = [(f"{b}x{s} H{h}", [s] * b, h) for b, s, h in SHAPES]
    ragged = [
        (f"RL-ragged {sum(rl_ragged_lengths(seed))} tok H16", rl_ragged_lengths(seed), 16),
        (f"RL-ragged {sum(rl_ragged_lengths(seed))} tok H128", rl_ragged_lengths(seed), 128),
        (f"64 short {sum(short_lengths(seed))} tok H16", short_lengths(seed), 16),
    ]
    if kind == "quick":
        return [(f"{b}x{s} H{h}", [s] * b, h) for b, s, h in QUICK_SHAPES] + [
            ("RL-ragged 8k tok H16", rl_ragged_lengths(seed, tokens=8192), 16)
        ]
    return {"uniform": uniform, "ragged": ragged, "all": uniform + ragged}[kind]


def flops(lengths, heads):
    s2 = sum(n * n for n in lengths) * heads
    return s2 * (DQK + DV), s2 * (4 * DQK + 3 * DV)


def fa4_varlen():
    """FlashAttention-4's varlen function, or None when flash-attn-4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # not installed, or its CUDA DSL cannot load
        return None
    return flash_attn_varlen_func


# --------------------------------------------------------------------------------------------
# Methods: each returns out [T, H, Dv] from (q, k, v) that may require grad.


def make_methods(lengths, heads, cu, scale):
    t, seqlen = sum(lengths), max(lengths)
    batch = len(lengths)
    uniform = all(n == seqlen for n in lengths)

    def ours(backend):
        return lambda q, k, v: verl_ops.mla_forward_padded(
            q, k, v, cu, cu, seqlen, seqlen, causal=True, softmax_scale=scale, backend=backend, validate=False
        )

    def megatron(q, k, v):
        vp = F.pad(v, (0, DQK - DV))
        out = torch.ops.aten._flash_attention_forward(q, k, vp, cu, cu, seqlen, seqlen, 0.0, True, False, scale=scale)[0]
        return out[..., :DV]

    def cudnn_varlen(q, k, v):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, seqlen, seqlen, True, 0.0, True, False, scale=scale)[0]

    def efficient(q, k, v):
        out = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, cu, cu, seqlen, seqlen, 0.0, 1, True, scale=scale
        )[0]
        return out[0]

    def dense(backend):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kind = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

        def f(q, k, v):
            def bhsd(x):
                return x.view(batch, seqlen, heads, x.shape[-1]).transpose(1, 2)

            with sdpa_kernel([kind]):
                o = F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, scale=scale)
            return o.transpose(1, 2).reshape(t, heads, DV)

        return f

    fa4 = fa4_varlen()

    def fa4_call(q, k, v):
        if fa4 is None:
            raise RuntimeError("flash-attn-4 is not importable (pip install flash-attn-4; see benchmarks/device/fa4_setup.sh)")
        r = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen,
                softmax_scale=scale, causal=True)
        return r[0] if isinstance(r, tuple) else r

    methods = {
        "ours padded": (ours("padded"), None),
        "ours native": (ours("native"), None),
        "ours varlen": (ours("varlen"), None),
        "ours auto": (ours("auto"), None),
        "megatron path": (megatron, None),
        "fa4 varlen": (fa4_call, None),
        "aten cudnn varlen": (cudnn_varlen, 3),
        "aten efficient": (efficient, None),
    }
    if uniform:
        methods.update({
            "sdpa flash": (dense("flash"), None),
            "sdpa efficient": (dense("efficient"), None),
            "sdpa cudnn": (dense("cudnn"), None),
        })
    return methods


def reference_tail(q, k, v, s0, seqlen, scale, rows=128):
    """float32 attention of the last `rows` queries of the sequence at rows [s0, s0 + seqlen):
    [rows, H, Dv]."""
    rows = min(rows, seqlen)
    end = s0 + seqlen
    qs = q[end - rows : end].float().transpose(0, 1)
    ks = k[s0:end].float().transpose(0, 1)
    vs = v[s0:end].float().transpose(0, 1)
    scores = scale * qs @ ks.transpose(1, 2)
    i = torch.arange(seqlen - rows, seqlen, device=q.device).unsqueeze(1)
    j = torch.arange(seqlen, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(j > i, float("-inf"))
    return (scores.softmax(-1) @ vs).transpose(0, 1)


def run_batch(label, lengths, heads, reps, floor, gen, only=None, quiet=False, reverse=False, cooldown=0.0,
              sustain_s=0.0):
    t = sum(lengths)
    scale = 1.0 / math.sqrt(DQK)
    q = torch.randn(t, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(t, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(t, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, device="cuda", dtype=torch.int32)
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    ref = reference_tail(q, k, v, starts[longest], lengths[longest], scale)
    ref_end = starts[longest] + lengths[longest]
    f_fwd, f_all = flops(lengths, heads)
    rows = []
    todo = [(name, m) for name, m in make_methods(lengths, heads, cu, scale).items() if only is None or name in only]
    # Odd rounds run the methods in reverse order, so that no method always follows the same one:
    # a long high-power fwd+bwd before a method lowers the clocks that method's forward runs at
    # (measured: a fixed order put one backend's forward 6-11% behind the same kernels timed
    # alone). `cooldown` seconds of idle GPU before each timing start every method from the same
    # clocks.
    if reverse:
        todo.reverse()

    def settle(fn):
        """Before a timing: the idle cooldown, then the sustained run (either may be 0)."""
        if cooldown:
            time.sleep(cooldown)
        if sustain_s:
            sustain(fn, sustain_s)

    for name, (fn, rep_cap) in todo:
        n = min(reps, rep_cap) if rep_cap else reps
        row = {"method": name}
        try:
            with torch.no_grad():
                out = fn(q, k, v)
            torch.cuda.synchronize()
            if tuple(out.shape) != (t, heads, DV):
                raise RuntimeError(f"output shape {tuple(out.shape)}")
            err = float((out[ref_end - ref.shape[0] : ref_end].float() - ref).norm() / ref.norm())
            row["rel_err"] = err
            if not err < 2e-2:
                raise RuntimeError(f"output mismatch: relative error {err:.3g}")
            with torch.no_grad():
                settle(lambda: fn(q, k, v))
                row["fwd_s"] = time_cuda(lambda: fn(q, k, v), n, warmup=1 if rep_cap else 3)
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
            g = torch.randn(t, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)

            def fwd_bwd():
                o = fn(qg, kg, vg)
                torch.autograd.backward(o, g)
                qg.grad = kg.grad = vg.grad = None

            row["fwd_tflops"] = f_fwd / row["fwd_s"] / 1e12
            try:
                settle(fwd_bwd)
                row["all_s"] = time_cuda(fwd_bwd, n, warmup=1 if rep_cap else 3)
                row["all_tflops"] = f_all / row["all_s"] / 1e12
            except Exception as e:  # forward works, backward does not: report both
                row["bwd_error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}"
        except Exception as e:  # report, keep going
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            row["error"] = f"{type(e).__name__}: {msg[:160]}"
            if os.environ.get("BENCH_MLA_TRACE"):
                traceback.print_exc()
        rows.append(row)
        if not quiet:
            print(fmt_row(label, row, floor), flush=True)
    return rows


def merge_rounds(rounds, f_fwd, f_all):
    """One row per method from several rounds of run_batch (the methods interleaved within each
    round, in reverse order every other round, so that a drift of the GPU's clocks over the
    run hits them alike): the median of the rounds' median times (for an even number of rounds
    the mean of the middle two); a method whose forward (or backward) failed in any round keeps
    that round's error."""
    merged = []
    for first in rounds[0]:
        same = [row for rows in rounds for row in rows if row["method"] == first["method"]]
        bad = [r for r in same if "error" in r]
        if bad:
            merged.append(bad[0])
            continue
        row = dict(first)
        row["fwd_s"] = statistics.median(r["fwd_s"] for r in same)
        row["fwd_tflops"] = f_fwd / row["fwd_s"] / 1e12
        row["fwd_spread"] = max(r["fwd_s"] for r in same) / min(r["fwd_s"] for r in same)
        row.pop("all_s", None)
        row.pop("all_tflops", None)
        bwd_bad = [r for r in same if "bwd_error" in r]
        if bwd_bad:  # the backward failed in some round: report that, not another round's time
            row["bwd_error"] = bwd_bad[0]["bwd_error"]
        else:
            row.pop("bwd_error", None)
            row["all_s"] = statistics.median(r["all_s"] for r in same)
            row["all_tflops"] = f_all / row["all_s"] / 1e12
            row["all_spread"] = max(r["all_s"] for r in same) / min(r["all_s"] for r in same)
        merged.append(row)
    return merged


def fmt_row(shape, r, floor):
    if "error" in r:
        return f"| {shape} | {r['method']} | error: {r['error']} | | | | |"
    fwd = f"{r['fwd_s'] * 1e3:.3f} | {r['fwd_tflops']:.0f} ({r['fwd_tflops'] / floor:.0%})"
    if "bwd_error" in r:
        both = f"backward error: {r['bwd_error']} |"
    else:
        both = f"{r['all_s'] * 1e3:.3f} | {r['all_tflops']:.0f} ({r['all_tflops'] / floor:.0%})"
    return f"| {shape} | {r['method']} | {fwd} | {both} | {r['rel_err']:.1e} |"


HEADER = [
    "| batch | method | fwd ms | fwd TFLOP/s (of floor) | fwd+bwd ms | fwd+bwd TFLOP/s (of floor) | rel err |",
    "|---|---|---|---|---|---|---|",
]


def summary(results):
    lines = []
    for shape, rows in results:
        by = {r["method"]: r for r in rows if "error" not in r and "bwd_error" not in r}
        base = by.get("megatron path")
        if not base:
            continue
        for m in ("ours padded", "ours native", "ours varlen", "ours auto", "fa4 varlen"):
            if m in by:
                lines.append(
                    f"- {shape}: {m} vs megatron path: forward {base['fwd_s'] / by[m]['fwd_s']:.2f}x, "
                    f"fwd+bwd {base['all_s'] / by[m]['all_s']:.2f}x"
                )
        peer = by.get("fa4 varlen")
        for m in ("ours varlen", "ours auto"):
            if peer and m in by:
                lines.append(
                    f"- {shape}: {m} vs fa4 varlen: forward {peer['fwd_s'] / by[m]['fwd_s']:.2f}x, "
                    f"fwd+bwd {peer['all_s'] / by[m]['all_s']:.2f}x"
                )
    return lines


PLOT_METHODS = ("megatron path", "ours padded", "ours native", "ours varlen", "ours auto", "fa4 varlen", "sdpa cudnn")


def plot(results, floor, path):
    """Grouped bars: forward and forward+backward TFLOP/s per shape and method, floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
    shapes = [shape for shape, _ in results]
    width = 0.8 / len(PLOT_METHODS)
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "all_tflops", "forward + backward")):
        for i, m in enumerate(PLOT_METHODS):
            vals = []
            for _, rows in results:
                row = next((r for r in rows if r["method"] == m), {})
                vals.append(row.get(key, 0.0))
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=m)
        ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=f"bf16 matmul floor {floor:.0f}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=20, ha="right")
        ax.set_title(f"mla_forward_padded {title}, causal 192/128 bf16")
        ax.set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_markdown(path):
    """(results, floor) from a markdown section this script wrote (to re-plot saved numbers)."""
    results, floor = [], None
    for line in open(path):
        line = line.split("<!--")[0].rstrip()  # a row's spread over rounds, if any
        if "matmul floor" in line:
            floor = float(line.split(":")[-1].split()[0])
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 7 or cells[0].startswith(("batch", "shape", "---")) or "error" in cells[2]:
            continue
        row = {"method": cells[1], "fwd_tflops": float(cells[3].split()[0])}
        if cells[5][:1].isdigit():
            row["all_tflops"] = float(cells[5].split()[0])
        if not results or results[-1][0] != cells[0]:
            results.append((cells[0], []))
        results[-1][1].append(row)
    return results, floor


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two small shapes and an 8k-token ragged batch, few repeats")
    p.add_argument("--batches", choices=("all", "uniform", "ragged"), default="all",
                   help="which batches: the uniform shapes, the ragged batches, or both")
    p.add_argument("--shapes", default=None,
                   help="uniform batches instead of --batches: comma-separated BxSxH (e.g. '16x1024x16,4x4096x128')")
    p.add_argument("--reps", type=int, default=None, help="timed repeats per method (default 30; quick 5)")
    p.add_argument("--out", default=None, help="write a markdown section here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--replot", default=None, help="only re-plot a markdown section written by --out")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every method this many times per batch, the methods interleaved (in reverse "
                        "order every other round), and report the median over the rounds (default 1)")
    p.add_argument("--sustain", type=float, default=0.0,
                   help="seconds of back-to-back calls before each timing (and before the matmul floor's), so that "
                        "every method is timed at the clock the GPU holds under sustained load (its power cap) "
                        "rather than in a short burst at boost clocks (default 0: bursts)")
    p.add_argument("--cooldown", type=float, default=0.0,
                   help="seconds of idle GPU before each timing (same starting clocks for every method)")
    p.add_argument("--methods", default=None,
                   help="comma-separated subset of the methods (e.g. 'ours varlen,fa4 varlen'; default all)")
    args = p.parse_args(argv)
    if args.replot:
        results, floor = parse_markdown(args.replot)
        plot(results, floor, args.plot or "mla.png")
        return 0
    if not torch.cuda.is_available():
        print("bench_mla: needs a CUDA device")
        return 1
    if not verl_ops.cuda_available():
        print("bench_mla: verl_ops was built without its CUDA kernels")
        return 1
    reps = args.reps or (5 if args.quick else 30)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    floor = matmul_tflops(reps, args.sustain)
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, bf16 matmul floor {floor:.0f} TFLOP/s"
          + (f" (after {args.sustain:g} s sustained)" if args.sustain else ""))
    print(f"fa4 varlen: {'flash-attn-4 importable' if fa4_varlen() else 'flash-attn-4 not importable'}")
    print(f"varlen sequence order (VERL_OPS_VARLEN_ORDER): {os.environ.get('VERL_OPS_VARLEN_ORDER', 'largest_first')}")
    only = None
    if args.methods:
        only = {m.strip() for m in args.methods.split(",") if m.strip()}
    todo = batches("quick" if args.quick else args.batches, args.seed)
    if args.shapes:
        todo = []
        for spec in args.shapes.split(","):
            b, s_len, h = (int(x) for x in spec.strip().lower().split("x"))
            todo.append((f"{b}x{s_len} H{h}", [s_len] * b, h))
    for label, lengths, heads in todo:
        if len(set(lengths)) > 1:
            print(f"{label}: {len(lengths)} sequences, lengths {lengths}")
    print("\n".join(HEADER))
    results = []
    for label, lengths, heads in todo:
        if args.rounds > 1:
            rounds = [run_batch(label, lengths, heads, reps, floor, gen, only, quiet=True, reverse=r % 2 == 1,
                                cooldown=args.cooldown, sustain_s=args.sustain)
                      for r in range(args.rounds)]
            rows = merge_rounds(rounds, *flops(lengths, heads))  # round 0's order: make_methods'
            for r in rows:
                spread = "".join(f", {k[:-7]} spread {r[k]:.3f}" for k in ("fwd_spread", "all_spread") if k in r)
                print(fmt_row(label, r, floor) + (f" <!-- {args.rounds} rounds{spread} -->" if spread else ""),
                      flush=True)
        else:
            rows = run_batch(label, lengths, heads, reps, floor, gen, only, cooldown=args.cooldown,
                             sustain_s=args.sustain)
        results.append((label, rows))
    print(f"varlen plan cache: {verl_ops.mla_cache_info()}")
    lines = summary(results)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"## mla_forward_padded — {dev}\n\n")
            f.write(f"- date: {datetime.date.today()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
                    f"commit {common.commit()}\n")
            f.write(f"- command: `python {common.command()}`\n")
            f.write(f"- bf16 matmul floor (8192^3, same run): {floor:.0f} TFLOP/s\n")
            if args.rounds > 1:
                f.write(f"- {args.rounds} rounds per batch, the methods interleaved (reversed every other round), "
                        f"{args.cooldown:g} s idle before each timing; each time is the median over the rounds "
                        "(max / min of the rounds after the row)\n")
            if args.sustain:
                f.write(f"- {args.sustain:g} s of back-to-back calls before each timing (and the matmul floor): "
                        "times at the sustained clock\n")
            f.write(f"- varlen sequence order: {os.environ.get('VERL_OPS_VARLEN_ORDER', 'largest_first')}\n")
            for label, lengths, heads in todo:
                if len(set(lengths)) > 1:
                    f.write(f"- {label}: {len(lengths)} sequences, lengths {lengths}\n")
            f.write("- causal FLOPs: fwd = H*S^2*(Dqk+Dv), fwd+bwd = H*S^2*(4*Dqk+3*Dv) per sequence; Dqk=192, Dv=128, bf16\n\n")
            f.write("\n".join(HEADER) + "\n")
            for shape, rows in results:
                for r in rows:
                    spread = "".join(f", {k[:-7]} {r[k]:.3f}" for k in ("fwd_spread", "all_spread") if k in r)
                    f.write(fmt_row(shape, r, floor) + (f" <!-- spread{spread[1:]} -->" if spread else "") + "\n")
            f.write("\n" + "\n".join(lines) + "\n")
    if args.plot:
        plot(results, floor, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
