"""Drop-in replacements for verl's THD pack/unpack helpers (``verl/models/mcore/util.py``).

The four functions below keep verl's signatures and return types but do the packing with
:class:`verl_ops.ThdLayout` and the fused ``preprocess_thd`` / ``postprocess_thd`` ops:

================================  ==============================================================
``preprocess_packed_seqs``        padded ``[B, S, *F]`` + mask -> ``([1, local_rows, *F], PackedSeqParams)``
``postprocess_packed_seqs``       ``[1, local_rows, *F]`` -> padded ``[B, S, *F]`` (zeros off-mask)
``preprocess_thd_engine``         jagged nested -> ``([1, local_rows, *F], PackedSeqParams, position_ids)``
``postprocess_thd_engine``        ``[1, local_rows, *F]`` -> jagged nested ``[B, j, *F]``
================================  ==============================================================

Parallel sizes and ranks come from ``megatron.core.parallel_state`` (tensor-parallel world size,
context-parallel world size / rank / group; for dynamic CP, ``local_cp_size`` with
``get_dynamic_data_context_parallel_groups``), exactly where verl reads them. megatron-core is an
optional dependency: it is imported inside the functions, so importing this module never needs it.

Differences from verl, all deliberate (the project's operator contracts, OPS.md sections 1-2):

* The :class:`~verl_ops.ThdLayout` built by a preprocess call is attached to the returned
  ``PackedSeqParams`` as ``packed_seq_params.verl_ops_layout`` and reused by the matching
  postprocess call. A ``PackedSeqParams`` without it (e.g. built by verl itself) still works:
  the layout is rebuilt from ``cu_seqlens_q_padded`` and the mask / nested offsets.
* Zigzag batches whose last sequence is lengthened by FP8 total padding, ``min_local_rows`` or
  ``pad_to_length_bucket`` past its valid rows are packed correctly (verl releases before 0.9.1
  raise a shape error there).
* ``preprocess_packed_seqs`` also records ``cp_partition_mode="zigzag"`` when megatron-core's
  ``PackedSeqParams`` has that field (verl's legacy path leaves the default, which is zigzag).
* Padding rows are always zero; ``position_ids`` of padding rows hold the row's position inside
  its padded sequence (verl leaves some of them 0). Valid rows are identical to verl's.
* ``need_roll=True``: values are rolled (position p holds token p+1, the last valid position
  wraps to token 0), position ids are *not* rolled. verl's callers discard the position ids of
  rolled tensors (labels, loss masks), and verl's own value at the last valid position of each
  sequence differs between its CP branches.
* The attention mask may be bool or 0/1 integers (verl needs bool); mismatched inputs (mask vs
  layout, nested offsets vs ``PackedSeqParams``, wrong output shape) raise ``ValueError``.
* The NPU-only MindSpeed position-id hook of verl's ``preprocess_thd_engine`` is not called.

Autograd follows verl: with ``cp > 1`` the postprocess all-gathers every rank's output shard over
the CP group (``torch.distributed.all_gather`` of the detached shard), and the gradient reaches
only this rank's local shard; no collective runs in backward. ``cp == 1`` issues no collective.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from dataclasses import fields, is_dataclass

import torch

from .._thd import postprocess_thd, preprocess_thd
from ..layout import CP_LAYOUTS, ThdLayout

__all__ = [
    "LAYOUT_ATTR",
    "install",
    "postprocess_packed_seqs",
    "postprocess_thd_engine",
    "preprocess_packed_seqs",
    "preprocess_thd_engine",
    "uninstall",
]

#: Attribute of ``PackedSeqParams`` that carries the :class:`ThdLayout` of its micro-batch.
LAYOUT_ATTR = "verl_ops_layout"


# --------------------------------------------------------------------------------------------
# Lazy megatron-core access.


def _mpu():
    try:
        from megatron.core import parallel_state
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            "verl_ops.integrations needs megatron-core (megatron.core.parallel_state); "
            "install it with `pip install megatron-core`"
        ) from e
    return parallel_state


def _packed_seq_params_cls():
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            "verl_ops.integrations.verl needs megatron-core (megatron.core.packed_seq_params); "
            "install it with `pip install megatron-core`"
        ) from e
    return PackedSeqParams


_FIELD_SUPPORT: dict[tuple[type, str], bool] = {}


def _supports_field(cls, name: str) -> bool:
    """True when ``cls(name=...)`` is accepted (dataclass field, ``__init__`` parameter or ``**kw``)."""
    key = (cls, name)
    if key not in _FIELD_SUPPORT:
        if is_dataclass(cls) and name in {f.name for f in fields(cls)}:
            ok = True
        else:
            try:
                params = inspect.signature(cls.__init__).parameters
            except (TypeError, ValueError):
                params = {}
            ok = name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        _FIELD_SUPPORT[key] = ok
    return _FIELD_SUPPORT[key]


def _make_packed_seq_params(layout: ThdLayout, extra: dict):
    cls = _packed_seq_params_cls()
    cu = layout.cu_seqlens_padded
    psp = cls(
        qkv_format="thd",
        cu_seqlens_q=cu,
        max_seqlen_q=layout.max_seqlen,
        cu_seqlens_kv=cu,
        max_seqlen_kv=layout.max_seqlen,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        **extra,
    )
    try:
        setattr(psp, LAYOUT_ATTR, layout)
    except (AttributeError, TypeError):  # frozen / slotted PackedSeqParams: rebuilt in postprocess
        pass
    return psp


def _cp_partition_args(cp_layout: str, cp_size: int) -> dict:
    if _supports_field(_packed_seq_params_cls(), "cp_partition_mode"):
        return {"cp_partition_mode": cp_layout}
    if cp_layout != "zigzag" and cp_size > 1:
        raise ValueError(
            f"cp_layout={cp_layout!r} requires PackedSeqParams.cp_partition_mode, which this "
            "megatron-core version does not provide. Upgrade megatron-core or use the zigzag layout."
        )
    return {}


def _check_cp_layout(op: str, cp_layout) -> None:
    if cp_layout not in CP_LAYOUTS:
        raise ValueError(
            f"{op}: unsupported context parallel layout {cp_layout!r}; expected one of {CP_LAYOUTS}"
        )


def _bool_mask(op: str, attention_mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = (
            tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        )
        raise ValueError(f"{op}: attention_mask must be a [B, S] tensor, got {shape}")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


def _local_shard(op: str, output: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
    if not isinstance(output, torch.Tensor) or output.dim() < 2 or output.shape[0] != 1:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output)
        raise ValueError(f"{op}: output must be [1, local_rows, *F], got {shape}")
    if output.shape[1] != layout.local_rows:
        raise ValueError(
            f"{op}: output has {output.shape[1]} rows but the packed layout gives this rank "
            f"local_rows={layout.local_rows}"
        )
    return output[0]


# --------------------------------------------------------------------------------------------
# Layout reuse / reconstruction.


def _layout_from_padded_offsets(
    op: str, lengths, cu_seqlens_padded: torch.Tensor, *, tp_size: int, cp_size: int, cp_layout: str
) -> ThdLayout:
    """A ThdLayout whose padded offsets are exactly ``cu_seqlens_padded`` (those the model used)."""
    try:
        return ThdLayout.from_padded_offsets(
            lengths, cu_seqlens_padded, tp_size=tp_size, cp_size=cp_size, cp_layout=cp_layout
        )
    except ValueError as e:
        raise ValueError(f"{op}: packed_seq_params.cu_seqlens_q_padded: {e}") from e


def _attached_layout(op: str, packed_seq_params, cp_size: int, cp_layout: str) -> ThdLayout | None:
    layout = getattr(packed_seq_params, LAYOUT_ATTR, None)
    if not isinstance(layout, ThdLayout):
        return None
    if getattr(packed_seq_params, "cu_seqlens_q_padded", None) is not layout.cu_seqlens_padded:
        return None  # offsets were replaced after preprocess: trust packed_seq_params
    if layout.cp_size != cp_size or layout.cp_layout != cp_layout:
        raise ValueError(
            f"{op}: packed_seq_params were built for cp_size={layout.cp_size}, "
            f"cp_layout={layout.cp_layout!r} but postprocess runs with cp_size={cp_size}, "
            f"cp_layout={cp_layout!r}"
        )
    return layout


def _gather_cp(output: torch.Tensor, cp_size: int, cp_rank: int, group) -> torch.Tensor:
    """``[cp, local_rows, *F]``: every rank's shard; only this rank's entry carries autograd."""
    gathered = [torch.empty_like(output) for _ in range(cp_size)]
    torch.distributed.all_gather(gathered, output.detach().contiguous(), group=group)
    shards = [g[0] for g in gathered]
    shards[cp_rank] = output[0]
    return torch.stack(shards)


# --------------------------------------------------------------------------------------------
# The drop-ins.


def preprocess_packed_seqs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pre_process: bool = True,
    use_fp8_padding: bool = False,
):
    """verl's legacy padded-batch pack.

    Args:
        input_ids: ``[B, S, *F]`` (token ids, labels, hidden states, ...).
        attention_mask: ``[B, S]``; valid tokens of row i are ``input_ids[i, attention_mask[i]]``.
        pre_process: pack ``input_ids``; when False they are returned unchanged (pipeline stages
            after the first only need the ``PackedSeqParams``).
        use_fp8_padding: apply FP8 alignment (``tf_config.fp8 in ("e4m3", "hybrid")``).

    Returns:
        ``(packed [1, local_rows, *F], packed_seq_params)``; ``packed`` is this CP rank's zigzag
        shard with alignment ``tp*cp*2`` (cp > 1) or ``tp`` (cp == 1), zero in padding rows.
    """
    op = "preprocess_packed_seqs"
    mpu = _mpu()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    cp_size = mpu.get_context_parallel_world_size()
    cp_rank = mpu.get_context_parallel_rank()
    mask = _bool_mask(op, attention_mask)
    layout = ThdLayout.from_lengths(
        mask.sum(dim=-1),
        tp_size=tp_size,
        cp_size=cp_size,
        cp_layout="zigzag",
        fp8_padding=bool(use_fp8_padding),
        device=input_ids.device,
    )
    packed_seq_params = _make_packed_seq_params(layout, _cp_partition_args("zigzag", cp_size))
    if not pre_process:
        return input_ids, packed_seq_params
    # The lengths came from this very mask: skip the second host read of preprocess_thd's check.
    packed, _ = preprocess_thd(input_ids, layout, cp_rank, attention_mask=mask, validate=False)
    return packed.unsqueeze(0), packed_seq_params


def postprocess_packed_seqs(
    output: torch.Tensor,
    packed_seq_params,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
) -> torch.Tensor:
    """verl's legacy unpack: ``[1, local_rows, *F]`` -> ``[batch_size, seq_len, *F]``.

    With cp > 1 every rank's shard is all-gathered over the CP group; the gradient reaches only
    this rank's ``output``. Positions where ``attention_mask`` is false are zero. With
    ``post_process=False`` the output is returned unchanged.
    """
    op = "postprocess_packed_seqs"
    if not post_process:
        return output
    mpu = _mpu()
    cp_size = mpu.get_context_parallel_world_size()
    mask = _bool_mask(op, attention_mask)
    if tuple(mask.shape) != (batch_size, seq_len):
        raise ValueError(
            f"{op}: attention_mask has shape {tuple(mask.shape)} but "
            f"batch_size={batch_size}, seq_len={seq_len}"
        )
    layout = _attached_layout(op, packed_seq_params, cp_size, "zigzag")
    if layout is None:
        layout = _layout_from_padded_offsets(
            op,
            mask.sum(dim=-1),
            packed_seq_params.cu_seqlens_q_padded,
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            cp_size=cp_size,
            cp_layout="zigzag",
        )
    local = _local_shard(op, output, layout)
    if cp_size > 1:
        cp_rank = mpu.get_context_parallel_rank()
        packed = _gather_cp(output, cp_size, cp_rank, mpu.get_context_parallel_group())
    else:
        cp_rank = 0
        packed = local
    return postprocess_thd(packed, layout, cp_rank, attention_mask=mask)


def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    local_cp_size: int | None = None,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
):
    """verl's model-engine pack of a jagged nested batch.

    Args:
        input_ids: jagged nested tensor ``[B, j, *F]``.
        pre_process: pack ``input_ids``; when False returns ``(input_ids, packed_seq_params, None)``.
        need_roll: next-token targets (labels): position p holds token p+1, the last valid
            position wraps to token 0. Position ids are not rolled.
        use_fp8_padding: FP8 alignment rules (OPS.md section 1).
        local_cp_size: dynamic CP: CP size of this micro-batch; the group comes from
            ``mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)`` and is
            stored in ``packed_seq_params.cp_group`` (with ``local_cp_size``).
        min_local_rows, pad_to_length_bucket: extra padding of the last sequence (OPS.md section 1).
        cp_layout: ``"zigzag"`` (default) or ``"contiguous"``; recorded as
            ``packed_seq_params.cp_partition_mode`` when megatron-core has that field (a
            contiguous layout with cp > 1 needs it).

    Returns:
        ``(packed [1, local_rows, *F], packed_seq_params, position_ids int64 [1, local_rows])``.
    """
    op = "preprocess_thd_engine"
    _check_cp_layout(op, cp_layout)
    if not (isinstance(input_ids, torch.Tensor) and input_ids.is_nested):
        raise ValueError(f"{op}: input_ids must be a jagged nested tensor, got {type(input_ids)}")
    mpu = _mpu()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    extra = {}
    if local_cp_size is not None:
        cp_size = local_cp_size
        cp_group = mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)
        cp_rank = torch.distributed.get_rank(group=cp_group)
        extra["local_cp_size"] = local_cp_size
        extra["cp_group"] = cp_group
    else:
        cp_size = mpu.get_context_parallel_world_size()
        cp_rank = mpu.get_context_parallel_rank()
    extra.update(_cp_partition_args(cp_layout, cp_size))
    offsets = input_ids.offsets()
    if offsets is None or input_ids._lengths is not None:
        raise ValueError(f"{op}: input_ids must be a contiguous jagged nested tensor (layout=torch.jagged)")
    layout = ThdLayout.from_lengths(
        offsets.diff(),
        tp_size=tp_size,
        cp_size=cp_size,
        cp_layout=cp_layout,
        fp8_padding=bool(use_fp8_padding),
        min_local_rows=min_local_rows,
        pad_to_length_bucket=pad_to_length_bucket,
        device=input_ids.device,
    )
    packed_seq_params = _make_packed_seq_params(layout, extra)
    if not pre_process:
        return input_ids, packed_seq_params, None
    # The layout was built from these offsets: no need to compare them again on the host.
    packed, position_ids = preprocess_thd(input_ids, layout, cp_rank, roll=bool(need_roll), validate=False)
    return packed.unsqueeze(0), packed_seq_params, position_ids.unsqueeze(0)


def postprocess_thd_engine(
    output: torch.Tensor,
    packed_seq_params,
    input_ids: torch.Tensor,
    batch_size: int,
    post_process: bool = True,
    local_cp_size: int | None = None,
    cp_layout: str = "zigzag",
) -> torch.Tensor:
    """verl's model-engine unpack: ``[1, local_rows, *F]`` -> jagged nested ``[B, j, *F]``.

    ``input_ids`` (the nested batch that was packed) gives the valid lengths. With cp > 1 (or
    ``local_cp_size`` > 1, group ``packed_seq_params.cp_group``) the shards are all-gathered over
    the CP group; the gradient reaches only this rank's ``output``. ``post_process=False``
    returns ``output`` unchanged.
    """
    op = "postprocess_thd_engine"
    _check_cp_layout(op, cp_layout)
    if not post_process:
        return output
    if not (isinstance(input_ids, torch.Tensor) and input_ids.is_nested):
        raise ValueError(f"{op}: input_ids must be the jagged nested batch that was packed")
    mpu = _mpu()
    if local_cp_size is not None:
        cp_size = local_cp_size
        cp_group = packed_seq_params.cp_group
        cp_rank = torch.distributed.get_rank(group=cp_group) if cp_size > 1 else 0
    else:
        cp_size = mpu.get_context_parallel_world_size()
        cp_group = mpu.get_context_parallel_group() if cp_size > 1 else None
        cp_rank = mpu.get_context_parallel_rank()
    if input_ids.size(0) != batch_size:
        raise ValueError(f"{op}: input_ids has {input_ids.size(0)} sequences but batch_size={batch_size}")
    offsets_cpu = input_ids.offsets().detach().to("cpu", torch.int64)
    layout = _attached_layout(op, packed_seq_params, cp_size, cp_layout)
    if layout is not None and not torch.equal(offsets_cpu, layout.cu_seqlens_cpu.to(torch.int64)):
        raise ValueError(f"{op}: input_ids' offsets do not match the packed_seq_params' layout")
    if layout is None:
        layout = _layout_from_padded_offsets(
            op,
            offsets_cpu.diff(),
            packed_seq_params.cu_seqlens_q_padded,
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            cp_size=cp_size,
            cp_layout=cp_layout,
        )
    local = _local_shard(op, output, layout)
    if cp_size > 1:
        packed = _gather_cp(output, cp_size, cp_rank, cp_group)
    else:
        cp_rank = 0
        packed = local
    return postprocess_thd(packed, layout, cp_rank, as_nested=True)


# --------------------------------------------------------------------------------------------
# Patching verl.

_DROP_INS = {
    "preprocess_packed_seqs": preprocess_packed_seqs,
    "postprocess_packed_seqs": postprocess_packed_seqs,
    "preprocess_thd_engine": preprocess_thd_engine,
    "postprocess_thd_engine": postprocess_thd_engine,
}
_UTIL_MODULE = "verl.models.mcore.util"
# (module name, attribute) -> verl's original function, for uninstall().
_ORIGINALS: dict[tuple[str, str], object] = {}


def _accepts(ours, theirs) -> bool:
    """verl's parameters are a prefix of ours, in order (every verl call site still binds the same)."""
    try:
        mine = list(inspect.signature(ours).parameters)
        other = list(inspect.signature(theirs).parameters)
    except (TypeError, ValueError):
        return False
    return mine[: len(other)] == other


