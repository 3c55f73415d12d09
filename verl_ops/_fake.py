"""Fake (Meta) kernels of every op: output shapes, dtypes and strides from the inputs' shapes
alone, symbolic under torch.compile. They reject the arguments the CPU/CUDA kernels reject without
reading data (the C++ binding layer, on the stable ABI, cannot take symbolic sizes, so these live
here). Messages match the C++ ones: "<op>: <argument> ..."."""

from __future__ import annotations

import math

import torch

from ._validate import check_merge_entries

_INT32_MAX = 2**31 - 1
_INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# int16 overflow flag slots of router_topk_record (core::kOverflowSlots).
_OVERFLOW_SLOTS = 4096


def _fail(op: str, msg: str):
    raise RuntimeError(f"{op}: {msg}")


def _check(cond, op: str, msg: str) -> None:
    if not cond:
        _fail(op, msg)


def _int_arg(op: str, name: str, v: int, lo: int = 0, hi: int = _INT32_MAX) -> None:
    _check(lo <= v <= hi, op, f"{name} must be in [{lo}, {hi}], got {v}")


def _check_cp(op: str, cp_size: int, cp_rank: int, allow_all: bool) -> None:
    _check(1 <= cp_size <= 2**30, op, f"cp_size must be in [1, 2^30], got {cp_size}")
    lo = -1 if allow_all else 0
    _check(
        lo <= cp_rank < cp_size,
        op,
        f"cp_rank must be in [0, cp_size={cp_size})" + (" (or -1 for all ranks)" if allow_all else "") + f", got {cp_rank}",
    )


def _check_cp_layout(op: str, cp_layout: int) -> None:
    _check(cp_layout in (0, 1), op, f"cp_layout must be 0 (zigzag) or 1 (contiguous), got {cp_layout}")


