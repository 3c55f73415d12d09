"""mla_rope: MLA's rotary position embedding of THD rows in one pass (docs/megatron.md#rope).

Megatron-Core applies RoPE to MLA's rope head dims as a chain of elementwise ops (de-interleave,
two products, rotate-half, a sum, concatenations: about seven passes over the tensor forward and
more backward) after a Python loop over the sequences that reads the offsets on the host. This op
is the same arithmetic, rounding for rounding, in one pass; its fake kernel, autograd and the
position index that replaces the loop live here.
"""

from __future__ import annotations

import torch

from ._library import _after_autograd, _autograd_lib, redispatcher, register_autograd
from ._validate import check_plain

_ops = torch.ops.verl_ops
OP = "mla_rope"


@torch.library.register_fake("verl_ops::mla_rope")
def _mla_rope_fake(x, cos, sin, positions, interleaved=True, backward=False):
    torch._check(x.dim() == 3, lambda: f"{OP}: x must be [rows, heads, dim], got {tuple(x.shape)}")
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _x, cos, sin, positions, interleaved, _backward_flag = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.interleaved = interleaved


def _backward(ctx, grad):
    cos, sin, positions = ctx.saved_tensors
    grad_x = _ops.mla_rope(grad, cos, sin, positions, ctx.interleaved, True)
    return grad_x, None, None, None, None, None


# torch.library.register_autograd, its kernel testing a Tensor argument for None first.
register_autograd("verl_ops::mla_rope", _backward, setup_context=_setup_context)


@torch.library.register_fake("verl_ops::mla_rope_")
def _mla_rope_inplace_fake(x, cos, sin, positions, interleaved=True, backward=False):
    torch._check(x.dim() == 3, lambda: f"{OP}_: x must be [rows, heads, dim], got {tuple(x.shape)}")
    return None


_inplace_redispatch = redispatcher(_ops.mla_rope_.default)


def _inplace_autograd(keyset, x, cos, sin, positions, interleaved=True, backward=False):
    """mla_rope_ is not differentiable (it rotates a buffer in place: a gradient's rope columns):
    refused where autograd would have to record it; otherwise run below Autograd, x's version
    counter bumped as for any in-place op. (A None in a Tensor argument is refused before this
    kernel runs: _autograd_lib's Autograd kernels check it first.)"""
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        raise RuntimeError(f"{OP}_: the in-place form is not differentiable (x, cos or sin requires grad); "
                           f"use verl_ops.mla_rope")
    _inplace_redispatch(keyset & _after_autograd, x, cos, sin, positions, interleaved, backward)
    torch.autograd.graph.increment_version(x)


_autograd_lib.impl("mla_rope_", _inplace_autograd, "Autograd", with_keyset=True)


def mla_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *, interleaved: bool = True
) -> torch.Tensor:
    """Rotate-half RoPE of ``x [rows, heads, dim]`` with each row's table row ``positions[row]``.

    Equal, bit for bit, to Megatron-Core's ``_apply_rotary_pos_emb_bshd(x[:, None], freqs[positions],
    rotary_interleaved=False, mla_rotary_interleaved=interleaved, mscale)`` when
    ``cos = (freqs.cos() * mscale).to(x.dtype)`` and ``sin`` likewise (``freqs [table_rows, dim]``).

    Args:
        x: ``[rows, heads, dim]``, ``dim`` even, inner stride 1 (rows and heads may be strided).
        cos, sin: ``[table_rows, dim]`` in x's dtype.
        positions: int64 ``[rows]``; on the CPU each must lie in ``[0, table_rows)`` (checked); on a
            GPU a row outside gets zeros (not read on the host).
        interleaved: de-interleave each head's dims first (MLA's ``mla_rotary_interleaved``).

    Returns:
        ``[rows, heads, dim]`` contiguous, in the de-interleaved order Megatron returns;
        differentiable in ``x``.
    """
    for name, t in (("x", x), ("cos", cos), ("sin", sin), ("positions", positions)):
        check_plain(OP, name, t)
    return _ops.mla_rope(x, cos, sin, positions, bool(interleaved), False)


