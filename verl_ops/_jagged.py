"""The jagged row ops jagged_gather (select / reorder whole sequences of a jagged batch) and
jagged_scatter (its adjoint): their fake (Meta) kernels, autograd and Python API. Used by dynamic
context parallel to take a group's subset of a batch and to put gathered outputs back into sample
order."""

from __future__ import annotations

import torch

from ._library import call_op, register_autograd
from ._validate import (
    INT32_MAX, as_int, check, check_plain, check_size, host_values_required, is_meta, is_tracing,
    should_validate
)

_ops = torch.ops.verl_ops


# --------------------------------------------------------------------------------------------
# Fake (Meta) kernels: the output is [rows, *F] with rows given (total_out / total_in).


def _jagged_fake(op, data_name, values, src_starts, cu_out, rows, rows_name):
    check(values.dim() >= 1, op, f"{data_name} must be [rows, *F], got a 0-d tensor")
    check(src_starts.dtype == torch.int64, op, f"src_starts must be int64, got {src_starts.dtype}")
    check(src_starts.dim() == 1, op, f"src_starts must be 1-D, got {src_starts.dim()} dims")
    check(cu_out.dtype == torch.int32, op, f"cu_seqlens_out must be int32, got {cu_out.dtype}")
    check(cu_out.dim() == 1, op, f"cu_seqlens_out must be 1-D, got {cu_out.dim()} dims")
    torch._check(
        cu_out.shape[0] == src_starts.shape[0] + 1,
        lambda: f"{op}: cu_seqlens_out must have len(src_starts) + 1 entries",
    )
    check(src_starts.device == values.device, op, f"src_starts is on {src_starts.device} but {data_name} is on {values.device}")
    check(cu_out.device == values.device, op, f"cu_seqlens_out is on {cu_out.device} but {data_name} is on {values.device}")
    torch._check(rows >= 0, lambda: f"{op}: {rows_name} must be >= 0, got {rows}")
    check_size(op, rows_name, (rows,) + tuple(values.shape[1:]), values.dtype)
    return values.new_empty((rows,) + tuple(values.shape[1:]))


@torch.library.register_fake("verl_ops::jagged_gather")
def _jagged_gather_fake(values, src_starts, cu_seqlens_out, total_out):
    return _jagged_fake("jagged_gather", "values", values, src_starts, cu_seqlens_out, total_out, "total_out")


@torch.library.register_fake("verl_ops::jagged_scatter")
def _jagged_scatter_fake(grad, src_starts, cu_seqlens_out, total_in):
    return _jagged_fake("jagged_scatter", "grad", grad, src_starts, cu_seqlens_out, total_in, "total_in")


# --------------------------------------------------------------------------------------------
# Autograd: the two ops are each other's adjoint, so each backward is one call of the other.


def _setup_context(ctx, inputs, output):
    # Both ops: (data, src_starts, cu_seqlens_out, rows of the other side); the backward needs the
    # index tensors and the data's row count (the other op's row argument).
    data, src_starts, cu_out, _ = inputs
    ctx.save_for_backward(src_starts, cu_out)
    ctx.data_rows = data.shape[0]


def _gather_backward(ctx, grad):
    # Spans may repeat (a row gathered twice gets both gradients), so this accumulates with
    # index_add_ instead of the disjoint-span scatter kernel. Row indices are built on the device
    # with the known output size: no host synchronisation.
    src_starts, cu_out = ctx.saved_tensors
    total_out = grad.shape[0]
    lengths = (cu_out[1:] - cu_out[:-1]).to(torch.int64)
    first = torch.repeat_interleave(src_starts - cu_out[:-1].to(torch.int64), lengths, output_size=total_out)
    rows = first + torch.arange(total_out, device=grad.device)
    out = grad.new_zeros((ctx.data_rows, *grad.shape[1:]))
    return out.index_add_(0, rows, grad), None, None, None


def _scatter_backward(ctx, grad_out):
    src_starts, cu_out = ctx.saved_tensors
    return _ops.jagged_gather(grad_out.contiguous(), src_starts, cu_out, ctx.data_rows), None, None, None


