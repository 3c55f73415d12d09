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
import os
import re
import sys
import warnings
from dataclasses import fields, is_dataclass

import torch

from .._library import call_op
from .._thd import postprocess_thd, preprocess_thd
from .._validate import check_jagged, check_plain, host_values_required, is_meta
from ..layout import CP_LAYOUTS, ThdLayout, _to_device
from ..layout import _rules as _layout_rules

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
    core = sys.modules.get("megatron.core")  # (already imported: skip the import statement's ~7 µs)
    ps = getattr(core, "parallel_state", None) if core is not None else None
    if ps is not None:
        return ps
    try:
        from megatron.core import parallel_state
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            "verl_ops.integrations needs megatron-core (megatron.core.parallel_state); "
            "install it with `pip install megatron-core`"
        ) from e
    return parallel_state


def _packed_seq_params_cls():
    cls = getattr(sys.modules.get("megatron.core.packed_seq_params"), "PackedSeqParams", None)
    if cls is not None:
        return cls
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


def _bool_mask(op: str, attention_mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """A [B, S] mask as bool (0/1 integers accepted, as verl's masks)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_nested:
        raise ValueError(f"{op}: {name} must be a [B, S] tensor, got a nested tensor")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = (
            tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        )
        raise ValueError(f"{op}: {name} must be a [B, S] tensor, got {shape}")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


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
_UTIL_TEXT_BY_FILE: dict[str, str] = {}  # verl util.py path -> its text, read once
_PAD_TO_PADDED = re.compile(r"max\(\s*align_size\s*,\s*seqlen_padded_i\s*\)")


def _verl_util_file() -> str | None:
    mod = sys.modules.get("verl.models.mcore.util")
    path = getattr(mod, "__file__", None)
    if path:
        return path
    verl = sys.modules.get("verl")
    roots = list(getattr(verl, "__path__", None) or [])
    if not roots:
        try:
            import importlib.util

            spec = importlib.util.find_spec("verl")  # finds the package without importing it
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "models", "mcore", "util.py")
        if os.path.isfile(path):
            return path
    return None


def zigzag_roll_rule() -> str:
    """``"0.9.1"`` or ``"main"``: the zigzag roll rule of the verl in use (see ZIGZAG_ROLL_RULE).
    Read from verl's source (whether its preprocess_thd_engine pads a sequence to its padded
    length); ``"0.9.1"`` when no verl is found."""
    return _verl_rule("ZIGZAG_ROLL_RULE", ZIGZAG_ROLL_RULE, "preprocess_thd_engine",
                      lambda body: not _PAD_TO_PADDED.search(body))


def _verl_rule(override_name: str, override: str | None, function: str, is_main) -> str:
    """``"0.9.1"`` or ``"main"``: ``override`` (the module setting named ``override_name``) when set,
    else ``"main"`` where the in-use verl's util.py has ``function`` and ``is_main(its source)``,
    ``"0.9.1"`` otherwise (also when no verl is found)."""
    if override is not None:
        if override not in ("0.9.1", "main"):
            raise ValueError(f"{override_name} must be '0.9.1', 'main' or None, got {override!r}")
        return override
    body = _verl_util_function(function)
    return "main" if body and is_main(body) else "0.9.1"


def _verl_util_function(name: str) -> str:
    """The source of function `name` in the in-use verl's ``verl/models/mcore/util.py`` (up to the
    next top-level ``def``), or "" where there is no verl, no such file or no such function."""
    path = _verl_util_file()
    if path is None:
        return ""
    text = _UTIL_TEXT_BY_FILE.get(path)
    if text is None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""
        _UTIL_TEXT_BY_FILE[path] = text
    start = text.find(f"def {name}(")
    if start < 0:
        return ""
    end = text.find("\ndef ", start + 1)
    return text[start:] if end < 0 else text[start:end]


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
    # One host read of the offsets; the layout op checks them and computes every size at once.
    # (input_ids and its offsets were checked above: ThdLayout.from_nested without its checks.)
    layout = ThdLayout._from_checked_offsets(
        offsets, None, _layout_rules("ThdLayout.from_lengths", tp_size, cp_size, cp_layout, bool(use_fp8_padding),
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
    else:
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
# Patching verl.

_DROP_INS = {
    "preprocess_packed_seqs": preprocess_packed_seqs,
    "postprocess_packed_seqs": postprocess_packed_seqs,
    "preprocess_thd_engine": preprocess_thd_engine,
    "postprocess_thd_engine": postprocess_thd_engine,
}
_UTIL_MODULE = "verl.models.mcore.util"
# Module that owns each drop-in in verl (the one install() patches first); default _UTIL_MODULE.
_OWNERS: dict[str, str] = {
    "_local_padding_mask": "verl.utils.dynamic_cp_scheduler",
    "build_r3_replay_mask": "verl.utils.megatron.router_replay_utils",
    "align_r3_router_replay_data": "verl.utils.megatron.router_replay_utils",
    "pp_gather": "verl.utils.megatron.router_replay_utils",
    "reorder_and_merge_vpp_layers": "verl.utils.megatron.router_replay_utils",
    "merge_nested_router_maps": "verl.utils.megatron.router_replay_utils",
    "DynamicCPScheduler": "verl.utils.dynamic_cp_scheduler",
    "postprocess_dynamic_cp_batch": "verl.utils.dynamic_cp_scheduler",
}
# (module name, attribute) -> verl's original function, for uninstall().
_ORIGINALS: dict[tuple[str, str], object] = {}
#: What the last :func:`install` did: ``{"patched": [...], "missing": [...], "incompatible": [...]}``.
last_report: dict[str, list[str]] = {"patched": [], "missing": [], "incompatible": []}


def _all_drop_ins() -> dict:
    """The THD drop-ins above, the BSHD / dict-output / VLM-mask ones (verl_bshd), the R3 /
    router padding-mask ones (verl_r3), the pipeline-parallel router-map ones (verl_pp) and the
    dynamic CP scheduler class and output collection (verl_dcp)."""
    from . import verl_bshd, verl_dcp, verl_pp, verl_r3

    out = dict(_DROP_INS)
    out.update({name: getattr(verl_bshd, name) for name in verl_bshd.__all__})
    out.update({
        "_local_padding_mask": verl_r3.local_padding_mask,
        "build_r3_replay_mask": verl_r3.build_r3_replay_mask,
        "align_r3_router_replay_data": verl_r3.align_r3_router_replay_data,
    })
    out.update({name: getattr(verl_pp, name) for name in verl_pp.__all__})
    out["DynamicCPScheduler"] = verl_dcp.DynamicCPScheduler
    out["postprocess_dynamic_cp_batch"] = verl_dcp.postprocess_dynamic_cp_batch
    return out


def _accepts(ours, theirs) -> bool:
    """verl's parameters are a prefix of ours, in order (every verl call site still binds the same)."""
    try:
        mine = list(inspect.signature(ours).parameters)
        other = list(inspect.signature(theirs).parameters)
    except (TypeError, ValueError):
        return False
    return mine[: len(other)] == other


