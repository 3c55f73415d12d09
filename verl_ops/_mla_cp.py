"""MLA attention under context parallelism: all-gather K / V over the CP group, then each rank
attends its own query chunks on the varlen kernels with the native value head dim.

Layout (verl's and Megatron's THD CP layout, docs/cp.md): ``cu_seqlens_padded`` holds the global
padded offsets of the micro-batch; sequence ``i`` (padded length ``P_i``) is split into ``2 * cp``
chunks (zigzag: rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order) or ``cp``
chunks (contiguous: rank ``r`` holds chunk ``r``), and a rank's rows are its chunks of every
sequence, in sequence order.

Each query chunk ``m`` of ``c`` rows sees the first ``(m + 1) * c`` keys of its sequence under the
causal mask; with the bottom-right causal alignment of :func:`mla_forward_padded` that is one
varlen segment (``c`` queries against a ``(m + 1) * c``-key prefix), so the whole rank's attention
is one call. The prefixes are gathered from the all-gathered K / V by one precomputed index
(about ``(1 + 1 / (2 cp))`` times the full K / V for zigzag).

Why all-gather and not a ring: see docs/megatron.md#context-parallel (measured: the all-gather
moves the same bytes in one collective and keeps one fused attention call per rank; the ring
needs ``cp`` calls and log-sum-exp merges per layer).

Collectives: every rank of the group issues the same ones (two all-gathers forward, two
reduce-scatters backward) whatever its data, an empty shard included. The plan (index and
offsets) is built once per offsets tensor, with one host read of the offsets and one status
exchange over the group, so a rank whose input is bad makes every rank raise instead of hanging.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._mla import mla_forward_padded

OP = "mla_cp_attention"
CP_LAYOUTS = ("zigzag", "contiguous")
_PLAN_ATTR = "_verl_ops_mla_cp_plan"


def group_size_rank(group) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` for ``None`` or without torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _AllGather(torch.autograd.Function):
    """``[t, ...]`` on each rank -> ``[cp * t, ...]`` rank-major; backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        rows = grad.shape[0] // ctx.size
        out = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=ctx.group)
            rank = dist.get_rank(ctx.group)
            out.copy_(grad[rank * rows : (rank + 1) * rows])
        else:
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None


class CpPlan:
    """Varlen offsets of this rank's query chunks and the index of their key prefixes in the
    all-gathered K / V (built on the host, moved to the device once)."""

    def __init__(self, cu_seqlens_padded: torch.Tensor, cp: int, rank: int, cp_layout: str, device):
        cu = cu_seqlens_padded.detach().to("cpu", torch.int64)
        padded = cu[1:] - cu[:-1]
        chunks = 2 * cp if cp_layout == "zigzag" else cp
        c = padded // chunks  # rows of one chunk of each sequence
        self.local_rows = int(cu[-1]) // cp
        local_start = cu[:-1] // cp
        mine = [rank, 2 * cp - 1 - rank] if cp_layout == "zigzag" else [rank]
        s = len(mine)
        # Segment j of sequence i: query chunk mine[j] (c_i rows, at local_start_i + j * c_i),
        # keys 0 .. (mine[j] + 1) * c_i - 1 of sequence i.
        seg_c = c.repeat_interleave(s)
        seg_q = seg_c
        seg_kv = seg_c * (torch.tensor(mine, dtype=torch.int64) + 1).repeat(len(c))
        seg_seq_start = local_start.repeat_interleave(s)
        self.cu_q = torch.cat([seg_q.new_zeros(1), seg_q.cumsum(0)]).to(torch.int32)
        self.cu_kv = torch.cat([seg_kv.new_zeros(1), seg_kv.cumsum(0)]).to(torch.int32)
        self.max_q = int(seg_q.max()) if seg_q.numel() else 0
        self.max_kv = int(seg_kv.max()) if seg_kv.numel() else 0
        total_kv = int(self.cu_kv[-1])
        # Row of key position p of a segment in the gathered [cp * local_rows] K / V.
        p = torch.arange(total_kv, dtype=torch.int64) - torch.repeat_interleave(self.cu_kv[:-1].long(), seg_kv)
        c_row = torch.repeat_interleave(seg_c, seg_kv)
        start_row = torch.repeat_interleave(seg_seq_start, seg_kv)
        chunk = torch.div(p, c_row.clamp(min=1), rounding_mode="floor")
        within = p - chunk * c_row
        if cp_layout == "zigzag":
            second = chunk >= cp
            owner = torch.where(second, 2 * cp - 1 - chunk, chunk)
            slot = second.long()
        else:
            owner, slot = chunk, torch.zeros_like(chunk)
        kv_index = owner * self.local_rows + start_row + slot * c_row + within
        self.cu_q = self.cu_q.to(device)
        self.cu_kv = self.cu_kv.to(device)
        self.kv_index = kv_index.to(device)
        self.key = (cp, rank, cp_layout, str(device), cu_seqlens_padded._version)


