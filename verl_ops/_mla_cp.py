"""MLA attention under context parallelism: all-gather K / V over the CP group, then each rank
attends its own query chunks on the varlen kernels with the native value head dim.

Layouts (docs/cp.md#cp-layouts): ``cu_seqlens_padded`` holds the global padded offsets of the
micro-batch. Zigzag: sequence ``i`` (padded length ``P_i``, a multiple of ``2 * cp``) is cut into
``2 * cp`` chunks, rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence, in
sequence order. Contiguous: rank ``r`` holds rows ``[r L, (r + 1) L)`` of the global buffer
(``L = total / cp``; a sequence may span ranks).

Each of this rank's query segments (a chunk, or a sequence's part on this rank) ending at
position ``e`` of its sequence sees keys ``0 .. e - 1`` of that sequence under the causal mask;
with the bottom-right causal alignment of :func:`mla_forward_padded` that is one varlen segment
(the queries against a key prefix), so the whole rank's attention is one call. The prefixes are
gathered from the all-gathered K / V by one precomputed index (about ``(1 + 1 / (2 cp))`` times
the full K / V for zigzag).

Why all-gather and not a ring: docs/megatron.md#context-parallel (one collective per tensor and
one fused attention call per rank; the ring needs ``cp`` calls and log-sum-exp merges per layer;
benchmarks/megatron/bench_mla_cp.py measures both).

Collectives: every rank of the group issues the same ones (a small status all-reduce, then the
all-gathers or the ring's exchanges, forward and backward) whatever its data or what it remembers,
an empty shard included. The status exchange makes every rank raise when one rank's arguments are
bad (any argument mla_cp_attention or the attention op would reject on that rank: names, dtypes
the device's kernels do not take, shapes, offsets, the softmax scale) or when the ranks disagree
on what their collectives must share (dtype, kv heads, head dims, rows), instead of some ranks
waiting in a collective the others never join. The plan (index and offsets) is built once per
offsets tensor, with one host read of the offsets.

dtypes: whatever :func:`mla_forward_padded` takes on the device, float32 on CUDA included (its
CUDA reference kernels); the ring merges partial results in float32 (float64 for float64).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from ._mla import BACKENDS, _qkv_error, mla_forward_padded
from ._validate import cache_version, plain_error

_ops = torch.ops.verl_ops

OP = "mla_cp_attention"
CP_LAYOUTS = ("zigzag", "contiguous")
CP_COMM_TYPES = ("all_gather", "p2p")
_PLAN_ATTR = "_verl_ops_mla_cp_plan"


def group_size_rank(group) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` for ``None`` or without torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def longest_sequence(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of the offsets ``cu_seqlens`` (a host read)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _all_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[t, ...]`` on each rank -> ``[size * t, ...]``, rank-major."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The adjoint of :func:`_all_gather`: ``[size * t, ...]`` summed over the ranks, this rank's
    ``[t, ...]`` block. ``x`` is a buffer of the caller's (it may be overwritten)."""
    rows = x.shape[0] // size
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
        dist.all_reduce(x, group=group)
        rank = dist.get_rank(group)
        return x[rank * rows : (rank + 1) * rows].clone()
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _keep(ctx, q, k, v, out, lse, plan, group, cp, scale, backend_code):
    """What both communications keep for the backward: this rank's tensors only."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.meta = (plan, group, cp, scale, backend_code)


class _AllGatherAttention(torch.autograd.Function):
    """All-gather K / V, attend this rank's query segments to their key prefixes (one varlen call),
    and the adjoint. Only this rank's q, k, v, out and lse are kept for the backward, which
    gathers K / V again: the memory kept per layer shrinks with the CP size, as CP is for."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, cp, scale, backend_code):
        k_seg = _all_gather(k, group, cp).index_select(0, plan.kv_index)
        v_seg = _all_gather(v, group, cp).index_select(0, plan.kv_index)
        out, lse = _ops.mla_forward_padded(q, k_seg, v_seg, *plan.segments, scale, backend_code)
        _keep(ctx, q, k, v, out, lse, plan, group, cp, scale, backend_code)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, group, cp, scale, backend_code = ctx.meta
        k_all = _all_gather(k, group, cp)
        v_all = _all_gather(v, group, cp)
        dq, dk_seg, dv_seg = _ops.mla_backward_padded(
            grad_out.contiguous(),
            q,
            k_all.index_select(0, plan.kv_index),
            v_all.index_select(0, plan.kv_index),
            out,
            lse,
            *plan.segments,
            scale,
            backend_code,
        )
        dk_all = torch.zeros_like(k_all).index_add_(0, plan.kv_index, dk_seg)
        dv_all = torch.zeros_like(v_all).index_add_(0, plan.kv_index, dv_seg)
        return (
            dq,
            _reduce_scatter(dk_all, group, cp),
            _reduce_scatter(dv_all, group, cp),
            None,
            None,
            None,
            None,
            None,
        )


