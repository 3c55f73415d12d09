"""Python API of mla_forward_padded: variable-length (THD) attention for Multi-Latent Attention
head dims (value head dim Dv <= query/key head dim Dqk), with autograd (OPS.md section 6)."""

from __future__ import annotations

import torch

_ops = torch.ops.verl_ops

BACKENDS = ("auto", "padded", "native")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_kv, max_q, max_kv, causal, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv)
    ctx.meta = (max_q, max_kv, causal, scale, backend)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_kv = ctx.saved_tensors
    max_q, max_kv, causal, scale, backend = ctx.meta
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _ops.mla_backward_padded(
        grad_out, q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, causal, scale, backend
    )
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("verl_ops::mla_forward_padded", _backward, setup_context=_setup_context)


def _should_validate(validate, cu: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    if cu.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    if validate is None:
        return not cu.is_cuda
    return bool(validate)


def _validate_offsets(op: str, name: str, cu: torch.Tensor, rows: int, max_seqlen: int, max_name: str):
    c = cu.detach().to("cpu", torch.int64)
    if c.numel() == 0 or int(c[0]) != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {c[:1].tolist()}")
    lengths = c[1:] - c[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"{op}: {name} must be non-decreasing, got {c.tolist()}")
    if int(c[-1]) != rows:
        raise ValueError(f"{op}: {name}[-1]={int(c[-1])} must equal the number of rows {rows}")
    if lengths.numel() and int(lengths.max()) > max_seqlen:
        raise ValueError(f"{op}: a sequence has {int(lengths.max())} tokens, more than {max_name}={max_seqlen}")


def mla_forward_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate: bool | None = None,
) -> torch.Tensor:
    """Attention over a packed (THD) batch with a value head dim up to the query/key head dim.

    Equal to attention with ``v`` zero-padded to ``Dqk`` and the output trimmed back to ``Dv``
    (what Megatron / verl do for MLA), computed without materialising the padded output.

    Args:
        q: ``[Tq, Hq, Dqk]``; k: ``[Tk, Hk, Dqk]``; v: ``[Tk, Hk, Dv]`` with ``Dv <= Dqk``;
            ``Hq`` a multiple of ``Hk`` (grouped-query attention: query head ``h`` reads kv head
            ``h // (Hq // Hk)``). float16 / bfloat16 on CUDA; also float32 / float64 on the CPU.
        cu_seqlens_q, cu_seqlens_kv: int32 ``[B + 1]`` row offsets of the sequences.
        max_seqlen_q, max_seqlen_kv: the longest sequence (must be >= every length).
        causal: causal mask; for sequences whose query and key lengths differ the diagonal is
            aligned to the bottom-right corner (FlashAttention's convention: query ``i`` of ``Lq``
            sees keys ``j <= i + Lk - Lq``). A query that sees no key gets a zero output.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.
        backend: ``"padded"`` (V zero-padded to Dqk in one kernel, then the varlen FlashAttention
            kernels of torch), ``"native"`` (cuDNN attention with ``Dv != Dqk``: batches whose
            sequences all have the same length, or ragged causal self-attention batches that pass
            one tensor as both ``cu_seqlens_q`` and ``cu_seqlens_kv``, copied into right-padded
            dense rows), or ``"auto"`` (native where it measured faster, see the README; else
            padded). On the CPU every backend runs the same exact reference.
        validate: check the offsets against the data on the host. Default: on when the offsets
            are CPU tensors; CUDA offsets are only checked with ``validate=True`` (a host sync),
            as in FlashAttention.

    Returns:
        ``out [Tq, Hq, Dv]`` in q's dtype. With the padded backend and ``Dv < Dqk`` it is a view of
        a ``[Tq, Hq, Dqk]`` buffer (row stride ``Hq * Dqk``), so no copy trims it. Differentiable
        in q, k and v.
    """
    op = "mla_forward_padded"
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t)}")
    if _should_validate(validate, cu_seqlens_q):
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_kv.dtype != torch.int32:
            raise ValueError(
                f"{op}: cu_seqlens_q / cu_seqlens_kv must be int32, got {cu_seqlens_q.dtype} / {cu_seqlens_kv.dtype}"
            )
        if cu_seqlens_q.shape != cu_seqlens_kv.shape:
            raise ValueError(
                f"{op}: cu_seqlens_q and cu_seqlens_kv must have the same length, got "
                f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_kv.shape)}"
            )
        if q.dim() == 3 and k.dim() == 3:
            _validate_offsets(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], int(max_seqlen_q), "max_seqlen_q")
            _validate_offsets(op, "cu_seqlens_kv", cu_seqlens_kv, k.shape[0], int(max_seqlen_kv), "max_seqlen_kv")
    out, _ = _ops.mla_forward_padded(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_kv,
        max_seqlen_q,
        max_seqlen_kv,
        bool(causal),
        None if softmax_scale is None else float(softmax_scale),
        backend,
    )
    return out
