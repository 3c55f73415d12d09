"""The MLA attention ops mla_forward_padded, mla_backward_padded and mla_cache_info:
variable-length (THD) attention for Multi-Latent Attention head dims (value head dim Dv <=
query/key head dim Dqk; docs/mla.md#semantics). Their fake (Meta) kernels, the Python copy of the
``backend="auto"`` rule (the one the fake kernels and the Python API use; the op's own is
resolve_mla_backend in csrc/mla/mla_ops.cpp, and tests/test_mla.py checks that the two agree),
the autograd of mla_forward_padded and the Python API."""

from __future__ import annotations

import math
import numbers
import os

import torch

from ._library import register_autograd
from ._validate import INT32_MAX, as_bool, as_int, check, check_plain, is_meta, should_validate

_ops = torch.ops.verl_ops

BACKENDS = ("auto", "padded", "native", "varlen")
# Backends of the Python API only (not codes of the raw op): "fa4" calls FlashAttention-4's varlen
# kernels when flash-attn-4 is installed (an optional extra: pip install verl_ops[fa4]).
EXTRA_BACKENDS = ("fa4",)

_CACHE_FIELDS = ("available", "size", "hits", "misses", "builds", "failures", "evictions", "capacity",
                 "failed_buckets", "cudnn_version", "hopper_forward", "hopper_backward")


# --------------------------------------------------------------------------------------------
# backend="auto" (the Python copy of resolve_mla_backend) and the fake (Meta) kernels.

# Mirrors csrc/mla/mla_ops.cpp: the shapes where backend=auto picks the native path (Dqk, Dv,
# min max_seqlen, min query rows x heads).
_AUTO_NATIVE = ((192, 128, 1024, 16 * 1024 * 16),)
# Mirrors kAutoVarlen in csrc/mla/mla_ops.cpp: the head dims where backend=auto sends batches that
# are not uniform to the varlen backend (Dqk, Dv, min query rows x heads), where _varlen_auto holds.
_AUTO_VARLEN = ((192, 128, 0), (64, 64, 0), (128, 128, 0), (192, 192, 0), (256, 256, 0))
# Whether this build has the varlen backend, with the loaded cuDNN's version (auto uses varlen from
# kVarlenAutoMinCudnn, 9.7.0, on) and whether varlen runs the own SM90 forward and backward
# (mla_cache_info's hopper_forward and hopper_backward, where auto also sends uniform 192 / 128
# batches to it): read once, on the first question about a CUDA device, not at import. Reading
# the version loads part of cuDNN (cudnnGetVersion loads libcudnn_graph); a library that did that
# at import would change which cuDNN a later import picks: TransformerEngine's library names every
# cuDNN library as a dependency and, where the machine has its own cuDNN beside torch's, gets a
# mix of the two and fails to load. torch itself loads those libraries on first use only.
_VARLEN_STATE = None  # (built, cudnn version, own kernels)


def _probe_varlen() -> tuple:
    # (outside any fake / functional mode: the fake kernels ask too, and there calling an op would
    # not return real values)
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():
            info = torch.ops.verl_ops.mla_cache_info(torch.empty(0, device="cpu")).tolist()
    except (AttributeError, RuntimeError):  # a module built before the op existed
        return False, 0, False
    own = len(info) > 11 and bool(info[10]) and bool(info[11])
    return bool(info[0]), (info[9] if len(info) > 9 else 0), own


def _varlen_state() -> tuple:
    """(built, cudnn version, own kernels); probed on the first call (see _VARLEN_STATE). Asked by
    the fake kernels and by eager code only (``_auto_takes_fa4`` returns before it while tracing)."""
    global _VARLEN_STATE
    if _VARLEN_STATE is None:
        _VARLEN_STATE = _probe_varlen()
    return _VARLEN_STATE


_VARLEN_AUTO_MIN_CUDNN = 90700
_VARLEN_DEVICES = {}