def install(*, strict: bool = False) -> list[str]:
    """Swap the drop-ins into verl.

    Replaces ``preprocess_packed_seqs``, ``postprocess_packed_seqs``, ``preprocess_thd_engine`` and
    ``postprocess_thd_engine`` in ``verl.models.mcore.util`` and in every already-imported
    ``verl.*`` module that imported them by name (e.g. ``verl.models.mcore.model_forward``,
    ``verl.utils.megatron.router_replay_utils``); modules imported later pick the drop-ins up from
    ``verl.models.mcore.util``. A function whose verl parameters are not a prefix of ours (a
    newer/forked verl with parameters the drop-in lacks) is left alone with a warning.

    Returns the patched names as ``"module.attribute"`` (newly patched by this call; a second
    call returns ``[]`` unless new modules appeared). When verl (or megatron-core, which verl's
    module imports) is not importable, returns ``[]`` — or raises ``ImportError`` if
    ``strict=True``. Undo with :func:`uninstall`.
    """
    try:
        import importlib

        util = importlib.import_module(_UTIL_MODULE)
    except ImportError:
        if strict:
            raise
        return []
    originals = {}
    for name, ours in _DROP_INS.items():
        current = getattr(util, name, None)
        if current is None:
            continue
        theirs = _ORIGINALS.get((_UTIL_MODULE, name), current)
        if theirs is ours:
            continue
        if not _accepts(ours, theirs):
            warnings.warn(
                f"verl_ops.integrations.verl.install: {_UTIL_MODULE}.{name} has parameters the drop-in "
                f"does not support ({inspect.signature(theirs)}); leaving verl's version in place",
                stacklevel=2,
            )
            continue
        originals[name] = theirs
    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for name, theirs in originals.items():
            if getattr(mod, name, None) is theirs:
                _ORIGINALS.setdefault((mod_name, name), theirs)
                setattr(mod, name, _DROP_INS[name])
                patched.append(f"{mod_name}.{name}")
    return sorted(patched)


def uninstall() -> list[str]:
    """Undo :func:`install`: put verl's original functions back. Returns the restored names."""
    restored = []
    for (mod_name, name), theirs in list(_ORIGINALS.items()):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, name, None) is _DROP_INS[name]:
            setattr(mod, name, theirs)
            restored.append(f"{mod_name}.{name}")
        del _ORIGINALS[(mod_name, name)]
    return sorted(restored)
