"""Drop-ins for verl's router-replay helpers of the rollout-routing-replay (R3) path and dynamic CP.

==========================================  ===========================================================
``local_padding_mask``                      verl's ``_local_padding_mask`` (``verl/utils/dynamic_cp_scheduler.py``):
                                            bool ``[local_rows]``, True in the padding rows of one
                                            CP rank's THD shard (Megatron-Core's router padding mask)
``build_r3_replay_mask``                    ``verl/utils/megatron/router_replay_utils.py``: jagged bool,
                                            True on every row but the last of each sequence that
                                            has a response
``align_r3_router_replay_data``             the same module: rollout routes (one row short where
                                            the final token has none) padded with a zero row to the
                                            input lengths
==========================================  ===========================================================

Each returns exactly what verl 0.9.1 returns (values, dtypes, devices, nested offsets, exception
types and messages) without verl's per-sequence Python loops: the mask is computed for all rows
at once from the lengths, the alignment is one pack of the route rows into the input lengths' rows (the same kernel
as :func:`verl_ops.preprocess_thd`).
"""

from __future__ import annotations

import math

import torch

from .._thd import preprocess_thd
from ..layout import ThdLayout

__all__ = ["align_r3_router_replay_data", "build_r3_replay_mask", "local_padding_mask"]


def _rows_of(lengths: torch.Tensor, n: int | None = None):
    """(sequence index, position in the sequence) of every row of sequences of these lengths
    (``n``: their sum, when known on the host; read from the device otherwise)."""
    n = int(lengths.sum()) if n is None else n
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=n)
    starts = torch.cumsum(lengths, 0) - lengths
    return seq, torch.arange(n, device=lengths.device) - starts[seq]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain_args(seq_lens, cp_size, cp_rank, tp_size, min_local_rows) -> bool:
    """Arguments the vectorised path covers: a list / tuple of non-negative ints, tp and cp sizes
    >= 1, a rank in [0, cp_size), min_local_rows None or a positive int."""
    return (
        isinstance(seq_lens, (list, tuple))
        and all(_is_int(n) and n >= 0 for n in seq_lens)
        and _is_int(cp_size) and cp_size >= 1
        and _is_int(tp_size) and tp_size >= 1
        and _is_int(cp_rank) and 0 <= cp_rank < cp_size
        and (min_local_rows is None or (_is_int(min_local_rows) and min_local_rows > 0))
    )