def _varlen_auto(device: torch.device) -> bool:
    """Mirrors prepare_mla's varlen_auto: the build has the varlen backend, the loaded cuDNN is
    9.7.0 or newer, and `device` is a CUDA device of compute capability 9.x."""
    if device.type != "cuda":
        return False
    built, cudnn, _ = _varlen_state()
    if not built or cudnn < _VARLEN_AUTO_MIN_CUDNN:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _VARLEN_DEVICES:
        _VARLEN_DEVICES[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _VARLEN_DEVICES[index]


def _auto_flags(device: torch.device) -> tuple:
    """(varlen_auto, varlen_uniform) for resolve_mla_backend, as prepare_mla computes them."""
    varlen_auto = _varlen_auto(device)
    return varlen_auto, varlen_auto and _varlen_state()[2]


def _shares_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One offsets tensor for q and kv: the same tensor, or views of one storage at one offset
    with one shape (mirrors shares_offsets in csrc/mla/mla_ops.cpp)."""
    if a is b:
        return True
    return (
        torch._C._is_alias_of(a, b)
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _check_qkv_kinds(op, q, k, v):
    """The op's checks of q, k and v that read no shape but the dims: 3-D floating point tensors
    of one dtype on one device, of a dtype the device's kernels take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check(t.dim() == 3, op, f"{name} must be 3-D [T, H, D], got {t.dim()} dims")
        check(t.dtype.is_floating_point, op, f"{name} must be floating point, got {t.dtype}")
    check(k.dtype == q.dtype and v.dtype == q.dtype, op,
           f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    check(k.device == q.device and v.device == q.device, op,
           f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    # The dtypes the op's kernels take on the device (prepare_mla in csrc/mla/mla_ops.cpp): traced
    # code fails here, as the op would at run time.
    if q.device.type in ("cuda", "cpu"):
        where = "CUDA" if q.device.type == "cuda" else "the CPU"
        check(q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64), op,
               f"q must be float16, bfloat16, float32 or float64 on {where}, got {q.dtype}")


def _check_qkv_shapes(op, q, k, v):
    """The op's checks of the shapes of q, k and v against each other (after _check_qkv_kinds)."""
    dqk, dv = q.shape[2], v.shape[2]
    tk, hq, hk = k.shape[0], q.shape[1], k.shape[1]
    torch._check(k.shape[2] == dqk, lambda: f"{op}: k must have q's head dim {dqk}, got {k.shape[2]}")
    torch._check(dv <= dqk, lambda: f"{op}: v's head dim (Dv={dv}) must be <= the q/k head dim (Dqk={dqk})")
    torch._check(dv >= 1, lambda: f"{op}: v's head dim must be >= 1")
    torch._check(v.shape[0] == tk, lambda: f"{op}: k and v must have the same number of rows")
    torch._check(v.shape[1] == hk, lambda: f"{op}: k and v must have the same number of heads")
    torch._check(hk >= 1, lambda: f"{op}: k must have at least one head")
    torch._check(hq % hk == 0, lambda: f"{op}: the number of q heads must be a multiple of the number of k/v heads")


def _qkv_error(op, q, k, v, softmax_scale=None) -> str:
    """What the op would reject in q, k, v and softmax_scale alone (no offsets, no data read), as
    its message, or ''. mla_cp_attention checks it on every rank before its first collective, so
    that a rank whose attention call would fail raises on every rank instead of leaving the
    others waiting in a collective."""
    try:
        _check_qkv_kinds(op, q, k, v)
        _check_qkv_shapes(op, q, k, v)
        if softmax_scale is not None:
            check(math.isfinite(softmax_scale), op, f"softmax_scale must be finite, got {softmax_scale}")
    except RuntimeError as e:
        return str(e)
    return ""


def _mla_sizes(op, q, k, v, cu_q, cu_kv, max_q, max_kv, softmax_scale):
    _check_qkv_kinds(op, q, k, v)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        check(cu.dtype == torch.int32, op, f"{name} must be int32, got {cu.dtype}")
        check(cu.dim() == 1, op, f"{name} must be 1-D [B + 1], got {cu.dim()} dims")
        check(cu.device == q.device, op, f"{name} is on {cu.device} but q is on another device: {q.device}")
    tq, hq, dqk = q.shape
    tk, hk = k.shape[0], k.shape[1]
    dv = v.shape[2]
    torch._check(cu_q.shape[0] >= 1, lambda: f"{op}: cu_seqlens_q must have B + 1 >= 1 entries")
    torch._check(cu_kv.shape[0] == cu_q.shape[0], lambda: f"{op}: cu_seqlens_kv must have as many entries as cu_seqlens_q")
    _check_qkv_shapes(op, q, k, v)
    for name, val in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        msg = lambda name=name, val=val: f"{op}: {name} must be in [0, {INT32_MAX}], got {val}"  # noqa: E731
        torch._check(val >= 0, msg)
        torch._check(val <= INT32_MAX, msg)
    if softmax_scale is not None:
        check(math.isfinite(softmax_scale), op, f"softmax_scale must be finite, got {softmax_scale}")
    return tq, tk, hq, hk, dqk, dv, cu_q.shape[0] - 1


def _reference_path(q: torch.Tensor) -> bool:
    """Mirrors prepare_mla's reference flag: float32 / float64 on CUDA run the CUDA reference
    kernels under every backend code (the other CUDA backends take float16 / bfloat16 only)."""
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.float64)


def _backend_flags(q: torch.Tensor) -> tuple:
    """(varlen_auto, varlen_uniform, reference) of resolve_mla_backend for q. The reference path
    needs no device query (a fake float32 CUDA model traces on a machine without a GPU)."""
    if _reference_path(q):
        return False, False, True
    return (*_auto_flags(q.device), False)


def _mla_backend(op, backend, sizes, max_q, max_kv, causal, same_offsets, varlen_auto,
                 varlen_uniform=False, reference=False) -> str:
    """Mirrors resolve_mla_backend in csrc/mla/mla_ops.cpp (shapes, and varlen_auto /
    varlen_uniform for auto; reference: _reference_path(q), ahead of every other rule)."""
    check(backend in (0, 1, 2, 3), op, f"backend must be 0 (auto), 1 (padded), 2 (native) or 3 (varlen), got {backend}")
    if reference:
        return "reference"
    name = BACKENDS[backend]
    if name in ("padded", "varlen"):
        return name
    tq, tk, hq, hk, dqk, dv, batch = sizes
    uniform = batch * max_q == tq and batch * max_kv == tk
    same_heads = hq == hk
    same_len = max_q == max_kv
    mask_ok = not causal or same_len
    ragged_ok = causal and same_offsets and same_len and tq == tk
    if max_q <= 1 and max_kv <= 1:
        return "padded"
    if name == "auto" and varlen_auto and not uniform:
        for r_dqk, r_dv, min_rows_heads in _AUTO_VARLEN:
            if dqk == r_dqk and dv == r_dv and tq * hq >= min_rows_heads:
                return "varlen"
    if name == "auto" and varlen_auto and varlen_uniform and uniform and dqk == 192 and dv == 128:
        return "varlen"
    if name == "native":
        check(uniform or ragged_ok, op, "backend='native' needs a uniform batch or causal self-attention")
        check(same_heads, op, "backend='native' needs as many k/v heads as q heads")
        check(mask_ok, op, "backend='native' with causal=True needs max_seqlen_q == max_seqlen_kv")
        return "native"
    dense_enough = uniform or tq * 4 >= batch * max_q * 3
    if same_heads and (mask_ok if uniform else ragged_ok) and dense_enough:
        for r_dqk, r_dv, min_len, min_rows_heads in _AUTO_NATIVE:
            if dqk == r_dqk and dv == r_dv and max_q >= min_len and tq * hq >= min_rows_heads:
                return "native"
    return "padded"


def _mla_rows(like, backend, rows, heads, cols, full_cols):
    if backend == "padded" and cols < full_cols:
        return like.new_empty((rows, heads, full_cols)).narrow(2, 0, cols)
    return like.new_empty((rows, heads, cols))


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.register_fake("verl_ops::mla_forward_padded")
def _mla_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal=True,
                      softmax_scale=None, backend=0):
    op = "mla_forward_padded"
    s = _mla_sizes(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale)
    b = _mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                     _shares_offsets(cu_seqlens_q, cu_seqlens_kv), *_backend_flags(q))
    tq, tk, hq, hk, dqk, dv, _ = s
    return _mla_rows(q, b, tq, hq, dv, dqk), q.new_empty((hq, tq), dtype=_lse_dtype(q))


