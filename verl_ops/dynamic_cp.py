"""Dynamic context parallel (docs/cp.md#dynamic-cp): per micro-batch, choose a CP size from the longest
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
group of ``dp_size // local_cp_size`` ranks), with tensor collectives, over the whole DPxCP group
first (so that a rejected output makes every rank raise): 10 words per rank (its status and
counts, and what every rank must agree on: num_samples, local_cp_size, validate, the dtype,
feature shape, keys and plan hashes), then, with the width those fix, the headers with the
per-sequence lengths and sample ids; then one all-gather of the values over the merge group
(padded to the largest group) and one jagged_gather that restores the sample order. Every rank issues the same collectives
whatever its data; inputs that disagree across ranks raise on every rank instead of hanging.

This module holds the whole op family: the ops ``dynamic_cp_split`` / ``dynamic_cp_merge``
(defined and implemented here in Python) and the C++ steps of the merge
``dynamic_cp_merge_header`` / ``dynamic_cp_merge_index``, with their fake (Meta) kernels, the
split's autograd and the Python API.
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
from ._library import call_op, guard_dense_arguments, register_autograd
from ._validate import (
    CallerRejected,
    INT32_MAX,
    as_lengths,
    check_jagged,
    check_merge_entries,
    host_values_required,
    is_meta,
    process_group_named,
)

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
    # this group's sample ids as int64 tensors, per device (built once per plan: a host-to-device
    # copy from pageable memory waits for the stream, and every merged output key needs them),
    # and the plan's fingerprint
    _ids_on: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        """A hash of the plan (sizes, grouping and the lengths), the same on every rank (computed
        once per plan)."""
        f = self._ids_on.get("fingerprint")
        if f is None:
            f = self._ids_on["fingerprint"] = _crc((self.dp_size, self.local_cp_size, self.groups, self.lengths))
        return f

    def sample_ids_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`sample_ids` as an int64 tensor on ``device`` (cached per device; do not modify)."""
        key = str(device)
        ids = self._ids_on.get(key)
        if ids is None:
            ids = self._ids_on[key] = torch.tensor(self.sample_ids, dtype=torch.int64).to(device)
        return ids


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
        # The ops find their groups by the c10d name of the DPxCP group (the latest instance built for
        # it: every instance holds complete sub-groups, created by every rank in the same order).
        DynamicCPGroups._cache[self.group.group_name] = self

    @classmethod
    def for_group(cls, group=None, *, all_group_ranks=None) -> DynamicCPGroups:
        """The cached instance for ``group`` (created on first use: collective, see the class doc)."""
        dist = _dist()
        key = dist.group.WORLD if group is None else group
        inst = cls._cache.get(key)
        if inst is None:
            inst = cls._cache[key] = cls(group, all_group_ranks=all_group_ranks)
            # The ops find it by the group's c10d name.
            cls._cache.setdefault(inst.group.group_name, inst)
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


def _select(items: dict, lengths: list, ids: Sequence, single: bool, done: dict | None = None):
    """The sequences ``ids`` of every item (``done``: items whose values are already selected)."""
    out = {}
    index_cache = {}
    done = done or {}
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
        sel = done[name] if name in done else _ops.jagged_gather(values.contiguous(), src, cu, total)
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
# The registered ops: torch.ops.verl_ops.dynamic_cp_split / dynamic_cp_merge. Process groups
# travel by their c10d group name (as in torch's functional collectives); the Python functions
# further down are thin wrappers that turn nested tensors and dicts into these arguments.

_lib = torch.library.Library("verl_ops", "FRAGMENT")
_lib.define(
    "dynamic_cp_split(Tensor values, Tensor lengths, int max_seqlen_per_dp_cp_rank, str? group_name=None, "
    "int assignment=0, bool validate=True, bool rank_error=False) "
    "-> (Tensor values, Tensor lengths, Tensor sample_ids, SymInt local_cp_size)"
)
_lib.define(
    "dynamic_cp_merge(Tensor values, Tensor lengths, Tensor sample_ids, SymInt num_samples, SymInt local_cp_size, "
    "str? group_name=None, bool validate=True, int key_hash=0, bool rank_error=False) "
    "-> (Tensor values, Tensor lengths)"
)
# Nested tensors and all-None calls (verl_ops._library); a None beside defined tensors: each op's
# kernels below (inside their try blocks, so that a rank's error still joins the exchange).
_split_dense = guard_dense_arguments("dynamic_cp_split")
_merge_dense = guard_dense_arguments("dynamic_cp_merge")


