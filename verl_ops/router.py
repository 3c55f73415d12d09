"""Router replay (R2/R3) on the model's own THD layout (docs/router_replay.md).

Megatron's MoE routers record, per layer, the top-k expert ids of the tokens this rank routed:
``[T_local_sp, K]`` per layer, where ``T_local_sp = layout.local_rows / tp_size`` is this rank's
sequence-parallel chunk of its CP rank's THD rows (Megatron splits the packed rows into
``tp_size`` contiguous chunks, TP rank ``p`` holding chunk ``p``).

* :func:`merge_router_topk` (record side, verl's ``merge_router_topk_indices``): gathers the
  recorded indices over the TP (sequence-parallel) group and then the CP group and returns them
  per sequence, ``[len_i, L, K]`` int16 (jagged) or ``[B, S, L, K]`` with zeros where the
  attention mask is false.
* :func:`scatter_router_topk` (replay side, verl's ``set_router_replay_data``): the inverse, from
  ``[len_i, L, K]`` (or padded + mask) to this TP/CP rank's int64 targets ``[L, T_local_sp, K]``
  (``targets[l]`` is layer ``l``'s ``[T_local_sp, K]``, a view, no copy), plus the per-token
  replay mask packed the same way (False in padding rows).

Both take the :class:`~verl_ops.ThdLayout` the model's forward packed the micro-batch with, so the
routes always sit on the rows of the tokens they belong to (FP8 padding, CP layout, min_local_rows
and length buckets included): build it once and hand the same object to the model path and here.

Each direction is one kernel launch on the local data (plus the two all-gathers when
``tp_size * cp_size > 1``): the record kernel reads the L layer tensors in place through a pointer
table (any integer dtype, any strides; no ``torch.stack`` / ``permute`` / ``view`` copies) and,
when nothing needs gathering (tp = cp = 1), writes the per-sequence result directly.

Range check: expert ids are stored as int16. On CPU the record kernel raises at once on an id
outside ``[-32768, 32767]``. On CUDA it raises a device flag instead of synchronising, and
``merge_router_topk`` reads the flag where it reads the host anyway: with tp = cp = 1 once the
result is enqueued (verl copies the result to the host next in any case); with tp * cp > 1 in the
status exchange that precedes the gathers (below), so every rank raises together. With
``validate=False`` (and under torch.compile or CUDA-graph capture) the flag is not read and such
ids come out as -1.

Collectives: with tp * cp > 1 and validation on, the ranks first exchange one small status vector
(layout fingerprint, whether this rank's input failed its checks, int16 overflow) over the TP group
and then over the CP group; every rank then raises if any rank failed, so a bad input on one rank
is an error everywhere instead of a hang in the gathers. The gathers themselves are functional
all-gathers of the int16 rows viewed as uint8 (NCCL has no int16), first over TP, then over CP.
"""

from __future__ import annotations

import torch

from . import _library
from ._thd import _as_nested, _nested_values, _offsets_on
from ._validate import (
    CallerRejected, check, check_attention_mask, check_bool_tensor, check_cp, check_cp_layout, check_cp_rows,
    check_index_dtype, check_int_arg, check_layout_mask, check_mask_lengths, check_offset_pair, check_rank,
    check_size, process_group_named
)
from .layout import ThdLayout

_ops = torch.ops.verl_ops

__all__ = ["merge_router_topk", "scatter_router_topk"]


# --------------------------------------------------------------------------------------------
# Fake (Meta) kernels of the C++ ops router_topk_record (+ _layers) and router_topk_scatter:
# output shapes from the inputs' shapes alone, the kernels' argument checks in their words.

# int16 overflow flag slots of router_topk_record (core::kOverflowSlots).
_OVERFLOW_SLOTS = 4096


