"""The THD ops preprocess_thd (pack) and postprocess_thd (unpack): their fake (Meta) kernels,
autograd and Python API (the layout ops thd_layout / thd_layout_info: verl_ops/layout.py)."""

from __future__ import annotations

import zlib

import torch

from ._library import _BelowAutograd, call_op, redispatcher
from ._validate import (
    DenseArguments, check, check_attention_mask, check_cp, check_cp_layout, check_cp_rows, check_jagged,
    check_mask_lengths, check_offset_pair, check_plain, check_rank, check_size, device_of, is_jagged_nested,
    is_meta, should_validate
)
from .layout import ThdLayout, _to_device

_ops = torch.ops.verl_ops


# --------------------------------------------------------------------------------------------
# Fake (Meta) kernels: output shapes from the inputs' shapes alone (symbolic under torch.compile),
# rejecting what the CPU/CUDA kernels reject without reading data, in their words.


def _thd_common(op, data, cu, cu_padded, cp_size, cp_rank, cp_layout):
    check_cp_layout(op, cp_layout)
    check_cp(op, cp_size, cp_rank, allow_all=True)
    check_offset_pair(op, cu, cu_padded, data)


@torch.library.register_fake("verl_ops::preprocess_thd")
def _preprocess_thd_fake(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size=1, cp_rank=0, cp_layout=0,
                         roll=False, attention_mask=None):
    op = "preprocess_thd"
    _thd_common(op, values, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, cp_layout)
    torch._check(local_rows >= 0, lambda: f"{op}: local_rows must be >= 0, got {local_rows}")
    skip = 2 if attention_mask is not None else 1
    check(values.dim() >= skip, op, f"values has too few dimensions: {tuple(values.shape)}")
    if cp_rank < 0:
        check_cp_rows(op, cp_size, local_rows)
    if attention_mask is not None:
        check_attention_mask(op, attention_mask, values, cu_seqlens)
        torch._check(
            values.shape[0] == attention_mask.shape[0] and values.shape[1] == attention_mask.shape[1],
            lambda: f"{op}: padded input must be [B, S, *F] matching attention_mask "
            f"{list(attention_mask.shape)}, got {list(values.shape)}",
        )
    lead = (cp_size, local_rows) if cp_rank < 0 else (local_rows,)
    check_size(op, "local_rows", lead + tuple(values.shape[skip:]), values.dtype)
    check_size(op, "local_rows", lead, torch.int64)  # positions
    packed = values.new_empty(lead + tuple(values.shape[skip:]))
    positions = values.new_empty(lead, dtype=torch.int64)
    return packed, positions


@torch.library.register_fake("verl_ops::postprocess_thd")
def _postprocess_thd_fake(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size=1, cp_rank=-1, cp_layout=0,
                          roll=False, attention_mask=None):
    op = "postprocess_thd"
    _thd_common(op, packed, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, cp_layout)
    skip = 2 if cp_rank < 0 else 1
    check(packed.dim() >= skip, op, f"packed has too few dimensions: {tuple(packed.shape)}")
    if cp_rank < 0:
        torch._check(packed.shape[0] == cp_size,
                     lambda: f"{op}: packed holds {packed.shape[0]} shards but cp_size is {cp_size}")
    if attention_mask is not None:
        check_attention_mask(op, attention_mask, packed, cu_seqlens)
        lead = tuple(attention_mask.shape)
        sized_by = "attention_mask"
    else:
        torch._check(total_tokens >= 0, lambda: f"{op}: total_tokens must be >= 0, got {total_tokens}")
        lead = (total_tokens,)
        sized_by = "total_tokens"
    check_size(op, sized_by, lead + tuple(packed.shape[skip:]), packed.dtype)
    return packed.new_empty(lead + tuple(packed.shape[skip:]))


# --------------------------------------------------------------------------------------------
# Autograd. pack and unpack are each other's adjoint (both are row gathers over the same
# bijection between valid tokens and padded rows), so each backward is one call of the other.


def _pack_setup_context(ctx, inputs, output):
    values, cu, cu_padded, local_rows, cp_size, cp_rank, cp_layout, roll, mask = inputs
    ctx.save_for_backward(cu, cu_padded, mask)
    ctx.meta = (values.shape[0], cp_size, cp_rank, cp_layout, roll)