def _groups_of(op: str, group_name) -> DynamicCPGroups | None:
    """The DynamicCPGroups of the DPxCP group named ``group_name`` (None: no process group)."""
    if group_name is None:
        return None
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op}: group_name={group_name!r} given but torch.distributed is not initialized")
    inst = DynamicCPGroups._cache.get(group_name)
    if inst is None:
        pg = process_group_named(op, "group_name", group_name)
        inst = DynamicCPGroups.for_group(None if pg == dist.group.WORLD else pg)
    return inst


def group_name_of(groups: DynamicCPGroups | None):
    """The c10d group name the ops take for ``groups`` (None without a group of more than one rank)."""
    if groups is None or groups.dp_size == 1:
        return None
    return groups.group.group_name


def _exchange(op: str, groups: DynamicCPGroups, words: list, error, what: str) -> torch.Tensor:
    """All-gather one fixed-size int64 row per rank (word 0: this rank's status) over the DPxCP
    group; raise on every rank when any rank failed. Returns the rows on the host."""
    rows = _all_gather_words([1 if error is not None else 0] + words, groups.group, groups.device, groups.dp_size)
    _raise_collected(op, rows[:, 0], None if isinstance(error, CallerRejected) else error, what)
    return rows


def _split_impl(values, lengths, max_seqlen_per_dp_cp_rank, group_name=None, assignment=0, validate=True,
                rank_error=False):
    op = "dynamic_cp_split"
    groups = _groups_of(op, group_name)
    dp_size = groups.dp_size if groups is not None else 1
    dp_rank = groups.dp_rank if groups is not None else 0
    error = plan = None
    try:
        if rank_error:
            raise CallerRejected()
        _split_dense.check_none((values, lengths))
        if not isinstance(assignment, int) or not 0 <= assignment < len(ASSIGNMENTS):
            raise ValueError(f"{op}: assignment must be 0 (contiguous) or 1 (balanced), got {assignment!r}")
        ls = as_lengths(op, "lengths", lengths)
        if values.dim() < 1 or values.shape[0] != sum(ls):
            raise ValueError(f"{op}: values must be [sum(lengths)={sum(ls)}, *F], got {tuple(values.shape)}")
        plan = _plan(op, ls, dp_size, max_seqlen_per_dp_cp_rank, dp_rank=dp_rank, assignment=ASSIGNMENTS[assignment])
        # Every group's rows, not only this rank's: the plan is the same on every rank, so a group
        # too large for the selection's int32 offsets makes every rank raise the same error here.
        largest = max(plan.group_tokens(), default=0)
        if largest > INT32_MAX:
            raise ValueError(
                f"{op}: a CP group of this plan would hold {largest} rows, more than the int32 offsets of "
                f"the selection take ({INT32_MAX})"
            )
    except Exception as e:  # every rank still joins the exchange below; re-raised after it
        error = e
    if groups is not None and dp_size > 1 and validate:
        ls = plan.lengths if plan is not None else ()
        w = [(i + 1) * n for i, n in enumerate(ls)]
        words = [
            len(ls),
            sum(ls),
            sum(w) % (1 << 61),
            sum((i + 1) * x for i, x in enumerate(w)) % (1 << 61),
            int(max_seqlen_per_dp_cp_rank),
            int(assignment) if isinstance(assignment, int) else -1,
            plan.fingerprint() if plan is not None else 0,
        ]
        rows = _exchange(op, groups, words, error, "input")
        if not bool((rows == rows[0]).all()):
            raise RuntimeError(
                f"{op}: the ranks of the DPxCP group hold different micro-batches or settings "
                f"(sequences, tokens, length hashes, max_seqlen_per_dp_cp_rank, assignment, plan per rank: "
                f"{rows[:, 1:].tolist()})"
            )
    if error is not None:
        if isinstance(error, CallerRejected):
            raise RuntimeError(f"{op}: this rank's input was rejected before the op")
        raise error
    ids = plan.sample_ids
    src, cu, total = jagged_indices(plan.lengths, ids, device=values.device)
    selected = _ops.jagged_gather(values.contiguous(), src, cu, total)
    where = lengths.device
    local_lengths = torch.tensor([plan.lengths[i] for i in ids], dtype=torch.int64).to(where)
    sample_ids = torch.tensor(ids, dtype=torch.int64).to(where)
    return selected, local_lengths, sample_ids, plan.local_cp_size


# The merge header, one int64 row per rank: 8 meta words (sequences n, rows, dtype hash, feature
# shape hash, row bytes, key hash, num_samples B, local_cp_size), the status word, then the B
# lengths (padded with 0) and the B sample ids (padded with -1). The status word sits right before
# the lengths: it is 0 in every accepted row, so a cumsum over [status, lengths] gives each
# sequence's first row in its group and then the group's row count.
_MERGE_N, _MERGE_ROWS, _MERGE_ROW_BYTES, _MERGE_STATUS = 0, 1, 4, 8
_MERGE_META = 9  # the 8 meta words + the status word


