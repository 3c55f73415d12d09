"""The log-prob drop-in: ``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits``
(verl's log-probs of the labels from the model's vocabulary-parallel logits, which
``verl.workers.engine.megatron.transformer_impl`` and the Megatron actor call once per micro-batch).

verl's function is ``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, labels)``.
This one is :func:`verl_ops.vocab_parallel_log_probs` over Megatron's tensor-parallel group: the same
float32 arithmetic and the same three collectives (max, sum, sum) on every rank of the group, one
pass over the logits forward and one backward, no float32 copy of them, no float32 softmax kept for
the backward. Results equal verl's to float32 rounding (the sums' order); gradients come back in the
logits' dtype, as autograd casts Megatron's.

What it does not copy: Megatron's function, given float32 logits, shifts them in place (verl clones
them first wherever it reads them again); this one leaves the logits as they are.
"""

from __future__ import annotations

import torch

from .._log_probs import vocab_parallel_log_probs

__all__ = ["vocab_parallel_log_probs_from_logits"]


def _tp_group():
    """Megatron's tensor-parallel group where model parallelism is initialised and spans more than one
    rank; else None (the logits hold the whole vocabulary)."""
    try:
        from megatron.core import parallel_state as ps
    except Exception:  # noqa: BLE001  (no megatron-core: one slice)
        return None
    if not ps.model_parallel_is_initialized():
        return None
    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def vocab_parallel_log_probs_from_logits(logits, labels):
    """verl's ``vocab_parallel_log_probs_from_logits``: ``log softmax(logits)[labels]`` per token, the
    vocabulary split across Megatron's tensor-parallel ranks (``logits [..., vocab / tp]``,
    ``labels [...]``). Returns float32 ``[...]``."""
    # Megatron's split: this rank's slice starts at rank * V (vocab_parallel_log_probs' default).
    return vocab_parallel_log_probs(logits, labels, group=_tp_group())