def _check_offsets(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    _check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    _check(t.dim() == 1, op, f"{name} must be 1-D with B + 1 >= 1 entries, got shape {tuple(t.shape)}")
    torch._check(t.shape[0] >= 1, lambda: f"{op}: {name} must be 1-D with B + 1 >= 1 entries, got shape (0,)")
    _check(t.device == like.device, op, f"{name} is on {t.device} but the data is on {like.device}")


def _check_offset_pair(op: str, cu: torch.Tensor, cu_padded: torch.Tensor, like: torch.Tensor) -> None:
    _check_offsets(op, "cu_seqlens", cu, like)
    _check_offsets(op, "cu_seqlens_padded", cu_padded, like)
    torch._check(
        cu.shape[0] == cu_padded.shape[0],
        lambda: f"{op}: cu_seqlens and cu_seqlens_padded must have the same length, got {cu.shape[0]} and "
        f"{cu_padded.shape[0]}",
    )


def _check_cp_rows(op: str, cp_size: int, local_rows) -> None:
    """cp_size * local_rows fits int64 (concrete local_rows only), as the kernels' checked product."""
    if type(local_rows) is int:
        _check(cp_size * local_rows <= 2**63 - 1, op, f"cp_size * local_rows overflows int64 ({cp_size} * {local_rows})")


def _check_size(op: str, sized_by: str, shape, dtype: torch.dtype) -> None:
    """The output's bytes fit int64, as the kernels' checked products (concrete sizes only; a
    symbolic size is the kernel's to check). An empty output still needs its strides to fit, as
    torch computes them (a zero-sized dim counts as 1)."""
    if any(type(d) is not int for d in shape):
        return
    n = 1 if 0 in shape else dtype.itemsize
    for d in shape:
        n *= max(d, 1)
    _check(n <= 2**63 - 1, op, f"the output size overflows int64 (shape {list(shape)} of {dtype}, sized by {sized_by})")


def _check_mask(op: str, name: str, mask: torch.Tensor, like: torch.Tensor, like_name: str = "the data is") -> None:
    _check(mask.dtype == torch.bool, op, f"{name} must be bool, got {mask.dtype}")
    _check(mask.device == like.device, op, f"{name} is on {mask.device} but {like_name} on {like.device}")


def _check_attention_mask(op: str, mask: torch.Tensor, like: torch.Tensor, cu: torch.Tensor) -> None:
    """attention_mask: bool [B, S] on the data's device, B from cu_seqlens."""
    _check_mask(op, "attention_mask", mask, like)
    _check(mask.dim() == 2, op, f"attention_mask must be [B, S], got shape {tuple(mask.shape)}")
    torch._check(
        mask.shape[0] == cu.shape[0] - 1,
        lambda: f"{op}: attention_mask has {mask.shape[0]} rows but the layout has {cu.shape[0] - 1} sequences",
    )


def _check_layout_args(op, name, x, tp_size, cp_size, cp_layout, min_local_rows, pad_to_length_bucket) -> None:
    """The layout ops' argument checks (as csrc/ops/thd_ops.cpp's layout_params and input checks)."""
    _int_arg(op, "tp_size", tp_size, 1)
    _int_arg(op, "cp_size", cp_size, 1)
    _check_cp_layout(op, cp_layout)
    if min_local_rows is not None:
        _int_arg(op, "min_local_rows", min_local_rows)
    if pad_to_length_bucket is not None:
        _check(pad_to_length_bucket > 0, op, f"pad_to_length_bucket must be a positive integer, got {pad_to_length_bucket}")
        _int_arg(op, "pad_to_length_bucket", pad_to_length_bucket, 1)
    _check(x.dim() == 1, op, f"{name} must be 1-D, got shape {tuple(x.shape)}")
    _check(x.dtype in _INDEX_DTYPES, op,
           f"{name} must be an integer tensor (uint8, int8, int16, int32 or int64), got {x.dtype}")


@torch.library.register_fake("verl_ops::thd_layout")
def _thd_layout_fake(lengths, tp_size=1, cp_size=1, cp_layout=0, fp8_padding=False, min_local_rows=None,
                     pad_to_length_bucket=None):
    op = "thd_layout"
    _check_layout_args(op, "lengths", lengths, tp_size, cp_size, cp_layout, min_local_rows, pad_to_length_bucket)
    n = lengths.shape[0] + 1
    return lengths.new_empty((n,), dtype=torch.int32), lengths.new_empty((n,), dtype=torch.int32)


@torch.library.register_fake("verl_ops::thd_layout_info")
def _thd_layout_info_fake(x, x_is_offsets=False, tp_size=1, cp_size=1, cp_layout=0, fp8_padding=False,
                          min_local_rows=None, pad_to_length_bucket=None):
    op = "thd_layout_info"
    _check_layout_args(op, "offsets" if x_is_offsets else "lengths", x, tp_size, cp_size, cp_layout, min_local_rows,
                       pad_to_length_bucket)
    _check(not x_is_offsets or x.shape[0] >= 1, op, "offsets must have B + 1 >= 1 entries, got 0")
    b = x.shape[0] - 1 if x_is_offsets else x.shape[0]
    return x.new_empty((2, b + 1), dtype=torch.int32), x.new_empty((7 + b,), dtype=torch.int64)


def _thd_common(op, data, cu, cu_padded, cp_size, cp_rank, cp_layout):
    _check_cp_layout(op, cp_layout)
    _check_cp(op, cp_size, cp_rank, allow_all=True)
    _check_offset_pair(op, cu, cu_padded, data)


@torch.library.register_fake("verl_ops::preprocess_thd")
def _preprocess_thd_fake(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size=1, cp_rank=0, cp_layout=0,
                         roll=False, attention_mask=None):
    op = "preprocess_thd"
    _thd_common(op, values, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, cp_layout)
    torch._check(local_rows >= 0, lambda: f"{op}: local_rows must be >= 0, got {local_rows}")
    skip = 2 if attention_mask is not None else 1
    _check(values.dim() >= skip, op, f"values has too few dimensions: {tuple(values.shape)}")
    if cp_rank < 0:
        _check_cp_rows(op, cp_size, local_rows)
    if attention_mask is not None:
        _check_attention_mask(op, attention_mask, values, cu_seqlens)
        torch._check(
            values.shape[0] == attention_mask.shape[0] and values.shape[1] == attention_mask.shape[1],
            lambda: f"{op}: padded input must be [B, S, *F] matching attention_mask "
            f"{list(attention_mask.shape)}, got {list(values.shape)}",
        )
    lead = (cp_size, local_rows) if cp_rank < 0 else (local_rows,)
    _check_size(op, "local_rows", lead + tuple(values.shape[skip:]), values.dtype)
    _check_size(op, "local_rows", lead, torch.int64)  # positions
    packed = values.new_empty(lead + tuple(values.shape[skip:]))
    positions = values.new_empty(lead, dtype=torch.int64)
    return packed, positions


@torch.library.register_fake("verl_ops::postprocess_thd")
def _postprocess_thd_fake(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size=1, cp_rank=-1, cp_layout=0,
                          roll=False, attention_mask=None):
    op = "postprocess_thd"
    _thd_common(op, packed, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, cp_layout)
    skip = 2 if cp_rank < 0 else 1
    _check(packed.dim() >= skip, op, f"packed has too few dimensions: {tuple(packed.shape)}")
    if cp_rank < 0:
        torch._check(packed.shape[0] == cp_size,
                     lambda: f"{op}: packed holds {packed.shape[0]} shards but cp_size is {cp_size}")
    if attention_mask is not None:
        _check_attention_mask(op, attention_mask, packed, cu_seqlens)
        lead = tuple(attention_mask.shape)
        sized_by = "attention_mask"
    else:
        torch._check(total_tokens >= 0, lambda: f"{op}: total_tokens must be >= 0, got {total_tokens}")
        lead = (total_tokens,)
        sized_by = "total_tokens"
    _check_size(op, sized_by, lead + tuple(packed.shape[skip:]), packed.dtype)
    return packed.new_empty(lead + tuple(packed.shape[skip:]))


def _jagged_fake(op, data_name, values, src_starts, cu_out, rows, rows_name):
    _check(values.dim() >= 1, op, f"{data_name} must be [rows, *F], got a 0-d tensor")
    _check(src_starts.dtype == torch.int64, op, f"src_starts must be int64, got {src_starts.dtype}")
    _check(src_starts.dim() == 1, op, f"src_starts must be 1-D, got {src_starts.dim()} dims")
    _check(cu_out.dtype == torch.int32, op, f"cu_seqlens_out must be int32, got {cu_out.dtype}")
    _check(cu_out.dim() == 1, op, f"cu_seqlens_out must be 1-D, got {cu_out.dim()} dims")
    torch._check(
        cu_out.shape[0] == src_starts.shape[0] + 1,
        lambda: f"{op}: cu_seqlens_out must have len(src_starts) + 1 entries",
    )
    _check(src_starts.device == values.device, op, f"src_starts is on {src_starts.device} but {data_name} is on {values.device}")
    _check(cu_out.device == values.device, op, f"cu_seqlens_out is on {cu_out.device} but {data_name} is on {values.device}")
    torch._check(rows >= 0, lambda: f"{op}: {rows_name} must be >= 0, got {rows}")
    _check_size(op, rows_name, (rows,) + tuple(values.shape[1:]), values.dtype)
    return values.new_empty((rows,) + tuple(values.shape[1:]))


@torch.library.register_fake("verl_ops::jagged_gather")
def _jagged_gather_fake(values, src_starts, cu_seqlens_out, total_out):
    return _jagged_fake("jagged_gather", "values", values, src_starts, cu_seqlens_out, total_out, "total_out")


@torch.library.register_fake("verl_ops::jagged_scatter")
def _jagged_scatter_fake(grad, src_starts, cu_seqlens_out, total_in):
    return _jagged_fake("jagged_scatter", "grad", grad, src_starts, cu_seqlens_out, total_in, "total_in")


@torch.library.register_fake("verl_ops::dynamic_cp_merge_header")
def _merge_header_fake(lengths, sample_ids, num_samples, rows, dtype_hash, feature_hash, row_bytes, key_hash,
                       local_cp_size):
    op = "dynamic_cp_merge_header"
    if not 0 <= num_samples <= _INT32_MAX:
        raise RuntimeError(f"{op}: num_samples must be in [0, {_INT32_MAX}], got {num_samples}")
    check_merge_entries(op, lengths, sample_ids, num_samples, RuntimeError, list)
    return lengths.new_empty((9 + 2 * num_samples,), dtype=torch.int64)


@torch.library.register_fake("verl_ops::dynamic_cp_merge_index")
def _merge_index_fake(header, num_samples, validate=True):
    op = "dynamic_cp_merge_index"
    if not 0 <= num_samples <= _INT32_MAX:
        raise RuntimeError(f"{op}: num_samples must be in [0, {_INT32_MAX}], got {num_samples}")
    width = 9 + 2 * num_samples
    if header.dtype != torch.int64 or header.dim() != 2 or header.shape[0] < 1 or header.shape[1] != width:
        raise RuntimeError(
            f"{op}: header must be int64 [groups >= 1, 9 + 2 * num_samples = {width}], got {header.dtype} "
            f"{list(header.shape)}"
        )
    G = header.shape[0]
    return (header.new_empty((G + 2 + 9 * G + 2 * (num_samples + 1),)),
            header.new_empty((num_samples + 1,), dtype=torch.int32))


@torch.library.register_fake("verl_ops::router_topk_record")
def _router_topk_record_fake(indices, cu_seqlens=None, cu_seqlens_padded=None, total_tokens=0, attention_mask=None,
                             op="router_topk_record"):
    _check(indices.dtype in _INDEX_DTYPES, op,
           f"indices must be an integer tensor (uint8, int8, int16, int32 or int64), got {indices.dtype}")
    _check(indices.dim() == 3, op, f"indices must be [L, T_local_sp, K], got shape {tuple(indices.shape)}")
    num_layers, rows, topk = indices.shape
    torch._check(num_layers >= 1, lambda: f"{op}: indices must hold at least one layer")
    fused = cu_seqlens is not None or cu_seqlens_padded is not None
    _check(
        fused == (cu_seqlens is not None and cu_seqlens_padded is not None),
        op,
        "cu_seqlens and cu_seqlens_padded must be given together (fused unpack) or both omitted",
    )
    if not fused:
        _check(attention_mask is None, op, "attention_mask needs cu_seqlens and cu_seqlens_padded")
        shape = (rows, num_layers, topk)
    else:
        _check_offset_pair(op, cu_seqlens, cu_seqlens_padded, indices)
        if attention_mask is not None:
            _check_attention_mask(op, attention_mask, indices, cu_seqlens)
            shape = tuple(attention_mask.shape) + (num_layers, topk)
        else:
            torch._check(total_tokens >= 0, lambda: f"{op}: total_tokens must be >= 0, got {total_tokens}")
            shape = (total_tokens, num_layers, topk)
    _check_size(op, "total_tokens / attention_mask", shape, torch.int16)
    return indices.new_empty(shape, dtype=torch.int16), indices.new_empty((_OVERFLOW_SLOTS,), dtype=torch.int32)


def stack_layers_fake(op: str, indices) -> torch.Tensor:
    """A list of L [T, K] layers (same dtype, device and shape) as one [L, T, K] fake tensor."""
    _check(len(indices) >= 1, op, "indices must hold at least one layer, got an empty list")
    first = indices[0]
    _check(first.dim() == 2, op, f"indices[0] must be [T_local_sp, K], got shape {tuple(first.shape)}")
    for i, t in enumerate(indices):
        _check(t.dim() == 2, op, f"indices[{i}] must be [T_local_sp, K], got shape {tuple(t.shape)}")
        _check(t.dtype == first.dtype, op, f"indices[{i}] is {t.dtype} but indices[0] is {first.dtype}")
        _check(t.device == first.device, op, f"indices[{i}] is on {t.device} but indices[0] is on {first.device}")
        torch._check(t.shape[1] == first.shape[1], lambda i=i, t=t: f"{op}: indices[{i}] has top-k {t.shape[1]} "
                     f"but indices[0] has {first.shape[1]}; K must be the same in every layer")
        torch._check(t.shape[0] == first.shape[0], lambda i=i, t=t: f"{op}: indices[{i}] has {t.shape[0]} rows "
                     f"but indices[0] has {first.shape[0]}; every layer records the same tokens")
    return first.new_empty((len(indices),) + tuple(first.shape))


if hasattr(torch.ops.verl_ops, "router_topk_record_layers"):

    @torch.library.register_fake("verl_ops::router_topk_record_layers")
    def _router_topk_record_layers_fake(indices, cu_seqlens=None, cu_seqlens_padded=None, total_tokens=0,
                                        attention_mask=None):
        op = "router_topk_record"
        return _router_topk_record_fake(stack_layers_fake(op, indices), cu_seqlens, cu_seqlens_padded, total_tokens,
                                        attention_mask)


@torch.library.register_fake("verl_ops::router_topk_scatter")
def _router_topk_scatter_fake(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size=1, tp_rank=0, cp_size=1,
                              cp_rank=0, cp_layout=0, attention_mask=None, replay_mask=None):
    op = "router_topk_scatter"
    _check_cp_layout(op, cp_layout)
    _check(routes.dtype in _INDEX_DTYPES, op,
           f"routes must be an integer tensor (uint8, int8, int16, int32 or int64), got {routes.dtype}")
    _int_arg(op, "tp_size", tp_size, 1)
    _check(0 <= tp_rank < tp_size, op, f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
    _check_cp(op, cp_size, cp_rank, allow_all=False)
    padded = attention_mask is not None
    _check(
        routes.dim() == (4 if padded else 3),
        op,
        "routes must be " + ("[B, S, L, K] (with attention_mask)" if padded else "[total_tokens, L, K]")
        + f", got shape {tuple(routes.shape)}",
    )
    _check_offset_pair(op, cu_seqlens, cu_seqlens_padded, routes)
    if attention_mask is not None:
        msg = f"padded routes {list(routes.shape)} must be [B, S, L, K] matching attention_mask {list(attention_mask.shape)}"
        _check(attention_mask.dim() == 2, op, msg)
        torch._check(routes.shape[0] == attention_mask.shape[0] and routes.shape[1] == attention_mask.shape[1],
                     lambda: f"{op}: {msg}")
        _check_attention_mask(op, attention_mask, routes, cu_seqlens)
    if replay_mask is not None:
        _check_mask(op, "replay_mask", replay_mask, routes, "routes are")
        lead = routes.shape[:2] if padded else routes.shape[:1]
        msg = ("replay_mask must be " + ("[B, S] like attention_mask" if padded else "[total_tokens] like the routes' rows")
               + f", got shape {tuple(replay_mask.shape)}")
        _check(replay_mask.dim() == len(lead), op, msg)
        torch._check(all(a == b for a, b in zip(replay_mask.shape, lead)), lambda: f"{op}: {msg}")
    torch._check(local_rows >= 0, lambda: f"{op}: local_rows must be >= 0, got {local_rows}")
    _check_cp_rows(op, cp_size, local_rows)
    torch._check(local_rows % tp_size == 0, lambda: f"{op}: local_rows={local_rows} is not divisible by "
                 f"tp_size={tp_size}; the sequence-parallel split needs equal chunks")
    rows = local_rows // tp_size
    _check_size(op, "local_rows", (routes.shape[-2], rows, routes.shape[-1]), torch.int64)
    targets = routes.new_empty((routes.shape[-2], rows, routes.shape[-1]), dtype=torch.int64)
    replay = routes.new_empty((rows,) if replay_mask is not None else (0,), dtype=torch.bool)
    return targets, replay


# --- mla -------------------------------------------------------------------------------------

# Mirrors csrc/ops/mla_ops.cpp: the shapes where backend=auto picks the native path (Dqk, Dv,
# min max_seqlen, min query rows x heads).
_AUTO_NATIVE = ((192, 128, 1024, 16 * 1024 * 16),)
# Mirrors kAutoVarlen in csrc/ops/mla_ops.cpp: the head dims where backend=auto sends batches that
# are not uniform to the varlen backend (Dqk, Dv, min query rows x heads), where _varlen_auto holds.
_AUTO_VARLEN = ((192, 128, 0), (64, 64, 0), (128, 128, 0), (192, 192, 0), (256, 256, 0))
_MLA_BACKENDS = ("auto", "padded", "native", "varlen")
# Whether this build has the varlen backend, read once at import (_C is loaded by then): the fake
# kernels run under fake / functional modes, where calling an op would not return real values.
# With it, the loaded cuDNN's version: auto uses varlen from kVarlenAutoMinCudnn (9.7.0) on.
def _probe_varlen() -> tuple:
    try:
        info = torch.ops.verl_ops.mla_cache_info(torch.empty(0, device="cpu")).tolist()
    except (AttributeError, RuntimeError):  # a module built before the op existed
        return False, 0, False
    own = len(info) > 11 and bool(info[10]) and bool(info[11])
    return bool(info[0]), (info[9] if len(info) > 9 else 0), own


# _VARLEN_OWN: varlen runs the own SM90 forward and backward (mla_cache_info's hopper_forward and
# hopper_backward), where auto also sends uniform 192 / 128 batches to it.
_VARLEN_BUILT, _VARLEN_CUDNN, _VARLEN_OWN = _probe_varlen()
_VARLEN_AUTO_MIN_CUDNN = 90700
_VARLEN_DEVICES = {}


def _varlen_auto(device: torch.device) -> bool:
    """Mirrors prepare_mla's varlen_auto: the build has the varlen backend, the loaded cuDNN is
    9.7.0 or newer, and `device` is a CUDA device of compute capability 9.x."""
    if device.type != "cuda" or not _VARLEN_BUILT or _VARLEN_CUDNN < _VARLEN_AUTO_MIN_CUDNN:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _VARLEN_DEVICES:
        _VARLEN_DEVICES[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _VARLEN_DEVICES[index]


def _auto_flags(device: torch.device) -> tuple:
    """(varlen_auto, varlen_uniform) for resolve_mla_backend, as prepare_mla computes them."""
    varlen_auto = _varlen_auto(device)
    return varlen_auto, varlen_auto and _VARLEN_OWN


def _shares_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One offsets tensor for q and kv: the same tensor, or views of one storage at one offset
    with one shape (mirrors shares_offsets in csrc/ops/mla_ops.cpp)."""
    if a is b:
        return True
    return (
        torch._C._is_alias_of(a, b)
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _mla_sizes(op, q, k, v, cu_q, cu_kv, max_q, max_kv, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.dim() == 3, op, f"{name} must be 3-D [T, H, D], got {t.dim()} dims")
        _check(t.dtype.is_floating_point, op, f"{name} must be floating point, got {t.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, op,
           f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _check(k.device == q.device and v.device == q.device, op,
           f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    # The dtypes the op's kernels take on the device (prepare_mla in csrc/ops/mla_ops.cpp): traced
    # code fails here, as the op would at run time.
    if q.device.type == "cuda":
        _check(q.dtype in (torch.float16, torch.bfloat16), op,
               f"q must be float16 or bfloat16 on CUDA, got {q.dtype}")
    elif q.device.type == "cpu":
        _check(q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64), op,
               f"q must be float16, bfloat16, float32 or float64 on the CPU, got {q.dtype}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        _check(cu.dtype == torch.int32, op, f"{name} must be int32, got {cu.dtype}")
        _check(cu.dim() == 1, op, f"{name} must be 1-D [B + 1], got {cu.dim()} dims")
        _check(cu.device == q.device, op, f"{name} is on {cu.device} but q is on another device: {q.device}")
    tq, hq, dqk = q.shape
    tk, hk = k.shape[0], k.shape[1]
    dv = v.shape[2]
    torch._check(cu_q.shape[0] >= 1, lambda: f"{op}: cu_seqlens_q must have B + 1 >= 1 entries")
    torch._check(cu_kv.shape[0] == cu_q.shape[0], lambda: f"{op}: cu_seqlens_kv must have as many entries as cu_seqlens_q")
    torch._check(k.shape[2] == dqk, lambda: f"{op}: k must have q's head dim {dqk}, got {k.shape[2]}")
    torch._check(dv <= dqk, lambda: f"{op}: v's head dim (Dv={dv}) must be <= the q/k head dim (Dqk={dqk})")
    torch._check(dv >= 1, lambda: f"{op}: v's head dim must be >= 1")
    torch._check(v.shape[0] == tk, lambda: f"{op}: k and v must have the same number of rows")
    torch._check(v.shape[1] == hk, lambda: f"{op}: k and v must have the same number of heads")
    torch._check(hk >= 1, lambda: f"{op}: k must have at least one head")
    torch._check(hq % hk == 0, lambda: f"{op}: the number of q heads must be a multiple of the number of k/v heads")
    for name, val in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        msg = lambda name=name, val=val: f"{op}: {name} must be in [0, {_INT32_MAX}], got {val}"  # noqa: E731
        torch._check(val >= 0, msg)
        torch._check(val <= _INT32_MAX, msg)
    if softmax_scale is not None:
        _check(math.isfinite(softmax_scale), op, f"softmax_scale must be finite, got {softmax_scale}")
    return tq, tk, hq, hk, dqk, dv, cu_q.shape[0] - 1


def _mla_backend(op, backend, sizes, max_q, max_kv, causal, same_offsets, varlen_auto,
                 varlen_uniform=False) -> str:
    """Mirrors resolve_mla_backend in csrc/ops/mla_ops.cpp (shapes, and varlen_auto /
    varlen_uniform for auto)."""
    _check(backend in (0, 1, 2, 3), op, f"backend must be 0 (auto), 1 (padded), 2 (native) or 3 (varlen), got {backend}")
    name = _MLA_BACKENDS[backend]
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
        _check(uniform or ragged_ok, op, "backend='native' needs a uniform batch or causal self-attention")
        _check(same_heads, op, "backend='native' needs as many k/v heads as q heads")
        _check(mask_ok, op, "backend='native' with causal=True needs max_seqlen_q == max_seqlen_kv")
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
                     _shares_offsets(cu_seqlens_q, cu_seqlens_kv), *_auto_flags(q.device))
    tq, tk, hq, hk, dqk, dv, _ = s
    return _mla_rows(q, b, tq, hq, dv, dqk), q.new_empty((hq, tq), dtype=_lse_dtype(q))


@torch.library.register_fake("verl_ops::mla_backward_padded")
def _mla_backward_fake(grad_out, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       causal=True, softmax_scale=None, backend=0):
    op = "mla_backward_padded"
    s = _mla_sizes(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale)
    tq, tk, hq, hk, dqk, dv, _ = s
    for name, t in (("grad_out", grad_out), ("out", out)):
        _check(t.dim() == 3 and t.dtype == q.dtype and t.device == q.device, op,
               f"{name} must be a 3-D [Tq, Hq, Dv] tensor of q's dtype and device")
        torch._check(t.shape[0] == tq and t.shape[1] == hq and t.shape[2] == dv,
                     lambda name=name: f"{op}: {name} must be [Tq, Hq, Dv] = [{tq}, {hq}, {dv}]")
    lse_dtype = _lse_dtype(q)
    _check(softmax_lse.dim() == 2 and softmax_lse.dtype == lse_dtype and softmax_lse.device == q.device, op,
           f"softmax_lse must be a 2-D [Hq, Tq] tensor of dtype {lse_dtype} on q's device")
    torch._check(softmax_lse.shape[0] == hq and softmax_lse.shape[1] == tq,
                 lambda: f"{op}: softmax_lse must be [Hq, Tq] = [{hq}, {tq}]")
    b = _mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                     _shares_offsets(cu_seqlens_q, cu_seqlens_kv), *_auto_flags(q.device))
    return q.new_empty((tq, hq, dqk)), k.new_empty((tk, hk, dqk)), _mla_rows(v, b, tk, hk, dv, dqk)


@torch.library.register_fake("verl_ops::mla_cache_info")
def _mla_cache_info_fake(like, capacity=-1):
    # Host counters: only a CPU `like` names a device they can be returned on.
    _check(like.device.type == "cpu", "mla_cache_info", f"like must be a CPU tensor, got one on {like.device}")
    _check(capacity >= -1, "mla_cache_info", f"capacity must be -1 (unchanged), 0 (no limit) or a number of plans, got {capacity}")
    return like.new_empty((12,), dtype=torch.int64)  # kMlaCacheInfoFields
