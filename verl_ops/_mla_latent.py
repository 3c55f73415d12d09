"""MLA attention on its operands in parts (docs/mla.md#latent-parts).

Megatron-Core's MultiLatentAttention builds attention's operands by concatenation:
``q = [q_nope | rope(q_pe)]`` and ``k = [k_nope | rope(k_pe)]`` with ``k_pe`` (one head) copied into
every head, then V as its own copy. Forward and backward that is about 4 GB of memory traffic per
layer at 33k tokens x 64 heads, for data the attention could read where it already is.

- ``torch.ops.verl_ops.mla_latent_forward / _backward``: the attention on the parts (CUDA: the SM90
  kernels read each part through a tensor map of its own; CPU: the concatenated reference).
- :func:`mla_latent_attention`: MLA's core step from the tensors Megatron's up-projections return
  (``q [T, H, 192]`` and ``kv [T, H, 256]`` as one row per token and head, ``k_pe [T, 1, 64]``),
  RoPE applied on the way (:func:`verl_ops.mla_rope`, one pass over the rope dims) and gradients
  returned in those same layouts: no concatenation forward or backward.
"""

from __future__ import annotations

import math
import os

import torch

from ._library import register_autograd
from ._mla import _validate_offsets
from ._validate import INT32_MAX, check_plain, is_meta

_ops = torch.ops.verl_ops

NOPE, ROPE, DV = 128, 64, 128


def _shared_k_pe(k_pe: torch.Tensor, hk: int) -> bool:
    return k_pe.shape[1] == 1 and hk != 1


# --------------------------------------------------------------------------------------------
# Argument checks (the CPU kernels, the fake kernels and mla_latent_attention; the CUDA kernels
# check the same in C++ and trust the offsets' values, as every CUDA op here).

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


_PART_NAMES = ("q", "q_pe", "k", "k_pe", "v")