def _merge_header(lengths, sample_ids, meta: list, device):
    """This rank's header row (layout above, status 0), int64 on ``device``, from its meta words
    (:func:`_merge_meta`): one launch of ``dynamic_cp_merge_header`` (lengths and ids are copied on
    the device, never read on the host)."""
    _, rows, dtype_hash, feature_hash, row_bytes, key_hash, num_samples, local_cp_size, _ = meta
    if lengths.device != device:
        lengths = lengths.to(device)
    if sample_ids.device != device:
        sample_ids = sample_ids.to(device)
    return call_op(
        _ops.dynamic_cp_merge_header, lengths, lengths, sample_ids, num_samples, rows,
        dtype_hash, feature_hash, row_bytes, key_hash, local_cp_size,
    )


def _merge_index(hdr: torch.Tensor, B: int, validate: bool):
    """The reorder index of the gathered header ``hdr`` [G, 9 + 2B] on its device, in one launch of
    ``dynamic_cp_merge_index`` (no host read). Returns ``(buf, merged_at, src_at, cu)``: ``cu`` the
    int32 offsets [B + 1] of the merged sequences, and one int64 buffer holding

    - ``buf[:merged_at + B]``, what the host reads: with ``validate``, per group 1 where its
      lengths sum to its rows, then the smallest merged length and the smallest row start (see
      below), without it the merged total at ``G``; the meta words [G, 9]; the B merged lengths;
    - ``buf[src_at:src_at + B]``: the first row of each merged sequence in the gathered values
      (sample i held by group g at position k: ``g * max_total`` + the rows of positions < k).

    Sample ids outside [0, B) (and the -1 padding) go to a spare word. Without ``validate`` a
    sample id given twice keeps one of its entries, which one is unspecified. With ``validate`` a sample
    no group holds keeps length and row start -1, so both minima are >= 0 exactly when every sample
    id in [0, B) was given and no length is negative; with as many ids as samples that means each
    once. The offsets sum the merged lengths from the word before them, the last group's status:
    0 unless the op raises.
    """
    G = hdr.shape[0]
    merged_at = G + 2 + G * _MERGE_META
    buf, cu = call_op(_ops.dynamic_cp_merge_index, hdr, hdr, B, validate)
    return buf, merged_at, merged_at + B + 1, cu


def _raise_header_errors(op: str, rows: list, B: int):
    """Raise the error of the failed header check, from the whole header on the host (``rows``: one
    list per group): each group's lengths >= 0 and summing to its rows, then the sample ids
    covering 0..B-1 once each."""
    M = _MERGE_META
    counts, totals = [r[_MERGE_N] for r in rows], [r[_MERGE_ROWS] for r in rows]
    lens = [r[M : M + n] for r, n in zip(rows, counts)]
    ids = [r[M + B : M + B + n] for r, n in zip(rows, counts)]
    for g in range(len(rows)):
        if sum(lens[g]) != totals[g] or (lens[g] and min(lens[g]) < 0):
            raise ValueError(
                f"{op}: group {g}'s outputs have {totals[g]} rows but their lengths "
                f"{lens[g]} (each >= 0) sum to {sum(lens[g])}"
            )
    flat = sorted(i for group_ids in ids for i in group_ids)
    if flat != list(range(B)):
        raise RuntimeError(
            f"{op}: the groups' sample ids do not cover the {B} samples once each (per group: "
            f"{ids}); the groups disagree on the plan"
        )
    raise RuntimeError(f"{op}: the header checks on the device and on the host disagree (header: {rows})")


def _merge_meta(values, n, num_samples, local_cp_size, key_hash, validate) -> list:
    """This rank's words of the first exchange after its status, from host-known shapes only (``n``:
    its sequence count): the header's 8 meta words (see above) and ``validate``."""
    feat = tuple(values.shape[1:])
    return [
        n, values.shape[0], _crc(str(values.dtype)), _crc(feat),
        math.prod(feat) * values.element_size(), key_hash, num_samples, local_cp_size, int(bool(validate)),
    ]


_AGREE_WORDS = 9  # _merge_meta's words
_AGREE_SAME = slice(2, 9)  # those every rank must share (dtype .. validate)
_MERGE_WHAT = "dtype, feature shape, row bytes, keys, num_samples, local_cp_size, validate"


