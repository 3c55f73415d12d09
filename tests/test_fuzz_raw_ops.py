#!/usr/bin/env python
"""Seeded random fuzzer over the raw ops (``torch.ops.verl_ops.<name>.default``).

Its pytest functions run a fixed seed range on the CPU (and on CUDA where a GPU is present) and
fail on any finding. Run more cases with ``python tests/test_fuzz_raw_ops.py --device cpu --cases
20000 --seed S``.

The project standard it checks: bad input gets a clear error naming the op and the argument;
nothing crashes, hangs or writes out of bounds; nothing in a user's batch is silently lost or
reordered.

How a case is judged
--------------------
A case is built from its seed: a mostly valid call (ragged lengths with zeros and ones, a layout
from the reference layout rules, cp_size 1/2/4, both CP layouts, roll, padded inputs with a
scattered attention mask, several dtypes and feature shapes) with 0-2 random mutations applied
(bad offsets, wrong dtypes / dims / lengths, non-contiguous or expanded tensors, bad sizes and
ranks, ...). The verdict does not come from the mutation's label: each op has a *contract check*
written from docs/ops.md / the schema comments that looks at the actual arguments and lists what is
wrong with them, and a *reference* (tests/reference.py's layout and pack, router_reference's
stack) that gives the outputs of a valid call. A mutation that leaves the call valid (a
non-contiguous copy, an expanded tensor, cp_layout flipped on a layout that is valid both ways,
an offset shifted inside the padding) is therefore checked against the reference like an
unmutated call.

The kinds of contract violation (``Bad.kind``) and what they require:

* ``static`` shape / dtype / device / scalar-range errors: must raise on every device, and the
  Meta kernel must raise too (``meta=False`` for device mixes, which Meta cannot see);
* ``host``   value errors an op reads on the host whatever the device (the Python ops, layout
  ops): must raise on every device;
* ``value``  value errors in offset / index tensors: must raise on CPU; on CUDA the op does not
  read device tensors (no host synchronisation, by design), so it may return, but must not crash
  or touch memory out of bounds (run the CUDA fuzzer under compute-sanitizer);
* ``alloc``  an output too large to allocate (over 1 TiB): must raise, naming the op;
* ``either`` a bad input the op may reject, or report in its outputs (then compared);
* ``free``   a call whose result is unspecified (``validate=False`` with bad entries, an output of
  2 GiB - 1 TiB that may or may not fit): may raise or return; must not crash.

A raise must be a RuntimeError / ValueError / TypeError / IndexError whose message contains the
op's name (router_topk_record_layers reports as router_topk_record, as its schema comment says)
and one of the words of a violated check (the argument). A return on a valid call must equal the
reference (values, dtype, shape, device), and the Meta kernel must give the same shapes and dtypes
for the same arguments on the meta device.

Crash isolation: the cases run in child processes (``--worker``); a crash or hang is reported with
its seed, and the run goes on after it. Reproduce one case with
``python tests/test_fuzz_raw_ops.py --device cpu --seed S --cases 1 --inprocess -v``.
Standalone: ``python tests/test_fuzz_raw_ops.py --device cpu|cuda --cases N --seed S`` prints a
summary and exits non-zero on any finding (``--inprocess`` runs without child processes, e.g.
under ``compute-sanitizer`` or ``valgrind``).

Memory: the child processes run as in a container with a memory cgroup limit of
``VERL_OPS_FUZZ_MEMORY`` bytes (default 4 GiB; 0: the host's own bound), through the test hooks of
csrc/ops/stable.h (``VERL_OPS_PROC_CGROUP`` / ``VERL_OPS_CGROUP_ROOT`` pointed at a fake cgroup v1
tree). So a ``free`` output (2 GiB - 1 TiB) is allocated or refused the same way on every host:
without it, on a host with 128 GiB the two jobs' outputs of up to 128 GiB each were allocated and
filled at once, and the host ran out of memory (every op of either job then failed with
MemoryError or an unusable CUDA context).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pytest
import torch
from conftest import random_data, scattered_mask
from reference import layout_is_valid, ref_layout, ref_pack
from router_reference import verl_stack

import verl_ops  # noqa: F401  (registers torch.ops.verl_ops)

ops = torch.ops.verl_ops
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
DATA_DTYPES = (torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.int16, torch.bool,
               torch.float16, torch.uint8, torch.float64)
ACCEPTED_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
# The ops under test (every verl_ops op except the CUDA-only mla_* ones).
OPS = (
    "thd_layout", "thd_layout_info", "preprocess_thd", "postprocess_thd", "jagged_gather",
    "jagged_scatter", "router_topk_record", "router_topk_record_layers", "router_topk_scatter",
    "merge_router_topk", "dynamic_cp_split", "dynamic_cp_merge", "dynamic_cp_merge_header",
    "dynamic_cp_merge_index", "vocab_log_probs_forward", "vocab_log_probs_backward",
)
# The names an op's messages may use (router_topk_record_layers shares router_topk_record's checks
# and words; the dispatcher's own errors name the schema).
MSG_NAMES = {"router_topk_record_layers": ("router_topk_record", "router_topk_record_layers")}
WEIGHTS = {
    "thd_layout": 6, "thd_layout_info": 6, "preprocess_thd": 14, "postprocess_thd": 14,
    "jagged_gather": 8, "jagged_scatter": 8, "router_topk_record": 9, "router_topk_record_layers": 6,
    "router_topk_scatter": 11, "merge_router_topk": 7, "dynamic_cp_split": 5, "dynamic_cp_merge": 6,
    "dynamic_cp_merge_header": 4, "dynamic_cp_merge_index": 5, "vocab_log_probs_forward": 6,
    "vocab_log_probs_backward": 6,
}


# --------------------------------------------------------------------------------------------
# Contract violations.


@dataclass
class Bad:
    kind: str  # "static", "host", "value", "alloc" or "free" (module doc)
    words: tuple  # one of them must appear in the message (the argument)
    text: str
    meta: bool = True  # static only: the Meta kernel can see it

    def must_raise(self, device: str) -> bool:
        if self.kind in ("free", "either"):
            return False
        return self.kind != "value" or device == "cpu"


class Violations(list):
    def add(self, kind, words, text, meta=True):
        self.append(Bad(kind, tuple([words] if isinstance(words, str) else words), text, meta))

    def static(self):
        return any(b.kind == "static" for b in self)


def _is_t(x) -> bool:
    return isinstance(x, torch.Tensor)


def _same_dev(a, b) -> bool:
    return a.device == b.device


def _row_bytes(t: torch.Tensor, skip: int) -> int:
    return t.element_size() * math.prod(t.shape[skip:])


def _fits64(v: int) -> bool:
    return -(2**63) <= v <= INT64_MAX


def _wrap64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _wrap32(v: int) -> int:
    v &= (1 << 32) - 1
    return v - (1 << 32) if v >= 1 << 31 else v


def _batch(cu):
    """B of an offsets tensor [B + 1] (None when it has no such shape)."""
    return cu.shape[0] - 1 if (_is_t(cu) and cu.dim() == 1 and cu.shape[0] >= 1) else None


def _readable(t) -> bool:
    """An offsets tensor whose values the checks can read (1-D int32, B + 1 >= 1 entries)."""
    return _is_t(t) and t.dtype == torch.int32 and t.dim() == 1 and t.shape[0] >= 1 and t.device.type != "meta"


def check_size(bad: Violations, nbytes: int, words, overflow_words=None):
    """An output of `nbytes`: int64 overflow is an argument error; over 1 TiB must fail to allocate
    (with the op's name); over 2 GiB may fail (a valid but large request on a small machine)."""
    if not _fits64(nbytes):
        bad.add("static", overflow_words or words + ("overflow", "output size"), "output size overflows int64")
    elif nbytes > 2**40:
        bad.add("alloc", words, f"output of {nbytes} bytes")
    elif nbytes > 2**31:
        bad.add("free", words, f"output of {nbytes} bytes (may not fit this machine)")


def check_offsets_pair(bad: Violations, cu, cup, like, names=("cu_seqlens", "cu_seqlens_padded")) -> bool:
    """Static checks of an int32 [B + 1] offsets pair on `like`'s device; True when both are usable."""
    ok = True
    for name, t in zip(names, (cu, cup)):
        if t.dtype != torch.int32:
            bad.add("static", name, f"{name} must be int32")
            ok = False
        if t.dim() != 1 or t.shape[0] < 1:
            bad.add("static", name, f"{name} must be 1-D [B + 1]")
            ok = False
        if not _same_dev(t, like):
            bad.add("static", name, f"{name} on another device", meta=False)
            ok = False
    if ok and cu.shape[0] != cup.shape[0]:
        bad.add("static", names[0], "cu_seqlens and cu_seqlens_padded lengths differ")
        ok = False
    return ok


def check_layout_values(bad: Violations, cu: list, cup: list, cp: int, layout: int, total_padded: int,
                        kind="value", extra_words=()):
    """docs/layout.md#invariants on host offsets lists."""
    if cu[0] != 0:
        bad.add(kind, "cu_seqlens", "cu_seqlens must start at 0")
    if cup[0] != 0:
        bad.add(kind, "cu_seqlens_padded", "cu_seqlens_padded must start at 0")
    for i in range(len(cu) - 1):
        n, p = cu[i + 1] - cu[i], cup[i + 1] - cup[i]
        if n < 0:
            bad.add(kind, "cu_seqlens", f"cu_seqlens decreases at {i}")
        if p < n:
            bad.add(kind, ("cu_seqlens_padded", "cu_seqlens"), f"sequence {i} padded {p} < {n} tokens")
        if layout == 0 and cp > 1 and p % (2 * cp):
            bad.add(kind, ("zigzag", "cu_seqlens_padded"), f"zigzag sequence {i} padded {p} not a multiple of 2cp")
    if cup[-1] != total_padded:
        bad.add(kind, ("cu_seqlens_padded", *extra_words), f"cu_seqlens_padded[-1]={cup[-1]} != {total_padded}")


def check_mask_static(bad: Violations, mask, like, B, name="attention_mask") -> bool:
    ok = True
    if mask.dtype != torch.bool:
        bad.add("static", name, f"{name} must be bool")
        ok = False
    if mask.dim() != 2:
        bad.add("static", name, f"{name} must be 2-D")
        ok = False
    if not _same_dev(mask, like):
        bad.add("static", name, f"{name} on another device", meta=False)
        ok = False
    if B is not None and mask.dim() >= 1 and mask.shape[0] != B:
        bad.add("static", name, f"{name} rows != B")
        ok = False
    return ok


def check_mask_counts(bad: Violations, mask, cu: list, kind="value"):
    """The mask holds each sequence's tokens (a bool [B, S] mask, B = len(cu) - 1)."""
    if not (_is_t(mask) and mask.dtype == torch.bool and mask.dim() == 2 and mask.shape[0] == len(cu) - 1):
        return
    for i, c in enumerate(mask.sum(dim=1).tolist()):
        if c != cu[i + 1] - cu[i]:
            bad.add(kind, "attention_mask", f"attention_mask row {i} holds {c} tokens, layout {cu[i + 1] - cu[i]}")
            return


def seqs_of(values, cu: list, mask):
    """Per-sequence valid tokens of jagged values (offsets cu) or padded values with a mask."""
    if mask is None:
        return [values[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    return [values[i][mask[i]] for i in range(mask.shape[0])]


def pack_reference(seqs, cup, cp, rank, layout, roll, feature_shape, dtype):
    """tests/reference.py's pack of rank `rank` (-1: every rank, stacked)."""
    name = ("zigzag", "contiguous")[layout]
    ranks = range(cp) if rank < 0 else [rank]
    outs = [ref_pack(seqs, cup, cp, r, name, roll, feature_shape=tuple(feature_shape), dtype=dtype) for r in ranks]
    if rank < 0:
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    return outs[0]


# --------------------------------------------------------------------------------------------
# Per-op contract checks and references: (args, device) -> (violations, expected outputs).
# `expected` is a tuple whose items are tensors (compared exactly), ints, or callables
# (actual -> None or a message); None where there are violations. Value checks are made whenever
# the offsets are readable, also next to static errors: the op may report either first.


def spec_thd_layout(args, device, info=False):
    if info:
        x, is_off, tp, cp, layout, fp8, mlr, bucket = args
        name = "offsets" if is_off else "lengths"
    else:
        x, tp, cp, layout, fp8, mlr, bucket = args
        is_off, name = False, "lengths"
    bad = Violations()
    if not 1 <= tp <= INT32_MAX:
        bad.add("static", "tp_size", "tp_size out of range")
    if not 1 <= cp <= INT32_MAX:
        bad.add("static", "cp_size", "cp_size out of range")
    if layout not in (0, 1):
        bad.add("static", "cp_layout", "cp_layout not 0/1")
    if mlr is not None and not 0 <= mlr <= INT32_MAX:
        bad.add("static", "min_local_rows", "min_local_rows out of range")
    if bucket is not None and not 1 <= bucket <= INT32_MAX:
        bad.add("static", "pad_to_length_bucket", "pad_to_length_bucket out of range")
    if x.device.type != "cpu":
        bad.add("static", (name, "CPU", "cpu", "backend"), f"{name} must be on the CPU", meta=False)
    if x.dim() != 1:
        bad.add("static", name, f"{name} must be 1-D")
    if x.dtype not in INDEX_DTYPES:
        bad.add("static", name, f"{name} must be an integer tensor (uint8 .. int64), got {x.dtype}")
    if is_off and x.dim() == 1 and x.shape[0] < 1:
        bad.add("static", name, "offsets need B + 1 >= 1 entries")
    if bad:
        return bad, None
    v = [int(a) for a in x.tolist()]
    lengths = [b - a for a, b in pairwise(v)] if is_off else v
    first_bad = next((i for i, n in enumerate(lengths) if not 0 <= n <= INT32_MAX), None)
    if first_bad is not None:
        if not info:
            if any(n < 0 for n in lengths):
                bad.add("host", "lengths", "a negative length")
            else:
                bad.add("host", ("lengths", "padded total"), "a length over 2**31 - 1: the padded total cannot fit")
            return bad, None
        # thd_layout_info reports a bad length in info[0:2] for the Python layout to raise (the
        # offsets are left unset); the length is exact here (offsets far apart do not wrap).
        n_bad = lengths[first_bad]
        if not _fits64(n_bad):  # (raising is fine too: the length is not representable)
            bad.add("either", ("offsets", "lengths", "padded"), f"length {first_bad} = {n_bad} does not fit int64")

        def check_info(t):
            head = t[:7].tolist()
            want = [first_bad, n_bad, 0, 0, 0, 0, 0]
            if not _fits64(n_bad):
                if head[0] == first_bad:  # flagged (its value cannot be stored)
                    return None
                return (f"info[0:7]={head}: length {first_bad} is {n_bad} (offsets {v[first_bad]} -> "
                        f"{v[first_bad + 1]}); the difference wraps in int64 and is not flagged")
            if head != want or t.shape[0] != 7 + len(lengths) or t.dtype != torch.int64:
                return f"info {t.dtype}[{t.shape[0]}] head {head}, want {want} (bad length flagged)"
            return None
        return bad, (lambda out: None, check_info)
    cl = ("zigzag", "contiguous")[layout]
    words = ("padded", "min_local_rows", "pad_to_length_bucket", "tp_size", "cp_size", "zigzag", "overflow")
    try:
        cu, cup = ref_layout(lengths, tp, cp, cl, fp8, mlr, bucket)
    except ValueError:  # an empty batch whose last sequence would have to be padded
        bad.add("host", words, "min_local_rows needs a sequence to pad")
        return bad, None
    if cup[-1] > INT32_MAX:
        bad.add("host", words, "padded total does not fit int32")
    elif not layout_is_valid(cup, cp, cl):
        bad.add("host", words, "the rules break the zigzag invariant / cp divisibility")
    if bad:
        return bad, None
    if not info:
        return bad, (torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32))
    padded = [b - a for a, b in pairwise(cup)]
    head = [-1, 0, cu[-1], cup[-1], max(padded, default=0), max(lengths, default=0), min(lengths, default=0)]
    return bad, (torch.tensor([cu, cup], dtype=torch.int32), torch.tensor(head + lengths, dtype=torch.int64))


def _cp_args(bad, cp, rank, layout, allow_all=True):
    if layout not in (0, 1):
        bad.add("static", "cp_layout", "cp_layout not 0/1")
    if not 1 <= cp <= 2**30:
        bad.add("static", "cp_size", "cp_size out of [1, 2^30]")
        return False
    if not (-1 if allow_all else 0) <= rank < cp:
        bad.add("static", "cp_rank", "cp_rank out of range")
    return True


def spec_preprocess(args, device):
    values, cu, cup, local_rows, cp, rank, layout, roll, mask = args
    bad = Violations()
    cp_ok = _cp_args(bad, cp, rank, layout)
    offsets_ok = check_offsets_pair(bad, cu, cup, values)
    if local_rows < 0:
        bad.add("static", "local_rows", "local_rows < 0")
    skip = 2 if mask is not None else 1
    if values.dim() < skip:
        bad.add("static", "values", "values has too few dims")
    if cp_ok and not _fits64(cp * local_rows):
        bad.add("static", ("local_rows", "cp_size", "overflow"), "cp_size * local_rows overflows")
    mask_ok = mask is not None and check_mask_static(bad, mask, values, _batch(cu))
    if mask_ok and values.dim() >= 2 and tuple(values.shape[:2]) != tuple(mask.shape):
        bad.add("static", ("attention_mask", "values", "padded input"), "values [B, S] != mask shape")
    if values.dim() >= skip and local_rows >= 0 and cp_ok and rank >= -1:
        check_size(bad, (cp if rank < 0 else 1) * local_rows * _row_bytes(values, skip), ("local_rows",))
    if _readable(cu):
        c = cu.tolist()
        if cp_ok and offsets_ok:
            p = cup.tolist()
            check_layout_values(bad, c, p, cp, layout, cp * local_rows, extra_words=("local_rows",))
        if mask is None:
            if values.dim() >= 1 and values.shape[0] != c[-1]:
                bad.add("value", ("values", "cu_seqlens"), "values rows != cu_seqlens[-1]")
        else:
            check_mask_counts(bad, mask, c)
    if bad:
        return bad, None
    feat = tuple(values.shape[skip:])
    packed, pos = pack_reference(seqs_of(values.cpu(), c, None if mask is None else mask.cpu()), p, cp, rank,
                                 layout, roll, feat, values.dtype)
    return bad, (packed.to(values.device), pos.to(values.device))


def _holders(cu: list, cup: list, cp: int, layout: int, roll: bool):
    """token index -> [(rank, local row), ...] holding it after pack (the reference pack of token ids)."""
    lens = [b - a for a, b in pairwise(cu)]
    ids = [torch.arange(cu[i], cu[i] + n, dtype=torch.int64) + 1 for i, n in enumerate(lens)]
    where = {}
    for r in range(cp):
        packed, _ = pack_reference(ids, cup, cp, r, layout, roll, (), torch.int64)
        for row, v in enumerate(packed.tolist()):
            if v > 0:
                where.setdefault(v - 1, []).append((r, row))
    return where


def spec_postprocess(args, device):
    packed, cu, cup, total_tokens, cp, rank, layout, roll, mask = args
    bad = Violations()
    cp_ok = _cp_args(bad, cp, rank, layout)
    offsets_ok = check_offsets_pair(bad, cu, cup, packed)
    skip = 2 if rank < 0 else 1
    local_rows = None
    if packed.dim() < skip:
        bad.add("static", "packed", "packed has too few dims")
    else:
        local_rows = packed.shape[skip - 1]
        if rank < 0 and cp_ok and packed.shape[0] != cp:
            bad.add("static", ("packed", "shards"), "packed shards != cp_size")
    if mask is not None:
        check_mask_static(bad, mask, packed, _batch(cu))
    elif total_tokens < 0:
        bad.add("static", "total_tokens", "total_tokens < 0")
    if local_rows is not None:
        lead = mask.shape[0] * mask.shape[1] if (mask is not None and mask.dim() == 2) else max(total_tokens, 0)
        check_size(bad, lead * _row_bytes(packed, skip), ("total_tokens",))
    if _readable(cu):
        c = cu.tolist()
        if cp_ok and offsets_ok and local_rows is not None:
            p = cup.tolist()
            check_layout_values(bad, c, p, cp, layout, cp * local_rows, extra_words=("local_rows", "packed"))
        if mask is None:
            if c[-1] != total_tokens:
                bad.add("value", ("total_tokens", "cu_seqlens"), "total_tokens != cu_seqlens[-1]")
        else:
            check_mask_counts(bad, mask, c)
    if bad:
        return bad, None
    B = len(c) - 1
    feat = tuple(packed.shape[skip:])
    data = packed.cpu()
    where = _holders(c, p, cp, layout, roll)
    tokens = []  # per valid token (in sequence order): the rows it may come from (none: zero)
    for t in range(c[-1]):
        rows = []
        for r, row in where.get(t, []):
            if rank < 0:
                rows.append(data[r, row])
            elif r == rank:
                rows.append(data[row])
        tokens.append(rows)
    out_shape = ((total_tokens,) if mask is None else tuple(mask.shape)) + feat
    if mask is None:
        slots = list(range(total_tokens))
    else:
        m = mask.cpu()
        slots = [i * m.shape[1] + s for i in range(B) for s in m[i].nonzero().flatten().tolist()]
    dtype = packed.dtype
    n_rows = math.prod(out_shape[:len(out_shape) - len(feat)])

    def check(out):
        if out.dtype != dtype or tuple(out.shape) != out_shape or out.device != packed.device:
            return f"got {out.dtype}{list(out.shape)}@{out.device}, want {dtype}{list(out_shape)}"
        flat = out.cpu().reshape(n_rows, *feat)
        zero = torch.zeros(feat, dtype=dtype)
        for t, slot in enumerate(slots):
            want = tokens[t]
            if not want:
                if not torch.equal(flat[slot], zero):
                    return f"token {t} (output row {slot}) is held by no row of the input but is not zero"
            elif not any(torch.equal(flat[slot], w) for w in want):
                return f"token {t} (output row {slot}) does not hold the packed row that pack put it in"
        filled = set(slots)
        for slot in range(n_rows):
            if slot not in filled and not torch.equal(flat[slot], zero):
                return f"output row {slot} (masked out) is not zero"
        return None

    return bad, (check,)


def spec_jagged(args, device, scatter):
    data, src, cu, total = args
    name, total_name = ("grad", "total_in") if scatter else ("values", "total_out")
    bad = Violations()
    if data.dim() < 1:
        bad.add("static", name, f"{name} is 0-d")
    if src.dtype != torch.int64:
        bad.add("static", "src_starts", "src_starts must be int64")
    if src.dim() != 1:
        bad.add("static", "src_starts", "src_starts must be 1-D")
    if cu.dtype != torch.int32:
        bad.add("static", "cu_seqlens_out", "cu_seqlens_out must be int32")
    if cu.dim() != 1:
        bad.add("static", "cu_seqlens_out", "cu_seqlens_out must be 1-D")
    if src.dim() == 1 and cu.dim() == 1 and cu.shape[0] != src.shape[0] + 1:
        bad.add("static", "cu_seqlens_out", "len(cu_seqlens_out) != len(src_starts) + 1")
    for n, t in (("src_starts", src), ("cu_seqlens_out", cu)):
        if not _same_dev(t, data):
            bad.add("static", n, f"{n} on another device", meta=False)
    if total < 0:
        bad.add("static", total_name, f"{total_name} < 0")
    elif data.dim() >= 1:
        check_size(bad, total * _row_bytes(data, 1), (total_name,), (total_name, "output size"))
    if bad.static() and not (_readable(cu) and src.dtype == torch.int64 and src.dim() == 1
                             and cu.shape[0] == src.shape[0] + 1 and data.dim() >= 1):
        return bad, None
    s, c = src.tolist(), cu.tolist()
    n = len(s)
    pool = total if scatter else data.shape[0]
    gathered = data.shape[0] if scatter else total
    pool_name = total_name if scatter else name
    if c[0] != 0:
        bad.add("value", "cu_seqlens_out", "cu_seqlens_out must start at 0")
    for j in range(n):
        ln = c[j + 1] - c[j]
        if ln < 0:
            bad.add("value", "cu_seqlens_out", "cu_seqlens_out decreases")
        elif not 0 <= s[j] <= pool - ln:
            bad.add("value", ("src_starts", pool_name), f"src_starts[{j}] outside the pool")
    if c[-1] != gathered:
        bad.add("value", ("cu_seqlens_out", total_name, name), "cu_seqlens_out[-1] != gathered rows")
    if scatter and not any(b.kind == "value" for b in bad):
        spans = sorted((s[j], s[j] + c[j + 1] - c[j]) for j in range(n) if c[j + 1] > c[j])
        if any(b[0] < a[1] for a, b in pairwise(spans)):
            bad.add("value", ("src_starts", "overlapping"), "overlapping spans")
    if bad:
        return bad, None
    d = data.cpu()
    if scatter:
        out = torch.zeros((total, *data.shape[1:]), dtype=data.dtype)
        for j in range(n):
            out[s[j]:s[j] + c[j + 1] - c[j]] = d[c[j]:c[j + 1]]
    else:
        parts = [d[s[j]:s[j] + c[j + 1] - c[j]] for j in range(n)]
        out = torch.cat(parts) if parts else torch.zeros((0, *data.shape[1:]), dtype=data.dtype)
    return bad, (out.to(data.device),)


def check_layer_counts(bad: Violations, L, K, kind="static"):
    if L < 1:
        bad.add(kind, ("indices", "layer"), "no layer")
    if L > 2**16 or K > 2**20 or L * K > 2**22:
        bad.add(kind, ("indices", "layers", "top-k"), "too many layers / indices per token")


def record_check(bad, stacked, cu, cup, total, mask, raise_oob, kind_value="value"):
    """router_topk_record's contract on [L, T, K] indices (any strides); returns the expected
    outputs, or None."""
    L, T, K = stacked.shape
    fused = cu is not None or cup is not None
    if fused and (cu is None or cup is None):
        bad.add("static", "cu_seqlens", "cu_seqlens and cu_seqlens_padded come together")
        return None
    if not fused and mask is not None:
        bad.add("static", "attention_mask", "attention_mask needs the offsets")
        return None
    if not fused:
        check_size(bad, T * L * K * 2, ("indices",))
        rows, out_shape = list(range(T)), (T, L, K)
    else:
        offsets_ok = check_offsets_pair(bad, cu, cup, stacked)
        B = _batch(cu)
        if mask is not None:
            if check_mask_static(bad, mask, stacked, B):
                check_size(bad, mask.shape[0] * mask.shape[1] * L * K * 2, ("attention_mask",))
        elif total < 0:
            bad.add("static", "total_tokens", "total_tokens < 0")
        else:
            check_size(bad, total * L * K * 2, ("total_tokens",))
        if _readable(cu):
            c = cu.tolist()
            if offsets_ok:
                p = cup.tolist()
                check_layout_values(bad, c, p, 1, 0, T, kind=kind_value, extra_words=("rows", "indices"))
            if mask is None:
                if c[-1] != total:
                    bad.add(kind_value, ("total_tokens", "cu_seqlens"), "total_tokens != cu_seqlens[-1]")
            else:
                check_mask_counts(bad, mask, c, kind=kind_value)
        if bad:
            return None
        token_rows = [p[i] + q for i in range(B) for q in range(c[i + 1] - c[i])]
        if mask is None:
            rows, out_shape = token_rows, (total, L, K)
        else:
            m = mask.cpu()
            rows = [-1] * (m.shape[0] * m.shape[1])
            t = 0
            for i in range(B):
                for s in m[i].nonzero().flatten().tolist():
                    rows[i * m.shape[1] + s] = token_rows[t]
                    t += 1
            out_shape = (*m.shape, L, K)
    if bad:
        return None
    src = stacked.cpu().to(torch.int64)
    full = torch.zeros((len(rows), L, K), dtype=torch.int64)
    sel = [i for i, r in enumerate(rows) if r >= 0]
    if sel:
        full[sel] = src.permute(1, 0, 2)[[rows[i] for i in sel]]
    oob = (full < -32768) | (full > 32767)
    if bool(oob.any()):
        if raise_oob:
            bad.add("host", ("indices", "int16"), "a recorded index outside int16")
            return None
        want = full.masked_fill(oob, -1).to(torch.int16).reshape(out_shape)
        return (want.to(stacked.device),
                lambda o: None if (o.dtype == torch.int32 and tuple(o.shape) == (4096,) and bool(o.any()))
                else "overflow flags not raised for an index outside int16")
    want = full.to(torch.int16).reshape(out_shape)
    if not fused:
        assert torch.equal(want, verl_stack(src))  # the record reference is verl's stack
    return (want.to(stacked.device),
            lambda o: None if (o.dtype == torch.int32 and tuple(o.shape) == (4096,) and not bool(o.any()))
            else f"overflow flags {o.dtype}{list(o.shape)} set without an out-of-range index")


def spec_record(args, device):
    indices, cu, cup, total, mask = args
    bad = Violations()
    if indices.dtype not in INDEX_DTYPES:
        bad.add("static", "indices", "indices must be an integer tensor")
    if indices.dim() != 3:
        bad.add("static", "indices", "indices must be [L, T, K]")
    else:
        check_layer_counts(bad, indices.shape[0], indices.shape[2])
    if bad:
        return bad, None
    return bad, record_check(bad, indices, cu, cup, total, mask, device == "cpu")


def spec_record_layers(args, device):
    layers, cu, cup, total, mask = args
    bad = Violations()
    if len(layers) == 0:
        bad.add("static", ("indices", "empty list", "no tensor arguments"), "no layer", meta=False)
        return bad, None
    first = layers[0]
    if first.dim() != 2:
        bad.add("static", "indices", "indices[0] must be 2-D")
        return bad, None
    if first.dtype not in INDEX_DTYPES:
        bad.add("static", "indices", "indices must be an integer tensor")
    for i, t in enumerate(layers):
        if t.dim() != 2:
            bad.add("static", "indices", f"indices[{i}] must be 2-D")
        elif t.dtype != first.dtype or not _same_dev(t, first) or t.shape != first.shape:
            bad.add("static", "indices", f"indices[{i}] differs from indices[0]", meta=_same_dev(t, first))
    if not bad:
        check_layer_counts(bad, len(layers), first.shape[1])
    if bad:
        return bad, None
    stacked = torch.stack([t.cpu() for t in layers]).to(first.device)
    return bad, record_check(bad, stacked, cu, cup, total, mask, device == "cpu")


def spec_scatter(args, device):
    routes, cu, cup, local_rows, tp, tp_rank, cp, cp_rank, layout, mask, replay = args
    bad = Violations()
    if routes.dtype not in INDEX_DTYPES:
        bad.add("static", "routes", "routes must be an integer tensor")
    if not 1 <= tp <= INT32_MAX:
        bad.add("static", "tp_size", "tp_size out of range")
    elif not 0 <= tp_rank < tp:
        bad.add("static", "tp_rank", "tp_rank out of [0, tp)")
    cp_ok = _cp_args(bad, cp, cp_rank, layout, allow_all=False)
    if local_rows < 0:
        bad.add("static", "local_rows", "local_rows < 0")
    elif cp_ok and not _fits64(cp * local_rows):
        bad.add("static", ("local_rows", "cp_size", "overflow"), "cp_size * local_rows overflows")
    elif 1 <= tp <= INT32_MAX and local_rows % tp:
        bad.add("static", ("local_rows", "tp_size"), "local_rows % tp_size")
    padded = mask is not None
    if routes.dim() != (4 if padded else 3):
        bad.add("static", "routes", "routes rank")
    offsets_ok = check_offsets_pair(bad, cu, cup, routes)
    if padded:
        if mask.dim() != 2 or routes.dim() < 2 or tuple(routes.shape[:2]) != tuple(mask.shape):
            bad.add("static", ("routes", "attention_mask"), "routes [B, S] != mask")
        check_mask_static(bad, mask, routes, _batch(cu))
    if replay is not None:
        if replay.dtype != torch.bool:
            bad.add("static", "replay_mask", "replay_mask must be bool")
        if not _same_dev(replay, routes):
            bad.add("static", "replay_mask", "replay_mask on another device", meta=False)
        if routes.dim() >= 2:
            want = tuple(routes.shape[:2]) if padded else tuple(routes.shape[:1])
            if tuple(replay.shape) != want:
                bad.add("static", "replay_mask", "replay_mask shape")
    L = K = None
    if routes.dim() >= 2:
        L, K = routes.shape[-2], routes.shape[-1]
        if L > 2**20 or K > 2**20 or L * K > 2**22:
            bad.add("static", "routes", "too many indices per token")
        elif local_rows >= 0 and 1 <= tp <= INT32_MAX:
            check_size(bad, (local_rows // tp) * L * K * 8, ("local_rows",))
    if _readable(cu):
        c = cu.tolist()
        if cp_ok and offsets_ok:
            p = cup.tolist()
            check_layout_values(bad, c, p, cp, layout, cp * local_rows, extra_words=("local_rows",))
        if padded:
            check_mask_counts(bad, mask, c)
        elif routes.dim() >= 1 and routes.shape[0] != c[-1]:
            bad.add("value", ("routes", "cu_seqlens"), "routes rows != cu_seqlens[-1]")
    if bad:
        return bad, None
    rows = local_rows // tp
    r64 = routes.cpu().to(torch.int64)
    m = mask.cpu() if padded else None
    packed, _ = pack_reference(seqs_of(r64, c, m), p, cp, cp_rank, layout, False, (L, K), torch.int64)
    targets = packed[tp_rank * rows:(tp_rank + 1) * rows].permute(1, 0, 2).contiguous()
    if replay is None:
        rp = torch.zeros(0, dtype=torch.bool)
    else:
        rpk, _ = pack_reference(seqs_of(replay.cpu(), c, m), p, cp, cp_rank, layout, False, (), torch.bool)
        rp = rpk[tp_rank * rows:(tp_rank + 1) * rows]
    return bad, (targets.to(routes.device), rp.to(routes.device))


def spec_merge_router(args, device):
    (indices, cu, cup, total, local_rows, tp, cp, layout, _tp_name, _cp_name, mask, validate, rank_error) = args
    bad = Violations()
    # The Python op (verl_ops/router.py): every check reads the host ("host"), whatever the device.
    if tp != 1:
        bad.add("host", ("tp_size", "tp_group"), "tp_size != 1 needs a tp group")
    if cp != 1:
        bad.add("host", ("cp_size", "cp_group"), "cp_size != 1 needs a cp group")
    if layout not in (0, 1):
        bad.add("static", "cp_layout", "cp_layout not 0/1 (the op contract; unused when cp == 1)", meta=False)
    if rank_error:
        bad.add("host", ("rejected",), "rank_error")
    if not indices:
        bad.add("host", "indices", "empty list")
        return bad, None
    if len(indices) == 1 and indices[0].dim() == 3:
        stacked = indices[0]
    else:
        for i, t in enumerate(indices):
            if t.dim() != 2:
                bad.add("host", "indices", f"indices[{i}] must be 2-D")
        if any(b.text.startswith("indices[") for b in bad):
            return bad, None
        first = indices[0]
        for i, t in enumerate(indices):
            if t.dtype != first.dtype or t.shape != first.shape or not _same_dev(t, first):
                bad.add("host", "indices", f"indices[{i}] differs from indices[0]")
        if any(b.text.startswith("indices[") for b in bad):
            return bad, None
        stacked = torch.stack([t.cpu() for t in indices]).to(first.device)
    if stacked.dtype not in INDEX_DTYPES:
        bad.add("host", "indices", "indices must be an integer tensor")
    if stacked.shape[1] != local_rows:
        bad.add("host", ("indices", "local_rows"), "indices rows != local_rows")
    check_layer_counts(bad, stacked.shape[0], stacked.shape[2], kind="host")
    if mask is not None and (mask.dim() != 2 or mask.dtype != torch.bool):
        bad.add("host", "attention_mask", "attention_mask must be a bool [B, S]")
    # (CUDA: merge_router_topk reads the int16 overflow flags when it validates)
    exp = record_check(bad, stacked, cu, cup, total, mask, device == "cpu" or validate,
                       kind_value="host" if device == "cpu" else "value")
    for b in bad:  # the record op's checks are the merge's own, on every device
        if b.kind == "static":
            b.kind, b.meta = "host", False
    return bad, (exp[:1] if exp is not None else None)


def spec_split(args, device):
    values, lengths, max_seqlen, group_name, assignment, _validate, rank_error = args
    bad = Violations()
    if group_name is not None:
        bad.add("host", "group_name", "no process group")
    if rank_error:
        bad.add("host", ("rejected",), "rank_error")
    if assignment not in (0, 1):
        bad.add("host", "assignment", "assignment not 0/1")
    if not 1 <= max_seqlen <= INT32_MAX:
        bad.add("host", "max_seqlen_per_dp_cp_rank", "max_seqlen_per_dp_cp_rank out of range")
    ldt = lengths.dtype
    if lengths.dim() != 1 or ldt.is_floating_point or ldt.is_complex or ldt == torch.bool:
        bad.add("host", "lengths", "lengths must be a 1-D integer tensor")
        return bad, None
    if lengths.device.type == "meta":
        bad.add("host", "lengths", "lengths on the meta device")
        return bad, None
    ls = [int(x) for x in lengths.tolist()]
    if any(not 0 <= n <= INT32_MAX for n in ls):
        bad.add("host", "lengths", "a length outside [0, 2**31 - 1]")
        return bad, None
    if values.dim() < 1 or values.shape[0] != sum(ls):
        bad.add("host", "values", "values rows != sum(lengths)")
    if 1 <= max_seqlen <= INT32_MAX and max(ls, default=0) > max_seqlen:
        bad.add("host", ("max_seqlen_per_dp_cp_rank", "local_cp_size"), "needs more ranks than dp_size=1")
    if bad:
        return bad, None
    where = lengths.device
    return bad, (values, torch.tensor(ls, dtype=torch.int64, device=where),
                 torch.arange(len(ls), dtype=torch.int64, device=where), 1)


def spec_merge(args, device):
    values, lengths, ids, B, lcs, group_name, validate, _key_hash, rank_error = args
    bad = Violations()
    if group_name is not None:
        bad.add("host", "group_name", "no process group")
    if rank_error:
        bad.add("host", ("rejected",), "rank_error")
    entries_ok = True
    if not 0 <= B <= INT32_MAX:
        bad.add("host", "num_samples", "num_samples out of range")
        entries_ok = False
    if group_name is None and lcs != 1:  # (DynamicCPGroups._size's rule, for dp_size = 1)
        bad.add("host", "local_cp_size", "local_cp_size must be 1 without a process group (dp_size = 1)")
    for name, t in (("lengths", lengths), ("sample_ids", ids)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            bad.add("host", name, f"{name} must be a 1-D int32/int64 tensor")
            entries_ok = False
    if entries_ok and (lengths.shape[0] != ids.shape[0] or lengths.shape[0] > B):
        bad.add("host", ("lengths", "sample_ids", "num_samples"), "one entry per sequence, at most num_samples")
        entries_ok = False
    if values.dim() < 1:
        bad.add("host", "values", "values is 0-d")
        entries_ok = False
    if not entries_ok:
        return bad, None
    ls, si = lengths.tolist(), ids.tolist()
    if not (all(n >= 0 for n in ls) and sum(ls) == values.shape[0] and sorted(si) == list(range(B))):
        if validate:
            bad.add("host", ("lengths", "sample ids", "sample_ids", "outputs"), "lengths / sample ids do not fit")
        else:  # documented: without validate such entries give an unspecified result
            bad.add("free", ("lengths", "sample ids", "sample_ids"), "validate=False with bad entries")
    if bad:
        return bad, None
    starts = [sum(ls[:k]) for k in range(len(ls))]
    v = values.cpu()
    order = [si.index(s) for s in range(B)]
    parts = [v[starts[k]:starts[k] + ls[k]] for k in order]
    out = torch.cat(parts) if parts else torch.zeros((0, *values.shape[1:]), dtype=values.dtype)
    return bad, (out.to(values.device), torch.tensor([ls[k] for k in order], dtype=torch.int64))


def spec_merge_header(args, device):
    lengths, ids, B, rows, dh, fh, rb, kh, lcs = args
    bad = Violations()
    if not 0 <= B <= INT32_MAX:
        bad.add("static", "num_samples", "num_samples out of range")
    entries_ok = True
    for name, t in (("lengths", lengths), ("sample_ids", ids)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            bad.add("static", name, f"{name} must be a 1-D int32/int64 tensor")
            entries_ok = False
    if entries_ok and (lengths.shape[0] != ids.shape[0] or lengths.shape[0] > B):
        bad.add("static", ("lengths", "sample_ids", "num_samples"), "one entry per sequence, at most num_samples")
    if not _same_dev(lengths, ids):
        bad.add("static", "sample_ids", "sample_ids on another device", meta=False)
    if bad:
        return bad, None
    n = lengths.shape[0]
    ls, si = lengths.tolist(), ids.tolist()
    words = [n, rows, dh, fh, rb, kh, B, lcs, 0] + [ls[k] if k < n else 0 for k in range(B)] + \
            [si[k] if k < n else -1 for k in range(B)]
    return bad, (torch.tensor(words, dtype=torch.int64, device=lengths.device),)


def ref_merge_index(rows: list, B: int, validate: bool):
    """dynamic_cp_merge_index from core/merge_layout.h's description, with its wrapping sums.
    Returns (buf with None in the merged slots, the slots' candidate (length, row start) pairs):
    a slot given twice (a repeated sample id, or ids outside [0, B), which share the spare slot)
    keeps one of its entries, which one is unspecified (the CUDA kernel writes them in parallel)."""
    G, M = len(rows), 9
    meta_at = G + 2
    merged_at = meta_at + G * M
    src_at = merged_at + B + 1
    size = src_at + B + 1
    fill = -1 if validate else 0
    buf = [fill] * size
    for g, row in enumerate(rows):
        buf[meta_at + g * M:meta_at + (g + 1) * M] = row[:M]
    max_rows = max([0] + [row[1] for row in rows])
    cand = [[] for _ in range(B + 1)]
    for g, row in enumerate(rows):
        run = row[8]
        for k in range(B):
            sid = row[M + B + k]
            cand[sid if 0 <= sid < B else B].append((row[M + k], _wrap64(g * max_rows + run)))
            run = _wrap64(run + row[M + k])
        if validate:
            buf[g] = 1 if run == row[1] else 0
    return buf, cand, merged_at, src_at


def _merge_index_tail(buf, G, B, validate, merged_at, src_at):
    """The words derived from the merged slots: cu [B + 1] and the check / total words."""
    c = buf[merged_at - 1] & 0xFFFFFFFF
    cu = [_wrap32(c)]
    lo_len = lo_src = INT64_MAX
    total = 0
    for k in range(B):
        ln = buf[merged_at + k]
        c = (c + (ln & 0xFFFFFFFF)) & 0xFFFFFFFF
        cu.append(_wrap32(c))
        lo_len, lo_src = min(lo_len, ln), min(lo_src, buf[src_at + k])
        total += ln
    words = {}
    if B > 0:
        if validate:
            words = {G: lo_len, G + 1: lo_src}
        else:
            words = {G: _wrap64(total)}
    return cu, words


def spec_merge_index(args, device):
    header, B, validate = args
    bad = Violations()
    if not 0 <= B <= INT32_MAX:
        bad.add("static", "num_samples", "num_samples out of range")
        return bad, None
    if header.dtype != torch.int64 or header.dim() != 2 or header.shape[0] < 1 or header.shape[1] != 9 + 2 * B:
        bad.add("static", "header", "header must be int64 [G >= 1, 9 + 2B]")
        return bad, None
    G = header.shape[0]
    base, cand, merged_at, src_at = ref_merge_index(header.tolist(), B, validate)
    fill = -1 if validate else 0

    def check_buf(out):
        if out.dtype != torch.int64 or tuple(out.shape) != (len(base),) or out.device != header.device:
            return f"buf {out.dtype}{list(out.shape)}, want int64[{len(base)}]"
        got = out.tolist()
        want = list(base)
        for slot, options in enumerate(cand):  # a slot keeps one of its entries
            ln, src = got[merged_at + slot], got[src_at + slot]
            if not options:
                options = [(fill, fill)]
            if ln not in [o[0] for o in options] or src not in [o[1] for o in options]:
                return f"merged slot {slot} holds ({ln}, {src}), not one of its entries {options}"
            want[merged_at + slot], want[src_at + slot] = ln, src
        cu, words = _merge_index_tail(want, G, B, validate, merged_at, src_at)
        for i, w in words.items():
            want[i] = w
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            return f"buf[{i}] = {got[i]}, reference {want[i]}"
        check_buf.cu = cu
        return None

    def check_cu(out):
        want = getattr(check_buf, "cu", None)
        if out.dtype != torch.int32 or tuple(out.shape) != (B + 1,):
            return f"cu {out.dtype}{list(out.shape)}, want int32[{B + 1}]"
        if want is not None and out.tolist() != want:
            return f"cu {out.tolist()} != the prefix sums of the merged lengths {want}"
        return None

    return bad, (check_buf, check_cu)


LOGIT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_log_probs_args(bad: Violations, logits, labels, vocab_start) -> bool:
    """vocab_log_probs' contract on logits [*, V > 0] (float32 / float64 / float16 / bfloat16, any
    strides), labels [*] = logits.shape[:-1] (int64 / int32, logits' device) and vocab_start >= 0;
    True when the rows' shape is known (logits is not 0-d)."""
    if logits.dim() < 1:
        bad.add("static", "logits", "logits must be [*, vocab]")
    elif logits.shape[-1] == 0:
        bad.add("static", ("logits", "vocab"), "logits' last dim (the vocabulary slice) must be > 0")
    if logits.dtype not in LOGIT_DTYPES:
        bad.add("static", "logits", f"logits must be float32, float64, float16 or bfloat16, got {logits.dtype}")
    if vocab_start < 0:
        bad.add("static", "vocab_start", "vocab_start must be >= 0")
    if logits.dim() >= 1 and tuple(labels.shape) != tuple(logits.shape[:-1]):
        bad.add("static", "labels", "labels must have logits' shape less its last dim")
    if labels.dtype not in (torch.int64, torch.int32):
        bad.add("static", "labels", f"labels must be int64 or int32, got {labels.dtype}")
    if not _same_dev(labels, logits):
        bad.add("static", "labels", "labels on another device", meta=False)
    return logits.dim() >= 1


def ref_log_probs(logits, labels, vocab_start):
    """The documented math per row (x = logits.float(), evaluated in float64): (x [R, V], m, s, the
    label's column (0 where outside), inside [R]); m and s [R] are float64."""
    V = logits.shape[-1]
    x = logits.detach().cpu().float().reshape(-1, V)
    xd = x.double()
    m = xd.amax(dim=-1)
    s = torch.exp(xd - m[:, None]).sum(dim=-1)
    t = [int(v) - vocab_start for v in labels.cpu().reshape(-1).tolist()]  # exact: no wrapping
    inside = torch.tensor([0 <= u < V for u in t], dtype=torch.bool)
    col = torch.tensor([u if 0 <= u < V else 0 for u in t], dtype=torch.int64)
    return x, m, s, col, inside


def close_check(what, want, dtype, device, rtol, atol, exact=False, rounded=False):
    """A check (actual -> None or a message) of a tensor close to `want` (float64, the reference's
    shape): NaN where the reference is NaN, infinities equal, else within rtol / atol of it (of it
    rounded to `dtype`: rounded), or equal to it rounded to `dtype` (exact)."""
    def check(out):
        if not _is_t(out):
            return f"{what} is {type(out).__name__}"
        if out.dtype != dtype or tuple(out.shape) != tuple(want.shape) or out.device != torch.device(device):
            return f"{what}: {out.dtype}{list(out.shape)}@{out.device}, want {dtype}{list(want.shape)}@{device}"
        got = out.detach().cpu().double()
        w = want.to(dtype).double() if exact or rounded else want
        ok = torch.isclose(got, w, rtol=0 if exact else rtol, atol=0 if exact else atol, equal_nan=True)
        if not bool(ok.all()):
            i = (~ok).nonzero()[0].tolist()
            return f"{what}[{i}] = {got[tuple(i)].item()!r}, reference {w[tuple(i)].item()!r}"
        return None
    return check


def spec_log_probs_forward(args, device):
    logits, labels, vocab_start = args
    bad = Violations()
    check_log_probs_args(bad, logits, labels, vocab_start)
    if bad:
        return bad, None
    rows = tuple(labels.shape)
    x, m, s, col, inside = ref_log_probs(logits, labels, vocab_start)
    xt = x.gather(1, col[:, None])[:, 0].double()
    label_logit = torch.where(inside, xt, torch.zeros_like(xt))
    log_probs = -(torch.log(s) - torch.where(inside, xt - m, torch.zeros_like(xt)))
    where = logits.device
    tol = dict(rtol=1e-5, atol=1e-5)
    return bad, (close_check("log_probs", log_probs.reshape(rows), torch.float32, where, **tol),
                 close_check("logits_max", m.reshape(rows), torch.float32, where, 0, 0, exact=True),
                 close_check("sum_exp", s.reshape(rows), torch.float32, where, **tol),
                 close_check("label_logit", label_logit.reshape(rows), torch.float32, where, 0, 0, exact=True))


def spec_log_probs_backward(args, device):
    grad, logits, labels, logits_max, sum_exp, vocab_start = args
    bad = Violations()
    if check_log_probs_args(bad, logits, labels, vocab_start):
        rows = tuple(logits.shape[:-1])
        for name, t in (("grad_log_probs", grad), ("logits_max", logits_max), ("sum_exp", sum_exp)):
            if tuple(t.shape) != rows:
                bad.add("static", name, f"{name} must have labels' shape")
            if t.dtype != torch.float32:
                bad.add("static", name, f"{name} must be float32, got {t.dtype}")
            if not _same_dev(t, logits):
                bad.add("static", name, f"{name} on another device", meta=False)
    if bad:
        return bad, None
    # In float32 as documented: logits_max / sum_exp are any floats (several slices' statistics, or
    # not these logits' at all), where exp(x - m) may overflow.
    x, _m, _s, col, inside = ref_log_probs(logits, labels, vocab_start)
    m = logits_max.cpu().reshape(-1, 1)
    s = sum_exp.cpu().reshape(-1, 1)
    g = grad.cpu().reshape(-1, 1)
    onehot = torch.zeros_like(x)
    onehot[inside, col[inside]] = 1.0
    want = ((torch.exp(x - m) / s - onehot) * -g).double().reshape(logits.shape)
    dtype = logits.dtype
    if dtype in (torch.float16, torch.bfloat16):  # computed in float32, rounded once: one rounding apart
        return bad, (close_check("grad_logits", want, dtype, logits.device, torch.finfo(dtype).eps, 1e-5,
                                 rounded=True),)
    return bad, (close_check("grad_logits", want, dtype, logits.device, 1e-5, 1e-5),)


SPECS = {
    "thd_layout": lambda a, d: spec_thd_layout(a, d, info=False),
    "thd_layout_info": lambda a, d: spec_thd_layout(a, d, info=True),
    "preprocess_thd": spec_preprocess,
    "postprocess_thd": spec_postprocess,
    "jagged_gather": lambda a, d: spec_jagged(a, d, scatter=False),
    "jagged_scatter": lambda a, d: spec_jagged(a, d, scatter=True),
    "router_topk_record": spec_record,
    "router_topk_record_layers": spec_record_layers,
    "router_topk_scatter": spec_scatter,
    "merge_router_topk": spec_merge_router,
    "dynamic_cp_split": spec_split,
    "dynamic_cp_merge": spec_merge,
    "dynamic_cp_merge_header": spec_merge_header,
    "dynamic_cp_merge_index": spec_merge_index,
    "vocab_log_probs_forward": spec_log_probs_forward,
    "vocab_log_probs_backward": spec_log_probs_backward,
}
# The Meta check: ops whose output sizes depend on data that is not a SymInt argument have none
# (dynamic_cp_merge: the merged rows); dynamic_cp_split keeps its lengths on the host (argument 1),
# the way its fake kernel takes them.
NO_META = {"dynamic_cp_merge"}
META_KEEP_HOST = {"dynamic_cp_split": {1}}


# --------------------------------------------------------------------------------------------
# Case generation.


@dataclass
class Case:
    seed: int
    op: str
    args: list
    muts: list = field(default_factory=list)


def gen_lengths(rng: random.Random, max_b: int = 6) -> list:
    B = rng.choices(range(max_b + 1), weights=[3, 12, 14, 14, 12, 10, 8][:max_b + 1])[0]
    out = []
    for _ in range(B):
        r = rng.random()
        if r < 0.12:
            out.append(0)
        elif r < 0.22:
            out.append(1)
        elif r < 0.24:  # now and then a long one (several kernel tiles)
            out.append(rng.randint(300, 1500))
        else:
            out.append(min(int(rng.lognormvariate(2.0, 0.9)), 120))
    return out


def gen_layout(rng: random.Random, lengths, cp: int, layout: int, tp: int = 1):
    """(cu, cu_padded) lists of a valid layout from the reference rules (fp8 / min_local_rows /
    length buckets sometimes)."""
    name = ("zigzag", "contiguous")[layout]
    fp8 = rng.random() < 0.1
    mlr = rng.randint(0, 48) if rng.random() < 0.12 else None
    bucket = rng.choice([1, 3, 8, 16, 24]) if rng.random() < 0.12 else None
    for f, m, b in ((fp8, mlr, bucket), (fp8, None, None), (False, None, None)):
        try:
            cu, cup = ref_layout(lengths, tp, cp, name, f, m, b)
        except ValueError:
            continue
        if layout_is_valid(cup, cp, name) and cup[-1] % (tp * cp) == 0:
            return cu, cup
    raise AssertionError("no valid layout")


def other_device(device: str):
    """The device a device-mix mutation moves a tensor to (None: only one device here)."""
    if device == "cuda":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


# Tensor mutations: each takes (rng, tensor, device) and returns (tensor, label) or None.


def _noncontig(rng, t, device):
    if t.dim() == 0:
        return None
    buf = torch.empty((*t.shape[:-1], t.shape[-1] * 2 + 1), dtype=t.dtype, device=t.device)
    v = buf[..., 1::2]
    v.copy_(t)
    return v, "noncontiguous"


def _offset(rng, t, device):
    buf = torch.empty(t.numel() + 5, dtype=t.dtype, device=t.device)
    v = buf[5:].view(t.shape)
    v.copy_(t)
    return v, "storage_offset"


def _expand(rng, t, device):
    if t.dim() == 0 or t.shape[0] < 2:
        return None
    return t[:1].expand_as(t), "expanded_row0"


def _transposed(rng, t, device):
    if t.dim() < 2:
        return None
    return t.transpose(0, 1).contiguous().transpose(0, 1), "transposed_view"


def _empty(rng, t, device):
    if t.dim() == 0:
        return None
    return t[:0], "empty"


def _unsqueeze(rng, t, device):
    return t.unsqueeze(0), "unsqueezed"


def _flatten0d(rng, t, device):
    if t.numel() == 0:
        return None
    return t.reshape(-1)[0], "0-d"


def _move(rng, t, device):
    d = other_device(device)
    if d is None:
        return None
    return t.to(d), f"on_{d}"


def _drop_last(rng, t, device):
    if t.dim() == 0 or t.shape[0] == 0:
        return None
    return t[:-1], "drop_last"


def _append(rng, t, device):
    if t.dim() != 1:
        return None
    extra = t[-1:] if t.shape[0] else torch.zeros(1, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra + 1]), "append_one"


def _dtype_to(*dtypes):
    def f(rng, t, device):
        d = rng.choice([x for x in dtypes if x != t.dtype])
        return t.to(d), f"dtype_{str(d).split('.')[-1]}"
    return f


def _offsets_value(rng, t, device):
    """Bad / off-by-one values of an int offsets tensor (computed in int64, cast back with wrapping)."""
    if t.dim() != 1 or t.shape[0] == 0:
        return None
    work = torch.float64 if t.dtype.is_floating_point else torch.int64
    w = t.to(work).clone()
    n = w.shape[0]
    k = rng.randrange(n)
    how = rng.choice(["decrease", "negative", "too_large", "plus1", "minus1", "first_nonzero", "int_max",
                      "shift_all", "last_plus", "last_minus", "int_min"])
    if how == "decrease" and n >= 2:
        k = rng.randrange(1, n)
        w[k] = w[k - 1] - rng.randint(1, 3)
    elif how == "negative":
        w[k] = -rng.randint(1, 5)
    elif how == "too_large":
        w[k] = w[-1] + rng.randint(1, 9)
    elif how == "plus1":
        w[k] += 1
    elif how == "minus1":
        w[k] -= 1
    elif how == "first_nonzero":
        w[0] = rng.randint(1, 4)
    elif how == "int_max":
        w[k] = torch.iinfo(t.dtype).max if t.dtype in INDEX_DTYPES else INT32_MAX
    elif how == "int_min":
        w[k] = torch.iinfo(t.dtype).min if t.dtype in INDEX_DTYPES else -(2**31)
    elif how == "shift_all":
        w += 1
    elif how == "last_plus":
        w[-1] += rng.randint(1, 5)
    else:
        w[-1] -= rng.randint(1, 5)
    return w.to(t.dtype), f"value_{how}@{k}"


HARMLESS_LAYOUT_MUTATORS = [_noncontig, _offset, _expand]
OFFSET_MUTATORS = [_offsets_value, _offsets_value, _offsets_value, _dtype_to(torch.float32, torch.int64, torch.int16),
                   _unsqueeze, _flatten0d, _empty, _drop_last, _append, _move, _noncontig, _offset, _expand]
DATA_MUTATORS = [_noncontig, _offset, _expand, _transposed, _empty, _unsqueeze, _flatten0d, _move, _drop_last,
                 _dtype_to(torch.float32, torch.int64, torch.bfloat16, torch.bool)]


def int_choices(v: int):
    """Bad / boundary values for an int size argument around its valid value v."""
    return [v - 1, v + 1, 0, -1, -v - 1, 2**31, 2**40, 2**62, INT64_MAX, -(2**63), v * 2 + 1]


class Builder:
    """A case under construction: named arguments in schema order, and the mutation log."""

    def __init__(self, rng, device, op, names, values):
        self.rng, self.device, self.op = rng, device, op
        self.names = list(names)
        self.a = dict(zip(names, values))
        self.muts = []
        self.mutators = []  # (weight, fn(builder) -> label or None)

    def tensor_mut(self, name, mutators, weight=1.0):
        def f(b):
            t = b.a[name]
            if not _is_t(t):
                return None
            r = b.rng.choice(mutators)(b.rng, t, b.device)
            if r is None:
                return None
            b.a[name] = r[0]
            return f"{name}:{r[1]}"
        self.mutators.append((weight, f))

    def int_mut(self, name, values=None, weight=1.0):
        def f(b):
            cur = b.a[name]
            choices = values if values is not None else int_choices(cur if isinstance(cur, int) else 0)
            v = b.rng.choice([c for c in choices if c != cur] or [cur + 1])
            b.a[name] = v
            return f"{name}={v}"
        self.mutators.append((weight, f))

    def custom(self, fn, weight=1.0):
        self.mutators.append((weight, fn))

    def finish(self, seed):
        k = self.rng.choices([0, 1, 2], weights=[35, 40, 25])[0]
        tries = 0
        while len(self.muts) < k and tries < 20 and self.mutators:
            tries += 1
            weights = [w for w, _ in self.mutators]
            fn = self.rng.choices([f for _, f in self.mutators], weights=weights)[0]
            label = fn(self)
            if label is not None:
                self.muts.append(label)
        return Case(seed, self.op, [self.a[n] for n in self.names], self.muts)


def gen_thd_layout(rng, g, device, info=False):
    lengths = gen_lengths(rng)
    tp = rng.choice([1, 1, 1, 2, 4])
    cp = rng.choice([1, 2, 4])
    layout = rng.randint(0, 1)
    fp8 = rng.random() < 0.2
    mlr = rng.randint(0, 40) if rng.random() < 0.25 else None
    bucket = rng.choice([1, 2, 3, 8, 16, 24]) if rng.random() < 0.25 else None
    dtype = rng.choice([torch.int64, torch.int32, torch.int16, torch.uint8] if max(lengths, default=0) < 128
                       else [torch.int64, torch.int32])
    if info and rng.random() < 0.5:
        x = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int64)
        if x[-1] < 128 and rng.random() < 0.5:
            x = x.to(dtype)
        first = [x, True]
    else:
        x = torch.tensor(lengths, dtype=dtype)
        first = [x, False] if info else [x]
    names = (["x", "is_offsets"] if info else ["x"]) + ["tp", "cp", "layout", "fp8", "mlr", "bucket"]
    b = Builder(rng, device, "thd_layout_info" if info else "thd_layout", names,
                first + [tp, cp, layout, fp8, mlr, bucket])
    b.tensor_mut("x", [_offsets_value, _offsets_value, _noncontig, _expand, _empty, _unsqueeze, _flatten0d,
                       _dtype_to(torch.float32, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.int8),
                       _move], weight=3)
    b.int_mut("tp", [0, -1, 3, 2**31, 2**30, INT64_MAX])
    b.int_mut("cp", [0, -1, 3, 8, 2**30, 2**31, 2**62 + 1])
    b.int_mut("layout", [1 - layout, 2, -1, 7])
    b.int_mut("mlr", [-1, 0, 2**31, 2**40, 1, 37, 1000])
    b.int_mut("bucket", [0, -5, 2**31, 2**40, 1, 7, 4096])

    def big_length(b):
        x = b.a["x"]
        if x.dim() != 1 or x.numel() == 0 or x.dtype not in (torch.int64, torch.int32):
            return None
        x = x.clone()
        k = b.rng.randrange(x.numel())
        x[k] = b.rng.choice([INT32_MAX, 2**30, 2**31 - 2]) if x.dtype == torch.int32 else \
            b.rng.choice([2**31, 2**40, INT64_MAX, -(2**63), INT32_MAX])
        b.a["x"] = x
        return f"x[{k}]={int(x[k])}"
    b.custom(big_length)
    if info:
        b.custom(lambda b: (b.a.__setitem__("is_offsets", not b.a["is_offsets"]) or "is_offsets flipped"), 0.5)

        def extreme_offsets(b):  # lengths that wrap around int64
            if not b.a["is_offsets"]:
                return None
            b.a["x"] = torch.tensor([INT64_MAX, -(2**63) + 4], dtype=torch.int64)
            return "offsets=[INT64_MAX, INT64_MIN+4]"
        b.custom(extreme_offsets, 0.3)
    return b


def gen_thd(rng, g, device, unpack: bool):
    lengths = gen_lengths(rng)
    cp = rng.choice([1, 1, 2, 4])
    layout = rng.randint(0, 1)
    cu, cup = gen_layout(rng, lengths, cp, layout)
    local_rows = cup[-1] // cp
    feat = rng.choice([(), (3,), (2, 2), (5,), (0,)])
    dtype = rng.choice(DATA_DTYPES)
    padded = rng.random() < 0.3
    mask = None
    if padded:
        S = max(lengths, default=0) + rng.randint(0, 3)
        mask = scattered_mask(rng, lengths, S).to(device)
    roll = rng.random() < 0.4
    rank = rng.randint(-1, cp - 1)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    cup_t = torch.tensor(cup, dtype=torch.int32, device=device)
    if not unpack:
        values = random_data(((len(lengths), mask.shape[1]) if padded else (cu[-1],)) + feat, dtype, g).to(device)
        names = ["values", "cu_seqlens", "cu_seqlens_padded", "local_rows", "cp_size", "cp_rank", "cp_layout",
                 "roll", "attention_mask"]
        b = Builder(rng, device, "preprocess_thd", names,
                    [values, cu_t, cup_t, local_rows, cp, rank, layout, roll, mask])
        b.tensor_mut("values", DATA_MUTATORS)
        b.int_mut("local_rows", int_choices(local_rows), weight=1.5)
    else:
        shape = ((cp, local_rows) if rank < 0 else (local_rows,)) + feat
        packed = random_data(shape, dtype, g).to(device)
        total = cu[-1]
        names = ["packed", "cu_seqlens", "cu_seqlens_padded", "total_tokens", "cp_size", "cp_rank", "cp_layout",
                 "roll", "attention_mask"]
        b = Builder(rng, device, "postprocess_thd", names,
                    [packed, cu_t, cup_t, total, cp, rank, layout, roll, mask])
        b.tensor_mut("packed", DATA_MUTATORS)
        b.int_mut("total_tokens", int_choices(total), weight=1.5)
    b.tensor_mut("cu_seqlens", OFFSET_MUTATORS, weight=2)
    b.tensor_mut("cu_seqlens_padded", OFFSET_MUTATORS, weight=2)
    b.int_mut("cp_size", [0, -1, 3, 2 * cp, 2**30 + 1, 2**62 + 1, 1] + ([cp // 2] if cp > 1 else []))
    b.int_mut("cp_rank", [cp, -2, 2**32, -1, 0, cp - 1])
    b.int_mut("cp_layout", [1 - layout, 2, -1])
    b.custom(lambda b: (b.a.__setitem__("roll", not b.a["roll"]) or "roll flipped"), 0.3)
    b.tensor_mut("attention_mask", [_dtype_to(torch.int64, torch.float32, torch.uint8), _unsqueeze, _flatten0d,
                                    _noncontig, _drop_last, _move, _transposed])

    b.custom(_flip_mask)

    def mask_add(b):
        if b.a["attention_mask"] is not None:
            b.a["attention_mask"] = None
            return "attention_mask dropped"
        data = b.a["values"] if not unpack else b.a["packed"]
        if not _is_t(data) or data.dim() < (1 if unpack else 2) or b.a["cu_seqlens"].dim() != 1:
            return None
        B = b.a["cu_seqlens"].shape[0] - 1
        S = data.shape[1] if not unpack else b.rng.randint(0, 6)
        if B < 0:
            return None
        b.a["attention_mask"] = (torch.rand(B, S, generator=g) < 0.5).to(data.device)
        return "attention_mask added"
    b.custom(mask_add, 0.5)

    def swap_offsets(b):
        b.a["cu_seqlens"], b.a["cu_seqlens_padded"] = b.a["cu_seqlens_padded"], b.a["cu_seqlens"]
        return "offsets swapped"
    b.custom(swap_offsets, 0.3)
    return b


def gen_jagged(rng, g, device, scatter: bool):
    n = rng.choices(range(6), weights=[4, 12, 12, 10, 8, 6])[0]
    lens = [rng.choice([0, 1, rng.randint(0, 30)]) for _ in range(n)]
    feat = rng.choice([(), (3,), (2, 2), (0,)])
    dtype = rng.choice(DATA_DTYPES)
    cu = [0]
    for ln in lens:
        cu.append(cu[-1] + ln)
    if scatter:
        # disjoint spans in a pool of total_in rows, in random order
        gaps = [rng.randint(0, 4) for _ in range(n + 1)]
        order = list(range(n))
        rng.shuffle(order)
        starts, pos = [0] * n, gaps[0]
        for k, j in enumerate(order):
            starts[j] = pos
            pos += lens[j] + gaps[k + 1]
        total = pos
        data = random_data((cu[-1],) + feat, dtype, g).to(device)
    else:
        pool = sum(lens) + rng.randint(0, 10)
        starts = [rng.randint(0, pool - ln) for ln in lens]
        total = cu[-1]
        data = random_data((pool,) + feat, dtype, g).to(device)
    src = torch.tensor(starts, dtype=torch.int64, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    dname, tname = ("grad", "total_in") if scatter else ("values", "total_out")
    b = Builder(rng, device, "jagged_scatter" if scatter else "jagged_gather",
                [dname, "src_starts", "cu_seqlens_out", tname], [data, src, cu_t, total])
    b.tensor_mut(dname, DATA_MUTATORS)
    b.tensor_mut("cu_seqlens_out", OFFSET_MUTATORS, weight=2)

    def src_value(b):
        s = b.a["src_starts"]
        if not _is_t(s) or s.dim() != 1 or s.numel() == 0 or s.dtype != torch.int64:
            return None
        s = s.clone()
        k = b.rng.randrange(s.numel())
        v = b.rng.choice([-1, int(s[k]) + 1, int(s[k]) - 1, 2**62, INT64_MAX, -(2**63), INT64_MAX - 2, 10**6])
        v = max(-(2**63), min(INT64_MAX, v))
        s[k] = v
        b.a["src_starts"] = s
        return f"src_starts[{k}]={v}"
    b.custom(src_value, 2)
    b.tensor_mut("src_starts", [_dtype_to(torch.int32, torch.float32), _unsqueeze, _flatten0d, _drop_last,
                                _append, _move, _noncontig, _expand, _empty])
    # (the scatter's output size is its own argument: no 2**31 here, a valid request of many GiB
    # would only be slow; 2**40 rows must fail to allocate)
    b.int_mut(tname, [c for c in int_choices(total) if c != 2**31], weight=1.5)
    return b


def gen_router_case(rng, g, device, L, K, idtype):
    """A valid record input: [L, T, K] indices over a cp=1 layout (tp = cp = 1), plus the jagged or
    padded output form."""
    lengths = gen_lengths(rng)
    layout = rng.randint(0, 1)
    cu, cup = gen_layout(rng, lengths, 1, layout)
    T = cup[-1]
    info = torch.iinfo(idtype)
    lo, hi = max(info.min, -5 if info.min < 0 else 0), min(info.max, 300)
    idx = torch.randint(lo, hi + 1, (L, T, K), generator=g, dtype=torch.int64).to(idtype).to(device)
    return lengths, cu, cup, T, idx


def _index_value_mut(key):
    def f(b):
        t = b.a[key]
        if isinstance(t, list):
            if not t:
                return None
            li = b.rng.randrange(len(t))
            t = t[li]
        else:
            li = None
        if not _is_t(t) or t.numel() == 0 or t.dtype not in (torch.int32, torch.int64, torch.int16):
            return None
        t2 = t.clone()
        flat = t2.view(-1) if t2.is_contiguous() else None
        if flat is None:
            return None
        k = b.rng.randrange(flat.numel())
        info = torch.iinfo(t2.dtype)
        v = b.rng.choice([v for v in (40000, -40000, 32768, -32769, 32767, -32768, info.max, info.min)
                          if info.min <= v <= info.max])
        flat[k] = v
        if li is None:
            b.a[key] = t2
        else:
            b.a[key] = list(b.a[key])
            b.a[key][li] = t2
        return f"{key}[flat {k}]={v}"
    return f


def gen_record(rng, g, device, layers: bool):
    L = rng.choice([1, 2, 3, 4])
    K = rng.choice([1, 2, 8, 3])
    idtype = rng.choice(INDEX_DTYPES)
    lengths, cu, cup, T, idx = gen_router_case(rng, g, device, L, K, idtype)
    form = rng.choice(["plain", "fused", "fused", "padded"])
    cu_t = cup_t = mask = None
    total = rng.choice([0, T, 5])
    if form != "plain":
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        cup_t = torch.tensor(cup, dtype=torch.int32, device=device)
        total = cu[-1]
        if form == "padded":
            mask = scattered_mask(rng, lengths, max(lengths, default=0) + rng.randint(0, 3)).to(device)
    if rng.random() < 0.3:  # any strides: a [T, L, K] recording viewed as [L, T, K]
        idx = idx.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    if layers:
        first = [idx[l] for l in range(L)]
        if rng.random() < 0.3:
            first = [t.contiguous() for t in first]
        op = "router_topk_record_layers"
        vals = [first, cu_t, cup_t, total, mask]
    else:
        op = "router_topk_record"
        vals = [idx, cu_t, cup_t, total, mask]
    b = Builder(rng, device, op, ["indices", "cu_seqlens", "cu_seqlens_padded", "total_tokens", "attention_mask"],
                vals)
    b.custom(_index_value_mut("indices"), 2)
    if layers:
        def layer_mut(b):
            ls = list(b.a["indices"])
            how = b.rng.choice(["drop_all", "dtype", "rows", "k", "3d", "move", "noncontig", "expand", "extra",
                                "float"])
            if how == "drop_all":
                b.a["indices"] = []
                return "indices=[]"
            if not ls:
                return None
            i = b.rng.randrange(len(ls))
            t = ls[i]
            if how == "dtype":
                ls[i] = t.to(torch.int32 if t.dtype != torch.int32 else torch.int64)
            elif how == "float":
                ls = [x.float() for x in ls]
            elif how == "rows" and t.dim() == 2:
                ls[i] = t[:-1] if t.shape[0] else torch.zeros((1, t.shape[1]), dtype=t.dtype, device=t.device)
            elif how == "k" and t.dim() == 2:
                ls[i] = torch.cat([t, t[:, :1]], dim=1)
            elif how == "3d":
                ls[i] = t.unsqueeze(0)
            elif how == "move":
                d = other_device(b.device)
                if d is None:
                    return None
                ls[i] = t.to(d)
            elif how == "noncontig":
                ls[i] = _noncontig(b.rng, t, b.device)[0]
            elif how == "expand":
                r = _expand(b.rng, t, b.device)
                if r is None:
                    return None
                ls[i] = r[0]
            elif how == "extra":
                ls.append(ls[i].clone())
            else:
                return None
            b.a["indices"] = ls
            return f"indices[{i}]:{how}"
        b.custom(layer_mut, 3)
    else:
        b.tensor_mut("indices", [_noncontig, _expand, _transposed, _unsqueeze, _flatten0d, _empty, _move,
                                 _dtype_to(torch.float32, torch.bool, torch.uint16)], weight=2)
    b.tensor_mut("cu_seqlens", OFFSET_MUTATORS, weight=1.5)
    b.tensor_mut("cu_seqlens_padded", OFFSET_MUTATORS, weight=1.5)
    b.int_mut("total_tokens", int_choices(total))

    def drop_one(b):
        k = b.rng.choice(["cu_seqlens", "cu_seqlens_padded", "attention_mask"])
        if b.a[k] is None:
            return None
        b.a[k] = None
        return f"{k}=None"
    b.custom(drop_one, 0.7)
    b.tensor_mut("attention_mask", [_dtype_to(torch.int64, torch.float32), _unsqueeze, _drop_last, _move,
                                    _noncontig, _transposed])
    b.custom(lambda b: _flip_mask(b), 0.7)
    return b


def _flip_mask(b, key="attention_mask"):
    m = b.a[key]
    if m is None or m.numel() == 0 or m.dtype != torch.bool:
        return None
    m = m.clone(memory_format=torch.contiguous_format)
    flat = m.view(-1)
    k = b.rng.randrange(flat.numel())
    flat[k] = ~flat[k]
    b.a[key] = m
    return f"{key}[flat {k}] flipped"


def gen_scatter(rng, g, device):
    lengths = gen_lengths(rng)
    tp = rng.choice([1, 1, 2, 4])
    cp = rng.choice([1, 1, 2, 4])
    layout = rng.randint(0, 1)
    cu, cup = gen_layout(rng, lengths, cp, layout, tp)
    local_rows = cup[-1] // cp
    L, K = rng.choice([1, 2, 3]), rng.choice([1, 2, 8, 3])
    idtype = rng.choice(INDEX_DTYPES)
    info = torch.iinfo(idtype)
    lo, hi = max(info.min, -5 if info.min < 0 else 0), min(info.max, 300)
    padded = rng.random() < 0.3
    if padded:
        S = max(lengths, default=0) + rng.randint(0, 3)
        mask = scattered_mask(rng, lengths, S).to(device)
        shape = (len(lengths), S)
    else:
        mask = None
        shape = (cu[-1],)
    routes = torch.randint(lo, hi + 1, shape + (L, K), generator=g, dtype=torch.int64).to(idtype).to(device)
    replay = (torch.rand(shape, generator=g) < 0.6).to(device) if rng.random() < 0.5 else None
    names = ["routes", "cu_seqlens", "cu_seqlens_padded", "local_rows", "tp_size", "tp_rank", "cp_size", "cp_rank",
             "cp_layout", "attention_mask", "replay_mask"]
    b = Builder(rng, device, "router_topk_scatter", names,
                [routes, torch.tensor(cu, dtype=torch.int32, device=device),
                 torch.tensor(cup, dtype=torch.int32, device=device), local_rows, tp, rng.randrange(tp), cp,
                 rng.randrange(cp), layout, mask, replay])
    b.tensor_mut("routes", [_noncontig, _expand, _transposed, _unsqueeze, _flatten0d, _empty, _move, _drop_last,
                            _dtype_to(torch.float32, torch.bool, torch.uint16)], weight=1.5)
    b.tensor_mut("cu_seqlens", OFFSET_MUTATORS, weight=1.5)
    b.tensor_mut("cu_seqlens_padded", OFFSET_MUTATORS, weight=1.5)
    b.int_mut("local_rows", int_choices(local_rows), weight=1.5)
    b.int_mut("tp_size", [0, -1, 3, 2 * tp, 2**31, 1])
    b.int_mut("tp_rank", [tp, -1, 2**32, 0])
    b.int_mut("cp_size", [0, -1, 3, 2 * cp, 2**30 + 1, 2**62 + 1, 1])
    b.int_mut("cp_rank", [cp, -1, -2, 2**32, 0])
    b.int_mut("cp_layout", [1 - layout, 2, -1])
    b.tensor_mut("attention_mask", [_dtype_to(torch.int64, torch.float32), _unsqueeze, _drop_last, _move,
                                    _noncontig, _transposed])
    b.tensor_mut("replay_mask", [_dtype_to(torch.int64, torch.float32), _unsqueeze, _drop_last, _move,
                                 _noncontig, _expand, _flatten0d])
    b.custom(lambda b: _flip_mask(b), 0.7)

    def drop(b):
        k = b.rng.choice(["attention_mask", "replay_mask"])
        if b.a[k] is None:
            return None
        b.a[k] = None
        return f"{k}=None"
    b.custom(drop, 0.5)
    return b


def gen_merge_router(rng, g, device):
    L = rng.choice([1, 2, 3])
    K = rng.choice([1, 2, 8])
    idtype = rng.choice(INDEX_DTYPES)
    lengths, cu, cup, T, idx = gen_router_case(rng, g, device, L, K, idtype)
    mask = None
    if rng.random() < 0.3:
        mask = scattered_mask(rng, lengths, max(lengths, default=0) + rng.randint(0, 3)).to(device)
    indices = [idx] if rng.random() < 0.5 else [idx[l] for l in range(L)]
    names = ["indices", "cu_seqlens", "cu_seqlens_padded", "total_tokens", "local_rows", "tp_size", "cp_size",
             "cp_layout", "tp_group_name", "cp_group_name", "attention_mask", "validate", "rank_error"]
    b = Builder(rng, device, "merge_router_topk", names,
                [indices, torch.tensor(cu, dtype=torch.int32, device=device),
                 torch.tensor(cup, dtype=torch.int32, device=device), cu[-1], T, 1, 1, rng.randint(0, 1), None, None,
                 mask, rng.random() < 0.8, False])
    b.custom(_index_value_mut("indices"), 1.5)
    b.tensor_mut("cu_seqlens", OFFSET_MUTATORS, weight=1.5)
    b.tensor_mut("cu_seqlens_padded", OFFSET_MUTATORS, weight=1.5)
    b.int_mut("total_tokens", int_choices(cu[-1]))
    b.int_mut("local_rows", int_choices(T))
    b.int_mut("tp_size", [0, -1, 2, 4])
    b.int_mut("cp_size", [0, -1, 2, 4])
    b.int_mut("cp_layout", [2, -1, 7])
    b.custom(lambda b: (b.a.__setitem__("rank_error", True) or "rank_error=True"), 0.2)
    b.custom(lambda b: (b.a.__setitem__("tp_group_name", "no-such-group") or "tp_group_name set (tp_size=1)"), 0.2)

    def ind_mut(b):
        ls = list(b.a["indices"])
        how = b.rng.choice(["empty", "float", "1d", "rows", "noncontig"])
        if how == "empty":
            b.a["indices"] = []
        elif how == "float":
            b.a["indices"] = [t.float() for t in ls]
        elif how == "1d":
            b.a["indices"] = [t.reshape(-1) for t in ls]
        elif how == "rows":
            b.a["indices"] = [t[..., :-1, :] if t.dim() >= 2 and t.shape[-2] else t for t in ls]
        else:
            b.a["indices"] = [_noncontig(b.rng, t, b.device)[0] for t in ls]
        return f"indices:{how}"
    b.custom(ind_mut, 1.5)
    b.tensor_mut("attention_mask", [_dtype_to(torch.int64, torch.float32), _unsqueeze, _flatten0d, _drop_last,
                                    _noncontig])
    b.custom(lambda b: _flip_mask(b), 0.7)
    return b


def gen_split(rng, g, device):
    lengths = gen_lengths(rng)
    feat = rng.choice([(), (3,), (2, 2)])
    values = random_data((sum(lengths),) + feat, rng.choice(DATA_DTYPES), g).to(device)
    ldt = rng.choice([torch.int64, torch.int32, torch.int16] if max(lengths, default=0) < 2**15 else [torch.int64])
    lt = torch.tensor(lengths, dtype=ldt)
    if device != "cpu" and rng.random() < 0.3:
        lt = lt.to(device)
    max_seqlen = max(lengths, default=0) + rng.choice([0, 1, 50]) or 1
    b = Builder(rng, device, "dynamic_cp_split",
                ["values", "lengths", "max_seqlen_per_dp_cp_rank", "group_name", "assignment", "validate",
                 "rank_error"], [values, lt, max_seqlen, None, rng.randint(0, 1), rng.random() < 0.8, False])
    b.tensor_mut("values", [_noncontig, _expand, _drop_last, _flatten0d, _unsqueeze, _move])
    b.tensor_mut("lengths", [_offsets_value, _dtype_to(torch.float32, torch.bool, torch.uint8), _unsqueeze,
                             _flatten0d, _drop_last, _noncontig], weight=2)
    b.int_mut("max_seqlen_per_dp_cp_rank", [0, -1, max_seqlen - 1, 2**31, 2**40, 1])
    b.int_mut("assignment", [2, -1, 1 - b.a["assignment"]])
    b.custom(lambda b: (b.a.__setitem__("rank_error", True) or "rank_error=True"), 0.2)
    return b


def gen_merge(rng, g, device):
    B = rng.choices(range(7), weights=[3, 10, 12, 12, 10, 8, 6])[0]
    lens = [rng.choice([0, 1, rng.randint(0, 20)]) for _ in range(B)]
    ids = list(range(B))
    rng.shuffle(ids)
    feat = rng.choice([(), (3,), (2, 2)])
    values = random_data((sum(lens),) + feat, rng.choice(DATA_DTYPES), g).to(device)
    dt = rng.choice([torch.int64, torch.int32])
    lt = torch.tensor(lens, dtype=dt, device=device)
    it = torch.tensor(ids, dtype=rng.choice([torch.int64, torch.int32]), device=device)
    b = Builder(rng, device, "dynamic_cp_merge",
                ["values", "lengths", "sample_ids", "num_samples", "local_cp_size", "group_name", "validate",
                 "key_hash", "rank_error"],
                [values, lt, it, B, 1, None, rng.random() < 0.8, rng.randint(-5, 5), False])
    b.tensor_mut("values", [_noncontig, _expand, _drop_last, _flatten0d, _unsqueeze, _move])
    b.tensor_mut("lengths", [_offsets_value, _dtype_to(torch.float32, torch.int16), _unsqueeze, _drop_last,
                             _append, _noncontig, _move], weight=2)
    b.tensor_mut("sample_ids", [_offsets_value, _dtype_to(torch.float32, torch.int16), _unsqueeze, _drop_last,
                                _append, _expand, _move], weight=2)
    b.int_mut("num_samples", [B - 1, B + 1, -1, 0, 2**31, 2**40])
    b.int_mut("local_cp_size", [0, -1, 2, 3])
    b.custom(lambda b: (b.a.__setitem__("rank_error", True) or "rank_error=True"), 0.2)
    return b


def gen_merge_header(rng, g, device):
    B = rng.randint(0, 6)
    n = rng.randint(0, B)
    lt = torch.randint(0, 50, (n,), generator=g).to(rng.choice([torch.int64, torch.int32])).to(device)
    it = torch.randperm(B, generator=g)[:n].to(rng.choice([torch.int64, torch.int32])).to(device)
    ints = [rng.choice([0, 5, -3, INT64_MAX, -(2**63), rng.randint(-(2**40), 2**40)]) for _ in range(6)]
    b = Builder(rng, device, "dynamic_cp_merge_header",
                ["lengths", "sample_ids", "num_samples", "rows", "dtype_hash", "feature_hash", "row_bytes",
                 "key_hash", "local_cp_size"], [lt, it, B] + ints)
    b.tensor_mut("lengths", [_dtype_to(torch.float32, torch.int16, torch.uint8), _unsqueeze, _flatten0d,
                             _drop_last, _append, _noncontig, _expand, _move], weight=2)
    b.tensor_mut("sample_ids", [_dtype_to(torch.float32, torch.int16), _unsqueeze, _drop_last, _append,
                                _noncontig, _move], weight=2)
    b.int_mut("num_samples", [n - 1, -1, 2**31, 2**40, B + 1, -(2**63)])
    return b


def gen_merge_index(rng, g, device):
    G = rng.randint(1, 4)
    B = rng.randint(0, 6)
    ids = list(range(B))
    rng.shuffle(ids)
    cuts = sorted(rng.randint(0, B) for _ in range(G - 1))
    parts = [ids[a:b] for a, b in zip([0] + cuts, cuts + [B])]
    same = [rng.randint(-(2**40), 2**40) for _ in range(3)]
    rows = []
    for part in parts:
        ls = [rng.randint(0, 20) for _ in part]
        n = len(part)
        rows.append([n, sum(ls)] + same + [rng.randint(-5, 5), B, 1, 0] + ls + [0] * (B - n) + part + [-1] * (B - n))
    header = torch.tensor(rows, dtype=torch.int64, device=device)
    b = Builder(rng, device, "dynamic_cp_merge_index", ["header", "num_samples", "validate"],
                [header, B, rng.random() < 0.7])

    def corrupt(b):
        h = b.a["header"]
        if not _is_t(h) or h.dim() != 2 or h.numel() == 0 or h.dtype != torch.int64:
            return None
        h = h.clone()
        gi, w = b.rng.randrange(h.shape[0]), b.rng.randrange(h.shape[1])
        v = b.rng.choice([-1, 0, 1, int(h[gi, w]) + 1, B, B + 7, -(2**63), INT64_MAX, 2**31, 2**32 + 3,
                          b.rng.randint(-(2**62), 2**62)])
        h[gi, w] = v
        b.a["header"] = h
        return f"header[{gi},{w}]={v}"
    b.custom(corrupt, 4)
    b.tensor_mut("header", [_dtype_to(torch.int32, torch.float64), _unsqueeze, _flatten0d, _empty, _noncontig,
                            _expand, _transposed, _drop_last])
    b.int_mut("num_samples", [B - 1, B + 1, -1, 2**31, 2**40])
    return b


def _lead_shape(rng) -> tuple:
    """[*] of a log-probs call: none, one, two or three leading dims (zeros and ones among them),
    at most 64 rows."""
    k = rng.choices([0, 1, 2, 3], weights=[2, 8, 6, 2])[0]
    dims = []
    for _ in range(k):
        r = rng.random()
        dims.append(0 if r < 0.07 else 1 if r < 0.2 else rng.randint(2, (64, 8, 4)[k - 1]))
    return tuple(dims)


def gen_logits(rng, g, lead, V, dtype):
    """logits [*lead, V] of `dtype`, contiguous or a view with inner stride 1 (a slice of wider
    rows, every other leading row), sometimes with -inf (masked), +inf or NaN entries."""
    how = rng.choice(["contiguous", "contiguous", "wide", "step"])
    extra = rng.randint(1, 9) if how == "wide" else 0
    shape = list(lead) + [V + extra]
    if how == "step" and lead:
        d = rng.randrange(len(lead))
        shape[d] *= 2
    scale = rng.choice([0.1, 1.0, 4.0, 10.0, 100.0])
    full = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if full.numel() and rng.random() < 0.2:
        flat = full.view(-1)
        for _ in range(rng.randint(1, 4)):
            flat[rng.randrange(flat.numel())] = rng.choice([-math.inf, -math.inf, -math.inf, math.inf, math.nan])
    if full.numel() and full.dim() >= 2 and rng.random() < 0.05:
        full.view(-1, full.shape[-1])[rng.randrange(full.numel() // full.shape[-1])] = -math.inf  # a masked row
    full = full.to(dtype)
    if how == "wide":
        off = rng.randint(0, extra)
        full = full[..., off:off + V]
    elif how == "step" and lead:
        full = full[(slice(None),) * d + (slice(None, None, 2),)]
    if rng.random() < 0.3:
        full = _unit_stride(rng, full, None)[0]
    return full


def gen_labels(rng, g, lead, V, vocab_start, dtype):
    """labels [*lead]: mostly inside [vocab_start, vocab_start + V), some just outside, -100 (the
    ignore index), far away."""
    n = math.prod(lead)
    vals = []
    for _ in range(n):
        r = rng.random()
        if r < 0.75:
            vals.append(vocab_start + rng.randrange(V))
        else:
            vals.append(rng.choice([vocab_start - 1, vocab_start + V, vocab_start + V + 1, -1, -100, 0,
                                    rng.randint(-(2**31), 2**31 - 1)]))
    return torch.tensor(vals, dtype=torch.int64).reshape(lead).to(dtype)


def _unit_stride(rng, t, device):
    """t with its size-1 leading dims given other strides (any stride is theirs: a transpose, a
    slice or a permute leaves them so; is_contiguous() may stay True)."""
    ones = [d for d in range(t.dim() - 1) if t.shape[d] == 1]
    if not ones:
        return t, "no size-1 dim"
    stride = list(t.stride())
    for d in ones:
        stride[d] = rng.choice([0, 1, 7, t.shape[-1], 3 * t.numel() + 5])
    return t.as_strided(t.shape, stride), "size-1 dim strides"


def _vocab_zero(rng, t, device):
    if t.dim() == 0:
        return None
    return t[..., :0], "vocab=0"


def _vocab_drop(rng, t, device):
    if t.dim() == 0 or t.shape[-1] < 2:
        return None
    return t[..., :-1], "vocab-1"


LOGITS_MUTATORS = [_noncontig, _offset, _expand, _transposed, _empty, _unsqueeze, _flatten0d, _move, _drop_last,
                   _vocab_zero, _vocab_drop, lambda r, t, d: None if t.dim() < 2 or 1 not in t.shape[:-1]
                   else _unit_stride(r, t, d),
                   _dtype_to(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                             torch.bool, torch.uint8)]
LABELS_MUTATORS = [_noncontig, _offset, _expand, _empty, _unsqueeze, _flatten0d, _move, _drop_last,
                   _dtype_to(torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool)]
STATS_MUTATORS = [_noncontig, _offset, _expand, _empty, _unsqueeze, _flatten0d, _move, _drop_last,
                  _dtype_to(torch.float64, torch.float16, torch.bfloat16, torch.int64)]


def _log_probs_mutators(b, V):
    b.tensor_mut("logits", LOGITS_MUTATORS, weight=2)
    b.tensor_mut("labels", LABELS_MUTATORS, weight=1.5)

    def label_value(b):
        t = b.a["labels"]
        if not _is_t(t) or t.numel() == 0 or t.dtype not in (torch.int64, torch.int32):
            return None
        t = t.clone(memory_format=torch.contiguous_format)
        flat = t.view(-1)
        k = b.rng.randrange(flat.numel())
        vs = b.a["vocab_start"]
        info = torch.iinfo(t.dtype)
        v = b.rng.choice([vs - 1, vs, vs + V - 1, vs + V, -1, -100, info.max, info.min])
        v = max(info.min, min(info.max, v))
        flat[k] = v
        b.a["labels"] = t
        return f"labels[flat {k}]={v}"
    b.custom(label_value, 1.5)
    b.int_mut("vocab_start", [-1, -5, -(2**63), 0, 1, V, 2**31, 2**62, INT64_MAX, b.a["vocab_start"] + 1])

    def extreme_start(b):  # label - vocab_start does not fit int64
        t = b.a["labels"]
        if not _is_t(t) or t.numel() == 0 or t.dtype != torch.int64:
            return None
        t = t.clone(memory_format=torch.contiguous_format)
        k = b.rng.randrange(t.numel())
        t.view(-1)[k] = -(2**63) + b.rng.randint(0, 3)
        b.a["labels"] = t
        b.a["vocab_start"] = b.rng.choice([INT64_MAX, INT64_MAX - 1, 2**62 + 1])
        return f"labels[flat {k}]={int(t.view(-1)[k])}, vocab_start={b.a['vocab_start']}"
    b.custom(extreme_start, 0.3)


def _log_probs_call(rng, g, device):
    lead = _lead_shape(rng)
    V = rng.choice([1, 2, 3, 7, 32, 64, 129, rng.randint(1, 384)])
    dtype = rng.choice(LOGIT_DTYPES)
    ldt = rng.choice([torch.int64, torch.int32])
    vocab_start = rng.choice([0, 0, 0, V, 3 * V, rng.randint(1, 100000)])
    logits = gen_logits(rng, g, lead, V, dtype).to(device)
    labels = gen_labels(rng, g, lead, V, vocab_start, ldt).to(device)
    return lead, V, logits, labels, vocab_start


def gen_log_probs_forward(rng, g, device):
    _lead, V, logits, labels, vocab_start = _log_probs_call(rng, g, device)
    b = Builder(rng, device, "vocab_log_probs_forward", ["logits", "labels", "vocab_start"],
                [logits, labels, vocab_start])
    _log_probs_mutators(b, V)
    return b


def gen_log_probs_backward(rng, g, device):
    lead, V, logits, labels, vocab_start = _log_probs_call(rng, g, device)
    _x, m, s, _col, _inside = ref_log_probs(logits, labels, vocab_start)
    m, s = m.float().reshape(lead), s.float().reshape(lead)
    if rng.random() < 0.3:  # the whole vocabulary's statistics, this slice one of several
        up = torch.rand(lead, generator=g) * 3
        s = s * torch.exp(-up) + torch.rand(lead, generator=g) * 5
        m = m + up
    grad = torch.randn(lead, generator=g) * rng.choice([1.0, 1.0, 0.1, 3.0])
    if grad.numel() and rng.random() < 0.2:
        grad.view(-1)[rng.randrange(grad.numel())] = 0.0
    b = Builder(rng, device, "vocab_log_probs_backward",
                ["grad_log_probs", "logits", "labels", "logits_max", "sum_exp", "vocab_start"],
                [grad.to(device), logits, labels, m.to(device), s.to(device), vocab_start])
    _log_probs_mutators(b, V)
    for name in ("grad_log_probs", "logits_max", "sum_exp"):
        b.tensor_mut(name, STATS_MUTATORS)
    return b


GENERATORS = {
    "thd_layout": lambda r, g, d: gen_thd_layout(r, g, d, False),
    "thd_layout_info": lambda r, g, d: gen_thd_layout(r, g, d, True),
    "preprocess_thd": lambda r, g, d: gen_thd(r, g, d, unpack=False),
    "postprocess_thd": lambda r, g, d: gen_thd(r, g, d, unpack=True),
    "jagged_gather": lambda r, g, d: gen_jagged(r, g, d, False),
    "jagged_scatter": lambda r, g, d: gen_jagged(r, g, d, True),
    "router_topk_record": lambda r, g, d: gen_record(r, g, d, False),
    "router_topk_record_layers": lambda r, g, d: gen_record(r, g, d, True),
    "router_topk_scatter": gen_scatter,
    "merge_router_topk": gen_merge_router,
    "dynamic_cp_split": gen_split,
    "dynamic_cp_merge": gen_merge,
    "dynamic_cp_merge_header": gen_merge_header,
    "dynamic_cp_merge_index": gen_merge_index,
    "vocab_log_probs_forward": gen_log_probs_forward,
    "vocab_log_probs_backward": gen_log_probs_backward,
}


def make_case(seed: int, device: str, op: str | None = None) -> Case:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    if op is None:
        names = list(WEIGHTS)
        op = rng.choices(names, weights=[WEIGHTS[n] for n in names])[0]
    return GENERATORS[op](rng, g, device).finish(seed)


# --------------------------------------------------------------------------------------------
# Running and judging one case.


def describe(x, depth=0) -> str:
    if _is_t(x):
        s = f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        if x.device.type != "cpu":
            s += f"@{x.device}"
        if not x.is_contiguous():
            s += f" strides={list(x.stride())}"
        if x.device.type != "meta" and x.numel() <= 16:
            s += "=" + str(x.tolist()).replace(" ", "")
        return s
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(describe(y, depth + 1) for y in x) + "]"
    return repr(x)


def describe_args(case: Case) -> str:
    return f"{case.op}(" + ", ".join(describe(a) for a in case.args) + ")"


def finding_of(case: Case, kind: str, detail: str) -> dict:
    return {"seed": case.seed, "op": case.op, "kind": kind, "detail": detail, "muts": case.muts,
            "args": describe_args(case)}


def to_meta(x):
    if _is_t(x):
        return torch.empty_like(x, device="meta")
    if isinstance(x, list):
        return [to_meta(y) for y in x]
    return x


def call_op(op: str, args):
    return getattr(ops, op).default(*args)


def compare(out, expected) -> str | None:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if len(outs) != len(expected):
        return f"{len(outs)} outputs, reference has {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected)):
        if callable(e):
            msg = e(o)
            if msg:
                return f"output {i}: {msg}"
        elif _is_t(e):
            if not _is_t(o):
                return f"output {i} is {type(o).__name__}, reference a tensor"
            if o.dtype != e.dtype or tuple(o.shape) != tuple(e.shape) or o.device != e.device:
                return (f"output {i}: {o.dtype}{list(o.shape)}@{o.device}, reference "
                        f"{e.dtype}{list(e.shape)}@{e.device}")
            if not torch.equal(o.cpu(), e.cpu()):
                diff = (o.cpu() != e.cpu())
                where = diff.nonzero()[0].tolist() if diff.any() else "?"
                return f"output {i} differs from the reference (first at {where})"
        elif o != e:
            return f"output {i} = {o!r}, reference {e!r}"
    return None


def meta_shapes(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(o.shape), o.dtype) if _is_t(o) else ("int", None) for o in outs]


def _names(msg: str, op: str) -> bool:
    """`msg` names `op` as a word ("dynamic_cp_merge_header: ..." does not name dynamic_cp_merge)."""
    return re.search(rf"(?<![\w]){re.escape(op)}(?![\w])", msg) is not None


def error_problem(op: str, e: BaseException, words, any_op=False) -> str | None:
    """Why a raised error does not meet the standard (None: it does). `any_op`: a message naming
    another verl_ops op will do (a call whose result is unspecified, e.g. validate=False)."""
    names = MSG_NAMES.get(op, (op,))
    msg = str(e)
    if not isinstance(e, ACCEPTED_ERRORS):
        return f"wrong error type {type(e).__name__}"
    if not any(_names(msg, n) for n in names) and not (any_op and any(_names(msg, o) for o in OPS)):
        return f"message does not name the op ({names[0]})"
    if words and not any(w in msg for w in words):
        return f"message names none of {list(words)}"
    return None


def is_cuda_fault(e: BaseException) -> bool:
    """A sticky CUDA error (the context is lost); not an allocation failure."""
    s = str(e)
    if "out of memory" in s:
        return False
    return any(k in s for k in ("illegal memory access", "CUDA error", "misaligned address", "device-side assert",
                                "unspecified launch failure"))


class CudaFault(Exception):
    pass


# What happened to each case (the summary's columns): "valid" a valid call checked against the
# reference, "raised" a bad call rejected, "free" a call the device may take either way (CUDA value
# errors), "bad" a case with findings.
OUTCOMES = ("valid", "raised", "free", "bad")


def _any_cuda(x) -> bool:
    if _is_t(x):
        return x.is_cuda
    return isinstance(x, (list, tuple)) and any(_any_cuda(y) for y in x)


def judge(case: Case, device: str, outcome: list | None = None) -> list:
    """Runs one case; returns its findings (dicts). `outcome` (a list) gets the case's outcome."""
    findings = []

    def finding(kind, detail):
        findings.append(finding_of(case, kind, detail))

    # The kernel that runs: CUDA when any tensor argument is on a GPU (a mutation may have moved
    # every tensor of a CUDA case to the CPU).
    device = "cuda" if _any_cuda(case.args) else "cpu"
    bad, expected = SPECS[case.op](case.args, device)
    must = [b for b in bad if b.must_raise(device)]
    out = err = None
    try:
        out = call_op(case.op, case.args)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        err = e
        if device == "cuda" and is_cuda_fault(e):
            raise CudaFault(f"CUDA fault (sticky: the worker stops): {type(e).__name__}: {str(e)[:300]}") from e
    words = tuple(w for b in (must or bad) for w in b.words)
    if err is not None:
        why = error_problem(case.op, err, words if must else (), any_op=bool(bad) and not must)
        if why:
            finding("bad error", f"{why}: {type(err).__name__}: {str(err)[:300]}")
        if not bad and expected is not None:
            finding("rejected valid input", f"{type(err).__name__}: {str(err)[:300]}")
    else:
        if must:
            finding("silently accepted", "; ".join(b.text for b in must))
        elif expected is not None:
            why = compare(out, expected)
            if why:
                finding("wrong output", why)
    if outcome is not None:
        outcome.append("valid" if not bad else ("raised" if must else "free"))

    # The Meta kernel on the same arguments.
    if case.op in NO_META:
        return findings
    keep = META_KEEP_HOST.get(case.op, set())
    margs = [a if i in keep else to_meta(a) for i, a in enumerate(case.args)]
    try:
        mout, merr = call_op(case.op, margs), None
    except Exception as e:  # noqa: BLE001
        mout, merr = None, e
    if err is None:
        if merr is not None:
            finding("meta rejects", f"device op returned, Meta raised {type(merr).__name__}: {str(merr)[:300]}")
        elif meta_shapes(mout) != meta_shapes(out):
            finding("meta shapes", f"Meta {meta_shapes(mout)} != device {meta_shapes(out)}")
    else:
        static = [b for b in bad if b.kind == "static" and b.meta]
        if static and merr is None:
            finding("meta accepts", "Meta returned for: " + "; ".join(b.text for b in static))
        elif merr is not None:
            why = error_problem(case.op, merr, ())
            if why:
                finding("meta bad error", f"{why}: {type(merr).__name__}: {str(merr)[:300]}")
    return findings


# --------------------------------------------------------------------------------------------
# Worker (one process, a range of seeds) and driver (crash isolation, parallel batches).


def worker(device: str, seed: int, cases: int, inject_crash=None, verbose=False, op=None) -> int:
    """Runs seeds [seed, seed + cases): prints `B <seed>` before each case, `F <json>` per finding,
    `O <op> <outcome>` after each case and `S` at the end."""
    case = None
    for s in range(seed, seed + cases):
        print(f"B {s}", flush=True)
        if inject_crash is not None and s == inject_crash:
            os.abort()
        outcome = []
        try:
            case = make_case(s, device, op)
            if verbose:
                print(f"# {s} {describe_args(case)} muts={case.muts}", flush=True)
            found = judge(case, device, outcome)
            if device == "cuda" and torch.cuda.memory_reserved() > 4 * 2**30:
                torch.cuda.empty_cache()  # a large output of a "free" case must not crowd out the next
        except CudaFault as e:  # the CUDA context is gone: report and stop
            print("F " + json.dumps(fault_finding(case, e)), flush=True)
            return 3
        except Exception:  # noqa: BLE001  (a bug of the fuzzer itself: report it, do not hide it)
            case = Case(s, "?", []) if case is None or case.seed != s else case
            found = [finding_of(case, "fuzzer error", traceback.format_exc()[-1500:])]
        for f in found:
            print("F " + json.dumps(f), flush=True)
        print(f"O {case.op} {'bad' if found else (outcome[0] if outcome else 'bad')}", flush=True)
    print("S", flush=True)
    return 0


def _count(counts: dict, op: str, outcome: str, n: int = 1):
    row = counts.setdefault(op, {})
    row[outcome] = row.get(outcome, 0) + n


def fault_finding(case, e):
    return finding_of(case, "crash", str(e))


def _limit_memory():
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, resource.RLIM_INFINITY))
    except (ImportError, ValueError, OSError):
        pass


@dataclass
class Report:
    device: str
    seed: int
    cases: int
    findings: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # op -> outcome -> cases
    seconds: float = 0.0

    def merge_counts(self, counts: dict):
        for op, row in counts.items():
            for k, n in row.items():
                _count(self.counts, op, k, n)

    @property
    def ran(self) -> int:
        return sum(sum(r.values()) for r in self.counts.values())

    def groups(self) -> dict:
        """(kind, op, what) -> findings; `what` is the detail without its numbers."""
        out = {}
        for f in self.findings:
            what = f["detail"]
            if f["kind"] in ("bad error", "meta bad error"):  # why, the error's type, who it names
                why, _, rest = what.partition(": ")
                etype, _, msg = rest.partition(": ")
                head = msg.split(":")[0] if re.match(r"[\w:]+:", msg) else " ".join(msg.split()[:4])
                what = f"{why} {etype} {head}"
            what = re.sub(r"-?\d+", "N", what)
            what = re.sub(r"\[[^\]]*\]", "[..]", what)[:160]
            out.setdefault((f["kind"], f["op"], what), []).append(f)
        return out

    def format(self, limit=40) -> str:
        lines = [(f"fuzz {self.device}: {self.ran} of {self.cases} cases from seed {self.seed} in "
                  f"{self.seconds:.1f} s, {len(self.findings)} finding(s) in {len(self.groups())} group(s)"),
                 f"  {'op':28s}" + "".join(f"{k:>8s}" for k in OUTCOMES)]
        for op in sorted(self.counts):
            lines.append(f"  {op:28s}" + "".join(f"{self.counts[op].get(k, 0):8d}" for k in OUTCOMES))
        for shown, ((kind, op, _what), fs) in enumerate(sorted(self.groups().items())):
            if shown >= limit:
                lines.append(f"  ... and {len(self.groups()) - limit} more group(s)")
                break
            f = fs[0]
            detail = f["detail"][-700:] if kind == "fuzzer error" else f["detail"][:400]
            lines.append(f"  [{kind}] {op} x{len(fs)}: {detail}\n"
                         f"      e.g. seed={f['seed']} muts={f['muts']}\n      args: {f['args'][:500]}")
            if len(fs) > 1:
                lines.append(f"      seeds: {[x['seed'] for x in fs[:12]]}{' ...' if len(fs) > 12 else ''}")
        return "\n".join(lines)


def _run_worker(cmd, env, case_timeout):
    """(stdout lines, stderr, exit status or None when killed for a hang)."""
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
        lines, beat = [], [time.time()]

        def read():
            for line in p.stdout:
                lines.append(line.rstrip("\n"))
                beat[0] = time.time()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        rc = None
        while True:
            try:
                rc = p.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.time() - beat[0] > case_timeout:  # no case finished in time: a hang
                    p.kill()
                    p.wait()
                    break
        reader.join(timeout=10)
        err.seek(0)
        return lines, err.read(), rc


def _run_range(device, start, count, case_timeout, inject_crash, env_extra, op=None):
    """Runs seeds [start, start + count) in child processes; a crash or hang becomes a finding and
    the run goes on after that seed."""
    findings, counts = [], {}
    end = start + count
    while start < end:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device", device, "--seed", str(start),
               "--cases", str(end - start)]
        if inject_crash is not None:
            cmd += ["--inject-crash", str(inject_crash)]
        if op is not None:
            cmd += ["--op", op]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env_extra)
        lines, stderr, rc = _run_worker(cmd, env, case_timeout)
        last = last_done = None
        done = False
        for line in lines:
            if line.startswith("B "):
                last = int(line[2:])
            elif line.startswith("F "):
                findings.append(json.loads(line[2:]))
            elif line.startswith("O "):
                _, op_name, outcome = line.split()
                _count(counts, op_name, outcome)
                last_done = last
            elif line == "S":
                done = True
        if done and rc == 0:
            break
        if last is None:  # the worker died before its first case: no seed to blame
            findings.append(finding_of(Case(start, "?", []), "worker failed", f"exit status {rc}: {stderr[-1500:]}"))
            break
        what = f"hang (no case finished within {case_timeout} s)" if rc is None else f"crash (exit status {rc})"
        case = None
        if last != inject_crash:
            try:
                case = make_case(last, device, op)
            except Exception:  # noqa: BLE001
                case = None
        if not any(f["seed"] == last and f["kind"] == "crash" for f in findings):
            findings.append(finding_of(case or Case(last, "?", []), "crash" if rc is not None else "hang",
                                       f"{what}; stderr tail: {stderr[-800:]}"))
        if last_done != last:  # (a CUDA fault reports its case itself, then the worker stops)
            _count(counts, case.op if case is not None else "?", "bad")
        start = last + 1
    return findings, counts


def memory_limit_env(root: str, limit: int) -> dict:
    """The environment under which st::output's bound is `limit` bytes: a fake cgroup v1 tree under
    `root` (memory.limit_in_bytes and memory.memsw.limit_in_bytes both `limit`, so host swap adds
    nothing) named by a fake /proc/self/cgroup."""
    group = os.path.join(root, "memory", "verl_ops_fuzz")
    os.makedirs(group, exist_ok=True)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        with open(os.path.join(group, name), "w") as f:
            f.write(f"{limit}\n")
    proc = os.path.join(root, "proc_self_cgroup")
    with open(proc, "w") as f:
        f.write("4:memory:/verl_ops_fuzz\n0::/\n")
    return {"VERL_OPS_PROC_CGROUP": proc, "VERL_OPS_CGROUP_ROOT": root}


FUZZ_MEMORY = int(os.environ.get("VERL_OPS_FUZZ_MEMORY", str(4 << 30)))


def fuzz(device: str, seed: int, cases: int, jobs: int = 2, case_timeout: float = 60.0, inject_crash=None,
         env_extra=None, op=None) -> Report:
    with tempfile.TemporaryDirectory(prefix="verl_ops_fuzz_") as root:
        env = memory_limit_env(root, FUZZ_MEMORY) if FUZZ_MEMORY > 0 else {}
        return _fuzz(device, seed, cases, jobs, case_timeout, inject_crash, {**env, **(env_extra or {})}, op)


def _fuzz(device, seed, cases, jobs, case_timeout, inject_crash, env_extra, op) -> Report:
    t0 = time.time()
    jobs = max(1, min(jobs, cases))
    per = -(-cases // jobs)
    ranges = [(seed + i * per, min(per, cases - i * per)) for i in range(jobs) if cases - i * per > 0]
    report = Report(device, seed, cases)
    with ThreadPoolExecutor(len(ranges)) as ex:
        futs = [ex.submit(_run_range, device, s, n, case_timeout, inject_crash, env_extra, op)
                for s, n in ranges]
        for f in futs:
            fs, cs = f.result()
            report.findings += fs
            report.merge_counts(cs)
    report.findings.sort(key=lambda f: (f["kind"], f["op"], f["seed"]))
    report.seconds = time.time() - t0
    return report


def fuzz_inprocess(device: str, seed: int, cases: int, verbose=False, op=None) -> Report:
    t0 = time.time()
    report = Report(device, seed, cases)
    case = None
    for s in range(seed, seed + cases):
        outcome = []
        try:
            case = make_case(s, device, op)
            if verbose:
                print(f"# {s} {describe_args(case)} muts={case.muts}", flush=True)
            found = judge(case, device, outcome)
            if device == "cuda" and torch.cuda.memory_reserved() > 4 * 2**30:
                torch.cuda.empty_cache()  # a large output of a "free" case must not crowd out the next
        except CudaFault as e:
            report.findings.append(fault_finding(case, e))
            _count(report.counts, case.op, "bad")
            break
        except Exception:  # noqa: BLE001  (a bug of the fuzzer itself: report it, do not hide it)
            case = Case(s, "?", []) if case is None or case.seed != s else case
            found = [finding_of(case, "fuzzer error", traceback.format_exc()[-1500:])]
        report.findings += found
        _count(report.counts, case.op, "bad" if found else (outcome[0] if outcome else "bad"))
    report.seconds = time.time() - t0
    return report


# --------------------------------------------------------------------------------------------
# pytest.

CPU_CASES = int(os.environ.get("VERL_OPS_FUZZ_CASES", "12000"))
CUDA_CASES = int(os.environ.get("VERL_OPS_FUZZ_CUDA_CASES", "8000"))
FUZZ_SEED = int(os.environ.get("VERL_OPS_FUZZ_SEED", "1"))


def test_fuzz_raw_ops_cpu():
    report = fuzz("cpu", FUZZ_SEED, CPU_CASES, jobs=2)
    print(report.format(limit=500))
    assert report.ran == CPU_CASES, report.format()
    assert not report.findings, report.format(limit=500)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_fuzz_raw_ops_cuda():
    report = fuzz("cuda", FUZZ_SEED, CUDA_CASES, jobs=1)
    print(report.format(limit=500))
    assert not report.findings, report.format(limit=500)


def test_fuzz_workers_memory_bound(tmp_path):
    """The workers' CPU outputs are bounded by FUZZ_MEMORY on any host (memory_limit_env): an 8 GiB
    output is refused naming the 4 GiB bound, a 1 MiB one allocated."""
    code = ("import torch, verl_ops\n"
            "for rows in (1 << 29, 1 << 16):\n"
            "    try:\n"
            "        r = torch.ops.verl_ops.jagged_scatter(torch.zeros(3, 4), torch.tensor([0]),\n"
            "                                              torch.tensor([0, 3], dtype=torch.int32), rows)\n"
            "        print('ok', list(r.shape))\n"
            "    except RuntimeError as e:\n"
            "        print('error', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               **memory_limit_env(str(tmp_path), 4 << 30))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("error") and "jagged_scatter" in lines[0] and str(4 << 30) in lines[0], lines[0]
    assert lines[1] == "ok [65536, 4]", lines[1]


def test_fuzzer_covers_every_op():
    """Every registered verl_ops op (but the CUDA-only mla_* ones) has a generator, a contract
    check and a schema of the arity the generator builds."""
    schemas = {s.name.split("::")[1]: s for s in torch._C._jit_get_all_schemas()
               if s.name.startswith("verl_ops::")}
    wanted = {n for n in schemas if not n.startswith("mla_")}
    assert wanted == set(OPS) == set(GENERATORS) == set(SPECS) == set(WEIGHTS), sorted(wanted ^ set(OPS))
    for name in OPS:
        case = make_case(0, "cpu", name)
        assert len(case.args) == len(schemas[name].arguments), name


def test_fuzzer_catches_crashes_and_wrong_answers(monkeypatch):
    """The harness fails when it should: a worker that aborts is reported as a crash naming the
    seed, and a wrong output / a silently accepted bad input / an error without the op's name
    each become findings."""
    report = fuzz("cpu", 100, 6, jobs=1, inject_crash=102)
    crashes = [f for f in report.findings if f["kind"] == "crash"]
    assert [f["seed"] for f in crashes] == [102], report.format()
    assert report.ran == 6  # the crashed case, and the cases after it ran too

    real = call_op

    def wrong(op, args):  # a kernel that answers one off
        out = real(op, args)
        return out + 1 if out.dtype != torch.bool else ~out
    cu = torch.tensor([0, 3], dtype=torch.int32)
    good = Case(1, "jagged_gather", [torch.arange(6.0), torch.tensor([2]), cu, 3])
    monkeypatch.setattr(sys.modules[__name__], "call_op", wrong)
    assert [f["kind"] for f in judge(good, "cpu")] == ["wrong output"]
    bad = Case(2, "jagged_gather", [torch.arange(6.0), torch.tensor([5]), cu, 3])
    monkeypatch.setattr(sys.modules[__name__], "call_op", lambda op, args: torch.zeros(args[3]))
    assert "silently accepted" in [f["kind"] for f in judge(bad, "cpu")]

    def unnamed(op, args):
        raise RuntimeError("something went wrong")
    monkeypatch.setattr(sys.modules[__name__], "call_op", unnamed)
    assert "bad error" in [f["kind"] for f in judge(bad, "cpu")]


# --------------------------------------------------------------------------------------------
# Standalone.


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: 2 on cpu, 1 on cuda)")
    ap.add_argument("--inprocess", action="store_true", help="no child processes (for compute-sanitizer / valgrind)")
    ap.add_argument("--op", default=None, choices=OPS, help="only cases of this op")
    ap.add_argument("--no-rlimit", action="store_true", help="no address-space limit in CPU workers")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--groups", type=int, default=200, help="finding groups to print")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inject-crash", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    # An accidental huge allocation fails instead of taking the machine down. Not where CUDA is
    # there: a CUDA context (the CPU fuzz moves tensors to the GPU for its device-mix cases) needs
    # more address space than the limit, and a worker whose context failed under it ran out of
    # memory for everything after (MemoryError, the parser's SyntaxError, "device busy or
    # unavailable"); the ops' own CPU outputs stay bounded by the fake memory cgroup of fuzz().
    if a.device == "cpu" and not a.no_rlimit and not os.environ.get("VERL_OPS_FUZZ_NO_RLIMIT") and \
            (a.worker or a.inprocess) and not torch.cuda.is_available():
        _limit_memory()
    if a.worker:
        torch.set_num_threads(1)  # the workers run side by side, one per core
        return worker(a.device, a.seed, a.cases, a.inject_crash, a.verbose, a.op)
    if a.inprocess:
        report = fuzz_inprocess(a.device, a.seed, a.cases, a.verbose, a.op)
    else:
        env = {"VERL_OPS_FUZZ_NO_RLIMIT": "1"} if a.no_rlimit else {}
        report = fuzz(a.device, a.seed, a.cases, jobs=a.jobs or (2 if a.device == "cpu" else 1), env_extra=env,
                      op=a.op)
    print(report.format(limit=a.groups))
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
