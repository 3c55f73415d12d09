"""Argument checks shared by every Python entry point of verl_ops.

Every error names the op and the argument (``"<op>: <argument> must be ..., got ..."``) and is a
``ValueError`` (a wrong value, or a wrong kind of value where a value was expected, e.g. a float
length) or a ``TypeError`` (an argument that is not a tensor where a tensor is required), never a
crash or a silent coercion.

Lengths (:func:`as_lengths`, :func:`lengths_tensor`). A lengths argument is a list / tuple of
Python ints (``numpy`` integers and other ``__index__`` types too) or an integer tensor of one
dimension; every entry must be in ``[0, 2**31 - 1]`` (THD offsets are int32). Floats (even ``3.0``),
bools, strings, nested tensors, complex / bool / float tensors and values outside that range are
rejected, not converted: ``3.7`` never becomes ``3`` and ``True`` never becomes ``1``.

Nested inputs (:func:`check_jagged`). Every entry point that takes a nested tensor accepts only a
``torch.jagged`` nested tensor without holes (``nested_tensor_from_jagged(values, offsets)``, no
``lengths=``): a strided nested tensor or a jagged one with holes (offsets plus lengths, as made by
``narrow`` or ``nested_tensor_from_jagged(..., lengths=...)``) is rejected with the one message of
:data:`JAGGED_REQUIREMENT`. Where a plain tensor is required, :func:`check_plain` rejects any
nested tensor.

Meta tensors (:func:`is_meta`). Validation that reads data to the host is skipped for tensors on the
``meta`` device, so shape inference runs through every op on meta inputs. What cannot be decided
from shapes alone — building a :class:`~verl_ops.ThdLayout` or a dynamic-CP plan, which decide
output shapes from the lengths' *values* — raises a ``ValueError`` saying the op needs host lengths
(:func:`host_values_required`); build the layout from host lengths with ``device="meta"`` instead.

When to read values (:func:`should_validate`, :func:`is_tracing`): every wrapper checks values
eagerly unless ``validate=False``, and never under torch.compile, CUDA-graph capture or on meta
tensors. Layout arguments (:func:`check_rank`, :func:`check_layout_mask`,
:func:`check_mask_lengths`): ranks and attention masks against a :class:`~verl_ops.ThdLayout`.

Raw ops (:func:`check` and the ``check_*`` functions after it): the argument checks that the fake
(Meta) kernels of every op family share, raising ``RuntimeError`` in the C++ kernels' words.

Dense tensor arguments (:class:`DenseArguments`, last): every tensor argument of every raw op is a
dense (strided) tensor; the error for a nested tensor or a None in one, read from the op's schema,
which verl_ops._library registers on every op.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch

try:  # the class of every jagged nested tensor (torch.nested.nested_tensor_from_jagged and friends)
    from torch.nested._internal.nested_tensor import NestedTensor as _JaggedNT
except ImportError:  # pragma: no cover - a torch without it: every check takes the generic path
    _JaggedNT = ()

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

JAGGED_REQUIREMENT = (
    "must be a torch.jagged nested tensor without holes (layout=torch.jagged, contiguous offsets)"
)


def is_meta(t) -> bool:
    """True for a tensor on the meta device (no data: shape-only checks)."""
    return isinstance(t, torch.Tensor) and t.is_meta


def version_of(t: torch.Tensor):
    """``t._version``, or None where ``t`` tracks no version counter (an inference tensor, made under
    ``torch.inference_mode``). What is remembered on a tensor is keyed by its version, so that an
    in-place change invalidates it; a tensor without one gets nothing remembered on it."""
    try:
        return t._version
    except RuntimeError:
        return None


def cache_version(t: torch.Tensor):
    """What a value remembered on tensor ``t`` is keyed by: ``t``'s version (an in-place change
    invalidates it) and whether inference mode is on (a value built under ``torch.inference_mode``
    holds inference tensors, which autograd cannot save, so it must not be handed to a call outside
    it, nor the other way round); None where ``t`` has no version counter (an inference tensor):
    nothing is remembered on it."""
    v = version_of(t)
    return None if v is None else (v, torch.is_inference_mode_enabled())


def host_values_required(op: str, name: str, what: str = "lengths", hint: str | None = None) -> ValueError:
    """The error for a meta tensor whose values an op must read (they decide output shapes)."""
    if hint is None:
        hint = (
            "pass them on the CPU or a GPU; for shape inference build the layout from host lengths "
            "with ThdLayout.from_lengths(..., device='meta')"
        )
    return ValueError(
        f"{op}: {name} is a meta tensor, but {op} needs host {what} (their values decide the output "
        f"shapes); {hint}"
    )


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return f"{v!r} ({type(v).__name__})"


def as_int(op: str, name: str, v, *, lo: int | None = None, hi: int = INT64_MAX) -> int:
    """``v`` as a Python int in ``[lo, hi]`` (bools, floats, strings rejected)."""
    if isinstance(v, bool) or isinstance(v, torch.Tensor) or not hasattr(type(v), "__index__"):
        raise ValueError(f"{op}: {name} must be an int, got {_describe(v)}")
    n = operator.index(v)
    if (lo is not None and n < lo) or n > hi:
        lo_s = "-inf" if lo is None else str(lo)
        raise ValueError(f"{op}: {name} must be an int in [{lo_s}, {hi}], got {n}")
    return n


def as_bool(op: str, name: str, v) -> bool:
    """``v`` as a bool: True / False (or 0 / 1); anything else (a string, None, 2) is an error."""
    if isinstance(v, bool):
        return v
    if not isinstance(v, torch.Tensor) and hasattr(type(v), "__index__") and operator.index(v) in (0, 1):
        return bool(operator.index(v))
    if type(v).__name__ == "bool_":  # numpy.bool_
        return bool(v)
    raise ValueError(f"{op}: {name} must be a bool, got {_describe(v)}")


def lengths_tensor(op: str, name: str, lengths) -> torch.Tensor:
    """Checked lengths as a CPU int64 tensor ``[B]`` (one host read for a device tensor)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.is_nested:
            raise ValueError(
                f"{op}: {name} must be a 1-D integer tensor or a list of ints, got a nested tensor"
            )
        if lengths.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(lengths.shape)}")
        if not _is_integer_dtype(lengths.dtype):
            raise ValueError(f"{op}: {name} must be integers, got {lengths.dtype}")
        if is_meta(lengths):
            raise host_values_required(op, name)
        if lengths.dtype in (torch.uint64, torch.uint32):
            # Values above 2**63 - 1 would wrap in int64: check them as Python ints.
            return lengths_tensor(op, name, lengths.tolist())
        host = lengths.detach().to("cpu", torch.int64)
        bad = (host < 0) | (host > INT32_MAX)
        if host.numel() and bool(bad.any()):
            i = int(bad.nonzero()[0])
            _raise_bad_length(op, name, i, int(host[i]))
        return host
    return torch.tensor(as_lengths(op, name, lengths), dtype=torch.int64)