@torch.library.register_fake("verl_ops::router_topk_record")
def _router_topk_record_fake(indices, cu_seqlens=None, cu_seqlens_padded=None, total_tokens=0, attention_mask=None,
                             op="router_topk_record"):
    check_index_dtype(op, "indices", indices)
    check(indices.dim() == 3, op, f"indices must be [L, T_local_sp, K], got shape {tuple(indices.shape)}")
    num_layers, rows, topk = indices.shape
    torch._check(num_layers >= 1, lambda: f"{op}: indices must hold at least one layer")
    fused = cu_seqlens is not None or cu_seqlens_padded is not None
    check(
        fused == (cu_seqlens is not None and cu_seqlens_padded is not None),
        op,
        "cu_seqlens and cu_seqlens_padded must be given together (fused unpack) or both omitted",
    )
    if not fused:
        check(attention_mask is None, op, "attention_mask needs cu_seqlens and cu_seqlens_padded")
        shape = (rows, num_layers, topk)
    else:
        check_offset_pair(op, cu_seqlens, cu_seqlens_padded, indices)
        if attention_mask is not None:
            check_attention_mask(op, attention_mask, indices, cu_seqlens)
            shape = tuple(attention_mask.shape) + (num_layers, topk)
        else:
            torch._check(total_tokens >= 0, lambda: f"{op}: total_tokens must be >= 0, got {total_tokens}")
            shape = (total_tokens, num_layers, topk)
    check_size(op, "total_tokens / attention_mask", shape, torch.int16)
    return indices.new_empty(shape, dtype=torch.int16), indices.new_empty((_OVERFLOW_SLOTS,), dtype=torch.int32)


def _stack_layers_fake(op: str, indices) -> torch.Tensor:
    """A list of L [T, K] layers (same dtype, device and shape) as one [L, T, K] fake tensor."""
    check(len(indices) >= 1, op, "indices must hold at least one layer, got an empty list")
    first = indices[0]
    check(first.dim() == 2, op, f"indices[0] must be [T_local_sp, K], got shape {tuple(first.shape)}")
    for i, t in enumerate(indices):
        check(t.dim() == 2, op, f"indices[{i}] must be [T_local_sp, K], got shape {tuple(t.shape)}")
        check(t.dtype == first.dtype, op, f"indices[{i}] is {t.dtype} but indices[0] is {first.dtype}")
        check(t.device == first.device, op, f"indices[{i}] is on {t.device} but indices[0] is on {first.device}")
        torch._check(t.shape[1] == first.shape[1], lambda i=i, t=t: f"{op}: indices[{i}] has top-k {t.shape[1]} "
                     f"but indices[0] has {first.shape[1]}; K must be the same in every layer")
        torch._check(t.shape[0] == first.shape[0], lambda i=i, t=t: f"{op}: indices[{i}] has {t.shape[0]} rows "
                     f"but indices[0] has {first.shape[0]}; every layer records the same tokens")
    return first.new_empty((len(indices),) + tuple(first.shape))


if hasattr(torch.ops.verl_ops, "router_topk_record_layers"):

    @torch.library.register_fake("verl_ops::router_topk_record_layers")
    def _router_topk_record_layers_fake(indices, cu_seqlens=None, cu_seqlens_padded=None, total_tokens=0,
                                        attention_mask=None):
        op = "router_topk_record"
        return _router_topk_record_fake(_stack_layers_fake(op, indices), cu_seqlens, cu_seqlens_padded, total_tokens,
                                        attention_mask)


