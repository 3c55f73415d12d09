"""Megatron-Core MLA on the THD path without padding V to the query head dim.

verl patches ``MultiLatentAttention.forward`` so that, for packed (``qkv_format == "thd"``)
batches, V ``[t, n, 128]`` is zero-padded to the query/key head dim (192), attention runs, and the
output is trimmed back — except for the DSA variant (``config.experimental_attention_variant ==
"dsa"``), which is never padded, and configs without that attribute count as "no variant".
Megatron-Core >= 0.16.2 fixed the forward upstream, so the patch applies below that version only.

Here the same decisions route the THD core attention to :func:`verl_ops.mla_forward_padded`,
which pads inside one kernel (or not at all on the native and varlen paths) and returns the output
trimmed without an extra copy. Its ``backend="auto"`` sends ragged THD batches (RL micro-batches)
to the varlen backend, attention on the packed rows, where the build and the GPU have it (and
uniform batches too where that backend runs verl_ops' own SM90 kernels):

- :func:`use_mla_thd_path` — the decision (THD, not DSA, one CP rank, causal, no dropout, no
  separate padded offsets).
- :func:`mla_thd_core_attention` — the call, returning ``[t, n * Dv]`` like TransformerEngine's
  THD attention.
- :func:`apply_patch` — installs it on ``MultiLatentAttention`` (Megatron-Core < 0.16.2 only;
  megatron is imported only here). Calls the op does not take (context parallel, dropout, other
  variants) go to Megatron's core attention with verl's padding of V (none for DSA).
"""

from __future__ import annotations

import math

import torch

_PATCHED_ATTR = "_verl_ops_mla_patched"
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
    out = original(
        query, key, torch.nn.functional.pad(value, (0, dqk - dv)), *args, packed_seq_params=packed_seq_params, **kwargs
    )
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


def apply_patch(backend: str = "auto") -> bool:
    """Route THD MLA core attention of every ``MultiLatentAttention`` to ``mla_forward_padded``.

    Applies only for Megatron-Core < 0.16.2 (later versions handle Dv != Dqk themselves); returns
    whether the patch is installed. Idempotent. The DSA variant and every case that
    :func:`use_mla_thd_path` rejects keep Megatron's own core attention.
    """
    import megatron.core
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    if not needs_forward_patch(getattr(megatron.core, "__version__", "0")):
        return False
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