def _merge_agree(op: str, groups: DynamicCPGroups, meta: list | None, error, header_error=None) -> list:
    """The merge's first exchange, over the whole DPxCP group: one fixed-size int64 row per rank
    (its status, then :func:`_merge_meta`'s words; zeros where ``meta`` is None) and one host read.
    Raises on every rank when a rank failed, then when the ranks disagree on the words every rank
    must share, then when a rank's own header failed its checks (``header_error``: with one group,
    where each rank checks its own); returns the meta rows. Its width is fixed, so it is safe
    whatever the ranks passed: the second exchange's width (9 + 2 * num_samples) is agreed on
    before it is issued."""
    status = 1 if error is not None else (2 if header_error is not None else 0)
    words = [status] + (list(meta) if meta is not None else [0] * _AGREE_WORDS)
    rows = _all_gather_words(words, groups.group, groups.device, groups.dp_size)
    statuses = rows[:, 0].tolist()
    _raise_collected(op, [x == 1 for x in statuses], None if isinstance(error, CallerRejected) else error, "outputs")
    meta_rows = rows[:, 1:].tolist()
    if any(r[_AGREE_SAME] != meta_rows[0][_AGREE_SAME] for r in meta_rows):
        raise RuntimeError(
            f"{op}: the ranks' outputs disagree ({_MERGE_WHAT} per rank, the first four hashed: "
            f"{[r[_AGREE_SAME] for r in meta_rows]})"
        )
    _raise_collected(op, [x == 2 for x in statuses], header_error, "outputs")
    return meta_rows


def _index_and_read(op: str, hdrs: dict, c0: int, B: int, validate: bool, counts: dict):
    """The reorder index and its checks for merge groups' gathered headers (``hdrs``: merge group
    -> its rows [G, 9 + 2 B], ``c0`` this rank's group; a launch each), then one host read: this
    group's check words and merged lengths and the other groups' check words. With ``validate``
    the groups are checked in one order, each also against ``counts`` (merge group -> its ranks'
    sequence counts). Returns ``(buf, src_at, cu, this group's check words, merged lengths, the
    first group that failed its checks or None)``."""
    G = hdrs[c0].shape[0]
    found = {c: _merge_index(h, B, validate) for c, h in hdrs.items()}
    buf, merged_at, src_at, cu = found[c0]
    others = [c for c in hdrs if c != c0]
    parts = [buf[: merged_at + B]] + [found[c][0][: G + 2] for c in others]
    host = torch.cat(parts).cpu() if others else parts[0].cpu()
    checks = {c0: host[: G + 2].tolist()}
    for k, c in enumerate(others):
        at = merged_at + B + k * (G + 2)
        checks[c] = host[at : at + G + 2].tolist()
    merged_lengths = host[merged_at : merged_at + B].clone()  # a tensor of its own, as the fake's
    bad = None
    if validate:
        for c in sorted(hdrs):  # in one order: the same group (and error) on every rank holding them all
            ck = checks[c]
            if not (all(ck[:G]) and (B == 0 or min(ck[G:]) >= 0) and sum(counts[c]) == B):
                bad = c
                break
    return buf, src_at, cu, checks[c0], merged_lengths, bad


def _header_error(op: str, hdr: torch.Tensor, B: int) -> Exception:
    """The error :func:`_raise_header_errors` raises for the failed header ``hdr`` (a host read)."""
    try:
        _raise_header_errors(op, hdr.cpu().tolist(), B)
    except (ValueError, RuntimeError) as e:
        return e
    raise AssertionError("unreachable: _raise_header_errors always raises")