@torch.library.register_fake("verl_ops::router_topk_scatter")
def _router_topk_scatter_fake(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size=1, tp_rank=0, cp_size=1,
                              cp_rank=0, cp_layout=0, attention_mask=None, replay_mask=None):
    op = "router_topk_scatter"
    check_cp_layout(op, cp_layout)
    check_index_dtype(op, "routes", routes)
    check_int_arg(op, "tp_size", tp_size, 1)
    check(0 <= tp_rank < tp_size, op, f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
    check_cp(op, cp_size, cp_rank, allow_all=False)
    padded = attention_mask is not None
    check(
        routes.dim() == (4 if padded else 3),
        op,
        "routes must be " + ("[B, S, L, K] (with attention_mask)" if padded else "[total_tokens, L, K]")
        + f", got shape {tuple(routes.shape)}",
    )
    check_offset_pair(op, cu_seqlens, cu_seqlens_padded, routes)
    if attention_mask is not None:
        msg = f"padded routes {list(routes.shape)} must be [B, S, L, K] matching attention_mask {list(attention_mask.shape)}"
        check(attention_mask.dim() == 2, op, msg)
        torch._check(routes.shape[0] == attention_mask.shape[0] and routes.shape[1] == attention_mask.shape[1],
                     lambda: f"{op}: {msg}")
        check_attention_mask(op, attention_mask, routes, cu_seqlens)
    if replay_mask is not None:
        check_bool_tensor(op, "replay_mask", replay_mask, routes, "routes are")
        lead = routes.shape[:2] if padded else routes.shape[:1]
        msg = ("replay_mask must be " + ("[B, S] like attention_mask" if padded else "[total_tokens] like the routes' rows")
               + f", got shape {tuple(replay_mask.shape)}")
        check(replay_mask.dim() == len(lead), op, msg)
        torch._check(all(a == b for a, b in zip(replay_mask.shape, lead)), lambda: f"{op}: {msg}")
    torch._check(local_rows >= 0, lambda: f"{op}: local_rows must be >= 0, got {local_rows}")
    check_cp_rows(op, cp_size, local_rows)
    torch._check(local_rows % tp_size == 0, lambda: f"{op}: local_rows={local_rows} is not divisible by "
                 f"tp_size={tp_size}; the sequence-parallel split needs equal chunks")
    rows = local_rows // tp_size
    check_size(op, "local_rows", (routes.shape[-2], rows, routes.shape[-1]), torch.int64)
    targets = routes.new_empty((routes.shape[-2], rows, routes.shape[-1]), dtype=torch.int64)
    replay = routes.new_empty((rows,) if replay_mask is not None else (0,), dtype=torch.bool)
    return targets, replay


# No derivative (integer routes): their Autograd kernels only test a Tensor argument for None; the
# Python API below calls them below Autograd.
_library.register_autograd("verl_ops::router_topk_record")
_library.register_autograd("verl_ops::router_topk_scatter")


# --------------------------------------------------------------------------------------------
# Python API and the op merge_router_topk (defined here).


# dtype names as the C++ messages print them.
_ATEN_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long"}


def _layer_list(op: str, indices):
    """(layers for _record, L, rows per layer, K, device) of a list of [T, K] or one [L, T, K]
    (any strides). A list goes to router_topk_record_layers as it is (torch >= 2.10; list
    arguments need that stable ABI), else it is stacked into one [L, T, K] tensor."""
    if isinstance(indices, torch.Tensor):
        if indices.is_nested:
            raise ValueError(
                f"{op}: indices must be a list of L tensors [T_local_sp, K] or one [L, T_local_sp, K] "
                "tensor, got a nested tensor"
            )
        if indices.dim() != 3:
            raise ValueError(
                f"{op}: indices must be a list of L tensors [T_local_sp, K] or one [L, T_local_sp, K] "
                "tensor, "
                f"got shape {tuple(indices.shape)}"
            )
        return indices, indices.shape[0], indices.shape[1], indices.shape[2], indices.device
    if not isinstance(indices, (list, tuple)) or len(indices) == 0:
        raise ValueError(
            f"{op}: indices must be a non-empty list of [T_local_sp, K] tensors, got {type(indices)}"
        )
    for i, t in enumerate(indices):
        if isinstance(t, torch.Tensor) and t.is_nested:
            raise ValueError(f"{op}: indices[{i}] must be a [T_local_sp, K] tensor, got a nested tensor")
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"{op}: indices[{i}] must be a [T_local_sp, K] tensor, got {shape}")
    first = indices[0]
    if _library.HAS_LAYERS:  # router_topk_record_layers checks dtypes, devices and sizes itself
        return list(indices), len(indices), first.shape[0], first.shape[1], first.device
    _check_layers(op, indices)
    return torch.stack(list(indices)), len(indices), first.shape[0], first.shape[1], first.device


