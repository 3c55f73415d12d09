"""Megatron-Core MLA on verl_ops' attention kernels, with the value head dim kept native.

MLA's query/key head dim (192) differs from its value head dim (128). verl patches
``MultiLatentAttention.forward`` so that, for packed (THD) batches, V is zero-padded to 192,
attention runs, and the output is trimmed back; megatron-core >= 0.18 does the same pad itself
(``_prepare_mla_core_attention_value``); 0.16.2-0.17.x do neither. Without TransformerEngine,
Megatron's ``DotProductAttention`` does not take THD batches at all.

Two ways in (docs/megatron.md):

- :class:`MLACoreAttention` — a core-attention module for Megatron's layer specs (THD, BSHD,
  context parallel incl. dynamic CP), put in place by :func:`install` (``install(spec)``), which also
  makes MultiLatentAttention hand it the native V where it would pad it, and fixes what breaks
  megatron-core without TransformerEngine (:mod:`verl_ops.integrations.megatron_compat`).
- :func:`apply_patch` — for specs that keep their own core attention (TransformerEngine's): routes
  THD calls that :func:`use_mla_thd_path` accepts to :func:`mla_thd_core_attention`, and everything
  else to the spec's attention with verl's padding of V. Applies on every megatron-core version
  (decided by the feature, :func:`mla_pads_value_itself`, not by the version number).
"""

from __future__ import annotations

import inspect
import math
import os
import threading
import warnings

import torch

from .._validate import cache_version

_PATCHED_ATTR = "_verl_ops_mla_patched"
# A core attention with this attribute True takes V with its native head dim (no pad to Dqk).
NATIVE_VALUE_ATTR = "takes_native_mla_value"
_FIXED_UPSTREAM = (0, 16, 2)


def _version_tuple(v: str) -> tuple:
    out = []
    for part in str(v).split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):  # "2rc0": stop after the numeric prefix
            break
    return tuple(out + [0] * (3 - len(out)))


def needs_forward_patch(megatron_core_version: str) -> bool:
    """True for Megatron-Core versions whose MLA forward does not handle Dv != Dqk on THD."""
    return _version_tuple(megatron_core_version) < _FIXED_UPSTREAM


def is_dsa(config) -> bool:
    return getattr(config, "experimental_attention_variant", None) == "dsa"


def _is_causal(attn_mask_type) -> bool:
    name = getattr(attn_mask_type, "name", None) or str(attn_mask_type)
    return "causal" in name


def _cp_size() -> int:
    try:
        from megatron.core import parallel_state

        return int(parallel_state.get_context_parallel_world_size())
    except Exception:  # not initialised (single process): no context parallelism
        return 1


def use_mla_thd_path(config, packed_seq_params, query, value, attn_mask_type, *, training=False) -> bool:
    """Whether this core-attention call can go to :func:`mla_thd_core_attention`.

    Requires: THD packing; not the DSA variant; one CP rank (the op sees whole sequences);
    a causal mask (verl packs sequences with their padding at the end, so with a causal mask the
    padding rows never reach a valid token); no attention dropout while training; row offsets
    that are the attention offsets (``cu_seqlens_q_padded`` absent or the same tensor);
    q/k/v as ``[t, n, d]``.
    """
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return False
    if is_dsa(config) or getattr(config, "experimental_attention_variant", None) is not None:
        return False
    if query.dim() != 3 or value is None or value.dim() != 3:
        return False
    if not _is_causal(attn_mask_type):
        return False
    if training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0:
        return False
    for side in ("q", "kv"):
        padded = getattr(packed_seq_params, f"cu_seqlens_{side}_padded", None)
        if padded is not None and padded is not getattr(packed_seq_params, f"cu_seqlens_{side}"):
            return False
    return _cp_size() == 1


def mla_thd_core_attention(query, key, value, packed_seq_params, *, softmax_scale=None, backend="auto"):
    """Causal THD attention of ``query/key [t, n, Dqk]`` and ``value [t, n, Dv]``; returns
    ``[t, n * Dv]`` (TransformerEngine's THD output shape, which Megatron reshapes to
    ``[t, 1, n * Dv]``)."""
    from .._mla import mla_forward_padded

    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    out = mla_forward_padded(
        query,
        key,
        value,
        packed_seq_params.cu_seqlens_q,
        packed_seq_params.cu_seqlens_kv,
        packed_seq_params.max_seqlen_q,
        packed_seq_params.max_seqlen_kv,
        causal=True,
        softmax_scale=softmax_scale,
        backend=backend,
        validate=False,
    )
    return out.reshape(out.shape[0], -1)


