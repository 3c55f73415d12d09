"""Where the host time of verl's preprocess_thd_engine drop-in goes, line by line.

    PYTHONPATH=.:<dir with line_profiler> python benchmarks/overhead/prof_dropin.py [--seqs 256 1024] [--cp 1 4]

Runs the drop-in (megatron stubbed, as in bench_overhead.py) on a log-normal batch of token ids
under line_profiler, over the drop-in and the functions it calls (layout op, layout build,
PackedSeqParams, op call). Without line_profiler it prints a cProfile table instead.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py

import verl_ops  # noqa: E402
from common import lognormal_lengths  # noqa: E402
from verl_ops import _library, layout  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    import pytest
    import verl_stubs

    from verl_ops.integrations import verl as vi

    mp = pytest.MonkeyPatch()
    cfg = verl_stubs.install_megatron_stub(mp)
    device = torch.device(args.device)
    try:
        from line_profiler import LineProfiler
    except ImportError:
        LineProfiler = None
    funcs = [vi.preprocess_thd_engine, vi._make_packed_seq_params, vi._layout_rules,
             layout.ThdLayout._from_checked_offsets, layout.ThdLayout._from_host, layout._to_device,
             _library.call_op]
    for B in args.seqs:
        lens = lognormal_lengths(B, 256, seed=B)  # bench_overhead.py's batch
        values = torch.randint(0, 32000, (sum(lens),), device=device)
        offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device)
        nested = torch.nested.nested_tensor_from_jagged(values, offsets)
        for cp in args.cp:
            cfg.cp, cfg.cp_rank = cp, 0
            for _ in range(50):
                vi.preprocess_thd_engine(nested)
            print(f"\n===== {B} sequences, cp={cp}, {args.n} calls", flush=True)
            if LineProfiler is not None:
                lp = LineProfiler(*[getattr(f, "__func__", f) for f in funcs])
                lp.enable_by_count()
                for _ in range(args.n):
                    vi.preprocess_thd_engine(nested)
                lp.disable_by_count()
                lp.print_stats(output_unit=1e-6, stripzeros=True)
            else:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.n):
                    vi.preprocess_thd_engine(nested)
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    mp.undo()


if __name__ == "__main__":
    main()