def _raise_bad_length(op: str, name: str, i: int, n: int):
    if n < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {name}[{i}]={n}")
    raise ValueError(
        f"{op}: {name}[{i}]={n} is too large: lengths must be <= 2**31 - 1 (THD offsets are int32)"
    )


def as_lengths(op: str, name: str, lengths) -> list:
    """Checked lengths as a list of Python ints (see the module doc for what is accepted)."""
    if isinstance(lengths, torch.Tensor):
        return lengths_tensor(op, name, lengths).tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ValueError(
            f"{op}: {name} must be a list of ints or a 1-D integer tensor, got {type(lengths).__name__}"
        )
    out = []
    for i, v in enumerate(lengths):
        if isinstance(v, bool) or isinstance(v, (str, bytes)) or not hasattr(type(v), "__index__"):
            raise ValueError(f"{op}: {name}[{i}] must be an int, got {_describe(v)}")
        if isinstance(v, torch.Tensor) and (v.dim() != 0 or not _is_integer_dtype(v.dtype) or is_meta(v)):
            raise ValueError(f"{op}: {name}[{i}] must be an int, got {_describe(v)}")
        n = operator.index(v)
        if n < 0 or n > INT32_MAX:
            _raise_bad_length(op, name, i, n)
        out.append(n)
    return out


