"""Where the op-level time of MLA attention goes: per-kernel device time of one forward and one
forward+backward, for verl_ops' varlen backend and (when importable) FlashAttention-4, on batches of
benchmarks/mla/bench_mla.py. Complements bench_mla.py (which times whole calls) and the standalone kernel
harnesses (benchmarks/mla/harness/prof_mla_sm90*.sh, which time the kernels without torch).

    python benchmarks/mla/prof_mla_ops.py                       # 1 x 16384 and RL-ragged, 16 heads
    python benchmarks/mla/prof_mla_ops.py --batches "4x4096 H16"

Prints, per method and pass, the CUDA-event time of the call (median of --reps) and the summed
device time of each kernel under torch.profiler (averaged over --reps calls), largest first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_mla  # noqa: E402  (also puts benchmarks/ on the path: common.py)
from common import profile_calls  # noqa: E402


def named_batches(seed):
    rl = bench_mla.rl_ragged_lengths(seed)
    return {
        "1x16384 H16": ([16384], 16),
        "4x4096 H16": ([4096] * 4, 16),
        "RL-ragged H16": (rl, 16),
        "RL-ragged H128": (rl, 128),
        "64 short H16": (bench_mla.short_lengths(seed), 16),
    }


def kernel_table(fn, reps):
    prof = profile_calls(fn, reps, warmup=1)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.count > 0:
            rows.append((t / reps, e.count // reps, e.key))
    rows.sort(reverse=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1x16384 H16,RL-ragged H16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("prof_mla_ops.py needs a CUDA GPU")
    all_batches = named_batches(a.seed)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for label in [b.strip() for b in a.batches.split(",")]:
        lengths, heads = all_batches[label]
        t = sum(lengths)
        f_fwd, f_all = bench_mla.flops(lengths, heads)
        scale = 1.0 / math.sqrt(bench_mla.DQK)
        q = torch.randn(t, heads, bench_mla.DQK, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(t, heads, bench_mla.DQK, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(t, heads, bench_mla.DV, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(t, heads, bench_mla.DV, device="cuda", dtype=torch.bfloat16, generator=gen)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, device="cuda", dtype=torch.int32)
        methods = bench_mla.make_methods(lengths, heads, cu, scale)
        for name in ("ours varlen", "fa4 varlen"):
            fn = methods[name][0]
            try:
                with torch.no_grad():
                    fn(q, k, v)
            except Exception as e:  # flash-attn-4 missing: said, not fatal
                print(f"\n{label} / {name}: not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
                continue
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def fwd():
                with torch.no_grad():
                    fn(q, k, v)

            def fwd_bwd():
                o = fn(qg, kg, vg)
                torch.autograd.backward(o, g)
                qg.grad = kg.grad = vg.grad = None

            for pas, f, flops in (("fwd", fwd, f_fwd), ("fwd+bwd", fwd_bwd, f_all)):
                s = bench_mla.time_cuda(f, max(a.reps, 5))
                rows = kernel_table(f, a.reps)
                total = sum(r[0] for r in rows)
                print(f"\n{label} / {name} / {pas}: event {s * 1e3:.3f} ms ({flops / s / 1e12:.0f} TFLOP/s), "
                      f"kernels {total / 1e3:.3f} ms ({flops / (total * 1e-6) / 1e12:.0f} TFLOP/s)")
                for us, count, key in rows[:12]:
                    print(f"  {us:9.1f} us  x{count:<2d} {key[:110]}")


if __name__ == "__main__":
    main()