def check_parts(op, q, q_pe, k, k_pe, v, cu_q, cu_kv, max_q, max_kv, scale, *, host_values=False,
                names=_PART_NAMES):
    """The latent ops' arguments: shapes, dtypes, devices, offsets and scalars, each error naming
    ``op`` and the argument (``names``: what to call the five parts). ``host_values``: the offsets'
    values too (CPU tensors)."""
    nq, nqp, nk, nkp, nv = names
    parts = ((nq, q, NOPE), (nqp, q_pe, ROPE), (nk, k, NOPE), (nkp, k_pe, ROPE), (nv, v, DV))
    for name, t, _ in parts:
        check_plain(op, name, t)
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        check_plain(op, name, t)
    for name, t, d in parts:
        if t.dim() != 3 or t.shape[2] != d:
            raise ValueError(f"{op}: {name} must be 3-D [T, H, {d}] (MLA's head dims: q and k 128 + 64 rope, "
                             f"v 128), got {tuple(t.shape)}")
    if q.dtype not in _FLOATS:
        raise ValueError(f"{op}: {nq} must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, t, _ in parts[1:]:
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} must have {nq}'s dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {nq} is on {q.device}")
    tq, hq, tk, hk = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    torch._check(q_pe.shape[0] == tq and q_pe.shape[1] == hq,
                 lambda: f"{op}: {nqp} must be [{tq}, {hq}, {ROPE}] like {nq}'s rows and heads, got {tuple(q_pe.shape)}")
    torch._check(v.shape[0] == tk and v.shape[1] == hk,
                 lambda: f"{op}: {nv} must be [{tk}, {hk}, {DV}] like {nk}'s rows and heads, got {tuple(v.shape)}")
    torch._check(k_pe.shape[0] == tk and (k_pe.shape[1] == 1 or k_pe.shape[1] == hk),
                 lambda: f"{op}: {nkp} must be [{tk}, 1, {ROPE}] (shared by every kv head) or [{tk}, {hk}, {ROPE}] "
                         f"({nk} has {tk} rows and {hk} heads), got {tuple(k_pe.shape)}")
    torch._check(hq >= 1 and hk >= 1 and hq % hk == 0,
                 lambda: f"{op}: {nq}'s heads ({hq}) must be a positive multiple of {nk}'s ({hk})")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if cu.dtype != torch.int32:
            raise ValueError(f"{op}: {name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{op}: {name} must be 1-D [B + 1], got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{op}: {name} is on {cu.device} but q is on {q.device}")
    torch._check(cu_q.shape[0] == cu_kv.shape[0],
                 lambda: f"{op}: cu_seqlens_kv must have as many entries as cu_seqlens_q ({cu_q.shape[0]}), "
                         f"got {cu_kv.shape[0]}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        if _is_int(m) and not 0 <= m <= INT32_MAX:
            raise ValueError(f"{op}: {name} must be in [0, {INT32_MAX}], got {m}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        raise ValueError(f"{op}: softmax_scale must be a finite float or None, got {scale!r}")
    if host_values and not is_meta(cu_q) and cu_q.device.type == "cpu" and _is_int(max_q) and _is_int(max_kv):
        _validate_offsets(op, "cu_seqlens_q", cu_q, tq, max_q, "max_seqlen_q")
        _validate_offsets(op, "cu_seqlens_kv", cu_kv, tk, max_kv, "max_seqlen_kv")


def check_backward_extras(op, grad_out, out, lse, q):
    tq, hq = q.shape[0], q.shape[1]
    for name, t in (("grad_out", grad_out), ("out", out), ("softmax_lse", lse)):
        check_plain(op, name, t)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.dim() != 3 or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{op}: {name} must be a 3-D [Tq, Hq, {DV}] tensor of q's dtype and device, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        torch._check(t.shape[0] == tq and t.shape[1] == hq and t.shape[2] == DV,
                     lambda name=name, t=t: f"{op}: {name} must be [{tq}, {hq}, {DV}], got {tuple(t.shape)}")
    dt = _lse_dtype(q)
    if lse.dim() != 2 or lse.dtype != dt or lse.device != q.device:
        raise ValueError(f"{op}: softmax_lse must be a 2-D [Hq, Tq] tensor of dtype {dt} on q's device, "
                         f"got {tuple(lse.shape)} {lse.dtype} on {lse.device}")
    torch._check(lse.shape[0] == hq and lse.shape[1] == tq,
                 lambda: f"{op}: softmax_lse must be [{hq}, {tq}], got {tuple(lse.shape)}")


# --------------------------------------------------------------------------------------------
# The raw ops: fake kernels, the CPU kernels (the concatenated reference) and autograd.


@torch.library.register_fake("verl_ops::mla_latent_forward")
def _forward_fake(q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                  causal=True, softmax_scale=None):
    check_parts("mla_latent_forward", q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                max_seqlen_kv, softmax_scale)
    tq, hq = q.shape[0], q.shape[1]
    # softmax_lse: [Hq, Tq], the transpose of the kernels' [Tq, Hq] rows (no copy).
    return q.new_empty((tq, hq, DV)), q.new_empty((tq, hq), dtype=_lse_dtype(q)).transpose(0, 1)


@torch.library.register_fake("verl_ops::mla_latent_backward")
def _backward_fake(grad_out, q, q_pe, k, k_pe, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv,
                   max_seqlen_q, max_seqlen_kv, causal=True, softmax_scale=None):
    op = "mla_latent_backward"
    check_parts(op, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale)
    check_backward_extras(op, grad_out, out, softmax_lse, q)
    tq, hq = q.shape[0], q.shape[1]
    tk, hk = k.shape[0], k.shape[1]
    return (q.new_empty((tq, hq, NOPE + ROPE)), k.new_empty((tk, hk, NOPE + DV)),
            k.new_empty((tk, hk, ROPE)))


def _concatenated(q, q_pe, k, k_pe):
    """The parts' concatenation (the reference the CPU kernels compute on)."""
    tk, hk = k.shape[0], k.shape[1]
    return torch.cat([q, q_pe], -1), torch.cat([k, k_pe.expand(tk, hk, ROPE)], -1)


@torch.library.impl("verl_ops::mla_latent_forward", "CPU")
def _forward_cpu(q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                 causal=True, softmax_scale=None):
    check_parts("mla_latent_forward", q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                max_seqlen_kv, softmax_scale, host_values=True)
    qf, kf = _concatenated(q, q_pe, k, k_pe)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(NOPE + ROPE)
    with torch._C._AutoDispatchBelowAutograd():
        out, lse = _ops.mla_forward_padded(qf, kf, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                           max_seqlen_kv, causal, softmax_scale, 0)
    return out.contiguous(), lse.transpose(0, 1).contiguous().transpose(0, 1)


@torch.library.impl("verl_ops::mla_latent_backward", "CPU")
def _backward_cpu(grad_out, q, q_pe, k, k_pe, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv,
                  max_seqlen_q, max_seqlen_kv, causal=True, softmax_scale=None):
    op = "mla_latent_backward"
    check_parts(op, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale,
                host_values=True)
    check_backward_extras(op, grad_out, out, softmax_lse, q)
    qf, kf = _concatenated(q, q_pe, k, k_pe)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(NOPE + ROPE)
    with torch._C._AutoDispatchBelowAutograd():
        dq, dk, dv = _ops.mla_backward_padded(grad_out, qf, kf, v, out, softmax_lse.contiguous(), cu_seqlens_q,
                                              cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, softmax_scale, 0)
    return dq.contiguous(), torch.cat([dk[..., :NOPE], dv], -1), dk[..., NOPE:].contiguous()


def _setup_context(ctx, inputs, output):
    q, q_pe, k, k_pe, v, cu_q, cu_kv, max_q, max_kv, causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, q_pe, k, k_pe, v, out, lse, cu_q, cu_kv)
    ctx.meta = (max_q, max_kv, causal, scale)