def _check_layers(op: str, layers) -> None:
    """The record kernel's checks of the layers (a list of [T, K], or one [L, T, K] tensor), in its
    words, on the host: one integer dtype, one device, one shape."""
    first = layers[0]
    if first.dtype not in _ATEN_NAMES:
        raise RuntimeError(
            f"{op}: indices must be an integer tensor (uint8, int8, int16, int32 or int64), got {first.dtype}"
        )
    if isinstance(layers, torch.Tensor):
        return
    for i, t in enumerate(layers):
        if t.dtype != first.dtype:
            raise RuntimeError(
                f"{op}: indices[{i}] is {_ATEN_NAMES.get(t.dtype, t.dtype)} but indices[0] is "
                f"{_ATEN_NAMES.get(first.dtype, first.dtype)}; every layer must have the same dtype"
            )
        if t.device != first.device:
            raise RuntimeError(f"{op}: indices[{i}] is on {t.device} but indices[0] is on {first.device}")
        if t.shape[1] != first.shape[1]:
            raise RuntimeError(
                f"{op}: indices[{i}] has top-k {t.shape[1]} but indices[0] has {first.shape[1]}; "
                "K must be the same in every layer"
            )
        if t.shape[0] != first.shape[0]:
            raise RuntimeError(
                f"{op}: indices[{i}] has {t.shape[0]} rows but indices[0] has {first.shape[0]}; "
                "every layer records the same tokens"
            )


def _record(layers, *args, op: str = "router_topk_record"):
    """router_topk_record on one [L, T, K] tensor, or on a list of [T, K] read in place; its
    errors name ``op`` (the op the caller called)."""
    try:
        if isinstance(layers, list):
            return _ops.router_topk_record_layers(layers, *args)
        return _library.call_op(_ops.router_topk_record, layers, layers, *args)
    except RuntimeError as e:
        msg = str(e)
        if op == "router_topk_record" or not msg.startswith("router_topk_record: "):
            raise
        raise RuntimeError(op + msg[len("router_topk_record") :]) from None


def _rows_per_tp_rank(op: str, layout: ThdLayout) -> int:
    if layout.local_rows % layout.tp_size != 0:
        raise ValueError(
            f"{op}: local_rows={layout.local_rows} is not divisible by tp_size={layout.tp_size}; "
            "Megatron's sequence-parallel split needs equal chunks"
        )
    return layout.local_rows // layout.tp_size


def _check_group(op: str, name: str, group, size: int) -> None:
    if group is None:
        raise ValueError(
            f"{op}: layout.{name}_size={size} needs {name}_group (the process group to gather over)"
        )
    if torch.compiler.is_compiling():
        return
    _check_world(op, name, group, size)


def _check_world(op: str, name: str, group, size: int) -> None:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world != size:
        raise ValueError(f"{op}: {name}_group has {world} ranks but layout.{name}_size is {size}")


def _check_int_mask(op: str, name: str, mask, device) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask)
        raise ValueError(f"{op}: {name} must be a bool tensor, got {what}")
    if mask.device != device:
        raise ValueError(f"{op}: {name} is on {mask.device} but the routes are on {device}")


def _exchange_device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# torch.ops.verl_ops.merge_router_topk: the layout travels as its offset tensors and sizes, the
# process groups by their c10d group names (as in torch's functional collectives).

_lib = torch.library.Library("verl_ops", "FRAGMENT")
_lib.define(
    "merge_router_topk(Tensor[] indices, Tensor cu_seqlens, Tensor cu_seqlens_padded, SymInt total_tokens, "
    "SymInt local_rows, int tp_size=1, int cp_size=1, int cp_layout=0, str? tp_group_name=None, "
    "str? cp_group_name=None, Tensor? attention_mask=None, bool validate=True, bool rank_error=False) -> Tensor"
)
# Nested tensors and all-None calls (verl_ops._library); a None beside defined tensors: its kernels
# (inside the try block, so that a rank's error still joins the exchange).
_merge_dense = _library.guard_dense_arguments("merge_router_topk")


def _group_of(op: str, name: str, group_name, size: int):
    if size == 1:
        return None
    if group_name is None:
        raise ValueError(f"{op}: {name}_size={size} needs {name}_group (the process group to gather over)")
    group = process_group_named(op, f"{name}_group_name", group_name)
    _check_world(op, name, group, size)
    return group


def _fingerprint(cu, cu_padded, total_tokens, local_rows, tp, cp, cp_layout, device) -> torch.Tensor:
    """Small int64 summary of a layout, computed where the offsets are (no host read); equal on
    every rank iff the layouts agree (up to a vanishingly unlikely hash collision)."""
    w = torch.arange(1, cu.numel() + 1, dtype=torch.int64, device=cu.device)
    sums = torch.stack([(cu.to(torch.int64) * w).sum(), (cu_padded.to(torch.int64) * w * w).sum()])
    sizes = torch.tensor([cu.numel(), int(total_tokens), int(local_rows), tp, cp, cp_layout], dtype=torch.int64)
    return torch.cat([sizes.to(device), sums.to(device)])


