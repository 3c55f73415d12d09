"""ThdLayout: the one packing decision of a micro-batch, shared by every op that touches it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

CP_LAYOUTS = ("zigzag", "contiguous")


def _lengths_to_cpu(lengths) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1:
            raise ValueError(f"ThdLayout.from_lengths: lengths must be 1-D, got shape {tuple(lengths.shape)}")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"ThdLayout.from_lengths: lengths must be integers, got {lengths.dtype}")
        # The one host synchronisation of the data path: layout sizes decide output shapes.
        return lengths.detach().to("cpu", torch.int64)
    if not isinstance(lengths, Sequence):
        raise ValueError(
            f"ThdLayout.from_lengths: lengths must be a list of ints or a 1-D tensor, got {type(lengths)}"
        )
    for i, v in enumerate(lengths):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"ThdLayout.from_lengths: lengths[{i}] must be an int, got {v!r}")
    return torch.tensor(list(lengths), dtype=torch.int64)


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

    lengths: tuple
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
        """Apply verl's THD alignment rules (OPS.md section 1) to per-sequence lengths.

        ``lengths`` may be a list of ints, a CPU tensor or a device tensor (read once to the
        host). The offset tensors live on ``device`` (default: the device of ``lengths`` when it
        is a tensor, else CPU).
        """
        if cp_layout not in CP_LAYOUTS:
            raise ValueError(f"ThdLayout.from_lengths: cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
        for name, v in (("tp_size", tp_size), ("cp_size", cp_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ThdLayout.from_lengths: {name} must be an int >= 1, got {v!r}")
        if pad_to_length_bucket is not None and pad_to_length_bucket <= 0:
            raise ValueError(
                f"ThdLayout.from_lengths: pad_to_length_bucket must be a positive integer, got {pad_to_length_bucket}"
            )
        if min_local_rows is not None and min_local_rows < 0:
            raise ValueError(f"ThdLayout.from_lengths: min_local_rows must be >= 0, got {min_local_rows}")
        if device is None:
            device = lengths.device if isinstance(lengths, torch.Tensor) else torch.device("cpu")
        host = _lengths_to_cpu(lengths)
        cu, cu_padded = torch.ops.verl_ops.thd_layout(
            host, tp_size, cp_size, cp_layout, bool(fp8_padding), min_local_rows, pad_to_length_bucket
        )
        lens = tuple(host.tolist())
        padded = (cu_padded[1:] - cu_padded[:-1]).tolist()
        factor = 2 if (cp_layout == "zigzag" and cp_size > 1) else 1
        align = tp_size * cp_size * factor
        if fp8_padding:
            align = math.lcm(16, align)
        total_padded = int(cu_padded[-1])
        device = torch.device(device)
        # One host-to-device copy for both offset tensors.
        both = torch.stack([cu, cu_padded]).to(device)
        return cls(
            lengths=lens,
            tp_size=tp_size,
            cp_size=cp_size,
            cp_layout=cp_layout,
            fp8_padding=bool(fp8_padding),
            min_local_rows=min_local_rows,
            pad_to_length_bucket=pad_to_length_bucket,
            align=align,
            cu_seqlens_cpu=cu,
            cu_seqlens_padded_cpu=cu_padded,
            cu_seqlens=both[0],
            cu_seqlens_padded=both[1],
            max_seqlen=max(padded, default=0),
            max_seqlen_unpadded=max(lens, default=0),
            min_seqlen_unpadded=min(lens, default=0),
            total_tokens=int(cu[-1]),
            total_padded=total_padded,
            local_rows=total_padded // cp_size,
        )

    @classmethod
    def from_nested(cls, x: torch.Tensor, **kwargs) -> ThdLayout:
        """Layout of a jagged nested tensor's sequences (same keyword arguments as from_lengths).

        The layout remembers ``x``'s offsets, so preprocess_thd(x, layout) skips re-checking them.
        """
        if not (isinstance(x, torch.Tensor) and x.is_nested):
            raise ValueError(f"ThdLayout.from_nested: x must be a jagged nested tensor, got {type(x)}")
        offsets = x.offsets()
        layout = cls.from_lengths(offsets.diff(), **kwargs)
        object.__setattr__(layout, "source_offsets", offsets)
        return layout

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

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
        d = dict(self.__dict__)
        both = torch.stack([self.cu_seqlens_cpu, self.cu_seqlens_padded_cpu]).to(device)
        d["cu_seqlens"], d["cu_seqlens_padded"] = both[0], both[1]
        return ThdLayout(**d)

    def same_as(self, other: ThdLayout) -> bool:
        """True when both layouts put every token in the same row."""
        return (
            self.cp_size == other.cp_size
            and self.cp_layout == other.cp_layout
            and torch.equal(self.cu_seqlens_cpu, other.cu_seqlens_cpu)
            and torch.equal(self.cu_seqlens_padded_cpu, other.cu_seqlens_padded_cpu)
        )
