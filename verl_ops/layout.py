"""ThdLayout: the one packing decision of a micro-batch, shared by every op that touches it.

The Python API of the layout ops ``thd_layout`` and ``thd_layout_info`` (the layout's offsets and
sizes, :meth:`ThdLayout.from_lengths` and friends), with their fake (Meta) kernels at the end."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field

import torch

from ._validate import (
    INT32_MAX, _raise_bad_length, as_bool, as_int, check, check_cp_layout, check_index_dtype, check_int_arg,
    check_jagged, host_values_required, is_meta, lengths_tensor
)

CP_LAYOUTS = ("zigzag", "contiguous")
# The raw ops take cp_layout as an int (the stable ABI has no str arguments at torch 2.9).
CP_LAYOUT_CODES = {name: code for code, name in enumerate(CP_LAYOUTS)}


def _check_rules(op: str, cp_layout, tp_size, cp_size) -> tuple[int, int]:
    if not isinstance(cp_layout, str) or cp_layout not in CP_LAYOUTS:
        raise ValueError(f"{op}: cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
    return (
        as_int(op, "tp_size", tp_size, lo=1, hi=INT32_MAX),
        as_int(op, "cp_size", cp_size, lo=1, hi=INT32_MAX),
    )


# info's head (see thd_layout_info in csrc/ops/thd_ops.h): status, bad length, totals, extremes.
_INFO_HEAD = 7


_PLAIN = (int, bool, str, type(None))
_RULES_CACHE: dict = {}


def _rules(op: str, tp_size=1, cp_size=1, cp_layout="zigzag", fp8_padding=False, min_local_rows=None,
           pad_to_length_bucket=None) -> dict:
    """Checked layout rules, as the ThdLayout fields they become (``align`` included); rules of
    plain Python values are checked once and remembered (a training run uses a handful)."""
    # (the types are part of the key: True == 1, but a bool must not hit an int's entry; only
    # plain values are ever stored, so a hit needs no further check)
    key = (tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket, type(tp_size),
           type(cp_size), type(cp_layout), type(fp8_padding), type(min_local_rows), type(pad_to_length_bucket))
    try:
        hit = _RULES_CACHE.get(key)
    except TypeError:  # an unhashable argument
        hit = None
    if hit is not None:
        return hit
    plain = all(type(v) in _PLAIN for v in key[:6])
    rules = _check_all_rules(op, tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket)
    if plain and len(_RULES_CACHE) < 4096:
        _RULES_CACHE[key] = rules
    return rules


def _check_all_rules(op, tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket) -> dict:
    tp_size, cp_size = _check_rules(op, cp_layout, tp_size, cp_size)
    fp8_padding = as_bool(op, "fp8_padding", fp8_padding)
    if pad_to_length_bucket is not None:
        pad_to_length_bucket = as_int(op, "pad_to_length_bucket", pad_to_length_bucket, lo=1, hi=INT32_MAX)
    if min_local_rows is not None:
        min_local_rows = as_int(op, "min_local_rows", min_local_rows, lo=0, hi=INT32_MAX)
    align = tp_size * cp_size * (2 if (cp_layout == "zigzag" and cp_size > 1) else 1)
    if fp8_padding:
        align = math.lcm(16, align)
    return dict(tp_size=tp_size, cp_size=cp_size, cp_layout=cp_layout, fp8_padding=fp8_padding,
                min_local_rows=min_local_rows, pad_to_length_bucket=pad_to_length_bucket, align=align)


def _host_lengths(op: str, lengths) -> torch.Tensor:
    """Lengths as a CPU integer tensor for the layout op, which checks their range (one host read
    for a device tensor). Unsigned 32/64-bit tensors and lists go through lengths_tensor."""
    if (isinstance(lengths, torch.Tensor) and not lengths.is_nested and lengths.dim() == 1
            and lengths.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
            and not is_meta(lengths)):
        return lengths.detach() if lengths.device.type == "cpu" else lengths.detach().to("cpu")
    return lengths_tensor(op, "lengths", lengths)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``. On CUDA the copy is issued without waiting for the
    transfer: the driver stages a pageable source before the call returns, so ``host`` may change
    or go right after (measured on an H200: ~4 µs for the copy, against ~11 µs for a blocking copy
    or for staging through pinned memory). Under compilation or stream capture: a plain copy."""
    if device.type == "cuda" and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
        return host.to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True, eq=False)