def _merge_impl(values, lengths, sample_ids, num_samples, local_cp_size, group_name=None, validate=True,
                key_hash=0, rank_error=False):
    op = "dynamic_cp_merge"
    groups = _groups_of(op, group_name)
    # With a group every rank joins the first exchange, whatever it was given: a rank that raised
    # alone (bad arguments, an unknown local_cp_size) would leave the others waiting in it.
    named = groups is not None and groups.dp_size > 1
    error = local = meta = None
    B = num_samples
    missing = _merge_dense.none_error((values, lengths, sample_ids))
    if missing is not None and not named:
        raise missing  # no exchange to join
    device = groups.device if named else values.device
    s = 1
    read = None  # with one group: this rank's index and checks, read before the first exchange
    header_error = None
    try:
        if rank_error:
            raise CallerRejected()
        if missing is not None:
            raise missing
        if not (isinstance(B, int) and not isinstance(B, bool) and 0 <= B <= INT32_MAX):
            raise ValueError(f"{op}: num_samples must be an int >= 0, got {B!r}")
        if groups is None and local_cp_size != 1:
            raise ValueError(
                f"{op}: local_cp_size must be 1 without a process group (dp_size = 1), got {local_cp_size!r}"
            )
        if groups is not None:
            s = groups._size(local_cp_size)
        check_merge_entries(op, lengths, sample_ids, B)
        if values.dim() < 1:
            raise ValueError(f"{op}: values must be [rows, *F], got a 0-d tensor")
        meta = _merge_meta(values, lengths.numel(), B, local_cp_size, key_hash, validate)
        local = _merge_header(lengths, sample_ids, meta, device)
        if s == (groups.dp_size if groups is not None else 1):
            # One group (local_cp_size == dp_size): each rank merges its own outputs, with no second
            # exchange. Its header checks run here, so that a bad header is this rank's error in the
            # first exchange and every rank raises.
            read = _index_and_read(op, {0: local.view(1, -1)}, 0, B, validate, {0: [lengths.numel()]})
            if read[-1] is not None:  # raised after the agreement checks
                header_error = _header_error(op, local.view(1, -1), B)
    except Exception as e:  # every rank still joins the first exchange; re-raised after it
        error = e
    if named:
        meta_rows = _merge_agree(op, groups, meta, error, header_error)
    elif error is not None:
        _raise_collected(op, [1], None if isinstance(error, CallerRejected) else error, "outputs")
    elif header_error is not None:
        raise header_error
    else:
        meta_rows = [meta]
    G = len(meta_rows) // s
    # The merge groups: every s-th rank from CP rank c (merge_group's members); this rank's is c0.
    c0 = groups.dp_rank % s if named else 0
    members = [meta_rows[c::s] for c in range(s)]
    # Every merge group's rows must fit jagged_gather's int32 offsets: checked for all of them, so
    # that every rank raises the same error.
    total = max(sum(r[_MERGE_ROWS] for r in m) for m in members)
    if total > INT32_MAX:
        raise ValueError(f"{op}: {total} merged rows do not fit the int32 offsets of jagged_gather")
    if read is None:  # G > 1
        # The second exchange: the headers (lengths and sample ids, 9 + 2 B words: the width every
        # rank agreed on) of the whole DPxCP group, so that every merge group's lengths and ids are
        # checked on every rank and a bad one makes every rank raise.
        everyone = torch.empty(groups.dp_size * local.numel(), dtype=torch.int64, device=device)
        _dist().all_gather_into_tensor(everyone, local, group=groups.group)
        everyone = everyone.view(groups.dp_size, -1)
        hdrs = {c: everyone[c::s].contiguous() for c in (range(s) if validate else (c0,))}
        counts = {c: [r[_MERGE_N] for r in members[c]] for c in hdrs}
        read = _index_and_read(op, hdrs, c0, B, validate, counts)
        if read[-1] is not None:
            raise _header_error(op, hdrs[read[-1]], B)
    buf, src_at, cu, checks, merged_lengths, _ = read
    if validate:
        total = sum(r[_MERGE_ROWS] for r in members[c0])  # every row of every group is merged once
    else:
        total = checks[G]
    if total > INT32_MAX:
        raise ValueError(f"{op}: {total} merged rows do not fit the int32 offsets of jagged_gather")
    feat = tuple(values.shape[1:])
    row_bytes = meta_rows[0][_MERGE_ROW_BYTES]
    if row_bytes == 0 or total == 0:
        return values.new_zeros((total, *feat)), merged_lengths
    max_total = max(r[_MERGE_ROWS] for r in members[c0])
    local_rows = values.detach().contiguous().view(values.shape[0], math.prod(feat))
    if local_rows.stride(-1) != 1:  # a one-element view keeps its stride: make it dense for the byte view
        local_rows = local_rows.clone(memory_format=torch.contiguous_format)
    local_bytes = local_rows.view(torch.uint8)
    if G > 1:
        local_bytes = local_bytes.to(device)
        if local_bytes.shape[0] == max_total:
            send = local_bytes
        else:
            send = torch.empty((max_total, row_bytes), dtype=torch.uint8, device=device)
            send[: local_bytes.shape[0]] = local_bytes
        gathered = torch.empty((G * max_total, row_bytes), dtype=torch.uint8, device=device)
        _dist().all_gather_into_tensor(gathered, send, group=groups.merge_group(local_cp_size))
    else:
        gathered = local_bytes
    out = _ops.jagged_gather(gathered, buf[src_at : src_at + B], cu, total)
    return out.view(values.dtype).view(total, *feat).to(values.device), merged_lengths


for _key in ("CPU", "CUDA"):
    _lib.impl("dynamic_cp_split", _split_impl, _key)
    _lib.impl("dynamic_cp_merge", _merge_impl, _key)