def _pack_backward(ctx, grad_packed, grad_positions):
    cu, cu_padded, mask = ctx.saved_tensors
    total_tokens, cp_size, cp_rank, cp_layout, roll = ctx.meta
    grad_values = _ops.postprocess_thd(
        grad_packed.contiguous(), cu, cu_padded, total_tokens, cp_size, cp_rank, cp_layout, roll, mask
    )
    return grad_values, None, None, None, None, None, None, None, None


def _unpack_setup_context(ctx, inputs, output):
    packed, cu, cu_padded, total_tokens, cp_size, cp_rank, cp_layout, roll, mask = inputs
    ctx.save_for_backward(cu, cu_padded, mask)
    local_rows = packed.shape[1] if cp_rank < 0 else packed.shape[0]
    ctx.meta = (local_rows, cp_size, cp_rank, cp_layout, roll)


def _unpack_backward(ctx, grad_out):
    cu, cu_padded, mask = ctx.saved_tensors
    local_rows, cp_size, cp_rank, cp_layout, roll = ctx.meta
    grad_packed, _ = _ops.preprocess_thd(
        grad_out.contiguous(), cu, cu_padded, local_rows, cp_size, cp_rank, cp_layout, roll, mask
    )
    return grad_packed, None, None, None, None, None, None, None, None


