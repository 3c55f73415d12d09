"""Dynamic context parallel (OPS.md section 5): per micro-batch, choose a CP size from the longest
sequence, divide the batch among the resulting CP groups, and put the groups' outputs back into
the original sample order.

The ``dp_size`` ranks of a DPxCP group (Megatron's ``context_parallel_size=1`` data-parallel
group under verl's dynamic CP) all hold the same micro-batch. For a micro-batch:

- ``local_cp_size = next_pow2(ceil(max_len / max_seqlen_per_dp_cp_rank))`` (at least 1); an error
  if it exceeds ``dp_size``. A batch with fewer sequences than ``dp_size`` is not divided:
  ``local_cp_size = dp_size`` and every rank keeps the whole batch. A power of two that does not
  divide a non-power-of-two ``dp_size`` rounds up to ``dp_size`` (one group).
- The ranks form ``dp_size // local_cp_size`` CP groups of consecutive ranks; rank ``r`` is in
  group ``local_dp_rank = r // local_cp_size`` at CP rank ``r % local_cp_size``.
- ``assignment="contiguous"`` (default, verl's): group g takes the g-th block of consecutive
  sequences. verl's blocks are ``ceil(B / groups)`` long, which leaves trailing groups empty when
  B is not a multiple (e.g. 9 sequences over 4 groups gives 3, 3, 3, 0); here the first
  ``B % groups`` blocks take one extra sequence instead (3, 2, 2, 2), so no group is ever empty
  (B >= dp_size >= groups). Where B divides evenly the two agree.
- ``assignment="balanced"``: longest-processing-time assignment by token count (sequences in
  decreasing length, each to the group with the fewest tokens so far, ties to the group with
  fewer sequences, then the lower index); each group keeps its sequences in the original order.

Merge gathers the groups' outputs over the ranks that share a CP rank (one rank per group, a
group of ``dp_size // local_cp_size`` ranks), with tensor collectives: a fixed-size header with
the per-sequence lengths first, then one all-gather of the values (padded to the largest group),
and one jagged_gather that restores the sample order. Every rank issues the same collectives
whatever its data; inputs that disagree across ranks raise on every rank instead of hanging.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._jagged import jagged_indices
from ._validate import INT32_MAX, as_lengths, check_jagged, host_values_required, is_meta

_ops = torch.ops.verl_ops

ASSIGNMENTS = ("contiguous", "balanced")


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _valid_cp_sizes(dp_size: int) -> list[int]:
    """Powers of two dividing dp_size, and dp_size itself."""
    sizes, s = [], 1
    while s <= dp_size:
        if dp_size % s == 0:
            sizes.append(s)
        s *= 2
    if sizes[-1] != dp_size:
        sizes.append(dp_size)
    return sizes


def _crc(obj) -> int:
    """Deterministic across processes (Python's hash() of str is salted per process)."""
    return zlib.crc32(repr(obj).encode())


# --------------------------------------------------------------------------------------------
# The plan: pure host arithmetic, no process group.


@dataclass(frozen=True)
class DynamicCPPlan:
    """How one micro-batch is divided among dynamic CP groups.

    Attributes:
        lengths: per-sequence lengths of the whole micro-batch (tuple of B ints).
        dp_size / dp_rank: size of the DPxCP group and this rank in it.
        local_cp_size: CP size of this micro-batch.
        assignment: "contiguous" or "balanced".
        groups: sample ids of each CP group, in group order (group g = ranks
            ``[g * local_cp_size, (g + 1) * local_cp_size)``), each in increasing order.
    """

    lengths: tuple
    dp_size: int
    dp_rank: int
    local_cp_size: int
    assignment: str
    groups: tuple = field(repr=False)

    @property
    def num_groups(self) -> int:
        """``dp_size // local_cp_size`` (verl's ``local_dp_size``)."""
        return len(self.groups)

    @property
    def local_dp_rank(self) -> int:
        """This rank's group, ``dp_rank // local_cp_size``."""
        return self.dp_rank // self.local_cp_size

    @property
    def cp_rank(self) -> int:
        """This rank inside its CP group, ``dp_rank % local_cp_size``."""
        return self.dp_rank % self.local_cp_size

    @property
    def sample_ids(self) -> tuple:
        """The sequences this rank's group processes, in original order."""
        return self.groups[self.local_dp_rank]

    @property
    def local_lengths(self) -> tuple:
        return tuple(self.lengths[i] for i in self.sample_ids)

    def group_tokens(self) -> list:
        """Tokens per group."""
        return [sum(self.lengths[i] for i in g) for g in self.groups]

    def fingerprint(self) -> int:
        return _crc((self.dp_size, self.local_cp_size, self.groups))


def plan_dynamic_cp(
    lengths,
    dp_size: int,
    max_seqlen_per_dp_cp_rank: int,
    *,
    dp_rank: int = 0,
    assignment: str = "contiguous",
) -> DynamicCPPlan:
    """The dynamic CP plan of a micro-batch with per-sequence ``lengths`` (see the module doc).

    ``lengths``: a list of ints or a 1-D integer tensor (read to the host; not on the meta
    device), every entry in ``[0, 2**31 - 1]``; floats and bools are rejected, not truncated.
    Raises ValueError when the longest sequence needs more than ``dp_size`` ranks.
    """
    return _plan(
        "plan_dynamic_cp", lengths, dp_size, max_seqlen_per_dp_cp_rank, dp_rank=dp_rank, assignment=assignment
    )


def _plan(op, lengths, dp_size, max_seqlen_per_dp_cp_rank, *, dp_rank, assignment) -> DynamicCPPlan:
    for name, v in (("dp_size", dp_size), ("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT32_MAX:
            raise ValueError(f"{op}: {name} must be an int >= 1 (and <= 2**31 - 1), got {v!r}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{op}: dp_rank must be an int in [0, dp_size={dp_size}), got {dp_rank!r}")
    if not isinstance(assignment, str) or assignment not in ASSIGNMENTS:
        raise ValueError(f"{op}: assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    lengths = tuple(as_lengths(op, "lengths", lengths))
    B = len(lengths)
    longest = max(lengths, default=0)
    need = _next_pow2(max(1, -(-longest // max_seqlen_per_dp_cp_rank)))
    if need > dp_size:
        raise ValueError(
            f"{op}: the longest sequence ({longest} tokens) needs local_cp_size={need} "
            f"(next power of two of ceil({longest} / "
            f"max_seqlen_per_dp_cp_rank={max_seqlen_per_dp_cp_rank})) "
            f"but dp_size is {dp_size}; raise max_seqlen_per_dp_cp_rank or cap the sequence length"
        )
    if B < dp_size:
        local_cp_size = dp_size  # too few sequences to give every group one: one group, whole batch
    else:
        local_cp_size = next(s for s in _valid_cp_sizes(dp_size) if s >= need)
    G = dp_size // local_cp_size
    if G == 1:
        groups = (tuple(range(B)),)
    elif assignment == "contiguous":
        base, rem = divmod(B, G)
        groups, start = [], 0
        for g in range(G):
            n = base + (1 if g < rem else 0)
            groups.append(tuple(range(start, start + n)))
            start += n
        groups = tuple(groups)
    else:
        heap = [(0, 0, g) for g in range(G)]  # (tokens, sequences, group)
        members = [[] for _ in range(G)]
        for i in sorted(range(B), key=lambda i: (-lengths[i], i)):
            tokens, count, g = heapq.heappop(heap)
            members[g].append(i)
            heapq.heappush(heap, (tokens + lengths[i], count + 1, g))
        groups = tuple(tuple(sorted(m)) for m in members)
    return DynamicCPPlan(lengths, dp_size, dp_rank, local_cp_size, assignment, groups)


# --------------------------------------------------------------------------------------------
# Process groups.


def _dist():
    import torch.distributed as dist

    return dist


class DynamicCPGroups:
    """The process sub-groups of one DPxCP group, created once.

    For every valid CP size s (powers of two dividing ``dp_size``, and ``dp_size``): the CP groups
    ``[g*s, (g+1)*s)`` (what ``mpu.get_dynamic_data_context_parallel_groups(group_size=s)`` returns)
    and the merge groups ``{c, c+s, c+2s, ...}`` (one rank of each CP group).

    ``new_group`` is collective, so the object is built at the same point on every rank, and the
    groups are created in one fixed order:

    - ``group`` the world group (default): every process creates every group.
    - ``group`` a sub-group (the DPxCP group of a job with TP / PP) and ``all_group_ranks`` the
      global ranks of *every* DPxCP group of the job (the same list on every process): every
      process creates every sub-group of every DPxCP group and keeps its own. This is the mode
      that works whatever the backend's initialisation (NCCL bound to a device splits
      communicators, which needs every process of the world in every ``new_group``).
    - ``group`` a sub-group alone: each process creates only its own groups, with group-local
      synchronisation. Not possible when the default NCCL group is bound to a device (eager
      initialisation); that raises and asks for ``all_group_ranks``.

    Args:
        group: this process's DPxCP process group (default: the world group).
        all_group_ranks: the global ranks of every DPxCP group of the job, each in increasing
            order, all of one size (see above).
    """

    _cache: dict = {}

    def __init__(self, group=None, *, all_group_ranks=None):
        dist = _dist()
        if not dist.is_initialized():
            raise RuntimeError("DynamicCPGroups: torch.distributed is not initialized")
        world = dist.group.WORLD
        self.group = world if group is None else group
        self.ranks = tuple(dist.get_process_group_ranks(self.group))
        self.dp_size = len(self.ranks)
        self.dp_rank = dist.get_rank(self.group)
        self.backend = dist.get_backend(self.group)
        self.sizes = tuple(_valid_cp_sizes(self.dp_size))
        if list(self.ranks) != sorted(self.ranks):
            raise RuntimeError(
                f"DynamicCPGroups: the group's ranks {list(self.ranks)} must be in increasing order, so that "
                "sub-group ranks follow the group's order"
            )
        if all_group_ranks is not None:
            parents = [tuple(int(r) for r in ranks) for ranks in all_group_ranks]
            if self.ranks not in parents or any(len(p) != self.dp_size for p in parents):
                raise ValueError(
                    f"DynamicCPGroups: all_group_ranks must list every DPxCP group, each of {self.dp_size} "
                    f"ranks, including this group {list(self.ranks)}; got {[list(p) for p in parents]}"
                )
            local = False
        elif self.group is world:
            parents, local = [self.ranks], False
        else:
            default = dist.distributed_c10d._get_default_group()
            if getattr(default, "bound_device_id", None) is not None:
                raise RuntimeError(
                    "DynamicCPGroups: the default process group is bound to a device (eager NCCL "
                    "initialisation), so every process must take part in creating every sub-group; pass "
                    "all_group_ranks= (the global ranks of every DPxCP group, the same on every process)"
                )
            parents, local = [self.ranks], True
        me = dist.get_rank()
        self._cp, self._merge = {}, {}
        for s in self.sizes:
            for parent in parents:
                specs = [(self._cp, parent[g * s : (g + 1) * s]) for g in range(self.dp_size // s)]
                specs += [(self._merge, parent[c::s]) for c in range(s)]
                for table, members in specs:
                    mine = me in members
                    if len(members) == 1 or len(members) == self.dp_size:
                        # No new group: a single rank, or the parent itself.
                        pg = self.group if mine and len(members) > 1 else None
                    elif local:
                        pg = dist.new_group(list(members), use_local_synchronization=True) if mine else None
                    else:
                        pg = dist.new_group(list(members))
                    if mine:
                        table[s] = pg

    @classmethod
    def for_group(cls, group=None, *, all_group_ranks=None) -> DynamicCPGroups:
        """The cached instance for ``group`` (created on first use: collective, see the class doc)."""
        dist = _dist()
        key = dist.group.WORLD if group is None else group
        inst = cls._cache.get(key)
        if inst is None:
            inst = cls._cache[key] = cls(group, all_group_ranks=all_group_ranks)
        return inst

    def _size(self, local_cp_size: int) -> int:
        if local_cp_size not in self.sizes:
            raise ValueError(
                f"DynamicCPGroups: local_cp_size must be one of {list(self.sizes)} for "
                f"dp_size={self.dp_size}, got {local_cp_size!r}"
            )
        return local_cp_size

    def cp_group(self, local_cp_size: int):
        """This rank's CP group of size ``local_cp_size`` (None when the size is 1)."""
        return self._cp[self._size(local_cp_size)]

    def merge_group(self, local_cp_size: int):
        """The ranks sharing this rank's CP rank, one per CP group (None when there is one group)."""
        return self._merge[self._size(local_cp_size)]

    @property
    def device(self) -> torch.device:
        """Where this group's collectives need their tensors."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Batches: a jagged nested tensor, values [total, *F] with lengths, or a mapping of those plus
# per-sample dense tensors [B, ...].


class _Item(NamedTuple):
    kind: str  # "nested", "values", "dense"
    tensor: torch.Tensor


def _lengths_of_nested(op: str, name: str, x: torch.Tensor) -> list | None:
    """The sequence lengths of jagged nested ``x``; None on the meta device (no values)."""
    check_jagged(op, name, x)
    offsets = x.offsets()
    if is_meta(offsets):
        return None
    return offsets.diff().tolist()


def _parse_batch(op: str, batch, lengths):
    """(items: dict name -> _Item, lengths list). A single tensor is stored under the name None."""
    single = not isinstance(batch, Mapping)
    entries = {None: batch} if single else dict(batch)
    given = None if lengths is None else as_lengths(op, "lengths", lengths)
    found = None
    items = {}
    for name, t in entries.items():
        where = "batch" if single else f"batch[{name!r}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {where} must be a tensor, got {type(t)}")
        if t.is_nested:
            ls = _lengths_of_nested(op, where, t)
            items[name] = _Item("nested", t)
            if ls is None:  # meta: only the sequence count is known; the lengths come from lengths=
                if given is None:
                    raise host_values_required(
                        op, where, "lengths", "pass lengths= (host ints) with a meta nested batch"
                    )
                if t.size(0) != len(given):
                    raise ValueError(f"{op}: {where} has {t.size(0)} sequences but lengths= has {len(given)}")
                continue
        elif single:
            if given is None:
                raise ValueError(f"{op}: a values tensor [total, *F] needs lengths=")
            if t.dim() < 1 or t.shape[0] != sum(given):
                raise ValueError(
                    f"{op}: values must be [sum(lengths)={sum(given)}, *F], got {tuple(t.shape)}"
                )
            ls = given
            items[name] = _Item("values", t)
        else:
            items[name] = _Item("dense", t)
            continue
        if found is None:
            found = ls
        elif ls != found:
            raise ValueError(f"{op}: {where} has other sequence lengths than the batch's first nested tensor")
    ref = given if given is not None else found
    if ref is None:
        raise ValueError(f"{op}: the batch has no jagged tensor; pass lengths=")
    if found is not None and given is not None and found != given:
        raise ValueError(f"{op}: lengths= disagrees with the nested tensors' lengths")
    for name, it in items.items():
        if it.kind == "dense" and (it.tensor.dim() < 1 or it.tensor.shape[0] != len(ref)):
            raise ValueError(
                f"{op}: batch[{name!r}] must be nested or have one row per sequence ([B={len(ref)}, ...]), "
                f"got {tuple(it.tensor.shape)}"
            )
    return items, ref, single


def _select(items: dict, lengths: list, ids: Sequence, single: bool):
    out = {}
    index_cache = {}
    for name, it in items.items():
        t = it.tensor
        if it.kind == "dense":
            out[name] = t.index_select(0, torch.tensor(list(ids), dtype=torch.int64, device=t.device))
            continue
        key = t.device
        if key not in index_cache:
            index_cache[key] = jagged_indices(lengths, ids, device=t.device)
        src, cu, total = index_cache[key]
        values = t.values() if it.kind == "nested" else t
        sel = _ops.jagged_gather(values.contiguous(), src, cu, total)
        if it.kind == "nested":
            lens = [lengths[i] for i in ids]
            out[name] = torch.nested.nested_tensor_from_jagged(
                sel,
                offsets=cu.to(torch.int64),
                min_seqlen=min(lens, default=0),
                max_seqlen=max(lens, default=0),
            )
        else:
            out[name] = (sel, torch.tensor([lengths[i] for i in ids], dtype=torch.int64))
    return out[None] if single else out


# --------------------------------------------------------------------------------------------
# Split.


class DynamicCPSplit(NamedTuple):
    """What :func:`dynamic_cp_split` returns.

    batch: this rank's micro-batch (same form as the input: nested tensor, ``(values, lengths)``,
        or a dict of those).
    local_cp_size: CP size of this micro-batch.
    cp_group: the CP group to run the model with (None when ``local_cp_size == 1``).
    plan: the :class:`DynamicCPPlan` (needed by :func:`dynamic_cp_merge`).
    groups: the :class:`DynamicCPGroups` used (None without torch.distributed).
    """

    batch: Any
    local_cp_size: int
    cp_group: Any
    plan: DynamicCPPlan
    groups: Any


_HEADER = 8  # status, count, 6 fingerprint / detail words


def _all_gather_words(words: list, group, device, world: int) -> torch.Tensor:
    """All-gather a fixed-length list of int64 words; returns host [world, len(words)]."""
    dist = _dist()
    t = torch.tensor(words, dtype=torch.int64, device=device)
    out = torch.empty(world * len(words), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out.view(world, len(words)).cpu()


def _raise_collected(op: str, status: torch.Tensor, local_error: BaseException | None, what: str) -> None:
    bad = [r for r, s in enumerate(status.tolist()) if s != 0]
    if not bad:
        return
    if local_error is not None:
        raise local_error
    raise RuntimeError(
        f"{op}: rank(s) {bad} of the group rejected their {what} (their error says why); nothing was done"
    )


def dynamic_cp_split(
    batch,
    max_seqlen_per_dp_cp_rank: int,
    *,
    lengths=None,
    groups: DynamicCPGroups | None = None,
    group=None,
    assignment: str = "contiguous",
    validate: bool = True,
) -> DynamicCPSplit:
    """This rank's part of a dynamic-CP micro-batch.

    Every rank of the DPxCP group calls this with the same micro-batch.

    Args:
        batch: the whole micro-batch: a jagged nested tensor ``[B, j, *F]``; or values
            ``[total, *F]`` with ``lengths``; or a dict of nested tensors (same lengths) and
            per-sample tensors ``[B, ...]``.
        max_seqlen_per_dp_cp_rank: tokens one rank may hold.
        lengths: per-sequence lengths (required for a values tensor; otherwise taken from the
            nested tensors). They decide ``local_cp_size``.
        groups: the :class:`DynamicCPGroups` to use; default: the cached one of ``group``.
        group: the DPxCP process group (default: the world group) when ``groups`` is not given.
            Without an initialized torch.distributed, ``dp_size`` is 1.
        assignment: ``"contiguous"`` (verl's) or ``"balanced"`` (see the module doc).
        validate: check with one small all-gather that every rank holds the same lengths and
            settings (a host read); a mismatch raises on every rank.

    Returns:
        :class:`DynamicCPSplit` ``(batch, local_cp_size, cp_group, plan, groups)``. The selection
        is differentiable (its backward scatters into the whole batch); when one group holds the
        whole batch the input tensors are returned as they are.
    """
    op = "dynamic_cp_split"
    dist = _dist()
    if groups is None and dist.is_available() and dist.is_initialized():
        groups = DynamicCPGroups.for_group(group)
    dp_size = groups.dp_size if groups is not None else 1
    dp_rank = groups.dp_rank if groups is not None else 0
    error, plan, parsed = None, None, None
    try:
        parsed = _parse_batch(op, batch, lengths)
        plan = _plan(
            op, parsed[1], dp_size, max_seqlen_per_dp_cp_rank, dp_rank=dp_rank, assignment=assignment
        )
    except Exception as e:  # every rank still joins the exchange below; re-raised after it
        error = e
    if groups is not None and dp_size > 1 and validate:
        ls = plan.lengths if plan is not None else ()
        w = [(i + 1) * n for i, n in enumerate(ls)]
        words = [
            1 if error is not None else 0,
            len(ls),
            sum(ls),
            sum(w) % (1 << 61),
            sum((i + 1) * x for i, x in enumerate(w)) % (1 << 61),
            int(max_seqlen_per_dp_cp_rank) if isinstance(max_seqlen_per_dp_cp_rank, int) else -1,
            _crc(assignment),
            plan.fingerprint() if plan is not None else 0,
        ]
        rows = _all_gather_words(words, groups.group, groups.device, dp_size)
        _raise_collected(op, rows[:, 0], error, "input")
        if not bool((rows == rows[0]).all()):
            raise RuntimeError(
                f"{op}: the ranks of the DPxCP group hold different micro-batches or settings "
                f"(sequences, tokens, length hashes, max_seqlen_per_dp_cp_rank, assignment, plan per rank: "
                f"{rows[:, 1:].tolist()})"
            )
    if error is not None:
        raise error
    items, lens, single = parsed
    if plan.num_groups == 1:
        # One group holds the whole batch: nothing to select, nothing to copy.
        local = {n: (it.tensor, torch.tensor(lens, dtype=torch.int64)) if it.kind == "values" else it.tensor
                 for n, it in items.items()}
        local = local[None] if single else local
    else:
        local = _select(items, list(plan.lengths), plan.sample_ids, single)
    cp_group = groups.cp_group(plan.local_cp_size) if groups is not None else None
    return DynamicCPSplit(local, plan.local_cp_size, cp_group, plan, groups)


# --------------------------------------------------------------------------------------------
# Merge.


def _output_parts(op: str, out, lengths):
    """(values [rows, *F], lengths list, nested?) of one output, or raise."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: outputs must be tensors (nested, or values with lengths=), got {type(out)}")
    if out.is_nested:
        if lengths is not None:
            raise ValueError(f"{op}: lengths= is for a values tensor, not for a nested tensor")
        ls = _lengths_of_nested(op, "outputs", out)
        if ls is None:  # meta: the count is known, the lengths are not (shape inference only)
            ls = [None] * out.size(0)
        return out.values(), ls, True
    if lengths is None:
        raise ValueError(f"{op}: a values tensor [rows, *F] needs lengths=")
    ls = as_lengths(op, "lengths", lengths)
    if out.dim() < 1 or out.shape[0] != sum(ls):
        raise ValueError(f"{op}: values must be [sum(lengths)={sum(ls)}, *F], got {tuple(out.shape)}")
    return out, ls, False


def dynamic_cp_merge(outputs, split: DynamicCPSplit, *, lengths=None):
    """Every group's outputs, in the original sample order, on every rank.

    Args:
        outputs: this rank's per-sequence outputs for ``split.plan.sample_ids`` (e.g. log-probs
            after :func:`postprocess_thd` over the CP group, so every member of a CP group holds
            the same outputs): a jagged nested tensor ``[n_local, j, *F]``, or values
            ``[rows, *F]`` with ``lengths``, or a dict of those (merged key by key, in sorted key
            order). Output lengths may differ from the input lengths.
        split: what :func:`dynamic_cp_split` returned for this micro-batch.

    Returns:
        Same form as ``outputs`` for the whole batch (B sequences): a nested tensor, or
        ``(values, lengths int64)``, or a dict. Forward-only: the result carries no gradient.

    Collectives (over the ranks sharing this CP rank; none when there is one group): one
    all-gather of a fixed-size int64 header with the lengths, then one all-gather of the values
    as bytes. A rank with a wrong number of sequences, or ranks disagreeing on dtype, feature shape,
    plan or keys, make every rank raise.
    """
    op = "dynamic_cp_merge"
    if isinstance(outputs, Mapping):
        if lengths is not None and not isinstance(lengths, Mapping):
            raise ValueError(f"{op}: with a dict of outputs, lengths must be a dict too")
        keys = sorted(outputs)
        key_hash = _crc(keys)
        return {
            k: _merge_one(op, outputs[k], split, None if lengths is None else lengths.get(k), key_hash)
            for k in keys
        }
    return _merge_one(op, outputs, split, lengths, 0)


def _merge_one(op, out, split: DynamicCPSplit, lengths, key_hash: int):
    plan, groups = split.plan, split.groups
    G = plan.num_groups
    error, values, ls, nested, local = None, None, None, True, None
    try:
        values, ls, nested = _output_parts(op, out, lengths)
        if len(ls) != len(plan.sample_ids):
            raise ValueError(
                f"{op}: this rank's group holds {len(plan.sample_ids)} sequences but the outputs have "
                f"{len(ls)}"
            )
        # Everything that can fail on this rank alone happens before the first collective.
        # Bytes, so every dtype travels the same way (gloo and NCCL lack some dtypes, e.g. bool).
        rows_2d = values.detach().contiguous().view(values.shape[0], math.prod(values.shape[1:]))
        local = rows_2d.view(torch.uint8)
    except (ValueError, TypeError, RuntimeError) as e:
        error = e
    if G == 1 or groups is None:
        if error is not None:
            raise error
        if nested and is_meta(out.offsets()):
            return out.detach()  # shape inference: the same sequences, nothing to reorder
        return _finish(values.detach(), ls, nested)
    if error is None and is_meta(values):
        error = ValueError(f"{op}: outputs on the meta device cannot be gathered across {G} CP groups")

    mg = groups.merge_group(plan.local_cp_size)
    device = groups.device
    maxn = max(len(g) for g in plan.groups)
    if error is None:
        feat = tuple(values.shape[1:])
        row_bytes = math.prod(feat) * values.element_size()
        header = [0, len(ls), _crc(str(values.dtype)), _crc(feat), row_bytes, plan.fingerprint(), key_hash]
        header.append(sum(ls))
        header += ls + [0] * (maxn - len(ls))
    else:
        header = [1] + [0] * (_HEADER - 1 + maxn)
    rows = _all_gather_words(header, mg, device, G)
    _raise_collected(op, rows[:, 0], error, "outputs")
    if not bool((rows[:, 2:7] == rows[0, 2:7]).all()):
        raise RuntimeError(
            f"{op}: the groups' outputs disagree (dtype, feature shape, row bytes, plan, keys hashes per "
            "group: "
            f"{rows[:, 2:7].tolist()})"
        )
    counts = rows[:, 1].tolist()
    if counts != [len(g) for g in plan.groups]:
        expected = [len(g) for g in plan.groups]
        raise RuntimeError(f"{op}: sequences per group {counts} do not match the plan {expected}")
    totals = rows[:, _HEADER - 1].tolist()
    max_total = max(totals)
    feat = tuple(values.shape[1:])
    if row_bytes == 0 or max_total == 0:
        merged_lengths = [0] * len(plan.lengths)
        for g, ids in enumerate(plan.groups):
            for k, i in enumerate(ids):
                merged_lengths[i] = int(rows[g, _HEADER + k])
        empty = values.new_zeros((sum(merged_lengths), *feat))
        return _finish(empty, merged_lengths, nested)

    dist = _dist()
    local = local.to(device)
    if local.shape[0] == max_total:
        send = local
    else:
        send = torch.empty((max_total, row_bytes), dtype=torch.uint8, device=device)
        send[: local.shape[0]] = local
    gathered = torch.empty((G * max_total, row_bytes), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, send, group=mg)

    # Sample i of group g, k-th in that group, starts at g * max_total + (offset of k in group g).
    B = len(plan.lengths)
    src, merged_lengths = [0] * B, [0] * B
    for g, ids in enumerate(plan.groups):
        pos = g * max_total
        for k, i in enumerate(ids):
            n = int(rows[g, _HEADER + k])
            src[i], merged_lengths[i] = pos, n
            pos += n
    cu = [0]
    for n in merged_lengths:
        cu.append(cu[-1] + n)
    if cu[-1] > 2**31 - 1:
        raise ValueError(f"{op}: {cu[-1]} merged rows do not fit the int32 offsets of jagged_gather")
    both = torch.tensor(src + cu, dtype=torch.int64).to(device)
    merged = _ops.jagged_gather(gathered, both[:B], both[B:].to(torch.int32), cu[-1])
    merged = merged.view(values.dtype).view(cu[-1], *feat).to(values.device)
    return _finish(merged, merged_lengths, nested)


def _finish(values: torch.Tensor, lengths: list, nested: bool):
    if not nested:
        return values, torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets=offsets.to(values.device),
        min_seqlen=min(lengths, default=0),
        max_seqlen=max(lengths, default=0),
    )