def _exchange(sends, recvs, group, cp, rank):
    """Send ``sends`` to the next rank of the ring and receive ``recvs`` from the previous one."""
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recvs]
    return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


def _ring_steps(cp, rank):
    """(step, kind) of the zigzag ring: step i attends the K / V block of rank ``rank - i``.
    "self": the own block, causal. "low" (a lower rank's block, chunks ``src`` and ``2 cp - 1 - src``):
    every local query sees its first chunks whole and its second chunks not at all. "high" (a higher
    rank's block): only the local second chunks see it, whole."""
    for i in range(cp):
        src = (rank - i) % cp
        yield i, "self" if i == 0 else ("low" if src < rank else "high")


def _ring_segments(plan, kind):
    """One ring step's attention: ``(q_rows, kv_rows, cu_q, cu_kv, max_q, max_kv, causal)``, the
    local query rows and block rows it takes (None: all of them) and its varlen offsets."""
    if kind == "self":
        return None, None, plan.cu_local, plan.cu_local, plan.max_local, plan.max_local, True
    if kind == "low":
        return None, plan.first, plan.cu_local, plan.cu_chunk, plan.max_local, plan.max_chunk, False
    return plan.second, None, plan.cu_chunk, plan.cu_local, plan.max_chunk, plan.max_local, False


def _rows(x, rows, dim=0):
    return x if rows is None else x.index_select(dim, rows)


def _pass_block(block, last, group, cp, rank):
    """Start sending ``block`` to the next rank of the ring and receiving the previous rank's
    (except at the last step): ``(requests, the arriving block or None)``."""
    if last:
        return [], None
    nxt = tuple(torch.empty_like(t) for t in block)
    return _exchange(block, nxt, group, cp, rank), nxt


def _merge(out_acc, lse_acc, out, lse, rows=None):
    """Fold a partial result (out [t, H, Dv], lse [H, t]) into the accumulators (at ``rows``)."""
    acc_o = _rows(out_acc, rows)
    acc_l = _rows(lse_acc, rows, 1)
    new = torch.logaddexp(acc_l, lse.to(acc_l.dtype))
    merged = acc_o * torch.exp(acc_l - new).t().unsqueeze(-1) + out.to(acc_o.dtype) * torch.exp(
        lse.to(acc_l.dtype) - new
    ).t().unsqueeze(-1)
    if rows is None:
        out_acc.copy_(merged)
        lse_acc.copy_(new)
    else:
        out_acc.index_copy_(0, rows, merged)
        lse_acc.index_copy_(1, rows, new)