def _concrete(t: torch.Tensor) -> bool:
    """A tensor with readable values (not fake, not meta)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and t.device.type != "meta"


@torch.library.register_fake("verl_ops::dynamic_cp_split")
@_split_dense.checked
def _split_fake(values, lengths, max_seqlen_per_dp_cp_rank, group_name=None, assignment=0, validate=True,
                rank_error=False):
    op = "dynamic_cp_split"
    if not isinstance(assignment, int) or not 0 <= assignment < len(ASSIGNMENTS):
        raise ValueError(f"{op}: assignment must be 0 (contiguous) or 1 (balanced), got {assignment!r}")
    if _concrete(lengths):
        # Host lengths (e.g. meta values for shape inference): the plan, hence every size, is known.
        groups = _groups_of(op, group_name)
        dp_size = groups.dp_size if groups is not None else 1
        dp_rank = groups.dp_rank if groups is not None else 0
        plan = _plan(op, as_lengths(op, "lengths", lengths), dp_size, max_seqlen_per_dp_cp_rank, dp_rank=dp_rank,
                     assignment=ASSIGNMENTS[assignment])
        n, rows, cp = len(plan.sample_ids), sum(plan.local_lengths), plan.local_cp_size
    else:
        ctx = torch.library.get_ctx()
        n, rows, cp = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size(min=1)
    return (values.new_empty((rows, *values.shape[1:])), lengths.new_empty((n,), dtype=torch.int64),
            lengths.new_empty((n,), dtype=torch.int64), cp)


@torch.library.register_fake("verl_ops::dynamic_cp_merge")
@_merge_dense.checked
def _merge_fake(values, lengths, sample_ids, num_samples, local_cp_size, group_name=None, validate=True,
                key_hash=0, rank_error=False):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (values.new_empty((rows, *values.shape[1:])),
            torch.empty((num_samples,), dtype=torch.int64, device="meta" if values.device.type == "meta" else "cpu"))


@torch.library.register_fake("verl_ops::dynamic_cp_merge_header")
def _merge_header_fake(lengths, sample_ids, num_samples, rows, dtype_hash, feature_hash, row_bytes, key_hash,
                       local_cp_size):
    op = "dynamic_cp_merge_header"
    if not 0 <= num_samples <= INT32_MAX:
        raise RuntimeError(f"{op}: num_samples must be in [0, {INT32_MAX}], got {num_samples}")
    check_merge_entries(op, lengths, sample_ids, num_samples, RuntimeError, list)
    return lengths.new_empty((9 + 2 * num_samples,), dtype=torch.int64)


@torch.library.register_fake("verl_ops::dynamic_cp_merge_index")
def _merge_index_fake(header, num_samples, validate=True):
    op = "dynamic_cp_merge_index"
    if not 0 <= num_samples <= INT32_MAX:
        raise RuntimeError(f"{op}: num_samples must be in [0, {INT32_MAX}], got {num_samples}")
    width = 9 + 2 * num_samples
    if header.dtype != torch.int64 or header.dim() != 2 or header.shape[0] < 1 or header.shape[1] != width:
        raise RuntimeError(
            f"{op}: header must be int64 [groups >= 1, 9 + 2 * num_samples = {width}], got {header.dtype} "
            f"{list(header.shape)}"
        )
    G = header.shape[0]
    return (header.new_empty((G + 2 + 9 * G + 2 * (num_samples + 1),)),
            header.new_empty((num_samples + 1,), dtype=torch.int32))


def _split_setup_context(ctx, inputs, output):
    values, lengths = inputs[0], inputs[1]
    _, local_lengths, sample_ids, _ = output
    ctx.save_for_backward(lengths, local_lengths, sample_ids)
    ctx.total_in = values.shape[0]


def _split_backward(ctx, grad, *_):
    # The selected sequences' rows go back to where they came from; the rest get zeros.
    lengths, local_lengths, sample_ids = ctx.saved_tensors
    dev = grad.device
    lengths = lengths.to(dev, torch.int64)
    src = (torch.cumsum(lengths, 0) - lengths)[sample_ids.to(dev)]
    cu = torch.zeros(local_lengths.shape[0] + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(local_lengths.to(dev), 0)
    out = _ops.jagged_scatter(grad.contiguous(), src, cu, ctx.total_in)
    return out, None, None, None, None, None, None


register_autograd("verl_ops::dynamic_cp_split", _split_backward, setup_context=_split_setup_context)
# No derivative: the Autograd kernel only tests a None (its wrapper calls it below Autograd).
register_autograd("verl_ops::dynamic_cp_merge_header")


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


def _all_gather_words(words: list, group, device, world: int) -> torch.Tensor:
    """All-gather a fixed-length list of int64 words; returns host [world, len(words)]."""
    dist = _dist()
    t = torch.tensor(words, dtype=torch.int64, device=device)
    out = torch.empty(world * len(words), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out.view(world, len(words)).cpu()


def _raise_collected(op: str, status: torch.Tensor, local_error: BaseException | None, what: str) -> None:
    bad = [r for r, s in enumerate(status.tolist() if isinstance(status, torch.Tensor) else status) if s != 0]
    if not bad:
        return
    if local_error is not None:
        raise local_error
    raise RuntimeError(
        f"{op}: rank(s) {bad} of the group rejected their {what} (their error says why); nothing was done"
    )


def _reject_everywhere(call, error: BaseException, collective: bool):
    """Raise ``error`` on this rank after joining the op's status exchange with a failed status (so
    the other ranks raise too instead of waiting)."""
    if collective:
        try:
            call()
        except RuntimeError:
            pass
    raise error


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
    """This rank's part of a dynamic-CP micro-batch (``torch.ops.verl_ops.dynamic_cp_split`` on the
    batch's first jagged tensor; the other tensors of a dict follow the same selection).

    Every rank of the DPxCP group calls this with the same micro-batch.

    Args:
        batch: the whole micro-batch: a jagged nested tensor ``[B, j, *F]``; or values
            ``[total, *F]`` with ``lengths``; or a dict of nested tensors (same lengths) and
            per-sample tensors ``[B, ...]`` (per-sample tensors alone need ``lengths``).
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
    name = group_name_of(groups)
    collective = name is not None and bool(validate)
    empty = torch.zeros(0, dtype=torch.int64)
    try:
        if not isinstance(assignment, str) or assignment not in ASSIGNMENTS:
            raise ValueError(f"{op}: assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        items, lens, single = _parse_batch(op, batch, lengths)
    except Exception as e:  # noqa: BLE001
        _reject_everywhere(
            lambda: _ops.dynamic_cp_split(empty, empty, 1, name, 0, True, True), e, collective
        )
    jagged = [n for n, it in items.items() if it.kind != "dense"]
    if jagged:
        first = jagged[0]
        ref = items[first]
        values = ref.tensor.values() if ref.kind == "nested" else ref.tensor
    else:
        # Only per-sample tensors [B, ...], with lengths=: the op plans and checks the batch on
        # rows without features; the per-sample tensors follow its selection.
        first = None
        device = next((it.tensor.device for it in items.values()), torch.device("cpu"))
        values = torch.empty((sum(lens), 0), device=device)
    host_lengths = torch.tensor(lens, dtype=torch.int64)
    sel, local_lengths, sample_ids, local_cp_size = _ops.dynamic_cp_split(
        values, host_lengths, max_seqlen_per_dp_cp_rank, name, ASSIGNMENTS.index(assignment), bool(validate)
    )
    plan = _plan(op, lens, dp_size, max_seqlen_per_dp_cp_rank, dp_rank=dp_rank, assignment=assignment)
    if plan.num_groups == 1:
        # One group holds the whole batch: nothing to select, nothing to copy.
        local = {n: (it.tensor, host_lengths) if it.kind == "values" else it.tensor for n, it in items.items()}
        local = local[None] if single else local
    else:
        local = _select(items, list(plan.lengths), plan.sample_ids, single, done={first: sel} if jagged else None)
    cp_group = groups.cp_group(plan.local_cp_size) if groups is not None else None
    return DynamicCPSplit(local, plan.local_cp_size, cp_group, plan, groups)


# --------------------------------------------------------------------------------------------
# Merge.


def _output_parts(op: str, out, lengths):
    """(values [rows, *F], lengths: a 1-D int64 tensor or None on the meta device, nested?) of one
    output, or raise. Nested lengths stay where the offsets are (no host read)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: outputs must be tensors (nested, or values with lengths=), got {type(out)}")
    if out.is_nested:
        if lengths is not None:
            raise ValueError(f"{op}: lengths= is for a values tensor, not for a nested tensor")
        check_jagged(op, "outputs", out)
        offsets = out.offsets()
        # The values buffer itself (no holes, checked above): the merge is forward-only, and the
        # nested class's values() dispatch costs more than the rest of the wrapper.
        return out._values, None if is_meta(offsets) else offsets.diff(), True
    if lengths is None:
        raise ValueError(f"{op}: a values tensor [rows, *F] needs lengths=")
    ls = as_lengths(op, "lengths", lengths)
    if out.dim() < 1 or out.shape[0] != sum(ls):
        raise ValueError(f"{op}: values must be [sum(lengths)={sum(ls)}, *F], got {tuple(out.shape)}")
    return out, torch.tensor(ls, dtype=torch.int64), False


def dynamic_cp_merge(outputs, split: DynamicCPSplit, *, lengths=None):
    """Every group's outputs, in the original sample order, on every rank
    (``torch.ops.verl_ops.dynamic_cp_merge`` per output tensor).

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

    Collectives (with one group only the first, and the outputs are returned as they are): over
    the whole DPxCP group, one all-gather of 10 int64 words per rank (status, counts, dtype /
    shape / key / plan hashes, ``num_samples``, ``local_cp_size``, ``validate``: a host read),
    then, once every rank agrees on them, one all-gather of the
    headers with the lengths and sample ids (the reorder index and its checks computed from them
    with tensor ops, a second host read); then one all-gather of the values as bytes over the
    ranks sharing this CP rank. A rank with a wrong number of sequences, another micro-batch's
    split, an empty dict where the others have keys, or ranks disagreeing on dtype, feature shape,
    plan or keys, make every rank raise (never collectives of mismatched sizes).
    """
    op = "dynamic_cp_merge"
    if isinstance(outputs, Mapping):
        if lengths is not None and not isinstance(lengths, Mapping):
            raise ValueError(f"{op}: with a dict of outputs, lengths must be a dict too")
        keys = sorted(outputs)
        key_hash = _crc((keys, split.plan.fingerprint()))
        if not keys:
            _merge_nothing(op, split, key_hash)
            return {}
        return {
            k: _merge_one(op, outputs[k], split, None if lengths is None else lengths.get(k), key_hash)
            for k in keys
        }
    return _merge_one(op, outputs, split, lengths, _crc(((), split.plan.fingerprint())))


def _merge_nothing(op, split: DynamicCPSplit, key_hash: int):
    """An empty dict of outputs: with a process group this rank still joins the merge's first
    exchange (as a merge of no rows under the keys' hash), so that ranks whose dicts have keys
    raise with it instead of waiting for it; where every rank's dict is empty nothing else runs."""
    plan, groups = split.plan, split.groups
    if group_name_of(groups) is not None:
        _merge_agree(op, groups, [0, 0, 0, 0, 0, key_hash, len(plan.lengths), plan.local_cp_size, 1], None)


def _merge_one(op, out, split: DynamicCPSplit, lengths, key_hash: int):
    plan, groups = split.plan, split.groups
    G = plan.num_groups
    agree = group_name_of(groups)  # with a process group every rank joins the first exchange
    name = agree if G > 1 else None
    B = len(plan.lengths)
    empty = torch.zeros(0, dtype=torch.int64)
    try:
        values, ls, nested = _output_parts(op, out, lengths)
        n = out.offsets().shape[0] - 1 if nested else ls.numel()
        if n != len(plan.sample_ids):
            raise ValueError(
                f"{op}: this rank's group holds {len(plan.sample_ids)} sequences but the outputs have {n}"
            )
        if not nested and ls.numel() and bool((ls < 0).any()):
            i = int((ls < 0).nonzero()[0])
            raise ValueError(f"{op}: lengths must be >= 0, got lengths[{i}]={int(ls[i])}")
        if G > 1 and is_meta(values):
            raise ValueError(f"{op}: outputs on the meta device cannot be gathered across {G} CP groups")
    except (ValueError, TypeError, RuntimeError) as e:
        if G > 1:
            def reject():
                _ops.dynamic_cp_merge(empty, empty, empty, B, plan.local_cp_size, name, True, key_hash, True)
        else:
            def reject():
                _merge_agree(op, groups, None, CallerRejected())
        _reject_everywhere(reject, e, agree is not None)
    if G == 1:
        # One group: the outputs are already the whole batch in sample order. With a process
        # group the ranks still agree on the merge (the op's first exchange, no copy), so that a
        # rank holding another micro-batch's split raises with the others instead of leaving them
        # waiting in theirs.
        if agree is not None:
            _merge_agree(op, groups, _merge_meta(values, n, B, plan.local_cp_size, key_hash, True), None)
        if nested:
            return out.detach()
        return values.detach(), ls
    merged, merged_lengths = _ops.dynamic_cp_merge(
        values.detach(), ls, plan.sample_ids_on(ls.device), B, plan.local_cp_size, name, True, key_hash
    )
    if not nested:
        return merged, merged_lengths
    # The offsets go to the device from pinned memory: a copy that does not wait for the merge's
    # kernels (from pageable memory it would; the caching host allocator keeps the buffer until
    # the copy has run).
    pinned = merged.device.type == "cuda"
    offsets = torch.zeros(B + 1, dtype=torch.int64, pin_memory=pinned)
    torch.cumsum(merged_lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(
        merged,
        offsets=offsets.to(merged.device, non_blocking=pinned),
        min_seqlen=int(merged_lengths.min()) if B else 0,
        max_seqlen=int(merged_lengths.max()) if B else 0,
    )