def check_merge_entries(
    op: str, lengths, sample_ids, num_samples: int, exc: type = ValueError, shape=tuple
) -> None:
    """The per-sequence entries of a dynamic-CP merge (the op and its header step): ``lengths`` and
    ``sample_ids`` 1-D int32/int64, one entry each per output sequence, at most ``num_samples``.
    Raises ``exc``; ``shape`` formats a bad tensor's shape as that op's message has it."""
    for name, t in (("lengths", lengths), ("sample_ids", sample_ids)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise exc(f"{op}: {name} must be a 1-D int32/int64 tensor, got {t.dtype} {shape(t.shape)}")
    if lengths.shape[0] != sample_ids.shape[0] or lengths.shape[0] > num_samples:
        raise exc(
            f"{op}: lengths ({lengths.shape[0]}) and sample_ids ({sample_ids.shape[0]}) must have one entry "
            f"per output sequence, at most num_samples={num_samples}"
        )


def is_jagged_nested(x) -> bool:
    """True for a jagged nested tensor, decided from its Python class: a nested tensor's
    properties (``is_nested``, ``layout``, ``device``) each go through its ``__torch_function__``,
    several microseconds of host time per read on the eager hot path."""
    return isinstance(x, _JaggedNT) if _JaggedNT else (isinstance(x, torch.Tensor) and x.is_nested
                                                       and x.layout == torch.jagged)


def device_of(t: torch.Tensor) -> torch.device:
    """``t.device``; for a jagged nested tensor read from its values (the same device, without the
    nested tensor's per-read dispatch)."""
    return t._values.device if isinstance(t, _JaggedNT) else t.device


def check_jagged(op: str, name: str, x) -> None:
    """``x`` is a jagged nested tensor without holes (or raise the one shared message)."""
    if _JaggedNT and isinstance(x, _JaggedNT) and x._lengths is None:
        return
    if not isinstance(x, torch.Tensor) or not x.is_nested:
        raise ValueError(f"{op}: {name} {JAGGED_REQUIREMENT}, got {_describe_nested(x)}")
    if x.layout != torch.jagged:
        raise ValueError(f"{op}: {name} {JAGGED_REQUIREMENT}, got layout={x.layout}")
    if getattr(x, "_lengths", None) is not None:
        raise ValueError(
            f"{op}: {name} {JAGGED_REQUIREMENT}, got a jagged nested tensor with holes (offsets plus "
            "lengths); call .contiguous() first"
        )


def _describe_nested(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a plain tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def check_plain(op: str, name: str, t, *, optional: bool = False) -> None:
    """``t`` is a plain (non-nested) tensor (None allowed when ``optional``)."""
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(plain_error(op, name, t))
    if t.is_nested:
        raise ValueError(plain_error(op, name, t))


def plain_error(op: str, name: str, t) -> str:
    """:func:`check_plain`'s message for ``t``, or '' for a plain tensor (for an entry point that
    reports its argument errors through a status exchange with the other ranks)."""
    if not isinstance(t, torch.Tensor):
        return f"{op}: {name} must be a tensor, got {type(t).__name__}"
    if t.is_nested:
        return f"{op}: {name} must be a plain (strided) tensor, got a nested tensor"
    return ""


def process_group_named(op: str, name: str, group_name: str):
    """The c10d process group called ``group_name`` (the op's argument ``name``; the collective ops
    take groups by name, as torch's functional collectives do), or a ValueError."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{op}: {name}={group_name!r} names no process group") from e


class CallerRejected(Exception):
    """Raised inside a collective op called with ``rank_error=True``: its wrapper found this rank's
    input bad before the op. The op still joins its status exchange, so the other ranks raise too,
    and the wrapper raises its own error."""


# --------------------------------------------------------------------------------------------
# When to check values. Checks that read data to the host run eagerly; never while tracing
# (torch.compile), while capturing a CUDA graph, or on meta tensors (no values to read).


def is_tracing(t: torch.Tensor) -> bool:
    """True under torch.compile, or while the current CUDA stream captures a graph (``t`` on CUDA)."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def should_validate(validate, t: torch.Tensor, default: bool = True) -> bool:
    """Whether to run the value checks on ``t``: ``validate`` (``default`` when None), and never
    while tracing / capturing or on a meta tensor."""
    if is_meta(t) or is_tracing(t):
        return False
    return default if validate is None else bool(validate)


# --------------------------------------------------------------------------------------------
# Checks of a wrapper's arguments against its ThdLayout (ValueError / TypeError).


def check_rank(op: str, name: str, rank, size: int, size_name: str | None = None) -> None:
    """``rank`` is an int in ``[0, size)`` (bools rejected); ``size_name`` names the bound in the
    message (``[0, cp_size=2)``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        bound = f"{size_name}={size}" if size_name else f"{size}"
        raise ValueError(f"{op}: {name} must be an int in [0, {bound}), got {rank!r}")


def check_layout_mask(op: str, mask, layout) -> None:
    """attention_mask's type, dtype and shape against ``layout`` (no data read)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{op}: attention_mask must be a bool tensor [B, S], got {type(mask).__name__}")
    if mask.is_nested:
        raise ValueError(f"{op}: attention_mask must be a bool tensor [B, S], got a nested tensor")
    if mask.dtype != torch.bool:
        raise ValueError(f"{op}: attention_mask must be bool, got {mask.dtype}")
    if mask.dim() != 2 or mask.shape[0] != layout.batch_size:
        raise ValueError(
            f"{op}: attention_mask must be [B={layout.batch_size}, S], got shape {tuple(mask.shape)}"
        )


def check_mask_lengths(op: str, mask: torch.Tensor, layout, validate) -> None:
    """:func:`check_layout_mask`, then (when validating) every row's valid-token count against
    the layout's lengths (one host read)."""
    check_layout_mask(op, mask, layout)
    if should_validate(validate, mask):
        counts = mask.sum(dim=1).cpu()
        expected = torch.tensor(layout.lengths, dtype=counts.dtype)
        if not torch.equal(counts, expected):
            bad = int((counts != expected).nonzero()[0])
            raise ValueError(
                f"{op}: attention_mask row {bad} has {int(counts[bad])} valid tokens but the layout "
                f"says {layout.lengths[bad]}"
            )


# --------------------------------------------------------------------------------------------
# Checks of the raw ops' arguments, shared by the fake (Meta) kernels of every op family. They
# reject what the CPU/CUDA kernels reject without reading data, with the kernels' RuntimeError and
# words ("<op>: <argument> ..."); a symbolic size goes through torch._check.

# The integer dtypes the index / route arguments take.
INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def fail(op: str, msg: str):
    raise RuntimeError(f"{op}: {msg}")


def check(cond, op: str, msg: str) -> None:
    if not cond:
        fail(op, msg)


def check_int_arg(op: str, name: str, v: int, lo: int = 0, hi: int = INT32_MAX) -> None:
    check(lo <= v <= hi, op, f"{name} must be in [{lo}, {hi}], got {v}")


def check_index_dtype(op: str, name: str, t: torch.Tensor) -> None:
    check(t.dtype in INDEX_DTYPES, op,
          f"{name} must be an integer tensor (uint8, int8, int16, int32 or int64), got {t.dtype}")


def check_cp(op: str, cp_size: int, cp_rank: int, allow_all: bool) -> None:
    check(1 <= cp_size <= 2**30, op, f"cp_size must be in [1, 2^30], got {cp_size}")
    lo = -1 if allow_all else 0
    check(
        lo <= cp_rank < cp_size,
        op,
        f"cp_rank must be in [0, cp_size={cp_size})" + (" (or -1 for all ranks)" if allow_all else "") + f", got {cp_rank}",
    )


def check_cp_layout(op: str, cp_layout: int) -> None:
    check(cp_layout in (0, 1), op, f"cp_layout must be 0 (zigzag) or 1 (contiguous), got {cp_layout}")


def check_offsets(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    check(t.dim() == 1, op, f"{name} must be 1-D with B + 1 >= 1 entries, got shape {tuple(t.shape)}")
    torch._check(t.shape[0] >= 1, lambda: f"{op}: {name} must be 1-D with B + 1 >= 1 entries, got shape (0,)")
    check(t.device == like.device, op, f"{name} is on {t.device} but the data is on {like.device}")


def check_offset_pair(op: str, cu: torch.Tensor, cu_padded: torch.Tensor, like: torch.Tensor) -> None:
    check_offsets(op, "cu_seqlens", cu, like)
    check_offsets(op, "cu_seqlens_padded", cu_padded, like)
    torch._check(
        cu.shape[0] == cu_padded.shape[0],
        lambda: f"{op}: cu_seqlens and cu_seqlens_padded must have the same length, got {cu.shape[0]} and "
        f"{cu_padded.shape[0]}",
    )


def check_cp_rows(op: str, cp_size: int, local_rows) -> None:
    """cp_size * local_rows fits int64 (concrete local_rows only), as the kernels' checked product."""
    if type(local_rows) is int:
        check(cp_size * local_rows <= INT64_MAX, op, f"cp_size * local_rows overflows int64 ({cp_size} * {local_rows})")


def check_size(op: str, sized_by: str, shape, dtype: torch.dtype) -> None:
    """The output's bytes fit int64, as the kernels' checked products (concrete sizes only; a
    symbolic size is the kernel's to check). An empty output still needs its strides to fit, as
    torch computes them (a zero-sized dim counts as 1)."""
    if any(type(d) is not int for d in shape):
        return
    n = 1 if 0 in shape else dtype.itemsize
    for d in shape:
        n *= max(d, 1)
    check(n <= INT64_MAX, op, f"the output size overflows int64 (shape {list(shape)} of {dtype}, sized by {sized_by})")


def check_bool_tensor(op: str, name: str, mask: torch.Tensor, like: torch.Tensor, like_name: str = "the data is") -> None:
    check(mask.dtype == torch.bool, op, f"{name} must be bool, got {mask.dtype}")
    check(mask.device == like.device, op, f"{name} is on {mask.device} but {like_name} on {like.device}")


def check_attention_mask(op: str, mask: torch.Tensor, like: torch.Tensor, cu: torch.Tensor) -> None:
    """attention_mask: bool [B, S] on the data's device, B from cu_seqlens."""
    check_bool_tensor(op, "attention_mask", mask, like)
    check(mask.dim() == 2, op, f"attention_mask must be [B, S], got shape {tuple(mask.shape)}")
    torch._check(
        mask.shape[0] == cu.shape[0] - 1,
        lambda: f"{op}: attention_mask has {mask.shape[0]} rows but the layout has {cu.shape[0] - 1} sequences",
    )


# --------------------------------------------------------------------------------------------
# Dense tensor arguments of every raw op. Each tensor argument of an op of torch.ops.verl_ops is a
# dense (strided) tensor; a nested tensor (jagged or strided) in one, or a None where the schema
# has a Tensor (not a Tensor?), is rejected naming the op and the argument:
#     "preprocess_thd: values must be a dense (strided) tensor, got a jagged nested tensor"
# ValueError for a nested (or sparse) tensor, TypeError for None. A Tensor? argument takes a dense
# tensor or None; a Tensor[] argument dense tensors (a None in the list, or for the whole list, is
# rejected by the schema: "verl_ops::<op>() Expected a value of type 'List[Tensor]' for argument
# '<name>' ..."). verl_ops._library registers these errors on every op (guard_dense_arguments).

DENSE = "a dense (strided) tensor"


def non_dense(t) -> str | None:
    """What ``t`` is when it is not a dense tensor ("None", "a jagged nested tensor", "a strided
    nested tensor", "a sparse_coo tensor", ...); None for a dense tensor (or a non-tensor)."""
    if t is None:
        return "None"
    if is_jagged_nested(t):
        return "a jagged nested tensor"
    if not isinstance(t, torch.Tensor):
        return None
    layout = str(t.layout).replace("torch.", "")
    if t.is_nested:
        return f"a {layout} nested tensor"
    return None if t.layout == torch.strided else f"a {layout} tensor"


def _tensor_kind(jit_type) -> str | None:
    """"tensor", "optional" or "list" for a schema argument of type Tensor, Tensor? or Tensor[]."""
    if isinstance(jit_type, torch.TensorType):
        return "tensor"
    if isinstance(jit_type, torch.OptionalType) and isinstance(jit_type.getElementType(), torch.TensorType):
        return "optional"
    if isinstance(jit_type, torch.ListType) and isinstance(jit_type.getElementType(), torch.TensorType):
        return "list"
    return None


_ABSENT = object()


class DenseArguments:
    """The tensor arguments of one op, read from its schema, and the error of a call that passes a
    nested tensor or a None in one of them.

    Arguments come as the dispatcher hands them to a Python kernel: positional in schema order
    (trailing defaults possibly left out), keyword-only ones by name. ``required``: the positions of
    the Tensor (not Tensor?, not Tensor[]) arguments, for a kernel's fast test of a None.
    """

    __slots__ = ("op", "tensors", "required")

    def __init__(self, op: str, schema):
        self.op = op
        # (position, name, kind, keyword-only) of each tensor argument, in schema order.
        self.tensors = tuple(
            (i, a.name, kind, a.kwarg_only)
            for i, a in enumerate(schema.arguments)
            if (kind := _tensor_kind(a.type)) is not None
        )
        self.required = tuple(i for i, _, kind, kw in self.tensors if kind == "tensor" and not kw)

    @classmethod
    def of(cls, qualname: str) -> DenseArguments:
        """The tensor arguments of ``namespace::op`` (its default overload)."""
        ns, name = qualname.split("::")
        return cls(name, getattr(getattr(torch.ops, ns), name).default._schema)

    def _values(self, args, kwargs):
        """(argument name, kind, value) of every tensor argument passed, list entries one by one."""
        for i, name, kind, kw in self.tensors:
            value = (kwargs or {}).get(name, _ABSENT) if kw else (args[i] if i < len(args) else _ABSENT)
            if value is _ABSENT or (value is None and kind != "tensor"):
                continue  # left out (its default) or an optional argument's None
            if kind == "list" and isinstance(value, (list, tuple)):
                for j, t in enumerate(value):
                    yield f"{name}[{j}]", kind, t
            else:
                yield name, kind, value

    def error(self, args, kwargs=None) -> Exception | None:
        """The error for the first tensor argument that is not dense, or None when all are."""
        for arg, kind, t in self._values(args, kwargs):
            what = non_dense(t)
            if what is not None:
                expected = f"{DENSE} or None" if kind == "optional" else DENSE
                return (TypeError if t is None else ValueError)(f"{self.op}: {arg} must be {expected}, got {what}")
        return None

    def none_error(self, args, kwargs=None) -> Exception | None:
        """:meth:`error`'s error when a Tensor argument is None (the fast test of ``required``)."""
        for i in self.required:
            if i < len(args) and args[i] is None:
                return self.error(args, kwargs)
        return None

    def reject(self, args, kwargs=None) -> Exception:
        """The error of a call that reached a kernel no dense call on a supported device reaches:
        :meth:`error`'s; else (dense tensors on a device the op has no kernel for) a
        NotImplementedError naming the device; else (no tensor at all) a ValueError."""
        e = self.error(args, kwargs)
        if e is not None:
            return e
        for arg, _, t in self._values(args, kwargs):
            if isinstance(t, torch.Tensor):
                kind = ("quantized " if t.is_quantized else "") + t.device.type
                return NotImplementedError(
                    f"{self.op}: {arg} is a {kind} tensor but {self.op} has no kernel for {kind} tensors in this build"
                )
        names = ", ".join(name for _, name, _, _ in self.tensors)
        return ValueError(f"{self.op}: got no tensor ({names}: None or empty), it needs {DENSE}")

    def check_none(self, args, kwargs=None) -> None:
        """Raise :meth:`none_error`'s error, if any."""
        e = self.none_error(args, kwargs)
        if e is not None:
            raise e

    def checked(self, fn):
        """``fn``, a Python kernel of the op (CPU, CUDA, fake), testing its Tensor arguments for None
        first (a nested tensor never reaches such a kernel: see verl_ops._library)."""

        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            self.check_none(args, kwargs)
            return fn(*args, **kwargs)

        return kernel
