"""Router replay drop-ins for verl (``verl/utils/megatron/router_replay_utils.py``).

verl's ``merge_router_topk_indices`` and ``set_router_replay_data`` each do two things: the data
path (stack / permute / int16, gather over the sequence-parallel group, THD unpack with a CP
all-gather; and back: THD pack, sequence-parallel split, per-layer int64) and the bookkeeping of
``RouterReplay`` objects (which routers belong to this pipeline / virtual-pipeline stage). The two
functions below replace the data path with :func:`verl_ops.merge_router_topk` /
:func:`verl_ops.scatter_router_topk` and leave the router bookkeeping to verl:

=================================  ==============================================================
``merge_router_topk_indices``      L recorded ``[T_local_sp, K]`` -> jagged ``[B, j, L, K]`` int16
                                   (nested ``input_ids``) or padded ``[B, S, L, K]`` (mask)
``set_router_replay_data``         routes -> ``(targets [L, T_local_sp, K] int64, replay_mask)``,
                                   optionally handed to ``routers[l].set_target_indices``
=================================  ==============================================================

The layout is the model's, built with the very rules of the model's forward
(:func:`layout_options`): FP8 padding when ``getattr(tf_config, "fp8", None) in ("e4m3",
"hybrid")`` (a config without the attribute means no FP8), the contiguous CP layout and
``min_local_rows = tf_config.csa_window_size`` for ``experimental_attention_variant ==
"dsv4_hybrid"``, zigzag otherwise; nested batches follow ``preprocess_thd_engine``, padded batches
``preprocess_packed_seqs`` (zigzag, FP8 rule only), exactly as verl. Pass the model's
``packed_seq_params`` (from :mod:`verl_ops.integrations.verl`'s preprocess) to reuse its
:class:`~verl_ops.ThdLayout` object itself.

Parallel sizes, ranks and groups come from ``megatron.core.parallel_state`` (tensor-parallel world
size / rank / group; context-parallel world size / rank / group, or for dynamic CP
``get_dynamic_data_context_parallel_groups(group_size=local_cp_size)``). megatron-core is imported
inside the functions only.

Differences from verl, all deliberate:

* ``merge_router_topk_indices`` takes the recorded tensors (``layers_topk_idx``, a list of
  ``router.recorded_topk_idx`` or one ``[L, T_local_sp, K]`` tensor) and *returns* the merged
  routes (on the recording device); verl reads them from its routers and appends ``result.cpu()``
  to a list. ``vp_rank`` is accepted for call compatibility; it only selects routers in verl.
* Expert ids outside the int16 range raise instead of wrapping (verl's ``.to(torch.int16)``).
* ``set_router_replay_data`` returns the targets; with ``routers`` (objects with
  ``set_target_indices``, one per layer of ``layers_topk_idx``'s layer dimension) it also sets
  them, passing ``replay_mask=`` only when a replay mask is given. Mapping layers to the routers
  of this pipeline stage (``moe_layer_freq``, layer offsets, ``model=``) stays with verl.
* A replay mask is honoured for padded routes too (``[B, S]`` bool; verl ignores it there).
"""

from __future__ import annotations

import functools

import torch

from ..layout import ThdLayout
from ..router import merge_router_topk, scatter_router_topk
from .._validate import check_jagged, host_values_required, is_meta
from ._common import LAYOUT_ATTR, _bool_mask, _mpu

__all__ = ["layout_options", "merge_router_topk_indices", "router_layout", "set_router_replay_data"]

_FP8_PADDING_MODES = ("e4m3", "hybrid")


def layout_options(tf_config, *, nested: bool = True) -> dict:
    """ThdLayout options of the model's forward for ``tf_config`` (verl's rules).

    ``nested=False`` gives the legacy padded path's (``preprocess_packed_seqs``: zigzag, no
    ``min_local_rows``). Attributes a config lacks read as unset, never as an error.
    """
    fp8_padding = getattr(tf_config, "fp8", None) in _FP8_PADDING_MODES
    if not nested:
        return {"cp_layout": "zigzag", "fp8_padding": fp8_padding, "min_local_rows": None}
    dsv4 = getattr(tf_config, "experimental_attention_variant", None) == "dsv4_hybrid"
    return {
        "cp_layout": "contiguous" if dsv4 else "zigzag",
        "fp8_padding": fp8_padding,
        "min_local_rows": getattr(tf_config, "csa_window_size", None) if dsv4 else None,
    }