@torch.library.register_fake("verl_ops::mla_backward_padded")
def _mla_backward_fake(grad_out, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       causal=True, softmax_scale=None, backend=0):
    op = "mla_backward_padded"
    s = _mla_sizes(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale)
    tq, tk, hq, hk, dqk, dv, _ = s
    for name, t in (("grad_out", grad_out), ("out", out)):
        check(t.dim() == 3 and t.dtype == q.dtype and t.device == q.device, op,
               f"{name} must be a 3-D [Tq, Hq, Dv] tensor of q's dtype and device")
        torch._check(t.shape[0] == tq and t.shape[1] == hq and t.shape[2] == dv,
                     lambda name=name: f"{op}: {name} must be [Tq, Hq, Dv] = [{tq}, {hq}, {dv}]")
    lse_dtype = _lse_dtype(q)
    check(softmax_lse.dim() == 2 and softmax_lse.dtype == lse_dtype and softmax_lse.device == q.device, op,
           f"softmax_lse must be a 2-D [Hq, Tq] tensor of dtype {lse_dtype} on q's device")
    torch._check(softmax_lse.shape[0] == hq and softmax_lse.shape[1] == tq,
                 lambda: f"{op}: softmax_lse must be [Hq, Tq] = [{hq}, {tq}]")
    b = _mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                     _shares_offsets(cu_seqlens_q, cu_seqlens_kv), *_backend_flags(q))
    return q.new_empty((tq, hq, dqk)), k.new_empty((tk, hk, dqk)), _mla_rows(v, b, tk, hk, dv, dqk)