def _backward(ctx, grad_out, grad_lse):
    q, q_pe, k, k_pe, v, out, lse, cu_q, cu_kv = ctx.saved_tensors
    max_q, max_kv, causal, scale = ctx.meta
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dkv, dkpe = _ops.mla_latent_backward(grad_out, q, q_pe, k, k_pe, v, out, lse, cu_q, cu_kv,
                                             max_q, max_kv, causal, scale)
    if _shared_k_pe(k_pe, k.shape[1]):
        dkpe = dkpe.sum(1, keepdim=True)
    return dq[..., :NOPE], dq[..., NOPE:], dkv[..., :NOPE], dkpe, dkv[..., NOPE:], None, None, None, None, None, None


register_autograd("verl_ops::mla_latent_forward", _backward, setup_context=_setup_context)
register_autograd("verl_ops::mla_latent_backward")


# --------------------------------------------------------------------------------------------
# MLA's core step on Megatron's tensors.


_AVAILABLE: dict = {}


def latent_kernels_available(t: torch.Tensor) -> bool:
    """Whether ``mla_latent_forward`` runs its SM90 kernels for tensors like ``t``: float16 /
    bfloat16 on a compute capability 9.0 device, in a build with those kernels (sm_90a). Asked of
    the op once per device (one launch on 1 row), then remembered."""
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    known = _AVAILABLE.get(index)
    if known is None:
        known = False
        if torch.cuda.get_device_capability(index) == (9, 0):
            dev = torch.device("cuda", index)
            z = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16, device=dev)  # noqa: E731
            cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
            try:
                with torch._C._AutoDispatchBelowAutograd():
                    _ops.mla_latent_forward(z(1, 1, NOPE), z(1, 1, ROPE), z(1, 1, NOPE), z(1, 1, ROPE), z(1, 1, DV),
                                            cu, cu, 1, 1, True, None)
                known = True
            except Exception:  # noqa: BLE001  (the op's error: no SM90 kernels here)
                known = False
        _AVAILABLE[index] = known
    return known


