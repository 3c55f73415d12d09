"""The CPU row kernels split large outputs over threads (csrc/cpu/thd_kernels.h, for_row_ranges:
at least 1 MiB per thread; VERL_OPS_CPU_THREADS=N sets the count, read once per process). The
ranges cut through sequences and zigzag chunks, so every op that splits (pack, unpack, jagged
gather) is checked here against tests/reference.py in child processes with 1 and 3 threads, on
batches of several MiB with ragged lengths (plain, rolled and attention-mask paths). Whether a
split happens is not visible from Python; a planted off-by-one in the ranges failed the 3-thread
case and passed the 1-thread one when this was written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import random, sys
import torch
sys.path.insert(0, HERE)
from conftest import scattered_mask
from reference import ref_pack
import verl_ops

rng = random.Random(7)
failures = []
# >= 3.4 MiB of float32 rows per rank's output: 3 threads of at least 1 MiB each.
for cp, lay in [(1, "zigzag"), (2, "zigzag"), (4, "zigzag"), (2, "contiguous"), (3, "contiguous")]:
    for roll in (False, True):
        lengths = [rng.choice([1, 2, 7, 63]) if rng.random() < 0.3 else int(rng.lognormvariate(5.5, 0.9)) for _ in range(24)]
        lengths = [max(1, min(n, 2000)) for n in lengths]
        hidden = max(8, -(-(3_600_000 * cp // 4) // sum(lengths)))
        seqs = [torch.randn(n, hidden) for n in lengths]
        values = torch.cat(seqs)
        layout = verl_ops.ThdLayout.from_lengths(lengths, cp_size=cp, cp_layout=lay)
        cu_padded = layout.cu_seqlens_padded_cpu.tolist()
        shards = []
        for r in range(cp):
            packed, pos = verl_ops.preprocess_thd(values, layout, r, roll=roll)
            want, want_pos = ref_pack(seqs, cu_padded, cp, r, lay, roll)
            if not torch.equal(packed, want) or not torch.equal(pos, want_pos):
                failures.append(f"pack cp={cp} {lay} roll={roll} rank {r}")
            shards.append(packed)
        if not roll:
            both = shards[0] if cp == 1 else torch.stack(shards)
            out = verl_ops.postprocess_thd(both, layout, as_nested=False)
            if not torch.equal(out, values):
                failures.append(f"unpack cp={cp} {lay}")
# attention mask (padded [B, S, F] input, valid tokens scattered in each row): the per-row path
lengths = [int(rng.lognormvariate(5.0, 0.8)) + 1 for _ in range(16)]
cap = max(lengths) + 37
hidden = -(-(3_600_000 * 2 // 4) // sum(lengths))
mask = scattered_mask(rng, lengths, cap)
padded = torch.randn(len(lengths), cap, hidden)
seqs = [padded[i][mask[i]] for i in range(len(lengths))]
layout = verl_ops.ThdLayout.from_lengths(lengths, cp_size=2, cp_layout="zigzag")
cu_padded = layout.cu_seqlens_padded_cpu.tolist()
shards = []
for r in range(2):
    packed, pos = verl_ops.preprocess_thd(padded, layout, r, attention_mask=mask)
    want, want_pos = ref_pack(seqs, cu_padded, 2, r, "zigzag", False)
    if not torch.equal(packed, want) or not torch.equal(pos, want_pos):
        failures.append(f"masked pack rank {r}")
    shards.append(packed)
out = verl_ops.postprocess_thd(torch.stack(shards), layout, attention_mask=mask)
if not torch.equal(out, torch.where(mask[..., None], padded, torch.zeros(()))):
    failures.append("masked unpack")
# jagged gather: sequences picked in a shuffled order, some twice
lengths = [int(rng.lognormvariate(5.5, 0.9)) + 1 for _ in range(40)]
values = torch.randn(sum(lengths), 300)
starts = [sum(lengths[:i]) for i in range(len(lengths))]
pick = list(range(len(lengths))) + [3, 3, 17]
rng.shuffle(pick)
src_starts = torch.tensor([starts[i] for i in pick], dtype=torch.int64)
out_lens = [lengths[i] for i in pick]
cu_out = torch.tensor([0] + [sum(out_lens[: k + 1]) for k in range(len(out_lens))], dtype=torch.int32)
got = verl_ops.jagged_gather(values, src_starts, cu_out)
want = torch.cat([values[starts[i] : starts[i] + lengths[i]] for i in pick])
if not torch.equal(got, want):
    failures.append("jagged_gather")
print("FAIL " + "; ".join(failures) if failures else "OK")
"""


@pytest.mark.parametrize("threads", ["1", "3"])
def test_row_kernels_split_over_threads_match_the_reference(threads):
    env = dict(os.environ, VERL_OPS_CPU_THREADS=threads)
    r = subprocess.run(
        [sys.executable, "-c", f"HERE = {HERE!r}\n" + CHILD],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "OK", r.stdout + r.stderr