@torch.library.register_fake("verl_ops::mla_cache_info")
def _mla_cache_info_fake(like, capacity=-1):
    # Host counters: only a CPU `like` names a device they can be returned on.
    check(like.device.type == "cpu", "mla_cache_info", f"like must be a CPU tensor, got one on {like.device}")
    check(capacity >= -1, "mla_cache_info", f"capacity must be -1 (unchanged), 0 (no limit) or a number of plans, got {capacity}")
    return like.new_empty((12,), dtype=torch.int64)  # kMlaCacheInfoFields


# --------------------------------------------------------------------------------------------
# Autograd of mla_forward_padded (its backward is the op mla_backward_padded).


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


# torch.library.register_autograd, its kernel testing a Tensor argument for None first; the
# backward op has no derivative: its Autograd kernel only runs that test (verl_ops._library).
register_autograd("verl_ops::mla_forward_padded", _backward, setup_context=_setup_context)
register_autograd("verl_ops::mla_backward_padded")


def _host_int(v):
    """A 0-d integer tensor (e.g. a ``max_seqlen`` kept as a tensor) as a Python int."""
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not is_meta(v):
        if not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool):
            return int(v)
    return v


def _validate_offsets(op: str, name: str, cu: torch.Tensor, rows: int, max_seqlen: int, max_name: str):
    """Offsets' values (read on the host): start at 0, non-decreasing, end at ``rows``, no sequence
    longer than ``max_seqlen``; each error names ``op`` and the argument."""
    c = cu.detach().to("cpu", torch.int64)
    if c.numel() == 0 or int(c[0]) != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {c[:1].tolist()}")
    lengths = c[1:] - c[:-1]
    if bool((lengths < 0).any()):
        i = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"{op}: {name} must be non-decreasing, got {int(c[i])} then {int(c[i + 1])} at index {i}")
    if int(c[-1]) != rows:
        raise ValueError(f"{op}: {name}[-1]={int(c[-1])} must equal the number of rows {rows}")
    if lengths.numel() and int(lengths.max()) > max_seqlen:
        i = int(torch.argmax(lengths))
        raise ValueError(f"{op}: a sequence has {int(lengths[i])} tokens, more than {max_name}={max_seqlen} "
                         f"(sequence {i})")


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
            ``h // (Hq // Hk)``). float16, bfloat16, float32 or float64, on the CPU and on CUDA.
            On CUDA float32 / float64 run verl_ops' CUDA reference kernels whatever ``backend``
            says (the other backends take float16 / bfloat16 only; slower, exact: for debugging
            float32 models), with a contiguous output.
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
            dense rows), ``"varlen"`` (cuDNN's fused attention on the packed rows themselves,
            through graphs of the cuDNN frontend: any lengths including 0, ragged batches, q and kv
            offsets that differ, grouped heads, ``Dv != Dqk``; no padded copies and no host read of
            the lengths; a graph is built once per bucket of shapes, see :func:`mla_cache_info`, so
            the first call of a bucket is slow and later ones are not; CUDA-graph capturable once
            the bucket's forward and backward ran eagerly; present in builds made with the
            ``nvidia-cudnn-frontend`` headers, else asking for it on CUDA raises), or ``"auto"``
            (from GPU measurements, see docs/mla.md#auto: on Hopper, in builds with ``varlen``, batches
            that are not uniform run ``varlen``, and uniform 192/128 ones too where it runs
            verl_ops' own SM90 kernels (else those go native where it measured faster); padded
            elsewhere; where flash-attn-4 is installed, eager bf16/fp16 self-attention with head
            dims 192/128 on Hopper runs ``"fa4"`` on uniform batches of sequences longer than
            1024, where it measured faster still, and on every batch where auto's ``varlen`` would
            not run the own SM90 kernels: a build without them or without ``varlen``, cuDNN older
            than 9.7.0, or VERL_OPS_VARLEN_FORWARD / _BACKWARD=cudnn). On the CPU every backend runs the same exact reference.
        validate: check the offsets against the data on the host. Default: on when the offsets
            are CPU tensors; CUDA offsets are only checked with ``validate=True`` (a host sync),
            as in FlashAttention. Meta offsets (shape inference) are never read.

    Returns:
        ``out [Tq, Hq, Dv]`` in q's dtype. With the padded backend and ``Dv < Dqk`` it is a view of
        a ``[Tq, Hq, Dqk]`` buffer (row stride ``Hq * Dqk``), so no copy trims it. Differentiable
        in q, k and v.
    """
    op = "mla_forward_padded"
    if not isinstance(backend, str) or backend not in BACKENDS + EXTRA_BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS + EXTRA_BACKENDS}, got {backend!r}")
    tensors = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv))
    for name, t in tensors:
        check_plain(op, name, t)
    if not torch.compiler.is_compiling():
        max_seqlen_q = as_int(op, "max_seqlen_q", _host_int(max_seqlen_q), lo=0, hi=INT32_MAX)
        max_seqlen_kv = as_int(op, "max_seqlen_kv", _host_int(max_seqlen_kv), lo=0, hi=INT32_MAX)
        causal = as_bool(op, "causal", causal)
        if softmax_scale is not None and (
            isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
        ):
            raise ValueError(f"{op}: softmax_scale must be a float or None, got {softmax_scale!r}")
    if should_validate(validate, cu_seqlens_q, default=not cu_seqlens_q.is_cuda):
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
    if backend == "auto" and _auto_takes_fa4(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q):
        backend = "fa4"
    if backend == "fa4" and isinstance(q, torch.Tensor) and _reference_path(q):
        backend = "auto"  # FlashAttention-4 takes float16 / bfloat16: the op's reference kernels run
    if backend == "fa4":
        return _fa4_forward(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal,
                            softmax_scale)
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
        BACKENDS.index(backend),
    )
    return out


def mla_cache_info(*, capacity: int | None = None) -> dict:
    """Counters of the ``backend="varlen"`` plan cache of :func:`mla_forward_padded`.

    cuDNN graphs are built per bucket of shapes: the batch size rounded up to a power of two (the
    extra sequences have length 0), ``max_seqlen_q`` / ``max_seqlen_kv`` rounded up to a power of
    two (at least 64), and, for the backward, the token totals rounded up in quarter-octave steps
    (they size its workspace); plus dtype, heads, head dims, causal, softmax scale, device and the
    cuDNN handle (one per thread at a time: a thread takes a handle from a per-device pool on its
    first call and gives it back when it exits, so later threads reuse its plans). In a steady
    training run ``builds`` stops growing.

    The cache keeps at most ``capacity`` plans (default 256, or the environment variable
    ``VERL_OPS_MLA_PLAN_CACHE_SIZE`` read at the first call; 0: no limit) and drops the least
    recently used beyond that, except plans used inside a CUDA-graph capture, which the graph may
    replay. A bucket whose build failed is remembered: its later calls raise the same error at once.

    Args:
        capacity: when given, sets the cache's capacity first (an int >= 0; 0: no limit).

    Returns:
        ``{"available": bool, "size", "hits", "misses", "builds", "failures", "evictions",
        "capacity", "failed_buckets", "cudnn_version": int}``: whether this build has the varlen
        backend, the cached plans, lookups that found a plan, lookups that did not, graphs built,
        builds cuDNN refused, plans evicted, the capacity, buckets remembered as failed, and the
        loaded cuDNN's version (e.g. 91900 for 9.19.0; 0 when none is loaded or the backend is
        not built). ``backend="auto"`` uses varlen only with cuDNN 9.7.0 or newer.
        ``"hopper_forward": bool``: the backend's forward runs verl_ops' own SM90 kernel (built
        for sm_90a, see setup.py) for head dims 192 / 128 on compute capability 9.0 GPUs instead
        of a cuDNN plan; ``VERL_OPS_VARLEN_FORWARD=cudnn`` (read once per process) turns it off.
        ``"hopper_backward": bool``: likewise for the backward (csrc/mla/sm90/mla_sm90_bwd.cu), which
        reads either forward's outputs; ``VERL_OPS_VARLEN_BACKWARD=cudnn`` (read once per
        process) keeps cuDNN's backward plan instead.
    """
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"mla_cache_info: capacity must be an int >= 0 (0: no limit), got {capacity!r}")
    values = _ops.mla_cache_info(torch.empty(0, device="cpu"), -1 if capacity is None else capacity).tolist()
    info = dict(zip(_CACHE_FIELDS, values))
    info["available"] = bool(info["available"])
    info["hopper_forward"] = bool(info.get("hopper_forward", 0))
    info["hopper_backward"] = bool(info.get("hopper_backward", 0))
    return info


_FA4_IMPORTABLE = None


def _fa4_importable() -> bool:
    global _FA4_IMPORTABLE
    if _FA4_IMPORTABLE is None:
        if os.environ.get("VERL_OPS_AUTO_FA4", "1") == "0":
            _FA4_IMPORTABLE = False
        else:
            try:
                _fa4_varlen_func("mla_forward_padded")
                _FA4_IMPORTABLE = True
            except Exception:  # noqa: BLE001  (absent, or present but unusable here)
                _FA4_IMPORTABLE = False
    return _FA4_IMPORTABLE


def _own_kernels_take_ragged(device: torch.device) -> bool:
    """Whether auto sends ragged batches on `device` to the varlen backend and that backend runs
    verl_ops' own SM90 forward and backward there (neither VERL_OPS_VARLEN_FORWARD nor
    VERL_OPS_VARLEN_BACKWARD switched a kernel off): the op's varlen_uniform flag."""
    return _auto_flags(device)[1]


