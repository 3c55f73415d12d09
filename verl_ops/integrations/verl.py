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

How the drop-ins relate to verl (the project's operator contracts, docs/layout.md):

* The :class:`~verl_ops.ThdLayout` built by a preprocess call is attached to the returned
  ``PackedSeqParams`` as ``packed_seq_params.verl_ops_layout`` and reused by the matching
  postprocess call. A ``PackedSeqParams`` without it (e.g. built by verl itself) still works:
  the layout is rebuilt from ``cu_seqlens_q_padded`` and the mask / nested offsets.
* Zigzag batches whose last sequence is lengthened by FP8 total padding, ``min_local_rows`` or
  ``pad_to_length_bucket`` past its valid rows are packed correctly (verl releases before 0.9.1
  raise a shape error there).
* ``preprocess_packed_seqs`` also records ``cp_partition_mode="zigzag"`` when megatron-core's
  ``PackedSeqParams`` has that field (verl's legacy path leaves the default, which is zigzag).
* Every row is verl's, padding rows included: values, ``position_ids`` (0 in padding
  rows except zigzag first-chunk rows) and, with ``need_roll=True``, verl's rolled values and
  rolled position ids (docs/layout.md#roll). The native kernels implement verl 0.9.1's rule
  directly. verl main differs from 0.9.1 in the rolled zigzag rows of padded sequences (cp > 1);
  the drop-in follows the verl in use, read from its source (:func:`zigzag_roll_rule`,
  overridable with ``ZIGZAG_ROLL_RULE``), and under main's rule rewrites those rows (at most two
  per sequence) with one indexed copy.
* verl's errors word for word where its tests match them, e.g.
  ``ValueError("Unsupported context parallel layout: interleaved")``.
* The attention mask may be bool or 0/1 integers (verl needs bool); mismatched inputs (mask vs
  layout, nested offsets vs ``PackedSeqParams``, wrong output shape) raise ``ValueError``.
* The NPU-only MindSpeed position-id hook of verl's ``preprocess_thd_engine`` is not called.
* Nested inputs must be ``torch.jagged`` nested tensors without holes (a strided nested tensor or
  one with offsets plus lengths raises ``ValueError``). Meta-device inputs: the preprocess calls
  build a layout from the lengths' values and raise a clear ``ValueError`` for a meta mask / meta
  nested offsets; the postprocess calls run shape-only on meta when ``packed_seq_params`` carries
  the layout of its preprocess call.

Autograd follows verl: with ``cp > 1`` the postprocess all-gathers every rank's output shard over
the CP group (``torch.distributed.all_gather`` of the detached shard), and the gradient reaches
only this rank's local shard; no collective runs in backward. ``cp == 1`` issues no collective.
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import fields, is_dataclass

import torch

from .._library import call_op
from .._thd import postprocess_thd, preprocess_thd
from .._validate import cache_version, check_jagged, check_plain, host_values_required, is_meta
from ..layout import CP_LAYOUTS, ThdLayout, _to_device
from ..layout import _rules as _layout_rules
from ._common import LAYOUT_ATTR, _bool_mask, _megatron, _mpu, _verl_rule, remember_host_offsets

# install() / uninstall() and their registry live in verl_ops.integrations.install; re-exported
# here, where verl_ops has always offered them.
from .install import (  # noqa: F401
    _ORIGINALS, _OWNERS, _UTIL_MODULE, _accepts, _all_drop_ins, install, last_report, uninstall,
)

__all__ = [
    "LAYOUT_ATTR",
    "install",
    "postprocess_packed_seqs",
    "postprocess_thd_engine",
    "preprocess_packed_seqs",
    "preprocess_thd_engine",
    "uninstall",
]

# --------------------------------------------------------------------------------------------
# PackedSeqParams.


def _packed_seq_params_cls():
    return _megatron("megatron.core.packed_seq_params", "PackedSeqParams", "verl_ops.integrations.verl")


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


def _make_packed_seq_params(layout: ThdLayout, extra: dict, cls=None):
    cls = _packed_seq_params_cls() if cls is None else cls
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


def _cp_partition_args(cp_layout: str, cp_size: int, cls=None) -> dict:
    if _supports_field(_packed_seq_params_cls() if cls is None else cls, "cp_partition_mode"):
        return {"cp_partition_mode": cp_layout}
    if cp_layout != "zigzag" and cp_size > 1:
        raise ValueError(
            f"cp_layout={cp_layout!r} requires PackedSeqParams.cp_partition_mode, which this "
            "Megatron-core version does not provide. Upgrade Megatron-core or use the zigzag layout."
        )
    return {}


def _check_cp_layout(op: str, cp_layout) -> None:
    # verl's exception and message, word for word (its tests match the text).
    if cp_layout not in CP_LAYOUTS:
        # verl's exception and text, word for word: a drop-in raises what verl raises (verl's own
        # tests match this exact message), the one place where the message does not start with the op.
        raise ValueError(f"Unsupported context parallel layout: {cp_layout}")


def _host_mask(op: str, mask: torch.Tensor) -> torch.Tensor:
    """The mask whose row counts build a layout: its values are needed (not on meta)."""
    if is_meta(mask):
        raise host_values_required(
            op, "attention_mask", "lengths",
            "pass the mask on the CPU or a GPU (a layout is built from its row counts)",
        )
    return mask


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

# Attribute of a nested tensor's offsets tensor: (its version, {rules: weakref to the layout built
# from it}). The calls of one micro-batch on nested tensors that share the offsets (input ids, the
# rolled labels and loss mask, the postprocess of the output) then read the offsets on the host once.
_LAYOUTS_ATTR = "_verl_ops_layouts"


def _layout_of_offsets(offsets: torch.Tensor, rules: dict) -> ThdLayout:
    """The layout of checked nested offsets under ``rules``: the one built earlier from this very
    offsets tensor (unchanged since) while that layout is alive, else a new one (one host read)."""
    key = tuple(rules.values())
    version = cache_version(offsets)
    cache = getattr(offsets, _LAYOUTS_ATTR, None) if version is not None else None
    if cache is not None and cache[0] == version:
        ref = cache[1].get(key)
        layout = ref() if ref is not None else None
        if layout is not None:
            return layout
    else:
        cache = None
    layout = ThdLayout._from_checked_offsets(offsets, None, rules)
    remember_host_offsets(layout)
    # (a weak reference: the layout holds the offsets, which would otherwise hold it in a cycle;
    # the caller keeps it alive through the PackedSeqParams it returns)
    refs = {} if cache is None else {k: r for k, r in cache[1].items() if r() is not None}
    refs[key] = weakref.ref(layout)
    if version is not None:  # (an inference tensor: nothing remembered on it, built per call)
        try:
            setattr(offsets, _LAYOUTS_ATTR, (version, refs))
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: built per call
            pass
    return layout


def _built_from(layout: ThdLayout, offsets: torch.Tensor) -> bool:
    """Whether ``layout`` was built from this very offsets tensor, unchanged since: then its host
    offsets are the offsets' values, known without reading the device."""
    if layout.source_offsets is not offsets:
        return False
    cache = getattr(offsets, _LAYOUTS_ATTR, None)
    if cache is None or cache[0] != cache_version(offsets):
        return False
    return any(r() is layout for r in cache[1].values())


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
    check_plain(op, "input_ids", input_ids)
    mpu = _mpu()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    cp_size = mpu.get_context_parallel_world_size()
    cp_rank = mpu.get_context_parallel_rank()
    mask = _host_mask(op, _bool_mask(op, attention_mask))
    layout = ThdLayout.from_lengths(
        mask.sum(dim=-1),
        tp_size=tp_size,
        cp_size=cp_size,
        cp_layout="zigzag",
        fp8_padding=bool(use_fp8_padding),
        device=input_ids.device,
    )
    remember_host_offsets(layout)
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
    check_plain(op, "output", output)
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
            _host_mask(op, mask).sum(dim=-1),
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


# --------------------------------------------------------------------------------------------
# verl 0.9.1 and verl main differ in one place of preprocess_thd_engine: with need_roll, zigzag and
# cp > 1, verl 0.9.1 zero-pads each sequence to its padded length before cutting its second chunk,
# verl main only to the alignment (max(len, align)). Valid rows are the same; main's rule moves the
# sequence's wrapped token 0 to the row after its last valid row on a rank whose second chunk
# ends in padding, and that chunk's last row then takes the rolled value of the next local row
# (the next sequence's first row, or the buffer's first row). The kernel implements 0.9.1's rule;
# under main's rule the drop-in rewrites those rows (at most two per sequence) with one indexed copy.

#: Which verl's zigzag roll rule preprocess_thd_engine follows: ``"0.9.1"``, ``"main"``, or None
#: (default) for the rule of the verl that is in use, read from its ``verl/models/mcore/util.py``.
ZIGZAG_ROLL_RULE: str | None = None
_PAD_TO_PADDED = re.compile(r"max\(\s*align_size\s*,\s*seqlen_padded_i\s*\)")


def zigzag_roll_rule() -> str:
    """``"0.9.1"`` or ``"main"``: the zigzag roll rule of the verl in use (see ZIGZAG_ROLL_RULE).
    Read from verl's source (whether its preprocess_thd_engine pads a sequence to its padded
    length); ``"0.9.1"`` when no verl is found."""
    return _verl_rule("ZIGZAG_ROLL_RULE", ZIGZAG_ROLL_RULE, "preprocess_thd_engine",
                      lambda body: not _PAD_TO_PADDED.search(body))


def _main_roll_rows(layout: ThdLayout, cp_rank: int):
    """Rows where verl main's rolled zigzag pack (cp > 1) differs from 0.9.1's, as three lists:
    local row, source token (global index into the valid rows, -1 for zero), position id."""
    cp, align = layout.cp_size, layout.align
    lens = layout.lengths
    cu = layout.cu_seqlens_cpu.tolist()
    cup = layout.cu_seqlens_padded_cpu.tolist()
    B = len(lens)
    padded = [cup[i + 1] - cup[i] for i in range(B)]
    r = cp_rank
    rows, src, pos = [], [], []

    def first_row_value(k):  # unrolled value and position of sequence k's first local row
        p = (padded[k] // (2 * cp)) * r
        return (cu[k] + p if p < lens[k] else -1), p

    for i in range(B):
        n, P = lens[i], padded[i]
        if P == 0:
            continue
        c = P // (2 * cp)
        base = cup[i] // cp
        D = max(n, align)
        end = min(P - c * r, D)
        L = end - (P - c * (r + 1))
        token0 = cu[i] if n > 0 else -1
        if 0 < L < c:
            rows.append(base + c + L - 1), src.append(token0), pos.append(0)
        last = base + 2 * c - 1
        if i + 1 < B and padded[i + 1] == 0:
            continue  # the next, empty, sequence zeroes this row under both rules
        if L < c:
            # the next local row: the next sequence's first (not empty: see above), or the
            # buffer's first row after the last sequence
            if i + 1 < B:
                k = i + 1
            elif padded[0] == 0:
                # an empty first sequence zeroes the buffer's last row after the roll (0.9.1 then
                # writes token 0 there; main does not), keeping its unrolled position id
                p = P - c * r - 1
                rows.append(last), src.append(-1), pos.append(p if p < n else 0)
                continue
            else:
                k = 0
            t, p = first_row_value(k)
            rows.append(last), src.append(t), pos.append(p)
        elif r > 0 and D == P - c * r:
            rows.append(last), src.append(token0), pos.append(0)
    return rows, src, pos


def _apply_main_roll(packed, position_ids, values, layout, cp_rank):
    rows, src, pos = _main_roll_rows(layout, cp_rank)
    if not rows:
        return packed, position_ids
    idx = _to_device(torch.tensor([rows, src, pos], dtype=torch.int64), packed.device)
    take = values.index_select(0, idx[1].clamp(min=0))
    keep = (idx[1] >= 0).view(-1, *([1] * (values.dim() - 1)))
    packed = packed.index_put((idx[0],), take.masked_fill(~keep, 0))
    position_ids = position_ids.index_put((idx[0],), idx[2])
    return packed, position_ids


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
        need_roll: next-token targets (labels): verl's rolled values and rolled position ids,
            row for row (docs/layout.md#roll).
        use_fp8_padding: FP8 alignment rules (docs/layout.md#fp8-padding).
        local_cp_size: dynamic CP: CP size of this micro-batch; the group comes from
            ``mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)`` and is
            stored in ``packed_seq_params.cp_group`` (with ``local_cp_size``).
        min_local_rows, pad_to_length_bucket: extra padding of the last sequence (docs/layout.md#rules).
        cp_layout: ``"zigzag"`` (default) or ``"contiguous"``; recorded as
            ``packed_seq_params.cp_partition_mode`` when megatron-core has that field (a
            contiguous layout with cp > 1 needs it).

    Returns:
        ``(packed [1, local_rows, *F], packed_seq_params, position_ids int64 [1, local_rows])``.
    """
    op = "preprocess_thd_engine"
    _check_cp_layout(op, cp_layout)
    check_jagged(op, "input_ids", input_ids)
    offsets = input_ids.offsets()
    if is_meta(offsets):
        raise host_values_required(
            op, "input_ids", "offsets", "pass a nested tensor whose offsets live on the CPU or a GPU"
        )
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
    if pad_to_length_bucket is not None and pad_to_length_bucket <= 0:
        # verl's check and words, before its cp_partition_mode one
        raise ValueError("pad_to_length_bucket must be a positive integer")
    psp_cls = _packed_seq_params_cls()
    extra.update(_cp_partition_args(cp_layout, cp_size, psp_cls))
    # One host read of the offsets per offsets tensor (the micro-batch's later calls on nested
    # tensors with the same offsets reuse the layout); the layout op checks them and computes every
    # size at once. (input_ids and its offsets were checked above: ThdLayout.from_nested without
    # its checks.)
    layout = _layout_of_offsets(
        offsets, _layout_rules("ThdLayout.from_lengths", tp_size, cp_size, cp_layout, bool(use_fp8_padding),
                               min_local_rows, pad_to_length_bucket)
    )
    packed_seq_params = _make_packed_seq_params(layout, extra, psp_cls)
    if not pre_process:
        return input_ids, packed_seq_params, None
    # The layout was built from these very offsets (checked above, no holes): pack the values
    # buffer directly, without a second look at the nested tensor.
    # (values() keeps the autograd link to the nested tensor; its buffer alone is cheaper when
    # nothing needs a gradient.)
    with torch._C.DisableTorchFunctionSubclass():  # (the nested class's dispatch costs ~30 µs here)
        needs_grad = input_ids.requires_grad
    values = input_ids.values() if needs_grad else input_ids._values
    # (the layout lives where the offsets do, which is where the values are, and the values are
    # [total_tokens, *F] by construction: the op directly, without preprocess_thd's argument checks;
    # the op itself checks cp_rank)
    packed, position_ids = call_op(
        torch.ops.verl_ops.preprocess_thd, values, values, layout.cu_seqlens, layout.cu_seqlens_padded,
        layout.local_rows, cp_size, cp_rank, layout.cp_layout_code, bool(need_roll), None,
    )
    if need_roll and cp_size > 1 and cp_layout == "zigzag" and zigzag_roll_rule() == "main":
        packed, position_ids = _apply_main_roll(packed, position_ids, values, layout, cp_rank)
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
    check_plain(op, "output", output)
    check_jagged(op, "input_ids", input_ids)
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
    layout = _attached_layout(op, packed_seq_params, cp_size, cp_layout)
    offsets = input_ids.offsets()
    if is_meta(offsets):
        # Shape inference: the attached layout decides the shapes; without one, there are no lengths.
        if layout is None:
            raise host_values_required(
                op, "input_ids", "offsets", "pass the packed_seq_params of the preprocess call (with its layout)"
            )
    elif layout is None or not _built_from(layout, offsets):
        # Offsets the layout was not built from (or changed since): read, and checked against it.
        # (the preprocess call's own input needs neither: its layout's host offsets are its values)
        offsets_cpu = offsets.detach().to("cpu", torch.int64)
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
# This module's drop-ins by their names in verl (verl_ops.integrations.install swaps them in).

_DROP_INS = {
    "preprocess_packed_seqs": preprocess_packed_seqs,
    "postprocess_packed_seqs": postprocess_packed_seqs,
    "preprocess_thd_engine": preprocess_thd_engine,
    "postprocess_thd_engine": postprocess_thd_engine,
}