def _megatron_core_attention(original, config, query, key, value, *args, packed_seq_params=None, **kwargs):
    """Megatron's own core attention for the cases the op does not take (context parallel,
    dropout, other variants ...), with verl's padding: on the THD path V is zero-padded to the
    query head dim and the output trimmed back, except for the DSA variant, which gets V as is."""
    thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
    if not thd or is_dsa(config) or value is None or value.dim() != 3 or query.dim() != 3:
        return original(query, key, value, *args, packed_seq_params=packed_seq_params, **kwargs)
    dqk, dv = query.shape[-1], value.shape[-1]
    if dv >= dqk:
        return original(query, key, value, *args, packed_seq_params=packed_seq_params, **kwargs)
    # TransformerEngine's attention reads the value head dim from this attribute (megatron-core
    # >= 0.18 sets it the same way around its own pad).
    core = getattr(original, "__self__", None)
    saved = getattr(core, "hidden_size_per_attention_head_v", None)
    if saved is not None:
        core.hidden_size_per_attention_head_v = dqk
    try:
        out = original(
            query, key, torch.nn.functional.pad(value, (0, dqk - dv)), *args,
            packed_seq_params=packed_seq_params, **kwargs,
        )
    finally:
        if saved is not None:
            core.hidden_size_per_attention_head_v = saved
    t, n = value.shape[0], value.shape[1]
    return out.reshape(t, n, dqk)[..., :dv].reshape(*out.shape[:-1], n * dv)


def _wrap_core_attention(mla_module, backend: str) -> None:
    core = mla_module.core_attention
    if getattr(core, _PATCHED_ATTR, False):
        return
    original = core.forward

    def forward(query, key, value, attention_mask, *args, packed_seq_params=None, attn_mask_type=None, **kwargs):
        mask_type = attn_mask_type if attn_mask_type is not None else getattr(core, "attn_mask_type", None)
        if use_mla_thd_path(
            mla_module.config, packed_seq_params, query, value, mask_type, training=mla_module.training
        ):
            return mla_thd_core_attention(
                query, key, value, packed_seq_params, softmax_scale=getattr(core, "softmax_scale", None), backend=backend
            )
        return _megatron_core_attention(
            original, mla_module.config, query, key, value, attention_mask, *args,
            packed_seq_params=packed_seq_params, attn_mask_type=attn_mask_type, **kwargs,
        )

    core.forward = forward
    setattr(core, _PATCHED_ATTR, True)
    setattr(core, NATIVE_VALUE_ATTR, True)  # pads V itself where it hands a call back


def mla_pads_value_itself(mla_module=None) -> bool:
    """Whether this megatron-core's ``MultiLatentAttention`` zero-pads V to the query head dim
    itself on the THD path (module functions ``_prepare_mla_core_attention_value`` /
    ``_trim_mla_core_attention_output``, megatron-core >= 0.18). Decided by the feature, not the
    version: 0.16.2-0.17.x have neither that pad nor a fix of their own."""
    if mla_module is None:
        from megatron.core.transformer import multi_latent_attention as mla_module
    return hasattr(mla_module, "_prepare_mla_core_attention_value")


def _takes_native_value(core_attention) -> bool:
    return bool(getattr(core_attention, NATIVE_VALUE_ATTR, False))


def _install_value_pad_bypass(mla_module) -> bool:
    """Where MultiLatentAttention pads V itself, hand core attentions that take the native V
    (:class:`MLACoreAttention`, or one wrapped by :func:`apply_patch`) V as it is: no pad before,
    no trim after. Every other core attention keeps Megatron's pad."""
    if not mla_pads_value_itself(mla_module):
        return False
    original = mla_module._prepare_mla_core_attention_value
    if getattr(original, _PATCHED_ATTR, False):
        return True

    def prepare(parallel_attention, query, value, packed_seq_params):
        if value is not None and _takes_native_value(getattr(parallel_attention, "core_attention", None)):
            dv = value.shape[-1]
            return value, False, dv, dv
        return original(parallel_attention, query, value, packed_seq_params)

    setattr(prepare, _PATCHED_ATTR, True)
    prepare.__wrapped__ = original
    mla_module._prepare_mla_core_attention_value = prepare
    return True


def apply_patch(backend: str = "auto") -> bool:
    """Route THD MLA core attention of every ``MultiLatentAttention`` to ``mla_forward_padded``,
    for users who keep their spec's core attention (TransformerEngine's, say).

    Applies on every megatron-core: where MultiLatentAttention pads V itself (>= 0.18, see
    :func:`mla_pads_value_itself`) the pad is skipped for the wrapped core attention, which pads
    V itself where it hands a call back to Megatron's attention. Returns True once installed.
    Idempotent. The DSA variant and every case that :func:`use_mla_thd_path` rejects keep
    Megatron's own core attention.
    """
    from megatron.core.transformer import multi_latent_attention as mla_module

    MultiLatentAttention = mla_module.MultiLatentAttention
    _install_value_pad_bypass(mla_module)
    if getattr(MultiLatentAttention, _PATCHED_ATTR, False):
        return True
    original_forward = MultiLatentAttention.forward

    def forward(self, *args, **kwargs):
        _wrap_core_attention(self, backend)
        return original_forward(self, *args, **kwargs)

    MultiLatentAttention.forward = forward
    MultiLatentAttention._verl_ops_original_forward = original_forward
    setattr(MultiLatentAttention, _PATCHED_ATTR, True)
    return True


# --------------------------------------------------------------------------------------------
# A core-attention module for Megatron's layer specs
# --------------------------------------------------------------------------------------------