def _agree(op: str, fp: torch.Tensor, groups, overflow, error) -> None:
    """One fixed-size all-gather per group, issued by every rank whatever its data; then every rank
    raises if any rank of the TP x CP grid failed its input checks, holds a different layout, or
    recorded an id outside the int16 range. A rank-local error therefore never leaves the other
    ranks waiting in the gathers that follow."""
    import torch.distributed as dist

    device = fp.device
    n = fp.numel()
    flags = torch.tensor([1 if error is not None else 0, 0, 0], dtype=torch.int64, device=device)
    payload = torch.cat([fp, flags])
    if overflow is not None:
        payload[n + 2] = overflow.amax().to(device=device, dtype=torch.int64)
    for group in groups:
        world = dist.get_world_size(group)
        out = torch.empty(world * payload.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(out, payload, group=group)
        rows = out.view(world, -1)
        mismatch = (rows[:, :n] != rows[0, :n]).any().to(torch.int64)
        verdict = rows[:, n:].amax(dim=0)
        verdict[1] = torch.maximum(verdict[1], mismatch)
        # The next group sees this group's verdict: over TP then CP every rank learns about all.
        payload = torch.cat([payload[:n], verdict])
    failed, mismatch, over = payload[n:].tolist()  # the one host read of the checks
    if error is not None and not isinstance(error, CallerRejected):
        raise error
    if failed:
        what = "this rank's" if error is not None else "another rank's"
        raise RuntimeError(f"{op}: {what} input failed its checks (see that rank's error)")
    if mismatch:
        raise RuntimeError(
            f"{op}: TP/CP ranks disagree on the THD layout (every rank must pass the same layout)"
        )
    if over:
        raise RuntimeError(
            f"{op}: indices hold values outside the int16 range [-32768, 32767] on this or another rank; "
            "router replay stores expert ids as int16"
        )


def _check_mask_counts(op: str, mask: torch.Tensor, cu: torch.Tensor, cu_padded: torch.Tensor,
                       data: torch.Tensor) -> None:
    """Every row of attention_mask holds as many valid tokens as the layout's sequence (one read).
    The shapes and devices first (the offsets in the kernels' words), so that bad offsets are not
    blamed on the mask."""
    check_offset_pair(op, cu, cu_padded, data)
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"{op}: attention_mask must be a bool [B, S] tensor, got {mask.dtype} {tuple(mask.shape)}")
    if mask.device != data.device:
        raise RuntimeError(f"{op}: attention_mask is on {mask.device} but the data is on {data.device}")
    counts = mask.sum(dim=1)
    expected = (cu[1:] - cu[:-1]).to(device=counts.device, dtype=counts.dtype)
    if counts.shape != expected.shape:
        raise ValueError(f"{op}: attention_mask must be [B={expected.numel()}, S], got shape {tuple(mask.shape)}")
    if not bool(torch.equal(counts, expected)):
        bad = int((counts != expected).nonzero()[0])
        raise ValueError(
            f"{op}: attention_mask row {bad} has {int(counts[bad])} valid tokens but the layout "
            f"says {int(expected[bad])}"
        )