def _local_error(q, k, v, cu_seqlens_padded, cp, cp_layout) -> str:
    """The first problem with this rank's arguments, or ''. Called before the status exchange."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"{OP}: q, k, v must be [t, n, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return f"{OP}: q, k, v must have the same rows (this rank's shard), got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
    if k.shape[1] != v.shape[1] or q.shape[1] % max(k.shape[1], 1) != 0:
        return f"{OP}: heads of q / k / v do not match: {q.shape[1]}, {k.shape[1]}, {v.shape[1]}"
    if k.shape[2] != q.shape[2] or v.shape[2] > q.shape[2]:
        return f"{OP}: head dims must be q == k >= v, got q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"{OP}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 1:
        return f"{OP}: cu_seqlens_padded must be [B + 1], got shape {tuple(cu_seqlens_padded.shape)}"
    if cu_seqlens_padded.dtype not in (torch.int32, torch.int64):
        return f"{OP}: cu_seqlens_padded must be int32, got {cu_seqlens_padded.dtype}"
    cu = cu_seqlens_padded.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        return f"{OP}: cu_seqlens_padded must start at 0 and be non-decreasing, got {cu.tolist()}"
    chunks = 2 * cp if cp_layout == "zigzag" else cp
    bad = (lengths % chunks != 0).nonzero()
    if bad.numel():
        i = int(bad[0])
        return (
            f"{OP}: cu_seqlens_padded: sequence {i} has padded length {int(lengths[i])}, not a multiple of "
            f"{chunks} ({cp_layout} layout over {cp} CP ranks)"
        )
    if int(cu[-1]) // cp != q.shape[0]:
        return (
            f"{OP}: q has {q.shape[0]} rows, but this rank's shard of cu_seqlens_padded (total "
            f"{int(cu[-1])} over {cp} CP ranks) has {int(cu[-1]) // cp}"
        )
    return ""


def _plan(q, k, v, cu_seqlens_padded, cp, rank, cp_layout, group) -> CpPlan:
    key = (cp, rank, cp_layout, str(q.device), cu_seqlens_padded._version)
    cached = getattr(cu_seqlens_padded, _PLAN_ATTR, None)
    if cached is not None and cached.key == key and cached.local_rows == q.shape[0]:
        return cached
    error = _local_error(q, k, v, cu_seqlens_padded, cp, cp_layout)
    # Status exchange: every rank learns whether any rank's arguments are bad, so all raise
    # together rather than some waiting in the all-gather.
    dev = q.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    status = torch.tensor([1 if error else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    if error:
        raise ValueError(error)
    if int(status.item()):
        raise ValueError(f"{OP}: another rank of the CP group got bad arguments (see its error); this rank's are fine")
    plan = CpPlan(cu_seqlens_padded, cp, rank, cp_layout, q.device)
    try:
        setattr(cu_seqlens_padded, _PLAN_ATTR, plan)
    except (AttributeError, RuntimeError):  # e.g. a tensor subclass that takes no attributes
        pass
    return plan


def mla_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    cp_group=None,
    cp_layout: str = "zigzag",
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of this CP rank's query rows over the whole sequences' keys.

    Args:
        q, k: ``[t_local, n, Dqk]``; v: ``[t_local, n, Dv]`` with ``Dv <= Dqk`` (this rank's shard).
        cu_seqlens_padded: int32 ``[B + 1]``, the global padded offsets (each padded length a
            multiple of ``2 * cp`` for zigzag, ``cp`` for contiguous), any device.
        max_seqlen: the longest padded sequence (used only without CP; ``None`` reads it).
        cp_group: the context-parallel process group (``None`` or one rank: no CP).
        cp_layout: ``"zigzag"`` or ``"contiguous"``.
        softmax_scale: default ``1 / sqrt(Dqk)``.
        backend: :func:`mla_forward_padded`'s backend.

    Returns:
        ``[t_local, n, Dv]``, equal to the rows of this rank in causal attention over the whole
        padded sequences; differentiable in q, k and v.
    """
    if cp_layout not in CP_LAYOUTS:
        raise ValueError(f"{OP}: cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    cp, rank = group_size_rank(cp_group)
    if cp == 1:
        if max_seqlen is None:
            cu = cu_seqlens_padded.detach().cpu().long()
            max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        cu32 = cu_seqlens_padded.to(device=q.device, dtype=torch.int32)
        return mla_forward_padded(
            q, k, v, cu32, cu32, max_seqlen, max_seqlen, causal=True, softmax_scale=softmax_scale, backend=backend
        )
    plan = _plan(q, k, v, cu_seqlens_padded, cp, rank, cp_layout, cp_group)
    k_all = _AllGather.apply(k, cp_group, cp)
    v_all = _AllGather.apply(v, cp_group, cp)
    k_seg = k_all.index_select(0, plan.kv_index)
    v_seg = v_all.index_select(0, plan.kv_index)
    return mla_forward_padded(
        q, k_seg, v_seg, plan.cu_q, plan.cu_kv, plan.max_q, plan.max_kv,
        causal=True, softmax_scale=softmax_scale, backend=backend, validate=False,
    )