# Uniform batches of sequences up to this long stay on the own SM90 kernels under auto: they
# measured ahead of FlashAttention-4 there (H200, 2026-11-26: 64 x 256 .. 16 x 1024, 16 and 128
# heads, forward 1.04-1.27x, forward+backward 1.01-1.07x) and behind it on longer uniform ones
# (2048 .. 8192 with 16 heads: forward 0.93-0.97x, forward+backward 0.97-0.98x).
_AUTO_FA4_UNIFORM_ABOVE = 1024


def _auto_takes_fa4(q, k, v, cu_q, cu_kv, max_seqlen_q) -> bool:
    """backend="auto" runs FlashAttention-4 where it is installed and measured faster than every
    native backend (benchmarks/RESULTS.md, H200): eager bf16 / fp16 self-attention (one offsets
    tensor for q and kv) with MLA's head dims 192 / 128 on Hopper, on uniform batches (every
    sequence ``max_seqlen_q`` long: ``B * max_seqlen_q == Tq``) of sequences longer than 1024.
    Ragged batches and short uniform ones stay on the varlen backend where it runs the own SM90
    kernels, which measured at or ahead of FlashAttention-4 there (forward+backward 1.01-1.10x on
    the ragged batches, 1.01-1.07x on uniform ones up to 1024; 0.97-0.98x on longer uniform ones
    with 16 heads). Not while tracing or capturing (the op keeps the graph one node);
    VERL_OPS_AUTO_FA4=0 turns it off."""
    if not (q.is_cuda and cu_q is cu_kv and q.dim() == 3 and k.dim() == 3 and v.dim() == 3):
        return False
    if q.shape[-1] != 192 or v.shape[-1] != 128 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if not _fa4_importable():
        return False
    uniform = (cu_q.shape[0] - 1) * int(max_seqlen_q) == q.shape[0]
    return (uniform and int(max_seqlen_q) > _AUTO_FA4_UNIFORM_ABOVE) or not _own_kernels_take_ragged(q.device)