def router_layout(
    lengths, tf_config, *, tp_size: int, cp_size: int, nested: bool = True, device=None
) -> ThdLayout:
    """The ThdLayout the model's forward builds for these lengths (see :func:`layout_options`)."""
    options = layout_options(tf_config, nested=nested)
    return ThdLayout.from_lengths(lengths, tp_size=tp_size, cp_size=cp_size, device=device, **options)


def _cp_of(mpu, local_cp_size):
    """(cp_size, cp_rank, cp_group) as verl's preprocess_thd_engine / postprocess_thd_engine read them."""
    if local_cp_size is not None:
        if local_cp_size <= 1:
            return 1, 0, None
        group = mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)
        return local_cp_size, torch.distributed.get_rank(group=group), group
    cp_size = mpu.get_context_parallel_world_size()
    if cp_size <= 1:
        return 1, 0, None
    return cp_size, mpu.get_context_parallel_rank(), mpu.get_context_parallel_group()


def _layout_for(op, lengths, tf_config, tp_size, cp_size, nested, device, packed_seq_params) -> ThdLayout:
    layout = getattr(packed_seq_params, LAYOUT_ATTR, None) if packed_seq_params is not None else None
    if isinstance(layout, ThdLayout):
        if layout.tp_size != tp_size or layout.cp_size != cp_size:
            raise ValueError(
                f"{op}: packed_seq_params' layout was built for tp_size={layout.tp_size}, "
                f"cp_size={layout.cp_size} "
                f"but this call runs with tp_size={tp_size}, cp_size={cp_size}"
            )
        if is_meta(lengths):  # shape inference: the attached layout decides the shapes
            if lengths.shape[0] != layout.batch_size:
                raise ValueError(
                    f"{op}: the batch has {lengths.shape[0]} sequences but packed_seq_params' layout has "
                    f"{layout.batch_size}"
                )
            return layout
        want = torch.as_tensor(lengths).detach().to("cpu", torch.int64)
        if tuple(want.tolist()) != layout.lengths:
            raise ValueError(f"{op}: the batch's sequence lengths do not match packed_seq_params' layout")
        return layout
    if is_meta(lengths):
        raise host_values_required(
            op, "the batch" if nested else "attention_mask", "lengths",
            "pass it on the CPU or a GPU, or pass packed_seq_params= with the model's layout",
        )
    return router_layout(lengths, tf_config, tp_size=tp_size, cp_size=cp_size, nested=nested, device=device)


def _first_device(layers_topk_idx):
    if isinstance(layers_topk_idx, torch.Tensor):
        return layers_topk_idx.device
    if isinstance(layers_topk_idx, (list, tuple)) and layers_topk_idx:
        if isinstance(layers_topk_idx[0], torch.Tensor):
            return layers_topk_idx[0].device
    return None


def merge_router_topk_indices(
    attention_mask,
    input_ids,
    layers_topk_idx,
    tf_config,
    vp_rank=None,
    local_cp_size=None,
    *,
    packed_seq_params=None,
) -> torch.Tensor:
    """verl's record-side merge: this rank's recorded routes -> every token's routes.

    Args:
        attention_mask: ``[B, S]`` (padded batches; unused for a nested ``input_ids``).
        input_ids: the micro-batch as the model saw it: a jagged nested tensor (model engine) or
            padded ``[B, S]`` with ``attention_mask`` (legacy path).
        layers_topk_idx: the recorded indices of this rank's MoE layers, a list of L
            ``[T_local_sp, K]`` tensors (``router.recorded_topk_idx``) or one ``[L, T_local_sp, K]``.
        tf_config: the model's TransformerConfig (FP8 and attention-variant settings).
        vp_rank: accepted for call compatibility (verl uses it to pick routers).
        local_cp_size: dynamic CP size of this micro-batch (nested batches).
        packed_seq_params: the model's, to reuse its :class:`ThdLayout`.

    Returns:
        int16 jagged nested ``[B, j, L, K]`` (nested ``input_ids``) or ``[B, S, L, K]`` with zeros
        where ``attention_mask`` is false, on the recording device; the same on every TP/CP rank.
    """
    op = "merge_router_topk_indices"
    del vp_rank
    mpu = _mpu()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    tp_group = mpu.get_tensor_model_parallel_group() if tp_size > 1 else None
    device = _first_device(layers_topk_idx)
    dtypes = {t.dtype for t in layers_topk_idx if isinstance(t, torch.Tensor)} \
        if isinstance(layers_topk_idx, (list, tuple)) else set()
    if len(dtypes) > 1:
        # layers recorded in different integer dtypes (verl converts each to int16 before its stack):
        # one common dtype here, which the op stores as int16 (anything that is not a tensor is left
        # for the op's own error)
        common = functools.reduce(torch.promote_types, dtypes)
        layers_topk_idx = [t.to(common) if isinstance(t, torch.Tensor) else t for t in layers_topk_idx]
    if isinstance(input_ids, torch.Tensor) and input_ids.is_nested:
        check_jagged(op, "input_ids", input_ids)
        cp_size, _, cp_group = _cp_of(mpu, local_cp_size)
        lengths = input_ids.offsets().diff()
        layout = _layout_for(op, lengths, tf_config, tp_size, cp_size, True, device, packed_seq_params)
        return merge_router_topk(layers_topk_idx, layout, tp_group=tp_group, cp_group=cp_group)
    mask = _bool_mask(op, attention_mask)
    cp_size, _, cp_group = _cp_of(mpu, None)
    layout = _layout_for(op, mask.sum(dim=-1), tf_config, tp_size, cp_size, False, device, packed_seq_params)
    if device is not None:
        mask = mask.to(device)
    return merge_router_topk(
        layers_topk_idx, layout, tp_group=tp_group, cp_group=cp_group, attention_mask=mask
    )


