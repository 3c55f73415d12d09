"""vocab_log_probs: log-probabilities of labels under a softmax over the vocabulary, in one pass
(docs/ops.md#vocab_log_probs).

verl computes its log-probs with Megatron-Core's ``vocab_parallel_cross_entropy`` (negated): the
logits are copied to float32, shifted, exponentiated and normalised in place, and the float32
softmax is kept for the backward, which writes float32 gradients that autograd casts back, about
ten passes over a [tokens, vocab] tensor. These ops are the same float32 arithmetic in one pass
forward (each row's max, sum of exponentials and label logit) and one backward, keeping only the
logits (no copy) and two floats per row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._library import register_autograd
from ._validate import check_plain

_ops = torch.ops.verl_ops
OP = "vocab_parallel_log_probs"
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check(op, logits, labels, vocab_start):
    torch._check(logits.dim() >= 1, lambda: f"{op}: logits must be [*, vocab], got {tuple(logits.shape)}")
    torch._check(logits.dim() < 1 or logits.shape[-1] > 0,
                 lambda: f"{op}: logits' last dim (the vocabulary slice) must be > 0, got {tuple(logits.shape)}")
    torch._check(logits.dtype in _FLOATS,
                 lambda: f"{op}: logits must be float32, float64, float16 or bfloat16, got {logits.dtype}")
    torch._check(tuple(labels.shape) == tuple(logits.shape[:-1]),
                 lambda: f"{op}: labels must have logits' shape less its last dim, got labels "
                         f"{tuple(labels.shape)} and logits {tuple(logits.shape)}")
    torch._check(labels.dtype in (torch.int64, torch.int32),
                 lambda: f"{op}: labels must be int64 or int32, got {labels.dtype}")
    torch._check(vocab_start >= 0, lambda: f"{op}: vocab_start must be >= 0, got {vocab_start}")


@torch.library.register_fake("verl_ops::vocab_log_probs_forward")
def _forward_fake(logits, labels, vocab_start=0):
    _check("vocab_log_probs_forward", logits, labels, vocab_start)
    shape = logits.shape[:-1]
    return tuple(logits.new_empty(shape, dtype=torch.float32) for _ in range(4))


@torch.library.register_fake("verl_ops::vocab_log_probs_backward")
def _backward_fake(grad_log_probs, logits, labels, logits_max, sum_exp, vocab_start=0):
    op = "vocab_log_probs_backward"
    _check(op, logits, labels, vocab_start)
    for name, t in (("grad_log_probs", grad_log_probs), ("logits_max", logits_max), ("sum_exp", sum_exp)):
        torch._check(tuple(t.shape) == tuple(labels.shape) and t.dtype == torch.float32,
                     lambda: f"{op}: {name} must be float32 with labels' shape {tuple(labels.shape)}")
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, labels, vocab_start = inputs
    _lp, logits_max, sum_exp, label_logit = output
    ctx.mark_non_differentiable(logits_max, sum_exp, label_logit)
    ctx.save_for_backward(logits, labels, logits_max, sum_exp)
    ctx.vocab_start = vocab_start


def _grad_logits(ctx, grad_lp):
    """The logits' gradient from the saved logits, labels and the whole vocabulary's statistics."""
    logits, labels, logits_max, sum_exp = ctx.saved_tensors
    return _ops.vocab_log_probs_backward(grad_lp.float(), logits, labels, logits_max, sum_exp, ctx.vocab_start)


def _backward(ctx, grad_lp, _g_max, _g_sum, _g_label):
    if grad_lp is None:
        return None, None, None
    return _grad_logits(ctx, grad_lp), None, None


# The forward op's own autograd treats its logits as the whole vocabulary (one slice); several
# slices go through _VocabParallel, which combines the statistics across the group first.
register_autograd("verl_ops::vocab_log_probs_forward", _backward, setup_context=_setup_context)
register_autograd("verl_ops::vocab_log_probs_backward")


class _VocabParallel(torch.autograd.Function):
    """Log-probs over a vocabulary split across ``group`` (each rank holds [start, start + V))."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        with torch._C._AutoDispatchBelowAutograd():
            _lp, local_max, local_sum, label_logit = _ops.vocab_log_probs_forward(logits, labels, vocab_start)
        # Every rank issues the same three collectives, whatever its labels.
        logits_max = local_max.clone()
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # A slice whose row is all -inf (masked ids) has no share of the sum (its own sum is NaN);
        # elsewhere each slice's sum is rescaled to the global max.
        sum_exp = torch.where(torch.isneginf(local_max) & ~torch.isneginf(logits_max), torch.zeros_like(local_sum),
                              local_sum * torch.exp(local_max - logits_max))
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        vocab = logits.shape[-1]
        wide = labels.long()
        inside = (wide >= vocab_start) & (wide < vocab_start + vocab)
        predicted = torch.where(inside, label_logit - logits_max, torch.zeros_like(label_logit))
        dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(logits, labels, logits_max, sum_exp)
        ctx.vocab_start = vocab_start
        return -(torch.log(sum_exp) - predicted)

    @staticmethod
    def backward(ctx, grad_lp):
        with torch._C._AutoDispatchBelowAutograd():
            grad = _grad_logits(ctx, grad_lp.contiguous())
        return grad, None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, group=None,
                             vocab_start: int | None = None) -> torch.Tensor:
    """``log softmax(logits)[label]`` per row, the vocabulary possibly split across ``group``.

    Equal to Megatron-Core's ``-vocab_parallel_cross_entropy(logits, labels)`` (verl's
    ``vocab_parallel_log_probs_from_logits``), float32 math, without its float32 copies of the
    logits: one pass forward, one backward, differentiable in ``logits``.

    Args:
        logits: ``[*, V]``, float32 / float64 / float16 / bfloat16, inner stride 1: this rank's slice
            ``[vocab_start, vocab_start + V)`` of the vocabulary.
        labels: ``[*]`` int64 / int32. A label outside this rank's slice contributes nothing here
            (on every rank, as in Megatron: its log-prob is then ``-log(sum exp)``).
        group: the process group the vocabulary is split across (tensor parallel), or None: the
            logits are the whole vocabulary.
        vocab_start: this rank's first vocabulary id; default ``rank(group) * V`` (Megatron's split).

    Returns:
        float32 ``[*]``; the gradient comes back in the logits' dtype.
    """
    check_plain(OP, "logits", logits)
    check_plain(OP, "labels", labels)
    if logits.dim() < 1 or logits.dtype not in _FLOATS:
        raise ValueError(f"{OP}: logits must be [*, vocab] float32, float64, float16 or bfloat16, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{OP}: labels must be int64 / int32 with logits' shape less its last dim "
                         f"{tuple(logits.shape[:-1])}, got {labels.dtype} {tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"{OP}: labels is on {labels.device} but logits is on {logits.device}")
    world = 1 if group is None else dist.get_world_size(group)
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * logits.shape[-1] if world > 1 else 0
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ValueError(f"{OP}: vocab_start must be an int >= 0, got {vocab_start!r}")
    if world == 1:
        return _ops.vocab_log_probs_forward(logits, labels, vocab_start)[0]
    return _VocabParallel.apply(logits, labels, vocab_start, group)