def _cp_group_of(packed_seq_params, pg_collection):
    """The CP group of this call: dynamic CP's per-micro-batch group (``packed_seq_params.cp_group``
    with ``local_cp_size``) first, then the module's ``pg_collection.cp``, then Megatron's global
    CP group; ``None`` without CP."""
    local = getattr(packed_seq_params, "local_cp_size", None) if packed_seq_params is not None else None
    group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
    if local is not None and int(local) <= 1:
        return None
    if group is not None:
        return group
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        try:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group(check_initialized=False)
        except Exception:  # noqa: BLE001  (not initialised, single process: no context parallelism)
            group = None
    return group


def _unsupported_config(config) -> str | None:
    """What of ``config`` :class:`MLACoreAttention` cannot build with (``"config.<field>=<value>"``),
    or None. The constructor refuses these; :func:`place_in_spec` keeps Megatron's attention for them."""
    for name, ok in (
        ("softmax_type", getattr(config, "softmax_type", "vanilla") in (None, "vanilla")),
        ("window_size", getattr(config, "window_size", None) is None),
        ("qk_clip", not getattr(config, "qk_clip", False)),
    ):
        if not ok:
            return f"config.{name}={getattr(config, name)!r}"
    return None


def unsupported_reason(config, attn_mask_type=None) -> str | None:
    """Why an MLA layer built from ``config`` (with the self-attention spec's ``attn_mask_type``,
    where known) should keep its own core attention, or None where :class:`MLACoreAttention` runs
    it as the spec's attention would. Besides what the constructor refuses: an experimental
    attention variant (DSA: its core attention takes extra inputs), attention dropout (verl trains
    MLA without it; the module refuses it while training), FP8 attention (TransformerEngine's FP8
    dot-product attention), masks other than causal."""
    reason = _unsupported_config(config)
    if reason is not None:
        return reason
    variant = getattr(config, "experimental_attention_variant", None)
    if variant is not None:
        return f"config.experimental_attention_variant={variant!r}"
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0.0:
        return f"config.attention_dropout={dropout!r}"
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(config, name, False):
            return f"config.{name}=True"
    if attn_mask_type is not None and not _is_causal(attn_mask_type):
        return f"attn_mask_type={getattr(attn_mask_type, 'name', attn_mask_type)}"
    return None