def _merge_impl(indices, cu, cu_padded, total_tokens, local_rows, tp_size=1, cp_size=1, cp_layout=0,
                tp_group_name=None, cp_group_name=None, attention_mask=None, validate=True, rank_error=False):
    op = "merge_router_topk"
    tp, cp = tp_size, cp_size
    tp_group = _group_of(op, "tp", tp_group_name, tp)
    cp_group = _group_of(op, "cp", cp_group_name, cp)
    multi = tp > 1 or cp > 1
    exchange = multi and validate
    if exchange and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        exchange = False
    error = overflow = None
    try:
        if rank_error:
            raise CallerRejected()
        _merge_dense.check_none((indices, cu, cu_padded))
        stacked = len(indices) == 1 and indices[0].dim() == 3
        layer_list, num_layers, rows, topk, device = _layer_list(op, indices[0] if stacked else list(indices))
        if local_rows % tp != 0:
            raise ValueError(
                f"{op}: local_rows={local_rows} is not divisible by tp_size={tp}; "
                "Megatron's sequence-parallel split needs equal chunks"
            )
        if cp == 1 and cp_layout not in (0, 1):  # unused without CP, but the contract is the same
            raise ValueError(f"{op}: cp_layout must be 0 (zigzag) or 1 (contiguous), got {cp_layout}")
        rows_sp = local_rows // tp
        if rows != rows_sp:
            raise ValueError(
                f"{op}: indices hold {rows} rows per layer but the layout gives this rank "
                f"local_rows / tp_size = {local_rows} / {tp} = {rows_sp}"
            )
        if attention_mask is not None and validate and attention_mask.device.type != "meta":
            _check_layers(op, layer_list)  # the kernel's checks, before the mask is blamed
            _check_mask_counts(op, attention_mask, cu, cu_padded, indices[0])
        if multi:
            local, overflow = _record(layer_list, op=op)
    except Exception as e:  # every rank still joins the exchange below; re-raised after it
        if not exchange:
            if isinstance(e, CallerRejected):
                raise RuntimeError(f"{op}: this rank's input was rejected before the op") from None
            raise
        error = e
    if exchange:
        first = tp_group if tp > 1 else cp_group
        dev = _exchange_device(first)
        fp = (_fingerprint(cu, cu_padded, total_tokens, local_rows, tp, cp, cp_layout, dev) if error is None
              else torch.zeros(8, dtype=torch.int64, device=dev))
        _agree(op, fp, [g for g, size in ((tp_group, tp), (cp_group, cp)) if size > 1], overflow, error)
    if not multi:
        routes, overflow = _record(layer_list, cu, cu_padded, total_tokens, attention_mask, op=op)
        if validate and overflow.is_cuda and bool(overflow.any()):
            raise RuntimeError(
                f"{op}: indices hold values outside the int16 range [-32768, 32767]; router replay stores "
                "expert ids as int16"
            )
        return routes
    import torch.distributed._functional_collectives as funcol

    # Collectives move bytes: NCCL has no int16 (and gloo needs none); the uint8 view is free.
    shard = local.view(torch.uint8)
    if tp > 1:
        shard = funcol.all_gather_tensor(shard, gather_dim=0, group=tp_group)
    if cp > 1:
        shard = funcol.all_gather_tensor(shard, gather_dim=0, group=cp_group)
        shard = shard.view(cp, local_rows, num_layers, 2 * topk)
    return _ops.postprocess_thd(
        shard, cu, cu_padded, total_tokens, cp, -1 if cp > 1 else 0, cp_layout, False, attention_mask
    ).view(torch.int16)


for _key in ("CPU", "CUDA"):
    _lib.impl("merge_router_topk", _merge_impl, _key)


@torch.library.register_fake("verl_ops::merge_router_topk")
@_merge_dense.checked
def _merge_fake(indices, cu, cu_padded, total_tokens, local_rows, tp_size=1, cp_size=1, cp_layout=0,
                tp_group_name=None, cp_group_name=None, attention_mask=None, validate=True, rank_error=False):
    op = "merge_router_topk"
    stacked = indices[0] if len(indices) == 1 and indices[0].dim() == 3 else _stack_layers_fake(op, indices)
    check_int_arg(op, "tp_size", tp_size, 1)
    check_int_arg(op, "cp_size", cp_size, 1)
    check_cp_layout(op, cp_layout)
    torch._check(local_rows % tp_size == 0, lambda: f"{op}: local_rows={local_rows} is not divisible by "
                 f"tp_size={tp_size}; Megatron's sequence-parallel split needs equal chunks")
    torch._check(stacked.shape[1] == local_rows // tp_size, lambda: f"{op}: indices hold {stacked.shape[1]} rows per "
                 f"layer but the layout gives this rank local_rows / tp_size = {local_rows} / {tp_size}")
    routes, _ = _router_topk_record_fake(stacked, cu, cu_padded, total_tokens, attention_mask, op=op)
    return routes