class _RingAttention(torch.autograd.Function):
    """Zigzag ring (Megatron's ``p2p`` cp_comm_type): the K / V blocks travel round the CP group
    while each step's block is attended (one varlen call per step), partial results merged by
    their log-sum-exp; in the backward the blocks travel again with their dK / dV accumulators,
    which reach the block's owner after the last step."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, cp, scale, backend_code):
        rank = dist.get_rank(group)
        t, h = q.shape[:2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out_acc = torch.zeros(t, h, v.shape[-1], dtype=acc, device=q.device)
        lse_acc = torch.full((h, t), -math.inf, dtype=acc, device=q.device)
        kb, vb = k.contiguous(), v.contiguous()
        for i, kind in _ring_steps(cp, rank):
            # the next block travels while this one is attended
            reqs, nxt = _pass_block((kb, vb), i == cp - 1, group, cp, rank)
            q_rows, kv_rows, *segments = _ring_segments(plan, kind)
            o, lse = _ops.mla_forward_padded(
                _rows(q, q_rows), _rows(kb, kv_rows), _rows(vb, kv_rows), *segments, scale, backend_code
            )
            _merge(out_acc, lse_acc, o, lse, q_rows)
            _wait(reqs)
            if nxt is not None:
                kb, vb = nxt
        out = out_acc.to(q.dtype)
        _keep(ctx, q, k, v, out, lse_acc, plan, group, cp, scale, backend_code)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, group, cp, scale, backend_code = ctx.meta
        rank = dist.get_rank(group)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kb, vb = k.contiguous(), v.contiguous()
        acc_reqs, acc_in = [], None
        for i, kind in _ring_steps(cp, rank):
            reqs, nxt = _pass_block((kb, vb), i == cp - 1, group, cp, rank)
            q_rows, kv_rows, *segments = _ring_segments(plan, kind)
            dq_p, dk_p, dv_p = _ops.mla_backward_padded(
                _rows(dout, q_rows),
                _rows(q, q_rows),
                _rows(kb, kv_rows),
                _rows(vb, kv_rows),
                _rows(out, q_rows),
                _rows(lse, q_rows, 1),
                *segments,
                scale,
                backend_code,
            )
            if q_rows is None:
                dq.add_(dq_p)
            else:
                dq.index_add_(0, q_rows, dq_p.to(dq.dtype))
            if kv_rows is not None:
                dk_p = torch.zeros_like(kb).index_copy_(0, kv_rows, dk_p)
                dv_p = torch.zeros_like(vb).index_copy_(0, kv_rows, dv_p)
            if acc_in is not None:  # this block's accumulator, from the previous rank
                _wait(acc_reqs)
                dk_p, dv_p = acc_in[0] + dk_p, acc_in[1] + dv_p
            acc = (dk_p.contiguous(), dv_p.contiguous())
            acc_in = (torch.empty_like(acc[0]), torch.empty_like(acc[1]))
            # The accumulator travels with its block; after the last step it reaches the owner.
            acc_reqs = _exchange(acc, acc_in, group, cp, rank)
            _wait(reqs)
            if nxt is not None:
                kb, vb = nxt
        _wait(acc_reqs)
        return dq.to(q.dtype), acc_in[0], acc_in[1], None, None, None, None, None


class CpPlan:
    """Varlen offsets of this rank's query segments and the index of their key prefixes in the
    all-gathered K / V (built on the host, moved to the device once)."""

    def __init__(self, cu_seqlens_padded: torch.Tensor, cu: torch.Tensor, cp: int, rank: int, cp_layout: str,
                 device):
        # cu: cu_seqlens_padded read to the host (int64), already checked
        self.local_rows = int(cu[-1]) // cp
        if cp_layout == "zigzag":
            seg_q, seg_kv, kv_index = self._zigzag(cu, cp, rank)
        else:
            seg_q, seg_kv, kv_index = self._contiguous(cu, cp, rank)
        self.cu_q = torch.cat([seg_q.new_zeros(1), seg_q.cumsum(0)]).to(torch.int32).to(device)
        self.cu_kv = torch.cat([seg_kv.new_zeros(1), seg_kv.cumsum(0)]).to(torch.int32).to(device)
        self.max_q = int(seg_q.max()) if seg_q.numel() else 0
        self.max_kv = int(seg_kv.max()) if seg_kv.numel() else 0
        self.kv_index = kv_index.to(device)
        self.key = (cp, rank, cp_layout, str(device), cache_version(cu_seqlens_padded))
        if cp_layout == "zigzag":
            self._ring(cu, cp, device)

    @property
    def segments(self):
        """The all-gather attention's varlen arguments: ``(cu_q, cu_kv, max_q, max_kv, causal)``."""
        return self.cu_q, self.cu_kv, self.max_q, self.max_kv, True

    def _ring(self, cu, cp, device):
        # The ring's offsets: each sequence's local rows (2 chunks) or one chunk, and the local row
        # indices of every sequence's first and second chunk.
        chunk = (cu[1:] - cu[:-1]) // (2 * cp)
        local = 2 * chunk
        self.cu_local = torch.cat([local.new_zeros(1), local.cumsum(0)]).to(torch.int32).to(device)
        self.cu_chunk = torch.cat([chunk.new_zeros(1), chunk.cumsum(0)]).to(torch.int32).to(device)
        self.max_local = int(local.max()) if local.numel() else 0
        self.max_chunk = int(chunk.max()) if chunk.numel() else 0
        start = torch.repeat_interleave(cu[:-1] // cp, chunk)
        first = start + _positions_in_segments(chunk)
        self.first = first.to(device)
        self.second = (first + torch.repeat_interleave(chunk, chunk)).to(device)

    def _zigzag(self, cu, cp, rank):
        # Segment j of sequence i: query chunk m = mine[j] (c_i rows, at local_start_i + j * c_i),
        # keys 0 .. (m + 1) * c_i - 1 of sequence i, which lie in chunks 0 .. m of their owners.
        c = (cu[1:] - cu[:-1]) // (2 * cp)
        mine = torch.tensor([rank, 2 * cp - 1 - rank], dtype=torch.int64)
        seg_c = c.repeat_interleave(2)
        seg_kv = seg_c * (mine + 1).repeat(len(c))
        seg_start = (cu[:-1] // cp).repeat_interleave(2)
        p = _positions_in_segments(seg_kv)
        c_row = torch.repeat_interleave(seg_c, seg_kv)
        chunk = torch.div(p, c_row.clamp(min=1), rounding_mode="floor")
        second = chunk >= cp  # chunks cp .. 2 cp - 1 sit second on rank 2 cp - 1 - chunk
        owner = torch.where(second, 2 * cp - 1 - chunk, chunk)
        kv_index = (
            owner * self.local_rows
            + torch.repeat_interleave(seg_start, seg_kv)
            + second.long() * c_row
            + p
            - chunk * c_row
        )
        return seg_c, seg_kv, kv_index

    def _contiguous(self, cu, cp, rank):
        # Rank r holds rows [r L, (r + 1) L) of the global buffer (sequences may span ranks); the
        # gathered K / V is the global buffer itself. Each sequence's part on this rank, rows
        # [a, b), attends keys [cu_i, b) of its sequence.
        lo, hi = rank * self.local_rows, (rank + 1) * self.local_rows
        a = cu[:-1].clamp(lo, hi)
        b = cu[1:].clamp(lo, hi)
        keep = b > a
        a, b, start = a[keep], b[keep], cu[:-1][keep]
        seg_q, seg_kv = b - a, b - start
        kv_index = torch.repeat_interleave(start, seg_kv) + _positions_in_segments(seg_kv)
        return seg_q, seg_kv, kv_index


def _positions_in_segments(lengths: torch.Tensor) -> torch.Tensor:
    """``[0 .. lengths[0]), [0 .. lengths[1]), ...`` concatenated (int64)."""
    first = lengths.cumsum(0) - lengths
    return torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(first, lengths)


def _tensor_error(q, k, v, rows: int | None = None, shard: str = "") -> str:
    """The first problem with q / k / v (and, given, their row count against the shard's), or ''."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.is_nested:
            return f"{OP}: {name} must be a plain tensor, got {type(t).__name__}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"{OP}: q, k, v must be [t, n, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return (
            f"{OP}: q, k, v must have the same rows (this rank's shard), got {q.shape[0]}, {k.shape[0]}, "
            f"{v.shape[0]}"
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % max(k.shape[1], 1) != 0:
        return f"{OP}: heads of q / k / v do not match: {q.shape[1]}, {k.shape[1]}, {v.shape[1]}"
    if k.shape[2] != q.shape[2] or v.shape[2] > q.shape[2]:
        return f"{OP}: head dims must be q == k >= v, got q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"{OP}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if rows is not None and q.shape[0] != rows:
        return f"{OP}: q has {q.shape[0]} rows, but this rank's shard of cu_seqlens_padded{shard} has {rows}"
    return ""


def _offsets_error(cu_seqlens_padded, cu, cp, cp_layout) -> str:
    """The first problem with the offsets (``cu``: their host copy, or None when they are not a
    1-D integer tensor), or ''."""
    if cu is None:
        if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 1:
            return f"{OP}: cu_seqlens_padded must be [B + 1], got shape {tuple(cu_seqlens_padded.shape)}"
        return f"{OP}: cu_seqlens_padded must be int32, got {cu_seqlens_padded.dtype}"
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        return f"{OP}: cu_seqlens_padded must start at 0 and be non-decreasing, got {cu.tolist()}"
    # The layout rules pad every sequence to a multiple of 2 cp (zigzag) or cp (contiguous).
    align = 2 * cp if cp_layout == "zigzag" else cp
    bad = (lengths % align != 0).nonzero()
    if bad.numel():
        i = int(bad[0])
        return (
            f"{OP}: cu_seqlens_padded: sequence {i} has padded length {int(lengths[i])}, not a multiple "
            f"of {align} ({cp_layout} layout over {cp} CP ranks; docs/layout.md#alignment)"
        )
    return ""


def _host_offsets(cu_seqlens_padded):
    """The offsets read to the host as int64, or None when they are not a 1-D int32 / int64 tensor
    with at least one entry."""
    if (
        cu_seqlens_padded.dim() != 1
        or cu_seqlens_padded.numel() < 1
        or cu_seqlens_padded.dtype not in (torch.int32, torch.int64)
    ):
        return None
    return cu_seqlens_padded.detach().to("cpu", torch.int64)


# What the ranks' collectives must agree on (the all-gathered / passed K and V blocks), after the
# status flag of _exchange_status.
_SHARED = ("dtype", "kv heads", "Dqk", "Dv", "rows")
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shared_values(q, k, v) -> list:
    dtype = _DTYPE_CODES.index(q.dtype) if q.dtype in _DTYPE_CODES else len(_DTYPE_CODES)
    return [dtype, k.shape[1], q.shape[2], v.shape[2], q.shape[0]]


def _status_device(group, q) -> torch.device:
    """Where the status tensor lives: the CPU for gloo, else this rank's GPU (q's, or the current
    one when q is not a CUDA tensor: a bad argument must not make the exchange itself fail)."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def _exchange_status(error: str, q, k, v, group) -> None:
    """One all-reduce (MAX) of [bad, shared values, -shared values] on every call, whatever a rank
    remembers from earlier calls: every rank learns whether any rank's arguments are bad and whether
    the ranks agree on _SHARED, so all raise together rather than some waiting in a collective."""
    values = [0] * len(_SHARED) if error else _shared_values(q, k, v)
    row = [1 if error else 0] + values + [-x for x in values]
    status = torch.tensor(row, dtype=torch.int64, device=_status_device(group, q))
    dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
    got = status.tolist()
    if error:
        raise ValueError(error)
    if got[0]:
        raise ValueError(
            f"{OP}: another rank of the CP group got bad arguments (see its error); this rank's are fine"
        )
    n = len(_SHARED)
    high, low = got[1 : 1 + n], [-x for x in got[1 + n :]]
    differ = [name for name, a, b in zip(_SHARED, high, low) if a != b]
    if differ:
        raise ValueError(
            f"{OP}: the ranks of the CP group disagree on {', '.join(differ)} of q / k / v (every rank "
            f"must pass the same dtype, kv heads and head dims, and the rows of one shard); this rank "
            f"has {dict(zip(_SHARED, values))}"
        )


def _argument_error(cp_layout, backend, cp_comm_type, softmax_scale) -> str:
    """The first problem with the non-tensor arguments, or ''."""
    if cp_layout not in CP_LAYOUTS:
        return f"{OP}: cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}"
    if backend not in BACKENDS:
        return f"{OP}: backend must be one of {BACKENDS}, got {backend!r}"
    if cp_comm_type not in CP_COMM_TYPES:
        return f"{OP}: cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}"
    if cp_comm_type == "p2p" and cp_layout != "zigzag":
        return f"{OP}: cp_comm_type 'p2p' (the ring) takes the zigzag layout only, got {cp_layout!r}"
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale)
    ):
        return f"{OP}: softmax_scale must be a finite float or None, got {softmax_scale!r}"
    return ""