class MLACoreAttention(torch.nn.Module):
    """Causal MLA core attention for Megatron-Core layer specs, with the value head dim kept
    native (192 / 128: no pad of V, no trim of the output).

    A drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` in the ``core_attention``
    slot of ``MLASelfAttentionSubmodules`` (put it there with :func:`install`), with their
    constructor as MultiLatentAttention calls it and their forward:

    - THD (``packed_seq_params.qkv_format == "thd"``): q, k ``[t, n, Dqk]``, v ``[t, n, Dv]`` ->
      ``[t, n * Dv]``. Sequences are the padded offsets (``cu_seqlens_q_padded`` where given, else
      ``cu_seqlens_q``); verl and Megatron put a sequence's padding after its tokens, so under the
      causal mask the real tokens' outputs and gradients are exactly those of attention over the
      real lengths (padding rows attend too, and are never read by a real token).
    - BSHD / SBHD (no packed params): ``[s, b, n, d]`` -> ``[s, b, n * Dv]``.
    - Context parallel (the CP group has > 1 rank; dynamic CP's ``packed_seq_params.cp_group``
      and ``local_cp_size`` per micro-batch): :func:`verl_ops.mla_cp_attention` with the layer's
      ``cp_comm_type`` (``"p2p"``: the ring; ``"all_gather"``), ``cp_layout`` zigzag (Megatron's) or
      contiguous (all-gather).

    Not supported (a clear error, never a silent difference): masks other than causal, attention
    dropout while training (verl trains MLA with ``attention_dropout=0``), softmax variants other
    than vanilla, sliding windows, QK-clip's logit tracking.
    """

    takes_native_mla_value = True

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        cp_layout: str = "zigzag",
        backend: str = "auto",
    ):
        super().__init__()
        self.config = config
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.attention_dropout_p = float(
            getattr(config, "attention_dropout", 0.0) if attention_dropout is None else attention_dropout
        ) or 0.0
        self.k_channels = k_channels if k_channels is not None else getattr(config, "kv_channels", None)
        self.v_channels = v_channels if v_channels is not None else self.k_channels
        self.hidden_size_per_attention_head_v = self.v_channels
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type
        self.pg_collection = pg_collection
        if cp_layout not in ("zigzag", "contiguous"):
            raise ValueError(
                f"MLACoreAttention: cp_layout must be 'zigzag' or 'contiguous', got {cp_layout!r}"
            )
        self.cp_layout = cp_layout
        self.backend = backend
        self.current_max_attn_logits = None
        reason = _unsupported_config(config)
        if reason is not None:
            raise NotImplementedError(
                f"MLACoreAttention: {reason} is not supported "
                "(vanilla softmax, no window, no QK-clip); keep Megatron's core attention for it"
            )

    def _check(self, attn_mask_type):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if not _is_causal(mask_type):
            raise NotImplementedError(
                f"MLACoreAttention: only causal attention is supported, got attn_mask_type={mask_type}"
            )
        if self.training and self.attention_dropout_p > 0.0:
            raise NotImplementedError(
                f"MLACoreAttention: attention dropout ({self.attention_dropout_p}) is not supported while "
                "training; set config.attention_dropout = 0.0 (verl's MLA setting)"
            )

    def _comm(self, cp_layout: str) -> str:
        """Megatron's ``cp_comm_type`` for this layer: ``"p2p"`` (its default) runs the ring on the
        zigzag layout; ``"all_gather"``, the contiguous layout and every other type (``"a2a"``,
        ``"a2a+p2p"``) run the all-gather."""
        comm = self.cp_comm_type
        if comm is None:
            comm = getattr(self.config, "cp_comm_type", None)
        if isinstance(comm, (list, tuple)):  # one entry per layer
            comm = comm[(self.layer_number - 1) % len(comm)] if comm else None
        return "p2p" if comm in (None, "p2p") and cp_layout == "zigzag" else "all_gather"

    def _scale(self, query) -> float:
        if self.softmax_scale is not None:
            return float(self.softmax_scale)
        return 1.0 / math.sqrt(self.k_channels or query.shape[-1])

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **extra,
    ):
        from .._mla_cp import group_size_rank, longest_sequence, mla_cp_attention
        from ._common import host_offsets

        self._check(attn_mask_type)
        if attention_bias is not None:
            raise NotImplementedError("MLACoreAttention: attention_bias is not supported")
        if extra:
            unknown = {k: v for k, v in extra.items() if v is not None}
            if unknown:
                raise TypeError(f"MLACoreAttention.forward: unexpected arguments {sorted(unknown)}")
        scale = self._scale(query)
        group = _cp_group_of(packed_seq_params, self.pg_collection)
        # (a group's size never changes: asked of torch.distributed once per group, not per call;
        # a weak reference, so that the module still deep-copies)
        known_group = self.__dict__.get("_cp_group_size")
        if group is None:
            cp = 1
        elif known_group is not None and known_group[0]() is group:
            cp = known_group[1]
        else:
            import weakref

            cp = group_size_rank(group)[0]
            self.__dict__["_cp_group_size"] = (weakref.ref(group), cp)
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if thd:
            if query.dim() == 4 and query.shape[1] == 1:  # [t, 1, n, d]
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            if query.dim() != 3:
                raise ValueError(f"MLACoreAttention: THD query must be [t, n, d], got {tuple(query.shape)}")
            cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            cu_kv = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
            if cu_kv is None:
                cu_kv = packed_seq_params.cu_seqlens_kv
            # (compared once per pair of offsets tensors: every layer of the micro-batch reuses it)
            kv_version = cache_version(cu_kv) if cu_kv is not None else None
            if cu_kv is not None and cu_kv is not cu and not (
                _cached_on(cu, _SAME_KV_ATTR, (id(cu_kv), kv_version), lambda: torch.equal(cu_kv.to(cu.device), cu))
                if kv_version is not None
                else torch.equal(cu_kv.to(cu.device), cu)  # no version to key a remembered answer by
            ):
                raise ValueError("MLACoreAttention: self-attention needs the same q and kv offsets")
            max_seqlen = None  # under CP the plan derives its segments from the offsets
            if cp == 1:
                max_seqlen = getattr(packed_seq_params, "max_seqlen_q", None)
                if max_seqlen is None or getattr(packed_seq_params, "cu_seqlens_q_padded", None) is not None:
                    # The padded offsets' longest sequence may exceed max_seqlen_q (the real
                    # lengths'): the drop-in's layout knows it; offsets from elsewhere are read
                    # once per offsets tensor, shared by every layer.
                    known = host_offsets(cu)
                    if known is not None:
                        max_seqlen = known[1]
                    else:
                        max_seqlen = _cached_on(cu, _MAX_ATTR, None, lambda: longest_sequence(cu))
                max_seqlen = int(max_seqlen)
            latent = getattr(query, LATENT_ATTR, None)
            if latent is not None:
                if key is not latent.kv or value is not latent.k_pe:
                    raise RuntimeError(
                        "MLACoreAttention: the query came from verl_ops' latent capture (q and kv as the "
                        "up-projections made them) but key / value were replaced on the way; set "
                        "VERL_OPS_MLA_LATENT=0 to have Megatron build them")
                if cp == 1:
                    from .._mla_latent import mla_latent_attention

                    out = mla_latent_attention(query, key, value, latent.rope_q, latent.rope_k, cu, cu,
                                               max_seqlen, max_seqlen, softmax_scale=scale)
                    return out.reshape(out.shape[0], -1)
                from .._mla_latent import concatenated_operands

                query, key, value = concatenated_operands(query, key, value, latent.rope_q, latent.rope_k)
            out = mla_cp_attention(
                query, key, value, cu, max_seqlen, cp_group=group, cp_layout=self.cp_layout,
                softmax_scale=scale, backend=self.backend,
                cp_comm_type=self._comm(self.cp_layout) if cp > 1 else "all_gather",  # (no CP: unused)
            )
            return out.reshape(out.shape[0], -1)
        if query.dim() != 4:
            raise ValueError(f"MLACoreAttention: BSHD query must be [s, b, n, d], got {tuple(query.shape)}")
        s, b, n = query.shape[0], query.shape[1], query.shape[2]

        def rows(x):  # [s, b, h, d] -> [b * s, h, d], sequence-major
            return x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3])

        cu = torch.arange(0, b + 1, dtype=torch.int32, device=query.device) * (s * cp)
        # Megatron shards BSHD sequences over CP in zigzag chunks (get_batch_on_this_cp_rank).
        out = mla_cp_attention(
            rows(query), rows(key), rows(value), cu, s * cp, cp_group=group, cp_layout="zigzag",
            softmax_scale=scale, backend=self.backend, cp_comm_type=self._comm("zigzag"),
        )
        dv = value.shape[-1]
        return out.reshape(b, s, n * dv).transpose(0, 1).contiguous()