def _local_padding_mask_rows(seq_lens, *, cp_size, cp_rank, tp_size, cp_layout, min_local_rows) -> torch.Tensor:
    """The mask built sequence by sequence with Python ints and slices, for arguments outside the
    vectorised path's domain (lengths that are not non-negative ints, sizes < 1, a rank out of
    range, a generator of lengths): the same steps as verl's, so the same result or error (a
    negative length in a vectorised repeat would corrupt the heap instead)."""
    factor = 2 if cp_layout == "zigzag" and cp_size > 1 else 1
    align = tp_size * cp_size * factor
    padded = [math.ceil(n / align) * align for n in seq_lens]
    if min_local_rows is not None:
        if min_local_rows <= 0:
            raise ValueError(f"min_local_rows must be positive, got {min_local_rows}")
        short = cp_size * min_local_rows - sum(padded)
        if short > 0:
            padded[-1] += short
    if cp_layout == "contiguous":
        local = sum(padded) // cp_size
        lo = local * cp_rank
        mask = torch.ones(local, dtype=torch.bool)
        start = 0
        for n, p in zip(seq_lens, padded, strict=True):
            a, b = max(lo, start), min(lo + local, start + n)
            if a < b:
                mask[a - lo : b - lo] = False
            start += p
        return mask
    parts = []
    for n, p in zip(seq_lens, padded, strict=True):
        mask = torch.ones(p // cp_size, dtype=torch.bool)
        if cp_size == 1:
            mask[:n] = False
        else:
            half = p // (2 * cp_size)
            front = max(0, min(n - cp_rank * half, half))
            back = max(0, min(n - (p - (cp_rank + 1) * half), half))
            mask[:front] = False
            mask[half : half + back] = False
        parts.append(mask)
    return torch.cat(parts)


def local_padding_mask(
    seq_lens,
    *,
    cp_size: int,
    cp_rank: int,
    tp_size: int,
    cp_layout: str = "zigzag",
    min_local_rows: int | None = None,
) -> torch.Tensor:
    """verl's ``_local_padding_mask``: the router padding mask of this CP rank's THD shard.

    Sequences are padded to ``tp * cp`` (contiguous, or cp == 1) or ``tp * cp * 2`` (zigzag,
    cp > 1); ``min_local_rows`` lengthens the last one so the batch has at least ``cp *
    min_local_rows`` rows. Returns bool ``[local rows]`` on the CPU: False on rows holding a
    token, True on padding rows (zigzag: each sequence's two chunks of this rank in order;
    contiguous: this rank's slice of the padded batch).
    """
    if cp_layout not in ("zigzag", "contiguous"):
        raise ValueError(f"Unsupported context parallel layout: {cp_layout}")
    if not _plain_args(seq_lens, cp_size, cp_rank, tp_size, min_local_rows):
        return _local_padding_mask_rows(seq_lens, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size,
                                        cp_layout=cp_layout, min_local_rows=min_local_rows)
    factor = 2 if cp_layout == "zigzag" and cp_size > 1 else 1
    align = tp_size * cp_size * factor
    lens = torch.tensor([int(n) for n in seq_lens], dtype=torch.int64)
    padded = -(-lens // align) * align
    if min_local_rows is not None:
        if min_local_rows <= 0:
            raise ValueError(f"min_local_rows must be positive, got {min_local_rows}")
        deficit = cp_size * min_local_rows - int(padded.sum())
        if deficit > 0:
            if padded.numel() == 0:
                raise IndexError("list index out of range")  # verl's error for an empty batch
            padded[-1] += deficit

    if cp_layout == "contiguous":
        local = int(padded.sum()) // cp_size
        ends = torch.cumsum(padded, 0)
        g = torch.arange(local * cp_rank, local * (cp_rank + 1), dtype=torch.int64)
        seq = torch.searchsorted(ends, g, right=True)
        return ~((g - (ends - padded)[seq]) < lens[seq])

    if lens.numel() == 0:
        return torch.cat([])  # verl's error for an empty batch, word for word
    local_len = padded // cp_size
    seq, r = _rows_of(local_len)
    n = lens[seq]
    if cp_size == 1:
        return ~(r < n)
    half = (padded // (2 * cp_size))[seq]
    front = (n - cp_rank * half).clamp(min=0).minimum(half)
    back = (n - (padded[seq] - (cp_rank + 1) * half)).clamp(min=0).minimum(half)
    valid = (r < front) | ((r >= half) & (r < half + back))
    return ~valid


def build_r3_replay_mask(input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's R3 replay mask: jagged bool with ``input_ids``' offsets, True on every row of a
    sequence except its last when the sequence has a response (``response_mask`` row sums > 0),
    False everywhere in a sequence without one."""
    offsets = input_ids.offsets()
    total_lens = offsets.diff()
    response_lens = response_mask.sum(dim=-1).to(device=total_lens.device, dtype=total_lens.dtype)
    replay_lens = torch.where(response_lens > 0, total_lens - 1, torch.zeros_like(total_lens))
    if replay_lens.shape != total_lens.shape:
        # response rows broadcast against one sequence: verl's repeat of (replay, rest) counts
        # per response row over (True, False) per sequence fails
        raise RuntimeError(
            "repeats must have the same size as input along dim, but got repeats.size(0) = "
            f"{2 * replay_lens.numel()} and input.size(0) = {2 * total_lens.numel()}"
        )
    if bool((replay_lens < 0).any()):  # an empty sequence with a response: verl's error
        raise RuntimeError("repeats can not be negative")
    # (rows: the values' length when the offsets cover them from 0 without holes, else their sum)
    plain = getattr(input_ids, "_lengths", None) is None and hasattr(input_ids, "_values")
    n = input_ids._values.shape[0] if plain else None
    seq, pos = _rows_of(total_lens, n)
    return torch.nested.nested_tensor_from_jagged(pos < replay_lens[seq], offsets=offsets)


def align_r3_router_replay_data(layers_topk_idx: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """verl's R3 route alignment: sequence i of ``layers_topk_idx`` (jagged ``[B, j, *F]``) holds
    as many rows as sequence i of ``input_ids`` or exactly one fewer; the short ones get one zero
    row appended. Returns a new jagged nested tensor (routes' dtype and device)."""
    if not layers_topk_idx.is_nested or not input_ids.is_nested:
        raise TypeError("R3 router replay requires jagged route targets and input_ids")
    if layers_topk_idx.layout != torch.jagged:
        return _align_by_sequence(layers_topk_idx, input_ids)
    route_off = layers_topk_idx.offsets()
    route_lens_t = layers_topk_idx._lengths if layers_topk_idx._lengths is not None else route_off.diff()
    route_lens = [int(n) for n in route_lens_t.tolist()]
    input_lens = [int(n) for n in input_ids.offsets().diff().tolist()]
    if len(route_lens) != len(input_lens):
        raise RuntimeError(
            f"R3 router replay has {len(route_lens)} route sequences for {len(input_lens)} input sequences"
        )
    for sample_id, (route_len, input_len) in enumerate(zip(route_lens, input_lens)):
        if route_len != input_len and route_len != input_len - 1:
            raise RuntimeError(
                f"R3 router replay sample {sample_id} has {route_len} route rows for {input_len} input tokens; "
                "expected equal lengths or exactly one missing final route"
            )
    if not route_lens:
        return torch.nested.as_nested_tensor([], layout=torch.jagged)  # verl's error for an empty batch
    values = layers_topk_idx._values
    device = values.device
    offsets = torch.zeros(len(input_lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(input_lens, dtype=torch.int64), 0)
    if layers_topk_idx._lengths is None:
        # A pack: the route rows (jagged by route_lens) into rows laid out by the input lengths,
        # zero in the one padding row of a short sequence; one row-copy kernel.
        layout = ThdLayout.from_padded_offsets(route_lens, offsets).to(device)
        out = preprocess_thd(values, layout, 0, validate=False)[0]
    else:  # routes with holes (offsets plus lengths): gather row by row
        lens = torch.tensor(route_lens, dtype=torch.int64, device=device)
        seq, pos = _rows_of(lens)
        src = route_off[:-1].to(device=device, dtype=torch.int64)[seq] + pos
        dst = offsets[:-1].to(device)[seq] + pos
        out = values.new_zeros((sum(input_lens), *values.shape[1:]))
        out[dst] = values[src]
    # (with the min / max length cache that torch's list constructor, verl's, attaches)
    return torch.nested.nested_tensor_from_jagged(
        out, offsets=offsets.to(device), min_seqlen=min(input_lens), max_seqlen=max(input_lens)
    )


def _align_by_sequence(layers_topk_idx: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The alignment one sequence at a time, for routes in the strided nested layout (no offsets
    to pack from): each short sequence gets one zero row, and the parts become one jagged tensor
    as torch's list constructor builds it."""
    parts = list(layers_topk_idx.unbind())
    input_lens = [int(n) for n in input_ids.offsets().diff().tolist()]
    if len(parts) != len(input_lens):
        raise RuntimeError(f"R3 router replay has {len(parts)} route sequences for {len(input_lens)} input sequences")
    out = []
    for sample_id, (part, input_len) in enumerate(zip(parts, input_lens)):
        if part.shape[0] == input_len - 1:
            part = torch.cat((part, part.new_zeros((1, *part.shape[1:]))), dim=0)
        elif part.shape[0] != input_len:
            raise RuntimeError(
                f"R3 router replay sample {sample_id} has {part.shape[0]} route rows for {input_len} input tokens; "
                "expected equal lengths or exactly one missing final route"
            )
        out.append(part)
    return torch.nested.as_nested_tensor(out, layout=torch.jagged)
