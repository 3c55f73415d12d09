"""Reference implementations of the THD layout and pack, written from docs/layout.md only.

Plain Python / PyTorch, one loop per sequence: slow, short, and meant to be obviously right.
"""

from __future__ import annotations

import math

import torch


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def ref_layout(lengths, tp=1, cp=1, cp_layout="zigzag", fp8=False, min_local_rows=None, bucket=None):
    """docs/layout.md#rules, rules 1-6. Returns (cu_seqlens, cu_seqlens_padded) as lists of ints.

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
    """The invariants the kernels rely on (docs/layout.md#invariants)."""
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    if cp_layout == "zigzag" and cp > 1 and any(p % (2 * cp) for p in padded):
        return False
    return cu_padded[-1] % cp == 0


def ref_pack(seqs, cu_padded, cp, cp_rank, cp_layout, roll, *, feature_shape=None, dtype=None, main_align=None):
    """docs/layout.md#pack, with verl's (0.9.1) padding-row and roll rules written procedurally.

    `seqs[i]` is sequence i's valid tokens, ``[len_i, *F]``. Returns (packed [local_rows, *F],
    position_ids int64 [local_rows]) of rank `cp_rank`.

    Unrolled: valid rows hold their token and position; padding rows hold zero and position 0,
    except zigzag first-chunk rows (cp > 1), whose positions count on through the padding.
    Rolled: contiguous rolls each sequence's valid rows (values and positions, ``(p+1) % len``);
    zigzag with cp == 1 rolls the whole local buffer by one row; zigzag with cp > 1 rolls the
    whole local buffer and then rewrites the last row of each chunk (the row after the first
    chunk's last row / the sequence's token 0 on rank 0), as verl does.

    ``main_align``: verl main's rule for the rolled zigzag case (cp > 1) instead of 0.9.1's: a
    sequence is zero-padded only to max(len, main_align) (its alignment), not to its padded
    length, so its second chunk holds the rows [P - (r+1)c, min(P - rc, that length)); the row
    rewritten after the roll is the last of those rows, with token 0 and position 0 when the chunk
    reaches the end of the zero-padded sequence.
    """
    cu_padded = [int(c) for c in cu_padded]
    if seqs:
        feature_shape, dtype = tuple(seqs[0].shape[1:]), seqs[0].dtype
    total = cu_padded[-1]
    local_rows = total // cp
    out = torch.zeros((local_rows, *feature_shape), dtype=dtype)
    out_pos = torch.zeros(local_rows, dtype=torch.int64)
    r = cp_rank
    lens = [x.shape[0] for x in seqs]
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]

    def padded_seq(i):  # sequence i zero-padded to its padded length
        d = torch.zeros((padded[i], *feature_shape), dtype=dtype)
        d[: lens[i]] = seqs[i]
        return d

    if cp == 1 or cp_layout == "contiguous":
        lo = r * local_rows
        for i in range(len(seqs)):
            n, g0 = lens[i], cu_padded[i]
            src = torch.arange(n)
            if roll and cp_layout == "contiguous":
                src = (src + 1) % max(n, 1)
            for p in range(n):
                g = g0 + p
                if lo <= g < lo + local_rows:
                    out[g - lo] = seqs[i][src[p]]
                    out_pos[g - lo] = src[p]
        if roll and cp_layout == "zigzag":  # cp == 1: the whole buffer rolls by one row
            out, out_pos = torch.roll(out, -1, 0), torch.roll(out_pos, -1, 0)
        return out, out_pos
    assert cp_layout == "zigzag"
    if local_rows == 0:
        return out, out_pos
    fixes = {}  # local row -> (value, position), applied after the roll in insertion order
    for i in range(len(seqs)):
        d, n, P = padded_seq(i), lens[i], padded[i]
        c = P // (2 * cp)
        start = cu_padded[i] // cp
        first, second = r * c, P - (r + 1) * c
        out[start : start + c] = d[first : first + c]
        out_pos[start : start + c] = torch.arange(first, first + c)
        out[start + c : start + 2 * c] = d[second : second + c]
        out_pos[start + c : start + 2 * c] = torch.tensor(
            [q if q < n else 0 for q in range(second, second + c)], dtype=torch.int64
        )
        if roll:
            dz = torch.cat([d, torch.zeros((1, *feature_shape), dtype=dtype)])  # d[P] reads zero
            k = (start + c - 1) % local_rows
            fixes[k] = (dz[first + c], out_pos[k].clone())
            if main_align is None:
                if c > 0:
                    k = start + 2 * c - 1
                    fixes[k] = (dz[0], torch.tensor(0)) if r == 0 else (dz[second + c], out_pos[k].clone())
            else:
                D = max(n, main_align)
                end = min(second + c, D)
                out[start + c : start + 2 * c] = 0  # only the rows of [second, end) hold data
                if end > second:
                    out[start + c : start + c + end - second] = dz[second:end]
                    k = start + c + end - second - 1
                    fixes[k] = (dz[0], torch.tensor(0)) if end == D else (dz[end], out_pos[k].clone())
    if roll:
        out, out_pos = torch.roll(out, -1, 0), torch.roll(out_pos, -1, 0)
        for k, (v, p) in fixes.items():
            out[k], out_pos[k] = v, p
    return out, out_pos


def ref_roll_dropped(lengths, cu_padded, cp, cp_layout):
    """(seq, token) pairs that a rolled zigzag pack (cp > 1) holds in no row: verl zeroes the last
    local row of a sequence followed by an empty one (rank 0's token 0, rank r's token P - r*c)."""
    if cp_layout != "zigzag" or cp == 1:
        return set()
    cu_padded = [int(c) for c in cu_padded]
    padded = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    dropped = set()
    for i in range(len(lengths) - 1):
        if padded[i + 1] != 0 or padded[i] == 0:
            continue
        c = padded[i] // (2 * cp)
        for r in range(cp):
            t = 0 if r == 0 else padded[i] - r * c
            if t < lengths[i]:
                dropped.add((i, t))
    return dropped