# The Autograd kernels are written by hand rather than through torch.library.register_autograd:
# that generic kernel costs ~5 µs of Python on every call, recording or not, while these go
# straight below the Autograd key when nothing needs a gradient (one check), and otherwise
# through an autograd.Function with the same setup_context / backward as above.


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(*args):
        with _BelowAutograd():
            return _ops.preprocess_thd.default(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        _pack_setup_context(ctx, inputs, output)
    backward = staticmethod(_pack_backward)


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(*args):
        with _BelowAutograd():
            return _ops.postprocess_thd.default(*args)

    setup_context = staticmethod(_unpack_setup_context)
    backward = staticmethod(_unpack_backward)


# With nothing to record they redispatch straight to the keys below Autograd (the keyset the
# dispatcher handed in), without a second trip through the dispatcher's entry. They call the
# operator handle's redispatch directly (what OpOverload.redispatch does, less one Python frame
# and one argument tuple: ~1 µs of the ~7 µs this kernel costs on a 2-core host). Each first tests
# its Tensor arguments for None (a nested tensor never reaches it: see verl_ops._library).
_after_autograd = torch._C._after_autograd_keyset
_pack_op = _ops.preprocess_thd.default
_unpack_op = _ops.postprocess_thd.default
_pack_redispatch = redispatcher(_pack_op)
_unpack_redispatch = redispatcher(_unpack_op)
_pack_dense = DenseArguments.of("verl_ops::preprocess_thd")
_unpack_dense = DenseArguments.of("verl_ops::postprocess_thd")
_grad_enabled = torch.is_grad_enabled


# (The dispatcher leaves trailing arguments that equal their schema default out of the call.)
def _pack_autograd(keyset, values, cu, cu_padded, local_rows, cp_size=1, cp_rank=0, cp_layout=0, roll=False, mask=None):
    if values is None or cu is None or cu_padded is None:
        raise _pack_dense.error((values, cu, cu_padded))
    if values.requires_grad and _grad_enabled():
        return _Pack.apply(values, cu, cu_padded, local_rows, cp_size, cp_rank, cp_layout, roll, mask)
    return _pack_redispatch(keyset & _after_autograd, values, cu, cu_padded, local_rows, cp_size, cp_rank, cp_layout,
                            roll, mask)


def _unpack_autograd(keyset, packed, cu, cu_padded, total_tokens, cp_size=1, cp_rank=-1, cp_layout=0, roll=False,
                     mask=None):
    if packed is None or cu is None or cu_padded is None:
        raise _unpack_dense.error((packed, cu, cu_padded))
    if packed.requires_grad and _grad_enabled():
        return _Unpack.apply(packed, cu, cu_padded, total_tokens, cp_size, cp_rank, cp_layout, roll, mask)
    return _unpack_redispatch(keyset & _after_autograd, packed, cu, cu_padded, total_tokens, cp_size, cp_rank,
                              cp_layout, roll, mask)


_autograd_lib = torch.library.Library("verl_ops", "IMPL")
_autograd_lib.impl("preprocess_thd", _pack_autograd, "Autograd", with_keyset=True)
_autograd_lib.impl("postprocess_thd", _unpack_autograd, "Autograd", with_keyset=True)


# --------------------------------------------------------------------------------------------
# Wrappers. Shapes are always checked; values (a host read when the data is on a GPU) eagerly
# unless validate=False, and never while tracing or on meta tensors (verl_ops._validate).


def _nested_values(op: str, name: str, x: torch.Tensor, layout: ThdLayout, validate) -> torch.Tensor:
    """The values of jagged nested tensor ``x``, its sequence count and (when validating) its
    offsets checked against the layout's cu_seqlens."""
    # The one nested-input check of every entry point (see verl_ops._validate.check_jagged).
    check_jagged(op, name, x)
    if torch.compiler.is_compiling() or x.requires_grad:
        offsets, values = x.offsets(), x.values()
    else:
        # The same tensors as offsets() / values(), without their per-call dispatch cost.
        offsets, values = x._offsets, x._values
    if offsets.shape[0] - 1 != layout.batch_size:
        raise ValueError(f"{op}: {name} has {offsets.shape[0] - 1} sequences but the layout has {layout.batch_size}")
    if (
        offsets is not layout.source_offsets
        and should_validate(validate, values)
        and not is_meta(offsets)
        and not torch.equal(offsets.to(device="cpu", dtype=torch.int64), layout.cu_seqlens_cpu.to(torch.int64))
    ):
        raise ValueError(f"{op}: {name}'s offsets do not match the layout's cu_seqlens")
    return values


def _as_nested(values: torch.Tensor, cu: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
    """Jagged nested tensor of per-token ``values`` with the layout's sequences (``cu``: its
    cu_seqlens on values' device); the known min / max lengths spare torch a host read."""
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets=cu.to(torch.int64),
        min_seqlen=layout.min_seqlen_unpadded,
        max_seqlen=layout.max_seqlen_unpadded,
    )


def _offsets_on(op: str, layout: ThdLayout, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's (cu_seqlens, cu_seqlens_padded) on t's device (copied from the host copies
    when the layout lives elsewhere; plain tensor ops, so this also traces under torch.compile)."""
    if not isinstance(layout, ThdLayout):
        raise TypeError(f"{op}: layout must be a verl_ops.ThdLayout, got {type(layout)}")
    device = device_of(t)
    if layout.cu_seqlens.device == device:
        return layout.cu_seqlens, layout.cu_seqlens_padded
    both = _to_device(torch.stack([layout.cu_seqlens_cpu, layout.cu_seqlens_padded_cpu]), device)
    return both[0], both[1]


def preprocess_thd(
    x: torch.Tensor,
    layout: ThdLayout,
    cp_rank: int = 0,
    *,
    attention_mask: torch.Tensor | None = None,
    roll: bool = False,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a batch into this CP rank's THD rows.

    Args:
        x: a jagged nested tensor ``[B, j, *F]``; or its values ``[total_tokens, *F]`` (offsets are
            the layout's ``cu_seqlens``); or, with ``attention_mask``, padded ``[B, S, *F]``.
        layout: the micro-batch's :class:`ThdLayout`.
        cp_rank: this rank in the context-parallel group, ``0 <= cp_rank < layout.cp_size``.
        attention_mask: bool ``[B, S]``; valid tokens are ``x[i, attention_mask[i]]`` in order.
        roll: next-token targets, verl's rule per layout (docs/layout.md#roll): padded position
            p holds token p+1; where the sequence wraps to token 0 and how position ids roll
            follow verl's ``preprocess_thd_engine`` row for row.
        validate: compare the data's per-sequence lengths with the layout (reads them to the host
            when they live on a GPU). Default: on, except under torch.compile / CUDA-graph capture.

    Returns:
        ``packed [local_rows, *F]`` (x's dtype; zero in padding rows) and ``position_ids``
        (int64 ``[local_rows]``: each valid row's position inside its sequence; padding rows 0,
        except zigzag first-chunk rows, which keep their position, as verl writes them).
    """
    op = "preprocess_thd"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor (jagged nested, values or padded), got {type(x).__name__}")
    cu, cu_padded = _offsets_on(op, layout, x)
    check_rank(op, "cp_rank", cp_rank, layout.cp_size, "cp_size")
    if is_jagged_nested(x) or x.is_nested:
        if attention_mask is not None:
            raise ValueError(f"{op}: attention_mask is for padded input, not for a nested tensor")
        values = _nested_values(op, "x", x, layout, validate)
    elif attention_mask is not None:
        check_mask_lengths(op, attention_mask, layout, validate)
        if x.dim() < 2 or tuple(x.shape[:2]) != tuple(attention_mask.shape):
            raise ValueError(
                f"{op}: padded x must be [B, S, *F] matching attention_mask {tuple(attention_mask.shape)}, "
                f"got {tuple(x.shape)}"
            )
        values = x
    else:
        values = x
        if x.dim() < 1 or x.shape[0] != layout.total_tokens:
            raise ValueError(
                f"{op}: jagged values must be [total_tokens={layout.total_tokens}, *F], got {tuple(x.shape)}"
            )
    return call_op(
        _ops.preprocess_thd,
        values,
        values,
        cu,
        cu_padded,
        layout.local_rows,
        layout.cp_size,
        cp_rank,
        layout.cp_layout_code,
        bool(roll),
        attention_mask,
    )


def postprocess_thd(
    packed: torch.Tensor,
    layout: ThdLayout,
    cp_rank: int = 0,
    *,
    group=None,
    attention_mask: torch.Tensor | None = None,
    as_nested: bool = True,
    validate: bool | None = None,
) -> torch.Tensor:
    """Unpack model outputs back per sequence (inverse of :func:`preprocess_thd` on valid tokens).

    Args:
        packed: ``[local_rows, *F]`` when ``layout.cp_size == 1`` or a ``group`` is given;
            otherwise (``cp_size > 1``) every rank's shard, already gathered,
            ``[cp_size, local_rows, *F]``.
        layout: the same :class:`ThdLayout` the batch was packed with.
        cp_rank: this rank in the CP group.
        group: the CP process group. With a group, ``packed`` is this rank's shard
            ``[local_rows, *F]``; the shards are all-gathered (functional collectives, so this
            traces under torch.compile) and the gradient reaches this rank's shard only (other
            shards enter as constants, as in verl); no collective runs in backward.
        attention_mask: bool ``[B, S]``: return padded ``[B, S, *F]`` with zeros where it is false.
        as_nested: without a mask, return a jagged nested tensor ``[B, j, *F]`` (default) or its
            values ``[total_tokens, *F]``.

    Gradients flow to ``packed`` (each shard receives the pack of the output gradient).
    """
    op = "postprocess_thd"
    check_plain(op, "packed", packed)
    cu, cu_padded = _offsets_on(op, layout, packed)
    check_rank(op, "cp_rank", cp_rank, layout.cp_size, "cp_size")
    if group is not None and layout.cp_size > 1:
        out = _postprocess_over_group(op, packed, layout, cu, cu_padded, cp_rank, group, attention_mask, validate)
    else:
        if layout.cp_size > 1:
            if packed.dim() < 2 or tuple(packed.shape[:2]) != (layout.cp_size, layout.local_rows):
                raise ValueError(
                    f"{op}: with cp_size={layout.cp_size} and no group, packed must hold every rank's "
                    f"shard as [cp_size, local_rows={layout.local_rows}, *F], got {tuple(packed.shape)}"
                )
        elif packed.dim() < 1 or packed.shape[0] != layout.local_rows:
            raise ValueError(f"{op}: packed must be [local_rows={layout.local_rows}, *F], got {tuple(packed.shape)}")
        if attention_mask is not None:
            check_mask_lengths(op, attention_mask, layout, validate)
        out = call_op(
            _ops.postprocess_thd,
            packed,
            packed,
            cu,
            cu_padded,
            layout.total_tokens,
            layout.cp_size,
            -1 if layout.cp_size > 1 else 0,
            layout.cp_layout_code,
            False,
            attention_mask,
        )
    if attention_mask is not None or not as_nested:
        return out
    return _as_nested(out, cu, layout)


# --------------------------------------------------------------------------------------------
# Context parallel over a process group.


def _layout_fingerprint(layout: ThdLayout) -> list:
    """Small integer summary of a layout; equal on every rank iff the layouts agree (up to a
    vanishingly unlikely hash collision of the offsets)."""
    w = torch.arange(1, layout.batch_size + 2, dtype=torch.int64)
    h1 = int((layout.cu_seqlens_cpu.to(torch.int64) * w).sum()) % (1 << 61)
    h2 = int((layout.cu_seqlens_padded_cpu.to(torch.int64) * w * w).sum()) % (1 << 61)
    rules = [layout.tp_size, layout.local_rows, zlib.crc32(layout.cp_layout.encode())]
    return [layout.cp_size, layout.batch_size, layout.total_tokens, layout.total_padded, h1, h2, *rules]


def check_layout_across_ranks(layout: ThdLayout, group, device, local_error: Exception | None = None) -> None:
    """Raise on every rank when the ranks of ``group`` hold different layouts, or when a rank
    found its own arguments wrong (``local_error``: re-raised there, a RuntimeError elsewhere).

    One fixed-size all-gather that every rank issues whatever its data, so a mismatch is an
    error instead of a hang in the collective that follows.
    """
    import torch.distributed as dist

    words = [0 if local_error is None else 1] + _layout_fingerprint(layout)
    fp = torch.tensor(words, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    out = torch.empty(world * fp.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, fp, group=group)
    rows = out.view(world, fp.numel()).cpu()
    if bool(rows[:, 0].any()):
        if local_error is not None:
            raise local_error
        bad = rows[:, 0].nonzero().flatten().tolist()
        raise RuntimeError(
            f"verl_ops: CP rank(s) {bad} rejected their postprocess_thd arguments (their error says why)"
        )
    rows = rows[:, 1:]
    if not bool((rows == rows[0]).all()):
        raise RuntimeError(
            "verl_ops: CP ranks disagree on the THD layout (cp_size, batch, tokens, padded rows, "
            f"offset hashes per rank: {rows.tolist()})"
        )


class _UnpackLocalShard(torch.autograd.Function):
    """Unpack gathered shards; the gradient goes to this rank's shard only (pack for cp_rank)."""

    @staticmethod
    def forward(ctx, local, gathered, cu, cu_padded, total_tokens, cp_size, cp_rank, cp_layout, mask):
        ctx.save_for_backward(cu, cu_padded, mask)
        ctx.meta = (local.shape[0], cp_size, cp_rank, cp_layout)
        return _ops.postprocess_thd(gathered, cu, cu_padded, total_tokens, cp_size, -1, cp_layout, False, mask)

    @staticmethod
    def backward(ctx, grad_out):
        cu, cu_padded, mask = ctx.saved_tensors
        local_rows, cp_size, cp_rank, cp_layout = ctx.meta
        grad_local, _ = _ops.preprocess_thd(
            grad_out.contiguous(), cu, cu_padded, local_rows, cp_size, cp_rank, cp_layout, False, mask
        )
        return grad_local, None, None, None, None, None, None, None, None


def _postprocess_over_group(op, packed, layout, cu, cu_padded, cp_rank, group, attention_mask, validate):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    # Argument errors of one rank are reported through the cross-rank check, so that every rank
    # raises instead of the others waiting in the all-gather.
    error = None
    try:
        if not torch.compiler.is_compiling():
            world = dist.get_world_size(group)
            if world != layout.cp_size:
                raise ValueError(f"{op}: the group has {world} ranks but layout.cp_size is {layout.cp_size}")
            me = dist.get_rank(group)
            if me != cp_rank:
                raise ValueError(f"{op}: cp_rank={cp_rank} but this process is rank {me} of the group")
        if packed.dim() < 1 or packed.shape[0] != layout.local_rows:
            raise ValueError(
                f"{op}: with a group, packed is this rank's shard [local_rows={layout.local_rows}, *F], "
                f"got {tuple(packed.shape)}"
            )
        if attention_mask is not None:
            check_mask_lengths(op, attention_mask, layout, validate)
    except ValueError as e:
        error = e
    if should_validate(validate, packed):
        check_layout_across_ranks(layout, group, packed.device, local_error=error)
    elif error is not None:
        raise error
    local = packed.contiguous()
    if local.numel() == 0:
        # Nothing to move (an empty batch or zero-width rows, the same on every rank of a
        # consistent layout): no zero-size collective.
        gathered = local.detach().new_empty((layout.cp_size * local.shape[0], *local.shape[1:]))
    elif torch.compiler.is_compiling():
        gathered = funcol.all_gather_tensor(local.detach(), gather_dim=0, group=group)
    else:
        # Eagerly the plain collective: the same all-gather without the functional wrapper's
        # per-call overhead.
        flat = local.detach().reshape(-1)
        gathered = torch.empty(layout.cp_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
    gathered = gathered.view(layout.cp_size, *local.shape)
    return _UnpackLocalShard.apply(
        local,
        gathered,
        cu,
        cu_padded,
        layout.total_tokens,
        layout.cp_size,
        cp_rank,
        layout.cp_layout_code,
        attention_mask,
    )