def thd_rope_positions(cu_seqlens: torch.Tensor, rows: int, cp_size: int = 1, cp_rank: int = 0,
                       packed_freqs: bool = False, device=None) -> torch.Tensor | None:
    """Each local THD row's RoPE position (int64 ``[rows]``, on ``device``: default the host), as
    Megatron-Core's ``_apply_rotary_pos_emb_thd`` assigns them: sequence ``i`` has
    ``(cu[i+1] - cu[i]) // cp_size`` local rows; without CP they are positions ``0 ..``; with CP the
    local rows are the zigzag chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of the sequence;
    ``packed_freqs`` (the frequency table has a row per packed token) adds the sequence's offset
    ``cu[i]``. ``None`` when the rows do not add up to ``rows`` or the offsets decrease (Megatron's
    own code then reports the mismatch). ``cu_seqlens`` is read on the host; on a GPU the positions are built there from
    the per-sequence values (one small copy, a few launches, no host loop over the rows)."""
    plan = thd_rope_plan(cu_seqlens, rows, cp_size, cp_rank, packed_freqs)
    if plan is None:
        return None
    return positions_from_plan(plan[0], rows, cp_size, cp_rank, packed_freqs, device)


def positions_from_plan(per: torch.Tensor, rows: int, cp_size: int, cp_rank: int, packed_freqs: bool,
                        device=None) -> torch.Tensor:
    """:func:`thd_rope_positions` from :func:`thd_rope_plan`'s ``per`` (host ``[3, B]``)."""
    from .layout import _to_device

    dev = torch.device("cpu") if device is None else torch.device(device)
    per = _to_device(per, dev) if dev.type != "cpu" else per
    starts, local, base = per[0], per[1], per[2]
    seq = torch.repeat_interleave(torch.arange(local.numel(), device=dev), local, output_size=rows)
    j = torch.arange(rows, dtype=torch.int64, device=dev) - starts[seq]
    if cp_size > 1:
        seg = (local // 2)[seq]
        full = cp_size * local[seq]
        pos = torch.where(j < seg, cp_rank * seg + j, full - (cp_rank + 1) * seg + (j - seg))
    else:
        pos = j
    if packed_freqs:
        pos = pos + base[seq]
    return pos


def thd_rope_plan(cu_seqlens: torch.Tensor, rows: int, cp_size: int = 1, cp_rank: int = 0,
                  packed_freqs: bool = False):
    """``(per, top)`` of :func:`thd_rope_positions`, on the host: ``per`` int64 ``[3, B]``, each
    sequence's first local row, local rows and position offset (``cu[i]`` with ``packed_freqs``,
    else 0), and ``top`` the largest position of any row (-1 with no rows), computed from them
    alone; ``None`` when the rows do not add up to ``rows``, the offsets decrease, or (with
    ``packed_freqs``) start below 0."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    local = (cu[1:] - cu[:-1]) // cp_size
    if cu.numel() == 0 or int(local.sum()) != rows or bool((local < 0).any()):
        return None  # no offsets, or decreasing ones: no positions
    if packed_freqs and int(cu[0]) < 0:
        return None  # positions before the table's first row
    starts = torch.cumsum(local, 0) - local
    base = cu[:-1] if packed_freqs else torch.zeros_like(local)
    # Positions grow with the row inside a sequence (the second zigzag chunk's lie above the
    # first's), so a sequence's largest is its last local row's.
    j = local - 1
    if cp_size > 1:
        seg = local // 2
        last = torch.where(j < seg, cp_rank * seg + j, cp_size * local - (cp_rank + 1) * seg + (j - seg))
    else:
        last = j
    last = torch.where(local > 0, last + base, torch.full_like(local, -1))
    top = int(last.max()) if last.numel() else -1
    return torch.stack([starts, local, base]), top
