"""Reference implementations of the THD layout and pack, written from OPS.md (sections 1, 2) only.

Plain Python / PyTorch, one loop per sequence: slow, short, and meant to be obviously right.
"""

from __future__ import annotations

import math

import torch


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def ref_layout(lengths, tp=1, cp=1, cp_layout="zigzag", fp8=False, min_local_rows=None, bucket=None):
    """OPS.md section 1, rules 1-6. Returns (cu_seqlens, cu_seqlens_padded) as lists of ints.

    Raises ValueError only where the rules themselves cannot be applied (a bucket <= 0, or an
    empty batch whose "last sequence" would have to be padded). Whether the result is a layout the
    kernels accept is for the caller to judge (see `layout_is_valid`).
    """
    lengths = [int(n) for n in lengths]
    # Rule 1.
    factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
    align = tp * cp * factor
    # Rule 2.
    total_align = None
    if fp8:
        total_align = align * 128
        align = math.lcm(16, align)
    # Rule 3.
    padded = [_ceil_to(n, align) for n in lengths]

    def pad_last_to(total):
        if total == sum(padded):
            return
        if not padded:
            raise ValueError("no last sequence to pad")
        padded[-1] += total - sum(padded)

    # Rule 4.
    if fp8:
        pad_last_to(_ceil_to(sum(padded), total_align))
    # Rule 5.
    if min_local_rows is not None and sum(padded) < cp * min_local_rows:
        pad_last_to(cp * min_local_rows)
    # Rule 6.
    if bucket is not None:
        if bucket <= 0:
            raise ValueError("pad_to_length_bucket must be > 0")
        m = math.lcm(bucket, cp)
        if fp8:
            m = math.lcm(m, total_align)
        pad_last_to(_ceil_to(sum(padded), m))

    cu, cu_padded = [0], [0]
    for n, p in zip(lengths, padded):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + p)
    return cu, cu_padded


def layout_is_valid(cu_padded, cp, cp_layout) -> bool:
    """The invariants the kernels rely on (OPS.md section 1, after rule 7)."""
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    if cp_layout == "zigzag" and cp > 1 and any(p % (2 * cp) for p in padded):
        return False
    return cu_padded[-1] % cp == 0


def ref_pack(seqs, cu_padded, cp, cp_rank, cp_layout, roll, *, feature_shape=None, dtype=None):
    """OPS.md section 2, pack. `seqs[i]` is sequence i's valid tokens, ``[len_i, *F]``.

    Returns (packed [local_rows, *F], position_ids int64 [local_rows]) of rank `cp_rank`.
    """
    cu_padded = [int(c) for c in cu_padded]
    if seqs:
        feature_shape, dtype = tuple(seqs[0].shape[1:]), seqs[0].dtype
    # The global padded buffer, one padded sequence at a time.
    bufs, poss = [], []
    for i, x in enumerate(seqs):
        n = x.shape[0]
        padded = cu_padded[i + 1] - cu_padded[i]
        if roll and n > 0:
            x = torch.roll(x, -1, 0)  # position p holds token p+1, the last valid one token 0
        buf = torch.zeros((padded, *feature_shape), dtype=dtype)
        buf[:n] = x
        bufs.append(buf)
        poss.append(torch.arange(padded, dtype=torch.int64))
    total = cu_padded[-1]
    local_rows = total // cp
    if bufs:
        glob, gpos = torch.cat(bufs), torch.cat(poss)
    else:
        glob, gpos = torch.zeros((0, *feature_shape), dtype=dtype), torch.zeros(0, dtype=torch.int64)
    if cp == 1:
        return glob, gpos
    r = cp_rank
    if cp_layout == "contiguous":
        return glob[r * local_rows : (r + 1) * local_rows], gpos[r * local_rows : (r + 1) * local_rows]
    assert cp_layout == "zigzag"
    out = torch.zeros((local_rows, *feature_shape), dtype=dtype)
    out_pos = torch.zeros(local_rows, dtype=torch.int64)
    for i, (buf, pos) in enumerate(zip(bufs, poss)):
        c = buf.shape[0] // (2 * cp)
        start = cu_padded[i] // cp
        for k, chunk in enumerate((r, 2 * cp - 1 - r)):
            out[start + k * c : start + (k + 1) * c] = buf[chunk * c : (chunk + 1) * c]
            out_pos[start + k * c : start + (k + 1) * c] = pos[chunk * c : (chunk + 1) * c]
    return out, out_pos
