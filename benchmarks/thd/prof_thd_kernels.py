"""Kernel time of the THD pack / unpack kernels alone (torch.profiler's CUDA kernel durations, no
launch or host time), on narrow rows (ids, [T, 1] log-probs) and wide ones (hidden, router rows).

    python benchmarks/thd/prof_thd_kernels.py [--reps 20]

Prints one markdown row per batch, cp size and direction (zigzag, rank 0 for pack, all ranks for
unpack). CUDA events around one call (bench_thd.py) include the gap before the kernel starts;
this isolates the kernel for comparing kernel changes."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
from common import lognormal_lengths, profile_calls  # noqa: E402
from verl_ops import ThdLayout  # noqa: E402
from verl_ops.layout import CP_LAYOUT_CODES  # noqa: E402

OPS = torch.ops.verl_ops
ZIGZAG = CP_LAYOUT_CODES["zigzag"]


CASES = [
    ("64 seqs ids int64", 64, 2000, (), torch.int64),
    ("256 seqs ids int64", 256, 2000, (), torch.int64),
    ("256 short seqs ids int64", 256, 256, (), torch.int64),
    ("3000 seqs ids int64", 3000, 150, (), torch.int64),
    ("1024 seqs fp32 [.,1]", 1024, 256, (1,), torch.float32),
    ("64 seqs hidden bf16 [.,1024]", 64, 2000, (1024,), torch.bfloat16),
    ("128 seqs router int16 [.,48,8]", 128, 2000, (48, 8), torch.int16),
]


def kernel_us(fn, reps):
    prof = profile_calls(fn, reps)
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "rows_kernel" in e.name]
    if not ks:
        raise RuntimeError("no rows_kernel in the profile")
    return sum(e.device_time for e in ks) / len(ks)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prof_thd_kernels: needs a CUDA device")
        return 1
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | tokens | cp | pack kernel | unpack kernel |")
    print("|---|---|---|---|---|")
    for label, b, median, feat, dtype in CASES:
        lengths = lognormal_lengths(b, median, seed=b)
        t = sum(lengths)
        x = (torch.randn(t, *feat, device="cuda") * 100).to(dtype)
        for cp in (1, 4):
            lay = ThdLayout.from_lengths(lengths, cp_size=cp, device="cuda")
            common = (lay.cu_seqlens, lay.cu_seqlens_padded)
            whole = OPS.preprocess_thd(x, *common, lay.local_rows, cp, -1, ZIGZAG, False, None)[0]
            pack = lambda: OPS.preprocess_thd(x, *common, lay.local_rows, cp, 0, ZIGZAG, False, None)  # noqa: E731
            unpack = lambda: OPS.postprocess_thd(whole, *common, t, cp, -1, ZIGZAG, False, None)  # noqa: E731
            print(f"| {label} | {t} | {cp} | {kernel_us(pack, args.reps):.2f} µs | {kernel_us(unpack, args.reps):.2f} µs |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