class ThdLayout:
    """Where every token of a micro-batch goes in the THD buffer and on which CP rank.

    Build it once per micro-batch with :meth:`from_lengths` and hand the same object to every op
    of that micro-batch (inputs, labels, router replay, outputs), so they cannot disagree.

    Attributes:
        lengths: valid tokens per sequence, ``tuple[int]`` of length B.
        cu_seqlens / cu_seqlens_padded: int32 ``[B + 1]`` prefix sums of the valid and padded
            lengths, on :attr:`device`. ``cu_seqlens_cpu`` / ``cu_seqlens_padded_cpu`` are the
            host copies.
        max_seqlen: longest padded sequence (what attention kernels take as ``max_seqlen``).
        total_tokens / total_padded: sums of the valid / padded lengths.
        local_rows: rows of the THD buffer each CP rank holds (``total_padded // cp_size``).
        align: the per-sequence alignment that was applied.
    """

    # tuple[int], or (built from the layout op) the op's int64 info tensor whose tail holds the
    # lengths: turned into the tuple on first use of `lengths` (a 1024-entry tolist is ~15 µs)
    _lengths: object = field(repr=False)
    tp_size: int
    cp_size: int
    cp_layout: str
    fp8_padding: bool
    min_local_rows: int | None
    pad_to_length_bucket: int | None
    align: int
    cu_seqlens_cpu: torch.Tensor = field(repr=False)
    cu_seqlens_padded_cpu: torch.Tensor = field(repr=False)
    cu_seqlens: torch.Tensor = field(repr=False)
    cu_seqlens_padded: torch.Tensor = field(repr=False)
    max_seqlen: int
    max_seqlen_unpadded: int
    min_seqlen_unpadded: int
    total_tokens: int
    total_padded: int
    local_rows: int
    # The offsets tensor of the nested tensor this layout was built from (see from_nested):
    # packing that same nested tensor needs no re-validation of its offsets.
    source_offsets: torch.Tensor | None = field(default=None, repr=False)

    @property
    def cp_layout_code(self) -> int:
        """``cp_layout`` as the raw ops take it: 0 = zigzag, 1 = contiguous."""
        return CP_LAYOUT_CODES[self.cp_layout]

    @classmethod
    def from_lengths(
        cls,
        lengths,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        cp_layout: str = "zigzag",
        fp8_padding: bool = False,
        min_local_rows: int | None = None,
        pad_to_length_bucket: int | None = None,
        device: torch.device | str | None = None,
    ) -> ThdLayout:
        """Apply verl's THD alignment rules (docs/layout.md#rules) to per-sequence lengths.

        ``lengths`` may be a list of ints, a CPU tensor or a device tensor of an integer dtype
        (read once to the host); every length must be an int in ``[0, 2**31 - 1]`` — floats,
        bools and strings are rejected, never converted (see :mod:`verl_ops._validate`). The
        offset tensors live on ``device`` (default: the device of ``lengths`` when it is a tensor,
        else CPU).

        Meta device: the layout's sizes are decided by the lengths' *values*, so lengths on the
        meta device raise a ``ValueError`` ("needs host lengths"). For shape inference build the
        layout from host lengths with ``device="meta"``: every op then runs on meta inputs.
        """
        op = "ThdLayout.from_lengths"
        rules = _rules(op, tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket)
        if device is None:
            device = lengths.device if isinstance(lengths, torch.Tensor) else torch.device("cpu")
        # The one host synchronisation of the data path: layout sizes decide output shapes.
        return cls._from_host(op, "lengths", _host_lengths(op, lengths), False, device, rules)

    @classmethod
    def _from_host(cls, op, name, host, is_offsets, device, rules) -> ThdLayout:
        """One call of the layout op on host lengths (or offsets), one host-to-device copy."""
        both, info = torch.ops.verl_ops.thd_layout_info(
            host, is_offsets, rules["tp_size"], rules["cp_size"], CP_LAYOUT_CODES[rules["cp_layout"]],
            rules["fp8_padding"], rules["min_local_rows"], rules["pad_to_length_bucket"],
        )
        head = info[:_INFO_HEAD].tolist()
        if head[0] >= 0:
            _raise_bad_length(op, name, head[0], head[1])
        device = torch.device(device)
        cu_cpu, cu_padded_cpu = both.unbind(0)
        cu_dev, cu_padded_dev = (cu_cpu, cu_padded_cpu) if device.type == "cpu" else _to_device(both, device).unbind(0)
        total_padded = head[3]
        # (every field set at once: the frozen dataclass's __init__ sets them one by one, ~3 µs)
        layout = object.__new__(cls)
        layout.__dict__.update(
            rules,
            _lengths=info,
            cu_seqlens_cpu=cu_cpu,
            cu_seqlens_padded_cpu=cu_padded_cpu,
            cu_seqlens=cu_dev,
            cu_seqlens_padded=cu_padded_dev,
            max_seqlen=head[4],
            max_seqlen_unpadded=head[5],
            min_seqlen_unpadded=head[6],
            total_tokens=head[2],
            total_padded=total_padded,
            local_rows=total_padded // rules["cp_size"],
            source_offsets=None,
        )
        return layout

    @classmethod
    def from_padded_offsets(
        cls,
        lengths,
        cu_seqlens_padded,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        cp_layout: str = "zigzag",
    ) -> ThdLayout:
        """The layout whose padded offsets are exactly ``cu_seqlens_padded``.

        For offsets produced elsewhere (e.g. a ``PackedSeqParams.cu_seqlens_q_padded`` built by
        another packer): the padding is taken as given and only checked to be a valid layout
        (every sequence fits its padded slot, total divisible by ``cp_size``, zigzag halves
        whole). The offset tensors live on ``cu_seqlens_padded``'s device. Both arguments are
        read on the host: meta tensors raise a ``ValueError`` ("needs host ..."), as in
        :meth:`from_lengths`.
        """
        op = "ThdLayout.from_padded_offsets"
        tp_size, cp_size = _check_rules(op, cp_layout, tp_size, cp_size)
        cu_in = cu_seqlens_padded
        if not isinstance(cu_in, torch.Tensor):
            raise TypeError(f"{op}: cu_seqlens_padded must be a 1-D integer tensor, got {type(cu_in).__name__}")
        if cu_in.is_nested or cu_in.dim() != 1:
            what = "a nested tensor" if cu_in.is_nested else f"shape {tuple(cu_in.shape)}"
            raise ValueError(f"{op}: cu_seqlens_padded must be a 1-D integer tensor, got {what}")
        if cu_in.is_floating_point() or cu_in.is_complex() or cu_in.dtype == torch.bool:
            raise ValueError(f"{op}: cu_seqlens_padded must be integers, got {cu_in.dtype}")
        lens = lengths_tensor(op, "lengths", lengths)
        if is_meta(cu_seqlens_padded):
            raise host_values_required(op, "cu_seqlens_padded", "offsets")
        cu_padded64 = cu_seqlens_padded.detach().to("cpu", torch.int64)
        B = lens.numel()
        if cu_padded64.numel() != B + 1:
            raise ValueError(
                f"{op}: cu_seqlens_padded has {cu_padded64.numel()} entries but the batch has {B} "
                f"sequences (expected {B + 1})"
            )
        if int(cu_padded64[0]) != 0:
            raise ValueError(f"{op}: cu_seqlens_padded must start at 0, got {int(cu_padded64[0])}")
        padded = cu_padded64[1:] - cu_padded64[:-1]
        if bool((padded < 0).any()):
            i = int((padded < 0).nonzero()[0])
            raise ValueError(
                f"{op}: cu_seqlens_padded must be non-decreasing, got {int(cu_padded64[i])} then "
                f"{int(cu_padded64[i + 1])} at index {i}"
            )
        if bool((padded < lens).any()):
            i = int((padded < lens).nonzero()[0])
            raise ValueError(
                f"{op}: cu_seqlens_padded does not fit the lengths: sequence {i} has {int(padded[i])} "
                f"padded rows but lengths[{i}] is {int(lens[i])} (cu_seqlens_padded "
                f"{cu_padded64.tolist()}, lengths {lens.tolist()})"
            )
        total_padded = int(cu_padded64[-1])
        if total_padded > 2**31 - 1:
            raise ValueError(f"{op}: padded total {total_padded} does not fit int32")
        if total_padded % cp_size != 0:
            raise ValueError(f"{op}: padded total {total_padded} is not divisible by cp_size={cp_size}")
        zigzag = cp_layout == "zigzag" and cp_size > 1
        if zigzag and bool((padded % (2 * cp_size) != 0).any()):
            raise ValueError(
                f"{op}: zigzag with cp_size={cp_size} needs every padded length to be a multiple of "
                f"{2 * cp_size}, got {padded.tolist()}"
            )
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
        return cls._from_offsets(
            lens,
            cu,
            cu_padded64.to(torch.int32),
            cu_seqlens_padded.device,
            tp_size=tp_size,
            cp_size=cp_size,
            cp_layout=cp_layout,
            fp8_padding=False,
            min_local_rows=None,
            pad_to_length_bucket=None,
            align=tp_size * cp_size * (2 if zigzag else 1),
        )

    @classmethod
    def _from_offsets(cls, lens, cu, cu_padded, device, **rules) -> ThdLayout:
        """Build from checked host offsets (int32 [B + 1]); one host-to-device copy for both."""
        lengths = tuple(lens.tolist())
        padded = (cu_padded[1:] - cu_padded[:-1]).tolist()
        total_padded = int(cu_padded[-1])
        both = _to_device(torch.stack([cu, cu_padded]), torch.device(device))
        return cls(
            _lengths=lengths,
            **rules,
            cu_seqlens_cpu=cu,
            cu_seqlens_padded_cpu=cu_padded,
            cu_seqlens=both[0],
            cu_seqlens_padded=both[1],
            max_seqlen=max(padded, default=0),
            max_seqlen_unpadded=max(lengths, default=0),
            min_seqlen_unpadded=min(lengths, default=0),
            total_tokens=int(cu[-1]),
            total_padded=total_padded,
            local_rows=total_padded // rules["cp_size"],
        )

    @classmethod
    def from_nested(cls, x: torch.Tensor, **kwargs) -> ThdLayout:
        """Layout of a jagged nested tensor's sequences (same keyword arguments as from_lengths).

        The layout remembers ``x``'s offsets, so preprocess_thd(x, layout) skips re-checking them.
        ``x`` must be a ``torch.jagged`` nested tensor without holes (a strided nested tensor or
        one with offsets plus lengths is rejected), with its offsets off the meta device.
        """
        op = "ThdLayout.from_nested"
        check_jagged(op, "x", x)
        offsets = x.offsets()
        if is_meta(offsets):
            raise host_values_required(op, "x", "offsets")
        device = kwargs.pop("device", None)
        return cls._from_checked_offsets(offsets, device, _rules("ThdLayout.from_lengths", **kwargs))

    @classmethod
    def _from_checked_offsets(cls, offsets, device, rules) -> ThdLayout:
        """from_nested after its checks: ``offsets`` of a jagged nested tensor without holes, off the
        meta device; one host read of them, one layout op, one copy of the offsets to ``device``
        (default: where ``offsets`` are)."""
        host = offsets if offsets.device.type == "cpu" else offsets.to("cpu")
        layout = cls._from_host(
            "ThdLayout.from_lengths", "lengths", host, True, offsets.device if device is None else device, rules
        )
        object.__setattr__(layout, "source_offsets", offsets)
        return layout

    @property
    def lengths(self) -> tuple:
        """Valid tokens per sequence, ``tuple[int]`` of length B."""
        ls = self._lengths
        if not isinstance(ls, tuple):
            ls = tuple(ls[_INFO_HEAD:].tolist())
            object.__setattr__(self, "_lengths", ls)
        return ls

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
        return f"ThdLayout(lengths={self.lengths!r}, {shown})"

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_cpu.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def seqlens_padded(self) -> list:
        c = self.cu_seqlens_padded_cpu
        return (c[1:] - c[:-1]).tolist()

    def to(self, device) -> ThdLayout:
        """The same layout with its offset tensors on ``device``."""
        device = torch.device(device)
        if device == self.device:
            return self
        both = _to_device(torch.stack([self.cu_seqlens_cpu, self.cu_seqlens_padded_cpu]), device)
        return dataclasses.replace(self, cu_seqlens=both[0], cu_seqlens_padded=both[1])

    def same_as(self, other: ThdLayout) -> bool:
        """True when both layouts put every token in the same row."""
        return (
            self.cp_size == other.cp_size
            and self.cp_layout == other.cp_layout
            and torch.equal(self.cu_seqlens_cpu, other.cu_seqlens_cpu)
            and torch.equal(self.cu_seqlens_padded_cpu, other.cu_seqlens_padded_cpu)
        )