_MAX_ATTR = "_verl_ops_max_seqlen"
_SAME_KV_ATTR = "_verl_ops_same_kv_offsets"


def _is_mla_submodules(obj) -> bool:
    return all(hasattr(obj, f) for f in ("core_attention", "linear_kv_down_proj", "linear_kv_up_proj"))


def _core_attention_entry(cp_layout: str, backend: str):
    """What goes into an MLA ``core_attention`` slot: the class, or a ModuleSpec with its options."""
    if (cp_layout, backend) == ("zigzag", "auto"):
        return MLACoreAttention
    # Megatron builds a slot from a class or a ModuleSpec (whose params become keyword arguments),
    # not from any callable.
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=MLACoreAttention, params={"cp_layout": cp_layout, "backend": backend})


def _mla_slots(spec):
    """Every MLA self-attention submodules object reachable from ``spec`` (a layer spec, a
    ``TransformerBlockSubmodules``, an MTP block spec, or lists of them), once each, with the
    ``attn_mask_type`` of the self-attention ModuleSpec that holds it (None where unknown)."""
    import dataclasses

    seen, found = set(), []

    def walk(obj, mask_type=None):
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
            return
        if not dataclasses.is_dataclass(obj):
            return
        sub = getattr(obj, "submodules", None)
        params = getattr(obj, "params", None)
        if sub is not None and _is_mla_submodules(sub) and isinstance(params, dict):
            mask_type = params.get("attn_mask_type", mask_type)
        if _is_mla_submodules(obj):
            found.append((obj, mask_type))
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name, None), mask_type if f.name == "submodules" else None)

    walk(spec)
    return found


def use_in_spec(spec, *, cp_layout: str = "zigzag", backend: str = "auto") -> int:
    """Put :class:`MLACoreAttention` into the ``core_attention`` slot of every MLA self-attention
    reachable from ``spec`` (a layer spec, a ``TransformerBlockSubmodules``, an MTP block spec,
    or lists of them). Returns how many slots were set (0: no MLA in the spec)."""
    core = _core_attention_entry(cp_layout, backend)
    slots = _mla_slots(spec)
    for submodules, _ in slots:
        submodules.core_attention = core
    return len(slots)


def place_in_spec(spec, config, *, cp_layout: str = "zigzag", backend: str = "auto") -> dict:
    """Put :class:`MLACoreAttention` into the MLA core-attention slots of ``spec`` whose layer
    :func:`unsupported_reason` accepts (with ``config``, and the ``attn_mask_type`` of the MLA
    self-attention spec that holds the slot); other MLA layers keep their attention. Changes
    ``spec`` in place. TransformerEngine's specs are included (``TEDotProductAttention`` is
    replaced like Megatron's ``DotProductAttention``).

    Returns ``{"placed": n, "kept": {reason: n}, "replaced": {class name: n}}``."""
    core = _core_attention_entry(cp_layout, backend)
    report = {"placed": 0, "kept": {}, "replaced": {}}
    for submodules, mask_type in _mla_slots(spec):
        current = submodules.core_attention
        if current is core or current is MLACoreAttention or getattr(current, "module", None) is MLACoreAttention:
            report["placed"] += 1
            continue
        reason = unsupported_reason(config, mask_type)
        if reason is not None:
            report["kept"][reason] = report["kept"].get(reason, 0) + 1
            continue
        name = getattr(getattr(current, "module", current), "__name__", type(current).__name__)
        report["replaced"][name] = report["replaced"].get(name, 0) + 1
        submodules.core_attention = core
        report["placed"] += 1
    return report


def install(spec=None, *, cp_layout: str = "zigzag", backend: str = "auto", fast_rope: bool = True):
    """Make megatron-core's MLA run on verl_ops' kernels with the native value head dim.

    - Fixes what breaks megatron-core without TransformerEngine where it bites
      (:func:`verl_ops.integrations.megatron_compat.patch_megatron_core`).
    - Where MultiLatentAttention pads V itself (>= 0.18), it hands :class:`MLACoreAttention`
      the native V and takes back ``[t, n * Dv]``: no pad, no trim, no copy.
    - ``fast_rope``: THD RoPE in one pass (:func:`fast_thd_rope`, bit-identical to Megatron's), and,
      where :class:`MLACoreAttention` runs on Hopper, no concatenation of MLA's q and k at all:
      the attention reads the up-projections' outputs in place and applies RoPE on the way
      (:func:`_install_latent_capture`; ``VERL_OPS_MLA_LATENT=0`` turns it off).
    - With ``spec`` (a GPT layer / block / MTP block spec), puts :class:`MLACoreAttention` into
      its MLA core-attention slots (:func:`use_in_spec`) and returns the spec.

    Idempotent. Imports megatron-core.
    """
    from megatron.core.transformer import multi_latent_attention as mla_module

    try:
        from .megatron_compat import patch_megatron_core
    except ImportError:
        patch_megatron_core = None
    if patch_megatron_core is not None:
        patch_megatron_core()
    _install_value_pad_bypass(mla_module)
    if fast_rope:
        _install_fast_rope()
        _install_latent_capture(mla_module)
    if spec is not None:
        use_in_spec(spec, cp_layout=cp_layout, backend=backend)
    return spec