def _fa4_varlen_func(op: str):
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise ImportError(
            f"{op}: backend='fa4' needs FlashAttention-4 (pip install flash-attn-4, or verl_ops[fa4]), "
            f"which is not importable here: {e}"
        ) from e
    return flash_attn_varlen_func


def _fa4_forward(op, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, softmax_scale):
    """backend="fa4": FlashAttention-4's varlen attention on the packed rows (its own autograd);
    the same conventions (bottom-right causal, Dv <= Dqk, grouped heads)."""
    if q.device.type != "cuda":
        raise ValueError(f"{op}: backend='fa4' runs on CUDA tensors only, got q on {q.device}")
    func = _fa4_varlen_func(op)
    # FlashAttention-4 reads the offsets unchecked (the API checks them only with validate=True):
    # clamped into the rows and made non-decreasing, bad offsets can shrink or empty a sequence
    # but never send its kernels outside the tensors. Valid offsets are unchanged.
    same = cu_q is cu_kv and q.shape[0] == k.shape[0]
    safe_q = torch.cummax(cu_q.clamp(0, q.shape[0]), 0)[0]
    cu_kv = safe_q if same else torch.cummax(cu_kv.clamp(0, k.shape[0]), 0)[0]
    cu_q = safe_q
    out = func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_kv, max_seqlen_q=int(max_q), max_seqlen_k=int(max_kv),
               softmax_scale=None if softmax_scale is None else float(softmax_scale), causal=bool(causal))
    return out[0] if isinstance(out, tuple) else out
