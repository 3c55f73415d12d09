"""CPU timings of the THD row ops (the raw ops: pack, unpack, jagged gather) on RL-ragged batches,
beside two aten floors measured in the same run: a plain copy of the same bytes (``clone``) and
TransformerEngine-style ``index_select`` with a precomputed index (the index itself not timed).

    python benchmarks/thd/bench_cpu_rows.py [--threads 1] [--reps 20]

CPU tensors are what the ops see under gloo, in CPU tests and where a caller keeps a batch on the
host; the batches are the ones bench_overhead uses (log-normal lengths, benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
from common import lognormal_lengths  # noqa: E402

import verl_ops  # noqa: E402

OPS = torch.ops.verl_ops


def best_us(fn, reps: int, rounds: int = 5) -> float:
    """Best of `rounds` means over `reps` calls, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the ops' CPU kernels use one)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, verl_ops {verl_ops.__version__}, {a.threads} thread(s)")
    print("| batch | op | verl_ops | clone (same bytes) | index_select (TE-style) |")
    print("|---|---|---|---|---|")
    for n, median, feat, dtype, label in (
        (256, 1000, (), torch.int64, "256 seqs ids int64"),
        (1024, 300, (1,), torch.float32, "1024 seqs fp32 [.,1]"),
        (32, 500, (512,), torch.bfloat16, "32 seqs hidden bf16 [.,512]"),
    ):
        lens = lognormal_lengths(n, median, 0)
        total = sum(lens)
        x = (torch.randint(0, 1000, (total, *feat)) if not dtype.is_floating_point else torch.randn(total, *feat)).to(dtype)
        for cp, layout in ((1, 0), (4, 0), (4, 1)):
            lay = verl_ops.ThdLayout.from_lengths(lens, cp_size=cp, cp_layout="zigzag" if layout == 0 else "contiguous")
            cu, cup, rows = lay.cu_seqlens, lay.cu_seqlens_padded, lay.local_rows
            name = f"cp={cp}" + ("" if cp == 1 else (" zigzag" if layout == 0 else " contiguous"))
            # pack of rank 0 vs the same number of rows copied / index-selected
            idx = torch.randint(0, total, (rows,))
            src_rows = x[:rows] if rows <= total else torch.cat([x, x])[:rows]
            t = best_us(lambda: OPS.preprocess_thd(x, cu, cup, rows, cp, 0, layout, False, None), a.reps)
            print(f"| {label} | pack, {name}, rank 0 ({rows} rows) | {t:.0f} µs | "
                  f"{best_us(lambda: src_rows.clone(), a.reps):.0f} µs | {best_us(lambda: x.index_select(0, idx), a.reps):.0f} µs |")
            shards = torch.stack([OPS.preprocess_thd(x, cu, cup, rows, cp, r, layout, False, None)[0] for r in range(cp)])
            back = OPS.postprocess_thd(shards, cu, cup, total, cp, -1, layout, False, None)
            assert torch.equal(back, x), "unpack does not invert pack"
            idx_all = torch.randint(0, shards.shape[0] * shards.shape[1], (total,))
            flat = shards.view(-1, *feat)
            t = best_us(lambda: OPS.postprocess_thd(shards, cu, cup, total, cp, -1, layout, False, None), a.reps)
            print(f"| {label} | unpack, {name}, all ranks ({total} rows) | {t:.0f} µs | "
                  f"{best_us(lambda: x.clone(), a.reps):.0f} µs | {best_us(lambda: flat.index_select(0, idx_all), a.reps):.0f} µs |")
        # jagged gather: the sequences in reverse order (a dynamic-CP merge's reorder)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()[:-1]], dtype=torch.int64)
        order = torch.arange(n - 1, -1, -1)
        rl = torch.tensor(lens)[order]
        cu_out = torch.zeros(n + 1, dtype=torch.int32)
        cu_out[1:] = rl.cumsum(0)
        src_starts = starts[order].contiguous()
        idx = torch.randint(0, total, (total,))
        t = best_us(lambda: OPS.jagged_gather(x, src_starts, cu_out, total), a.reps)
        print(f"| {label} | jagged_gather, sequences reversed ({total} rows) | {t:.0f} µs | "
              f"{best_us(lambda: x.clone(), a.reps):.0f} µs | {best_us(lambda: x.index_select(0, idx), a.reps):.0f} µs |")


if __name__ == "__main__":
    main()