register_autograd("verl_ops::jagged_gather", _gather_backward, setup_context=_setup_context)
register_autograd("verl_ops::jagged_scatter", _scatter_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Wrappers. The C++ ops check index values themselves for CPU tensors; for device tensors that
# would be a host synchronisation, so the wrappers check them here, eagerly, unless validate=False
# (and never while tracing or capturing a CUDA graph).


def _check_index_tensors(op: str, src_starts, cu_seqlens_out) -> None:
    for name, t, dtype in (
        ("src_starts", src_starts, torch.int64),
        ("cu_seqlens_out", cu_seqlens_out, torch.int32),
    ):
        check_plain(op, name, t)
        if t.dtype != dtype or t.dim() != 1:
            raise ValueError(
                f"{op}: {name} must be a 1-D {dtype} tensor, got {t.dtype} of shape {tuple(t.shape)}"
            )
    if cu_seqlens_out.shape[0] != src_starts.shape[0] + 1:
        raise ValueError(
            f"{op}: cu_seqlens_out must have len(src_starts) + 1 = {src_starts.shape[0] + 1} entries, "
            f"got {cu_seqlens_out.shape[0]}"
        )


def _check_values_on_host(
    op: str, src_starts, cu_out, gathered_rows: int, pool_rows: int, scatter: bool
) -> None:
    """The C++ CPU checks, for index tensors that live on a device."""
    both = torch.cat([cu_out.to(torch.int64), src_starts]).cpu()  # one device-to-host copy
    n = src_starts.shape[0]
    cu, st = both[: n + 1], both[n + 1 :]
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0:
        raise RuntimeError(f"{op}: cu_seqlens_out must start at 0, got {int(cu[0])}")
    if n and bool((lens < 0).any()):
        j = int((lens < 0).nonzero()[0])
        raise RuntimeError(
            f"{op}: cu_seqlens_out must be non-decreasing, got {int(cu[j])} then {int(cu[j + 1])} "
            f"at index {j}"
        )
    bad = (st < 0) | (st + lens > pool_rows)
    if n and bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise RuntimeError(
            f"{op}: src_starts[{j}]={int(st[j])} with length {int(lens[j])} is outside the "
            f"{pool_rows} rows of {'the output (total_in)' if scatter else 'values'}"
        )
    if int(cu[-1]) != gathered_rows:
        raise RuntimeError(
            f"{op}: cu_seqlens_out[-1]={int(cu[-1])} but the gathered side has {gathered_rows} rows"
        )
    if scatter and n > 1:
        keep = lens > 0
        s, e = st[keep], (st + lens)[keep]
        order = torch.argsort(s)
        s, e = s[order], e[order]
        if bool((s[1:] < e[:-1]).any()):
            raise RuntimeError(
                f"{op}: src_starts select overlapping rows; the scatter needs each row at most once"
            )


def jagged_gather(
    values: torch.Tensor,
    src_starts: torch.Tensor,
    cu_seqlens_out: torch.Tensor,
    total_out: int | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Gather whole sequences: output sequence j is rows ``[src_starts[j], src_starts[j] + len_j)``
    of ``values``, ``len_j = cu_seqlens_out[j+1] - cu_seqlens_out[j]``.

    Args:
        values: ``[rows, *F]``, any dtype.
        src_starts: int64 ``[n]``, first source row of each output sequence (spans may repeat).
        cu_seqlens_out: int32 ``[n + 1]``, prefix sums of the output lengths (starting at 0).
        total_out: ``cu_seqlens_out[-1]``; pass it to avoid reading it from a device tensor.
        validate: check index values on device tensors (a host read). Default: on, except under
            torch.compile / CUDA-graph capture. CPU tensors are always checked; meta tensors
            (shape inference) never are, and need ``total_out``.

    Returns:
        ``[total_out, *F]``. Differentiable in ``values`` (the backward accumulates, so repeated
        spans get the sum of their gradients).
    """
    op = "jagged_gather"
    check_plain(op, "values", values)
    _check_index_tensors(op, src_starts, cu_seqlens_out)
    if total_out is None:
        if is_meta(cu_seqlens_out):
            raise host_values_required(
                op, "cu_seqlens_out", "offsets", "pass total_out= (the output row count) for shape inference"
            )
        if cu_seqlens_out.shape[0] == 0:
            raise ValueError(f"{op}: cu_seqlens_out must have at least one entry (it starts at 0)")
        total_out = int(cu_seqlens_out[-1])
    elif not is_tracing(values):
        total_out = as_int(op, "total_out", total_out, lo=0, hi=INT32_MAX)
    if values.dim() >= 1 and values.device.type != "cpu" and should_validate(validate, values):
        _check_values_on_host(op, src_starts, cu_seqlens_out, total_out, values.shape[0], False)
    return call_op(_ops.jagged_gather, values, values, src_starts, cu_seqlens_out, total_out)


def jagged_scatter(
    grad: torch.Tensor,
    src_starts: torch.Tensor,
    cu_seqlens_out: torch.Tensor,
    total_in: int,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Adjoint of :func:`jagged_gather`: ``grad`` is shaped like the gather's output
    ``[cu_seqlens_out[-1], *F]``; returns ``[total_in, *F]`` with each sequence's rows put back at
    ``src_starts[j]`` and zeros elsewhere. The spans must be disjoint (checked).

    Differentiable in ``grad`` (backward: :func:`jagged_gather`).
    """
    op = "jagged_scatter"
    check_plain(op, "grad", grad)
    _check_index_tensors(op, src_starts, cu_seqlens_out)
    if not is_tracing(grad):
        total_in = as_int(op, "total_in", total_in, lo=0, hi=INT32_MAX)
    if grad.dim() >= 1 and grad.device.type != "cpu" and should_validate(validate, grad):
        _check_values_on_host(op, src_starts, cu_seqlens_out, grad.shape[0], total_in, True)
    return call_op(_ops.jagged_scatter, grad, grad, src_starts, cu_seqlens_out, total_in)


def jagged_indices(lengths, selection, device=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(src_starts int64 [n], cu_seqlens_out int32 [n + 1], total_out)`` that gather sequences
    ``selection`` (indices into a batch with per-sequence ``lengths``), in that order. Host-side
    arithmetic on Python ints; the two tensors are built on ``device`` with one copy."""
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += int(n)
    src, cu = [], [0]
    for i in selection:
        src.append(starts[i])
        cu.append(cu[-1] + int(lengths[i]))
    if cu[-1] > torch.iinfo(torch.int32).max:
        raise ValueError(f"jagged_indices: {cu[-1]} selected rows do not fit int32 offsets")
    both = torch.tensor(src + cu, dtype=torch.int64)
    if device is not None:
        both = both.to(device)
    n = len(src)
    return both[:n], both[n:].to(torch.int32), cu[-1]