# --------------------------------------------------------------------------------------------
# RoPE of THD batches in one pass
# --------------------------------------------------------------------------------------------

_ROPE_TABLE_ATTR = "_verl_ops_rope_tables"
_ROPE_POS_ATTR = "_verl_ops_rope_positions"
# Per thread: where fast_thd_rope's apply puts its plan (tables, positions) instead of rotating,
# while a latent capture (below) asks for it; None otherwise.
_ROPE_PLANS = threading.local()


def _cached_on(t: torch.Tensor, attr: str, key, make):
    """``make()``, remembered on tensor ``t`` under ``key`` (with t's version: in-place changes
    invalidate it), so every layer of a step reuses what the first one built."""
    version = cache_version(t)
    if version is None:  # an inference tensor: no version to key it by, nothing remembered on it
        return make()
    cache = getattr(t, attr, None)
    full_key = (key, version)
    if cache is not None and cache[0] == full_key:
        return cache[1]
    value = make()
    try:
        setattr(t, attr, (full_key, value))
    except (AttributeError, RuntimeError):
        pass
    return value


def fast_thd_rope(original):
    """A replacement for megatron-core's ``rope_utils._apply_rotary_pos_emb_thd`` that applies
    :func:`verl_ops.mla_rope` to the whole packed tensor at once: the same positions (zigzag CP
    chunks, per-sequence or packed frequency tables) and the same arithmetic, bit for bit, without
    the per-sequence loop and its host reads in every layer. Calls it does not cover (interleaved
    rotate-half, partial rotary dims, a non-float32 table) go to ``original``."""
    from .._rope import mla_rope, positions_from_plan, thd_rope_plan
    from ._common import host_offsets

    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, *args, **kwargs):
        names = ("multi_latent_attention", "mscale", "cp_group")  # megatron-core 0.16 order
        if args and "mla_rotary_interleaved" not in kwargs and len(args) <= 3:
            kwargs = {**dict(zip(names, args)), **kwargs}
            args = ()
        mla = kwargs.get("mla_rotary_interleaved", None)
        if mla is None:
            mla = kwargs.get("multi_latent_attention", False)
        mscale = kwargs.get("mscale", 1.0)
        cp_group = kwargs.get("cp_group", None)
        usable = (
            not args
            and not rotary_interleaved
            and cp_group is not None
            and t.dim() == 3
            and freqs.dtype == torch.float32
            and freqs.dim() >= 1
            and freqs.shape[-1] == t.shape[-1]
            and t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        )
        if not usable:
            return original(t, cu_seqlens, freqs, rotary_interleaved, *args, **kwargs)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()

        def index():  # once per micro-batch, shared by every layer
            # The offsets' host values: the drop-in's layout has them (no device read); offsets
            # from elsewhere are read once. The positions are built on t's device from the
            # per-sequence values (a host loop over ~30k rows took ~1.5 ms before the GPU's
            # first rope, while its queue was still short).
            known = host_offsets(cu_seqlens)
            cu = known[0] if known is not None else cu_seqlens.detach().to("cpu")
            if cu.numel() == 0:
                return None  # Megatron's own code reports it
            packed = freqs.size(0) == int(cu[-1])
            plan = thd_rope_plan(cu, t.shape[0], cp_size, cp_rank, packed)
            if plan is None or plan[1] >= freqs.size(0):
                return None  # Megatron's own code reports these
            return positions_from_plan(plan[0], t.shape[0], cp_size, cp_rank, packed, device=t.device)

        positions = _cached_on(
            cu_seqlens, _ROPE_POS_ATTR, (t.shape[0], cp_size, cp_rank, freqs.size(0), t.device), index
        )
        if positions is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved, *args, **kwargs)
        table = freqs.reshape(freqs.size(0), freqs.shape[-1])

        def tables():
            return ((torch.cos(table) * mscale).to(t.dtype), (torch.sin(table) * mscale).to(t.dtype))

        cos, sin = _cached_on(freqs, _ROPE_TABLE_ATTR, (float(mscale), t.dtype, t.device), tables)
        plans = getattr(_ROPE_PLANS, "sink", None)
        if plans is not None:
            # Asked for the plan only (the latent path, _LatentCapture): it rotates t itself later.
            from .._mla_latent import RopePlan

            plans.append(RopePlan(cos, sin, positions, bool(mla)))
            return t
        return mla_rope(t, cos, sin, positions, interleaved=bool(mla))

    apply.__wrapped__ = original
    setattr(apply, _PATCHED_ATTR, True)
    return apply