def install(*, strict: bool = False, report: bool = False):
    """Swap the drop-ins into verl.

    Replaces the THD functions (``preprocess_packed_seqs``, ``postprocess_packed_seqs``,
    ``preprocess_thd_engine``, ``postprocess_thd_engine``) and the BSHD / dict-output / VLM-mask
    ones of :mod:`verl_ops.integrations.verl_bshd` (``preprocess_bshd_engine``,
    ``postprocess_bshd_engine``, ``preprocess_bshd``, ``postprocess_bshd``,
    ``postprocess_packed_seqs_for_dict_output``, ``build_vlm_attn_mask_thd``,
    ``build_vlm_attn_mask_bshd``) and the R3 / router padding-mask ones of
    :mod:`verl_ops.integrations.verl_r3` (``_local_padding_mask`` in
    ``verl.utils.dynamic_cp_scheduler``; ``build_r3_replay_mask``, ``align_r3_router_replay_data`` in
    ``verl.utils.megatron.router_replay_utils``), the pipeline-parallel router-map ones of
    :mod:`verl_ops.integrations.verl_pp` and the dynamic CP ones of
    :mod:`verl_ops.integrations.verl_dcp` (``DynamicCPScheduler``, ``postprocess_dynamic_cp_batch``)
    in the verl module that owns them (``verl.models.mcore.util`` unless named)
    and in every already-imported ``verl.*`` module that imported them by name (e.g.
    ``verl.models.mcore.model_forward``); modules imported later pick the drop-ins up from the
    owner. A function this verl does not have is reported as missing; one whose verl parameters
    are not a prefix of ours (a newer/forked verl with parameters the drop-in lacks) is left
    alone, reported as incompatible, with a warning.

    Returns the patched names as ``"module.attribute"`` (newly patched by this call), or with
    ``report=True`` the dict ``{"patched": [...], "missing": [...], "incompatible": [...]}`` (also
    kept in :data:`last_report`). When verl (or megatron-core, which verl's module imports) is not
    importable, nothing is patched — or ``ImportError`` is raised if ``strict=True``. Undo with
    :func:`uninstall`.
    """
    import importlib

    drop_ins = _all_drop_ins()
    result = {"patched": [], "missing": [], "incompatible": []}
    originals = {}
    for name, ours in drop_ins.items():
        owner = _OWNERS.get(name, _UTIL_MODULE)
        try:
            mod = importlib.import_module(owner)
        except Exception:  # noqa: BLE001  (ImportError, or any error raised while verl's module imports)
            if strict:
                raise
            result["missing"].append(f"{owner}.{name}")
            continue
        current = getattr(mod, name, None)
        if current is None:
            result["missing"].append(f"{owner}.{name}")
            continue
        theirs = _ORIGINALS.get((owner, name), current)
        if theirs is ours:
            continue
        if not _accepts(ours, theirs):
            warnings.warn(
                f"verl_ops.integrations.verl.install: {owner}.{name} has parameters the drop-in "
                f"does not support ({inspect.signature(theirs)}); leaving verl's version in place",
                stacklevel=2,
            )
            result["incompatible"].append(f"{owner}.{name}")
            continue
        originals[name] = theirs
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for name, theirs in originals.items():
            if getattr(mod, name, None) is theirs:
                _ORIGINALS.setdefault((mod_name, name), theirs)
                setattr(mod, name, drop_ins[name])
                result["patched"].append(f"{mod_name}.{name}")
    result = {k: sorted(v) for k, v in result.items()}
    last_report.clear()
    last_report.update(result)
    return result if report else result["patched"]


def uninstall() -> list[str]:
    """Undo :func:`install`: put verl's original functions back. Returns the restored names."""
    restored = []
    for (mod_name, name), theirs in list(_ORIGINALS.items()):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, name, None) is _all_drop_ins()[name]:
            setattr(mod, name, theirs)
            restored.append(f"{mod_name}.{name}")
        del _ORIGINALS[(mod_name, name)]
    return sorted(restored)