def set_router_replay_data(
    layers_topk_idx,
    attention_mask,
    tf_config,
    vp_rank=None,
    replay_mask=None,
    local_cp_size=None,
    *,
    routers=None,
    packed_seq_params=None,
):
    """verl's replay-side split: every token's routes -> this rank's per-layer targets.

    Args:
        layers_topk_idx: routes of the micro-batch, jagged nested ``[B, j, L, K]`` (model engine)
            or padded ``[B, S, L, K]`` with ``attention_mask``; int16 as merged (any integer dtype).
        attention_mask: ``[B, S]`` for padded routes (unused for nested ones).
        tf_config: the model's TransformerConfig.
        vp_rank: accepted for call compatibility (verl uses it to pick routers).
        replay_mask: per-token bool flags in the form of ``layers_topk_idx`` (nested ``[B, j]`` or
            padded ``[B, S]``): True replays the recorded route, False keeps the router's own.
        local_cp_size: dynamic CP size of this micro-batch (nested routes).
        routers: optional objects with ``set_target_indices``, one per layer of the routes' layer
            dimension, in that order; each gets its ``[T_local_sp, K]`` int64 target (and
            ``replay_mask=`` when a replay mask is given).
        packed_seq_params: the model's, to reuse its :class:`ThdLayout`.

    Returns:
        ``(targets, replay_mask_packed)``: int64 ``[L, T_local_sp, K]`` on the routes' device
        (``targets[l]`` is layer l's, a view) and bool ``[T_local_sp]`` or None.
    """
    op = "set_router_replay_data"
    del vp_rank
    if not isinstance(layers_topk_idx, torch.Tensor):
        raise TypeError(f"{op}: layers_topk_idx must be a tensor, got {type(layers_topk_idx).__name__}")
    mpu = _mpu()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank() if tp_size > 1 else 0
    device = layers_topk_idx.device
    if layers_topk_idx.is_nested:
        check_jagged(op, "layers_topk_idx", layers_topk_idx)
        cp_size, cp_rank, _ = _cp_of(mpu, local_cp_size)
        lengths = layers_topk_idx.offsets().diff()
        layout = _layout_for(op, lengths, tf_config, tp_size, cp_size, True, device, packed_seq_params)
        targets, packed_mask = scatter_router_topk(
            layers_topk_idx, layout, tp_rank=tp_rank, cp_rank=cp_rank, replay_mask=replay_mask
        )
    else:
        mask = _bool_mask(op, attention_mask).to(device)
        cp_size, cp_rank, _ = _cp_of(mpu, None)
        lengths = mask.sum(dim=-1)
        layout = _layout_for(op, lengths, tf_config, tp_size, cp_size, False, device, packed_seq_params)
        if replay_mask is not None:
            replay_mask = _bool_mask(op, replay_mask, "replay_mask").to(device)
        targets, packed_mask = scatter_router_topk(
            layers_topk_idx,
            layout,
            tp_rank=tp_rank,
            cp_rank=cp_rank,
            attention_mask=mask,
            replay_mask=replay_mask,
        )
    if routers is not None:
        routers = list(routers)
        if len(routers) != targets.shape[0]:
            raise ValueError(f"{op}: got {len(routers)} routers for {targets.shape[0]} layers of routes")
        for router, target in zip(routers, targets):
            if packed_mask is None:
                router.set_target_indices(target)
            else:
                router.set_target_indices(target, replay_mask=packed_mask)
    return targets, packed_mask