def _install_fast_rope() -> bool:
    """Route megatron-core's THD RoPE through :func:`fast_thd_rope` (where the function exists)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = getattr(rope_utils, "_apply_rotary_pos_emb_thd", None)
    if original is None:
        return False
    if getattr(original, _PATCHED_ATTR, False):
        return True
    rope_utils._apply_rotary_pos_emb_thd = fast_thd_rope(original)
    return True


# --------------------------------------------------------------------------------------------
# MLA's q and k without concatenation (docs/megatron.md#mla-q-and-k-without-concatenation)
# --------------------------------------------------------------------------------------------
#
# MultiLatentAttention.get_query_key_value_tensors up-projects q [t, n * 192] and kv [t, n * 256],
# rotates q's rope columns and k_pe (one head), then builds query = cat(q_nope, q_pe), key =
# cat(k_nope, k_pe copied into n heads) and value = a copy of kv's v columns: ~4 GB of memory traffic
# per layer forward and backward at 33k tokens x 64 heads. Where MLACoreAttention runs the SM90
# kernels, which read those parts in place (verl_ops.mla_latent_attention), the concatenation is
# skipped: Megatron's own method runs up to its second RoPE call (so its projections, norms, TP and
# SP gathers are its own, on every megatron-core version), the RoPE hook records the rotation instead
# of applying it, and the method is left there (an exception caught here). It then returns q and kv
# as the projections made them and k_pe, the query tagged with the rest (LATENT_ATTR), which
# MLACoreAttention reads. Any step that does not go as expected falls back to Megatron's method,
# once with a warning, and the layer keeps Megatron's method from then on.

LATENT_ATTR = "_verl_ops_latent"
_LATENT_OFF_ATTR = "_verl_ops_latent_off"
_LATENT_HOOKS_ATTR = "_verl_ops_latent_hooks"
_CAPTURE = threading.local()


class _LatentStop(Exception):
    """Raised by the RoPE hook at the capture's second RoPE call, caught by the capture."""


class LatentQKV:
    """What MLACoreAttention needs beside the query: kv, k_pe and the two RoPE plans."""

    __slots__ = ("kv", "k_pe", "rope_q", "rope_k")

    def __init__(self, kv, k_pe, rope_q, rope_k):
        self.kv, self.k_pe, self.rope_q, self.rope_k = kv, k_pe, rope_q, rope_k


class _LatentCapture:
    def __init__(self, module):
        self.module = module
        self.ropes = []  # (the tensor RoPE was asked to rotate, its plan or None)
        self.linears = {}  # name -> (input, output)

    def result(self):
        """(query, key, value, q_compressed, kv_compressed) from what was recorded, or a reason
        string."""
        m = self.module
        if len(self.ropes) != 2 or self.ropes[0][1] is None or self.ropes[1][1] is None:
            return "Megatron's RoPE did not go through verl_ops' one-pass RoPE for q and k_pe"
        q_name = "linear_q_up_proj" if m.config.q_lora_rank is not None else "linear_q_proj"
        if q_name not in self.linears or "linear_kv_up_proj" not in self.linears:
            return "the up-projections' outputs were not seen"
        (q_in, q_out), (kv_in, kv_out) = self.linears[q_name], self.linears["linear_kv_up_proj"]
        (q_pe, rope_q), (k_pe, rope_k) = self.ropes
        n = m.num_attention_heads_per_partition
        t = q_pe.shape[0]
        el = q_out.element_size()
        ok = (
            q_pe.dim() == 3 and tuple(q_pe.shape) == (t, n, 64)
            and q_out.is_contiguous() and q_out.numel() == t * n * 192
            and q_pe.data_ptr() == q_out.data_ptr() + 128 * el and q_pe.stride() == (n * 192, 192, 1)
            and kv_out.is_contiguous() and kv_out.numel() == t * n * 256 and kv_out.dtype == q_out.dtype
            and k_pe.dim() == 3 and tuple(k_pe.shape) == (t, 1, 64)
        )
        if not ok:
            return "q, kv or k_pe were not laid out as expected"
        query = q_out.view(t, n, 192)
        key = kv_out.view(t, n, 256)
        value = k_pe.contiguous()  # (Megatron's .contiguous() on it then returns it as it is)
        setattr(query, LATENT_ATTR, LatentQKV(key, value, rope_q, rope_k))
        # (q_compressed: the q projection's input, the hidden states without q_lora_rank, as Megatron's)
        return query, key, value, q_in, kv_in