# --------------------------------------------------------------------------------------------
# Fake (Meta) kernels of the layout ops: output shapes from the inputs' shapes alone, the argument
# checks of csrc/ops/thd_ops.cpp (layout_params and the input checks) in its words.


def _check_layout_args(op, name, x, tp_size, cp_size, cp_layout, min_local_rows, pad_to_length_bucket) -> None:
    check_int_arg(op, "tp_size", tp_size, 1)
    check_int_arg(op, "cp_size", cp_size, 1)
    check_cp_layout(op, cp_layout)
    if min_local_rows is not None:
        check_int_arg(op, "min_local_rows", min_local_rows)
    if pad_to_length_bucket is not None:
        check(pad_to_length_bucket > 0, op, f"pad_to_length_bucket must be a positive integer, got {pad_to_length_bucket}")
        check_int_arg(op, "pad_to_length_bucket", pad_to_length_bucket, 1)
    check(x.dim() == 1, op, f"{name} must be 1-D, got shape {tuple(x.shape)}")
    check_index_dtype(op, name, x)


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
    check(not x_is_offsets or x.shape[0] >= 1, op, "offsets must have B + 1 >= 1 entries, got 0")
    b = x.shape[0] - 1 if x_is_offsets else x.shape[0]
    return x.new_empty((2, b + 1), dtype=torch.int32), x.new_empty((7 + b,), dtype=torch.int64)