class RopePlan:
    """What :func:`verl_ops.mla_rope` needs for one tensor: the tables (in its dtype, mscale applied),
    each row's position and the de-interleave flag."""

    __slots__ = ("cos", "sin", "positions", "interleaved")

    def __init__(self, cos, sin, positions, interleaved):
        self.cos, self.sin, self.positions, self.interleaved = cos, sin, positions, bool(interleaved)

    def apply(self, x, backward=False):
        return _ops.mla_rope(x, self.cos, self.sin, self.positions, self.interleaved, bool(backward))

    def apply_(self, x, backward=False):
        """:meth:`apply` written into ``x`` (one pass, no buffer where ``x``'s rows are aligned)."""
        _ops.mla_rope_(x, self.cos, self.sin, self.positions, self.interleaved, bool(backward))


class _LatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, k_pe, rope_q, rope_k, cu_q, cu_kv, max_q, max_kv, scale):
        with torch._C._AutoDispatchBelowAutograd():
            q_pe = rope_q.apply(q[..., NOPE:])
            k_pe_r = rope_k.apply(k_pe)
            out, lse = _ops.mla_latent_forward(q[..., :NOPE], q_pe, kv[..., :NOPE], k_pe_r, kv[..., NOPE:],
                                               cu_q, cu_kv, max_q, max_kv, True, scale)
        ctx.save_for_backward(q, q_pe, kv, k_pe_r, out, lse, cu_q, cu_kv)
        ctx.meta = (rope_q, rope_k, max_q, max_kv, scale, k_pe.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, q_pe, kv, k_pe_r, out, lse, cu_q, cu_kv = ctx.saved_tensors
        rope_q, rope_k, max_q, max_kv, scale, k_pe_shape = ctx.meta
        with torch._C._AutoDispatchBelowAutograd():
            dq, dkv, dkpe = _ops.mla_latent_backward(
                grad_out.contiguous(), q[..., :NOPE], q_pe, kv[..., :NOPE], k_pe_r, kv[..., NOPE:], out, lse,
                cu_q, cu_kv, max_q, max_kv, True, scale)
            # dq is this function's own buffer: its rope columns are turned back in place.
            rope_q.apply_(dq[..., NOPE:], backward=True)
            if _shared_k_pe(k_pe_r, kv.shape[1]):
                dkpe = dkpe.sum(1, keepdim=True)
            dk_pe = rope_k.apply(dkpe, backward=True).reshape(k_pe_shape)
        return dq, dkv, dk_pe, None, None, None, None, None, None, None


def mla_latent_attention(q, kv, k_pe, rope_q: RopePlan, rope_k: RopePlan, cu_seqlens_q, cu_seqlens_kv,
                         max_seqlen_q, max_seqlen_kv, softmax_scale=None):
    """Causal MLA attention from Megatron's up-projections, RoPE applied on the way.

    Args:
        q: ``[Tq, H, 192]``: per head 128 no-rope columns, then 64 rope columns not yet rotated.
        kv: ``[Tk, Hk, 256]``: per head k's 128 no-rope columns, then v's 128.
        k_pe: ``[Tk, 1, 64]`` (one rope key for every head, MLA's) or ``[Tk, Hk, 64]``, not yet rotated.
        rope_q, rope_k: the RoPE of q's rope columns and of ``k_pe`` (:class:`RopePlan`).

    Returns ``[Tq, H, 128]``, equal to the attention of ``[q_nope | rope(q_pe)]`` on
    ``[k_nope | rope(k_pe)]`` and v. Gradients come back as ``q``'s, ``kv``'s and ``k_pe``'s, each in
    its own layout. On CUDA the SM90 kernels read every part in place (Hopper, float16 / bfloat16);
    elsewhere the parts are concatenated and :func:`verl_ops.mla_forward_padded` runs."""
    _check_attention_args(q, kv, k_pe, rope_q, rope_k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                          softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(NOPE + ROPE)
    if latent_kernels_available(q) or q.device.type == "cpu" and os.environ.get("VERL_OPS_MLA_LATENT_CPU") == "1":
        return _LatentAttention.apply(q, kv, k_pe, rope_q, rope_k, cu_seqlens_q, cu_seqlens_kv,
                                      max_seqlen_q, max_seqlen_kv, float(softmax_scale))
    query, key, value = concatenated_operands(q, kv, k_pe, rope_q, rope_k)
    from ._mla import mla_forward_padded

    return mla_forward_padded(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                              causal=True, softmax_scale=softmax_scale, validate=False)


def _check_attention_args(q, kv, k_pe, rope_q, rope_k, cu_q, cu_kv, max_q, max_kv, scale):
    op = "mla_latent_attention"
    for name, t, d in (("q", q, NOPE + ROPE), ("kv", kv, NOPE + DV), ("k_pe", k_pe, ROPE)):
        check_plain(op, name, t)
        if t.dim() != 3 or t.shape[2] != d:
            raise ValueError(f"{op}: {name} must be 3-D [T, H, {d}], got {tuple(t.shape)}")
    for name, plan in (("rope_q", rope_q), ("rope_k", rope_k)):
        if not isinstance(plan, RopePlan):
            raise TypeError(f"{op}: {name} must be a verl_ops._mla_latent.RopePlan, got {type(plan).__name__}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        if not (_is_int(m) or isinstance(m, torch.SymInt)):
            raise ValueError(f"{op}: {name} must be an int, got {m!r} ({type(m).__name__})")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        raise ValueError(f"{op}: softmax_scale must be a float or None, got {scale!r}")
    if q.dtype not in _FLOATS:
        raise ValueError(f"{op}: q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{op}: kv must have q's dtype {q.dtype}, got {kv.dtype}")
    if kv.device != q.device:
        raise ValueError(f"{op}: kv is on {kv.device} but q is on {q.device}")
    check_parts(op, q[..., :NOPE], q[..., NOPE:], kv[..., :NOPE], k_pe, kv[..., NOPE:], cu_q, cu_kv, max_q, max_kv,
                scale, host_values=True, names=("q", "q", "kv", "k_pe", "kv"))
    for name, plan, rows in (("rope_q", rope_q, q.shape[0]), ("rope_k", rope_k, k_pe.shape[0])):
        pos, tables = plan.positions, (("cos", plan.cos), ("sin", plan.sin))
        for what, t in (("positions", pos), *tables):
            check_plain(op, f"{name}.{what}", t)
            if t.device != q.device:
                raise ValueError(f"{op}: {name}.{what} is on {t.device} but q is on {q.device}")
        if pos.dtype != torch.int64 or pos.dim() != 1 or pos.shape[0] != rows:
            raise ValueError(f"{op}: {name}.positions must be int64 [{rows}] (one per row), got {pos.dtype} "
                             f"{tuple(pos.shape)}")
        for what, t in tables:
            if t.dim() != 2 or t.shape[1] != ROPE or t.dtype != q.dtype:
                raise ValueError(f"{op}: {name}.{what} must be [table_rows, {ROPE}] in q's dtype {q.dtype}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if plan.cos.shape != plan.sin.shape:
            raise ValueError(f"{op}: {name}.cos and .sin must have one shape, got {tuple(plan.cos.shape)} and "
                             f"{tuple(plan.sin.shape)}")
        if pos.device.type == "cpu" and not is_meta(pos) and pos.numel():
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= plan.cos.shape[0]:
                raise ValueError(f"{op}: {name}.positions must lie in [0, {plan.cos.shape[0]}) (the table's rows), "
                                 f"got [{lo}, {hi}]")


def concatenated_operands(q, kv, k_pe, rope_q: RopePlan, rope_k: RopePlan):
    """The query, key and value Megatron would have built: ``[q_nope | rope(q_pe)]``,
    ``[k_nope | rope(k_pe)]`` (k_pe copied into every head) and v, each contiguous."""
    query, key = _concatenated(q[..., :NOPE], rope_q.apply(q[..., NOPE:]), kv[..., :NOPE], rope_k.apply(k_pe))
    return query, key, kv[..., NOPE:].contiguous()