def _group_name(group):
    return None if group is None else group.group_name


def merge_router_topk(
    indices,
    layout: ThdLayout,
    *,
    tp_group=None,
    cp_group=None,
    attention_mask: torch.Tensor | None = None,
    as_nested: bool = True,
    validate: bool | None = None,
) -> torch.Tensor:
    """Gather the recorded router top-k indices of every rank and return them per sequence
    (``torch.ops.verl_ops.merge_router_topk`` on the layout's offsets).

    Args:
        indices: this rank's recorded indices, a list of L tensors ``[T_local_sp, K]`` (one per MoE
            layer, as ``RouterReplay.recorded_topk_idx``) or one ``[L, T_local_sp, K]`` tensor; any
            integer dtype, any strides. ``T_local_sp = layout.local_rows // layout.tp_size``.
        layout: the micro-batch's :class:`ThdLayout` (the model's; ``layout.tp_size`` is the
            sequence-parallel size, ``layout.cp_size`` the CP size).
        tp_group: the tensor-parallel process group (needed when ``layout.tp_size > 1``); ranks are
            gathered in group order, as Megatron's ``gather_from_sequence_parallel_region``.
        cp_group: the context-parallel group (needed when ``layout.cp_size > 1``).
        attention_mask: bool ``[B, S]``: return padded ``[B, S, L, K]`` (zeros where it is false).
        as_nested: without a mask, return a jagged nested tensor ``[B, j, L, K]`` (default) or its
            values ``[total_tokens, L, K]``.
        validate: check the mask against the layout, the layouts across ranks and the int16 range
            on CUDA (host reads). Default: on, except under torch.compile / CUDA-graph capture.

    Returns:
        int16 routes of every valid token, identical on every rank of the TP and CP groups.

    Every rank of both groups must call this with the same layout. With validation, the ranks
    first exchange one small status vector (layout fingerprint, input-check failure, int16
    overflow) over the TP group and then the CP group, so a bad input on one rank raises on every
    rank instead of leaving the others waiting in the gathers.
    """
    op = "merge_router_topk"
    if not isinstance(layout, ThdLayout):
        raise TypeError(f"{op}: layout must be a verl_ops.ThdLayout, got {type(layout)}")
    tp, cp = layout.tp_size, layout.cp_size
    if tp > 1:
        _check_group(op, "tp", tp_group, tp)
    if cp > 1:
        _check_group(op, "cp", cp_group, cp)
    compiling = torch.compiler.is_compiling()
    if validate is None:
        checks = not compiling and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    else:
        checks = bool(validate) and not compiling
    names = (_group_name(tp_group) if tp > 1 else None, _group_name(cp_group) if cp > 1 else None)
    sizes = (layout.local_rows, tp, cp, layout.cp_layout_code) + names
    try:
        if isinstance(indices, torch.Tensor):
            _layer_list(op, indices)  # the shape message of the one-tensor form
            layers = [indices]
        elif isinstance(indices, (list, tuple)) and len(indices) > 0 and all(
            isinstance(t, torch.Tensor) and not t.is_nested and t.dim() == 2 for t in indices
        ):
            layers = list(indices)
        else:
            _layer_list(op, indices)  # raises with the message that names the bad entry
            raise ValueError(f"{op}: indices must be a list of [T_local_sp, K] tensors")
        cu, cu_padded = _offsets_on(op, layout, layers[0])
        if attention_mask is not None:
            check_layout_mask(op, attention_mask, layout)
    except Exception:
        if checks and (tp > 1 or cp > 1):
            # Join the status exchange as a failed rank, so the other ranks raise too.
            dummy = torch.zeros(1, 0, dtype=torch.int64)
            cu0 = torch.zeros(1, dtype=torch.int32)
            try:
                _ops.merge_router_topk([dummy], cu0, cu0, 0, *sizes, None, True, True)
            except RuntimeError:
                pass
        raise
    routes = _ops.merge_router_topk(
        layers, cu, cu_padded, layout.total_tokens, *sizes, attention_mask, checks
    )
    if attention_mask is not None or not as_nested:
        return routes
    return _as_nested(routes, cu, layout)