def _device_error(q, k, v, group) -> str:
    """q / k / v on a device the group's backend does not communicate (NCCL: CUDA only), or ''."""
    backend = dist.get_backend(group)
    if backend == "nccl" and not (q.is_cuda and k.is_cuda and v.is_cuda):
        return (
            f"{OP}: the CP group's backend is nccl, which needs CUDA tensors; got q on {q.device}, "
            f"k on {k.device}, v on {v.device}"
        )
    return ""


def _plan(q, k, v, cu_seqlens_padded, cp, rank, cp_layout, group, softmax_scale=None, error="") -> CpPlan:
    """This call's plan (cached on the offsets tensor), after the status exchange. `error`: a
    problem the caller found already; it is raised on this rank and reported to the others."""
    cached, fresh, cu = None, True, None
    if not error and not isinstance(cu_seqlens_padded, torch.Tensor):
        error = f"{OP}: cu_seqlens_padded must be a tensor, got {type(cu_seqlens_padded).__name__}"
    error = error or _tensor_error(q, k, v)
    # The op's own checks of q / k / v (dtypes its kernels take on the device, shapes) and of the
    # scale: a rank whose attention call would fail says so here, before any collective.
    error = error or _qkv_error(OP, q, k, v, softmax_scale) or _device_error(q, k, v, group)
    if not error:
        version = cache_version(cu_seqlens_padded)
        key = (cp, rank, cp_layout, str(q.device), version)
        cached = getattr(cu_seqlens_padded, _PLAN_ATTR, None) if version is not None else None
        fresh = cached is None or cached.key != key
        if fresh:
            cu = _host_offsets(cu_seqlens_padded)  # the one host read of a new plan
            total = int(cu[-1]) if cu is not None else 0
            error = _offsets_error(cu_seqlens_padded, cu, cp, cp_layout) or _tensor_error(
                q, k, v, total // cp, f" (total {total} over {cp} CP ranks)"
            )
        else:
            error = _tensor_error(q, k, v, cached.local_rows)
    _exchange_status(error, q, k, v, group)
    if not fresh:
        return cached
    plan = CpPlan(cu_seqlens_padded, cu, cp, rank, cp_layout, q.device)
    if key[-1] is not None:  # no cache on a tensor without a version counter
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
    cp_comm_type: str = "all_gather",
) -> torch.Tensor:
    """Causal attention of this CP rank's query rows over the whole sequences' keys.

    Args:
        q, k: ``[t_local, n, Dqk]``; v: ``[t_local, n, Dv]`` with ``Dv <= Dqk`` (this rank's shard).
        cu_seqlens_padded: int32 ``[B + 1]``, the global padded offsets (each padded length a
            multiple of ``2 * cp`` for zigzag, of ``cp`` for contiguous: the layout rules), any
            device.
        max_seqlen: the longest padded sequence (used only without CP, where ``None`` reads it;
            under CP the plan computes its segments' lengths from the offsets).
        cp_group: the context-parallel process group (``None`` or one rank: no CP).
        cp_layout: ``"zigzag"`` or ``"contiguous"``.
        softmax_scale: default ``1 / sqrt(Dqk)``.
        backend: :func:`mla_forward_padded`'s backend (``"auto"``, ``"padded"``, ``"native"``,
            ``"varlen"``; float32 / float64 on CUDA run its CUDA reference kernels under every
            name).
        cp_comm_type: ``"all_gather"`` (K / V all-gathered, one attention call; both layouts) or
            ``"p2p"`` (a ring: K / V blocks passed round the group under the attention of the
            previous block, log-sum-exp merges; zigzag only). Megatron's names; which is faster
            depends on the CP size and the heads (docs/megatron.md#context-parallel).

    Returns:
        ``[t_local, n, Dv]``, equal to the rows of this rank in causal attention over the whole
        padded sequences; differentiable in q, k and v.
    """
    tensors = (("q", q), ("k", k), ("v", v), ("cu_seqlens_padded", cu_seqlens_padded))
    error = next((e for name, t in tensors if (e := plain_error(OP, name, t))), "")
    error = error or _argument_error(cp_layout, backend, cp_comm_type, softmax_scale)
    cp, rank = group_size_rank(cp_group)
    if cp > 1:
        # Every check, this rank's argument errors included, goes through the status exchange.
        plan = _plan(q, k, v, cu_seqlens_padded, cp, rank, cp_layout, cp_group, softmax_scale, error)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        impl = _RingAttention if cp_comm_type == "p2p" else _AllGatherAttention
        return impl.apply(q, k, v, plan, cp_group, cp, float(softmax_scale), BACKENDS.index(backend))
    if error:
        raise ValueError(error)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if max_seqlen is None:
        max_seqlen = longest_sequence(cu_seqlens_padded)
    cu32 = cu_seqlens_padded.to(device=q.device, dtype=torch.int32)
    return mla_forward_padded(
        q,
        k,
        v,
        cu32,
        cu32,
        max_seqlen,
        max_seqlen,
        causal=True,
        softmax_scale=softmax_scale,
        backend=backend,
    )