def _latent_skip_reason(m, args) -> str | None:
    """Why this call of get_query_key_value_tensors keeps Megatron's path (None: capture it)."""
    from .._mla_latent import latent_kernels_available

    if os.environ.get("VERL_OPS_MLA_LATENT", "1").strip().lower() in ("0", "off", "false", "no"):
        return "off"
    if m.__dict__.get(_LATENT_OFF_ATTR) is not None:
        return "off for this layer"
    core = getattr(m, "core_attention", None)
    if not isinstance(core, MLACoreAttention) or core.backend != "auto":
        return "core attention"
    psp = args.get("packed_seq_params")
    if psp is None or getattr(psp, "qkv_format", None) != "thd":
        return "not THD"
    if args.get("key_value_states") is not None or args.get("inference_context") is not None \
            or args.get("inference_params") is not None:
        return "inference / cross attention"
    c = m.config
    if (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) != (128, 64, 128):
        return "head dims"
    if getattr(c, "apply_rope_fusion", False) or getattr(c, "cache_mla_latents", False) \
            or getattr(c, "experimental_attention_variant", None) is not None:
        return "config"
    if getattr(m, "recompute_up_proj", False) or getattr(m, "cache_mla_latents", False):
        return "recomputed up-projection"
    if m.training and (getattr(m, "checkpoint_core_attention", False) or getattr(m, "offload_core_attention", False)):
        return "checkpointed / offloaded core attention"
    if getattr(m, "offload_qkv_linear", False):
        return "offloaded qkv"
    if int(getattr(c, "context_parallel_size", 1) or 1) != 1 or getattr(psp, "cp_group", None) is not None:
        return "context parallel"
    hidden = args.get("hidden_states")
    if not latent_kernels_available(hidden):
        if not (hidden.device.type == "cpu" and os.environ.get("VERL_OPS_MLA_LATENT_CPU") == "1"):
            return "no SM90 kernels for these tensors"
    return None


def _ensure_linear_hooks(m) -> None:
    if m.__dict__.get(_LATENT_HOOKS_ATTR):
        return
    handles = []
    for name in ("linear_q_up_proj", "linear_q_proj", "linear_kv_up_proj"):
        linear = getattr(m, name, None)
        if linear is None:
            continue

        def hook(module, inputs, output, name=name):
            cap = getattr(_CAPTURE, "current", None)
            # (the capturing layer's own linear: also right in a deep copy of the model, whose
            # hooks are copies of these)
            if cap is not None and getattr(cap.module, name, None) is module:
                cap.linears[name] = (inputs[0] if inputs else None, output[0] if isinstance(output, tuple) else output)

        handles.append(linear.register_forward_hook(hook))
    m.__dict__[_LATENT_HOOKS_ATTR] = handles


def _recording_rope(original):
    """The RoPE function MultiLatentAttention calls (its module's ``apply_rotary_pos_emb``): as
    ``original``, except during a capture, where it records each call and its plan and stops the
    method at the second (k_pe) call."""

    def apply_rotary_pos_emb(t, freqs, *args, **kwargs):
        cap = getattr(_CAPTURE, "current", None)
        if cap is None:
            return original(t, freqs, *args, **kwargs)
        _ROPE_PLANS.sink = plans = []
        try:
            result = original(t, freqs, *args, **kwargs)
        finally:
            _ROPE_PLANS.sink = None
        cap.ropes.append((t, plans[0] if len(plans) == 1 else None))
        if len(cap.ropes) == 2:
            raise _LatentStop()
        return result

    apply_rotary_pos_emb.__wrapped__ = original
    setattr(apply_rotary_pos_emb, _PATCHED_ATTR, True)
    return apply_rotary_pos_emb


def _install_latent_capture(mla_module) -> bool:
    """Wrap ``MLASelfAttention.get_query_key_value_tensors`` (and the module's RoPE function) so that
    THD layers whose core attention is :class:`MLACoreAttention` on the SM90 kernels hand it q, kv and
    k_pe unconcatenated. Idempotent; False where this megatron-core lacks the pieces."""
    cls = getattr(mla_module, "MLASelfAttention", None)
    rope = getattr(mla_module, "apply_rotary_pos_emb", None)
    if cls is None or rope is None or not hasattr(cls, "get_query_key_value_tensors"):
        return False
    if not getattr(rope, _PATCHED_ATTR, False):
        mla_module.apply_rotary_pos_emb = _recording_rope(rope)
    original = cls.get_query_key_value_tensors
    if getattr(original, _PATCHED_ATTR, False):
        return True
    signature = inspect.signature(original)

    def get_query_key_value_tensors(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs).arguments
        except TypeError:
            bound = None
        if bound is None or _latent_skip_reason(self, bound) is not None:
            return original(self, *args, **kwargs)
        _ensure_linear_hooks(self)
        cap = _LatentCapture(self)
        _CAPTURE.current = cap
        try:
            ran_through = original(self, *args, **kwargs)
        except _LatentStop:
            ran_through = None
        finally:
            _CAPTURE.current = None
        if ran_through is not None:
            if not cap.ropes:
                return ran_through  # no RoPE call at all: nothing was left unrotated
            # Finished with a RoPE call recorded but not applied (q rotated by the recorder's plan
            # only): that result is wrong, Megatron's method runs again without the capture.
            result = "Megatron's method did not make its two RoPE calls (q, then k_pe) through apply_rotary_pos_emb"
        else:
            result = cap.result()
        if isinstance(result, str):
            # (the first, partial run's projections are discarded: once per layer)
            self.__dict__[_LATENT_OFF_ATTR] = result
            warnings.warn(f"verl_ops: MLA layer keeps Megatron's q / k concatenation: {result}", stacklevel=2)
            return original(self, *args, **kwargs)
        return result

    get_query_key_value_tensors.__wrapped__ = original
    setattr(get_query_key_value_tensors, _PATCHED_ATTR, True)
    cls.get_query_key_value_tensors = get_query_key_value_tensors
    return True