def _jagged_values(op: str, name: str, x: torch.Tensor, layout: ThdLayout, validate, feature_dims: int):
    """values of a jagged nested tensor (offsets checked against the layout) or of a plain tensor."""
    values = _nested_values(op, name, x, layout, validate) if x.is_nested else x
    if values.dim() != 1 + feature_dims or values.shape[0] != layout.total_tokens:
        want = "[total_tokens, L, K]" if feature_dims == 2 else "[total_tokens]"
        raise ValueError(
            f"{op}: {name} must be {want} with total_tokens={layout.total_tokens} (the layout's), "
            f"got {tuple(values.shape)}"
        )
    return values


def scatter_router_topk(
    routes: torch.Tensor,
    layout: ThdLayout,
    *,
    tp_rank: int = 0,
    cp_rank: int = 0,
    attention_mask: torch.Tensor | None = None,
    replay_mask: torch.Tensor | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's replay targets from per-sequence routes (inverse of :func:`merge_router_topk`).

    Args:
        routes: jagged nested ``[B, j, L, K]``, its values ``[total_tokens, L, K]``, or (with
            ``attention_mask``) padded ``[B, S, L, K]``; any integer dtype (int16 as recorded).
        layout: the micro-batch's :class:`ThdLayout` (the model's).
        tp_rank, cp_rank: this rank in the TP and CP groups.
        attention_mask: bool ``[B, S]`` for padded routes; valid tokens are ``routes[i, mask[i]]``.
        replay_mask: optional per-token bool flags (True: replay the recorded route, False: keep the
            router's own choice), in the same form as ``routes`` (nested ``[B, j]``, values
            ``[total_tokens]`` or padded ``[B, S]``).
        validate: compare nested offsets / mask row counts with the layout (host reads).

    Returns:
        ``(targets, replay_mask_packed)``: int64 ``[L, T_local_sp, K]`` (``targets[l]`` is layer
        ``l``'s ``[T_local_sp, K]``; zero in padding rows), and bool ``[T_local_sp]`` (False in
        padding rows) or None without ``replay_mask``.
    """
    op = "scatter_router_topk"
    if not isinstance(routes, torch.Tensor):
        raise TypeError(f"{op}: routes must be a tensor, got {type(routes).__name__}")
    cu, cu_padded = _offsets_on(op, layout, routes)
    check_rank(op, "tp_rank", tp_rank, layout.tp_size)
    check_rank(op, "cp_rank", cp_rank, layout.cp_size)
    _rows_per_tp_rank(op, layout)
    if attention_mask is not None:
        # The mask first, so a wrong mask (e.g. 0-d) is reported as the mask's error.
        check_layout_mask(op, attention_mask, layout)
        if routes.is_nested:
            raise ValueError(
                f"{op}: attention_mask is for padded routes [B, S, L, K], not for a nested tensor"
            )
        if routes.dim() != 4 or tuple(routes.shape[:2]) != tuple(attention_mask.shape):
            raise ValueError(
                f"{op}: padded routes must be [B, S, L, K] matching attention_mask "
                f"{tuple(attention_mask.shape)}, got {tuple(routes.shape)}"
            )
        check_mask_lengths(op, attention_mask, layout, validate)
        values = routes
        if replay_mask is not None:
            _check_int_mask(op, "replay_mask", replay_mask, routes.device)
            if replay_mask.is_nested or tuple(replay_mask.shape) != tuple(attention_mask.shape):
                raise ValueError(
                    f"{op}: with padded routes, replay_mask must be [B, S] like attention_mask, "
                    f"got {tuple(replay_mask.shape)}"
                )
    else:
        values = _jagged_values(op, "routes", routes, layout, validate, 2)
        if replay_mask is not None:
            _check_int_mask(op, "replay_mask", replay_mask, routes.device)
            replay_mask = _jagged_values(op, "replay_mask", replay_mask, layout, validate, 0)
    targets, packed_mask = _library.call_op(
        _ops.router_topk_scatter,
        values,
        values,
        cu,
        cu_padded,
        layout.local_rows,
        layout.tp_size,
        tp_rank,
        layout.cp_size,
        cp_rank,
        layout.cp_layout_code,
        attention_mask,
        replay_mask,
    )
    return targets, (packed_mask if replay_mask is not None else None)
