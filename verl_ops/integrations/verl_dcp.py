"""Drop-ins for verl's ``DynamicCPScheduler`` (``verl/utils/dynamic_cp_scheduler.py``), the
TensorDict adapter over Megatron-Core's ``DefaultDynamicCPScheduler``, and for its
``postprocess_dynamic_cp_batch``, which collects the CP group leaders' outputs back in sample order
(:func:`postprocess_dynamic_cp_batch`: the same results, with the outputs' bytes in one tensor
all-gather instead of through the host and pickle).

verl's ``DynamicCPScheduler(max_seqlen_per_dp_cp_rank, dp_size, cp_size).schedule(batch,
dcp_group, *, tp_size, cp_layout="zigzag", min_local_rows=None)`` hands the sequence lengths of a
batch (replicated on every rank of the DPxCP group) to Megatron-Core's scheduler, which returns
micro-batches, each a list of ``dp_size * cp_size`` per-rank lists of sample ids; the ranks that
hold the same list form one CP group of that micro-batch (``local_cp_size`` = their number). For
each micro-batch verl returns this rank's rows of the batch (a TensorDict) with the non-tensor
entries ``local_cp_size``, ``_dcp_sample_ids``, ``_dcp_group_leader`` (first rank of its group),
``_dcp_padding_mask`` (the router padding mask of its THD shard) and ``_dcp_local_num_tokens``.

:class:`DynamicCPScheduler` returns exactly that (same entries, values, dtypes, nested offsets,
errors and messages). How it differs from verl's code, not in what it returns:

* The schedule. With Megatron-Core's own ``DefaultDynamicCPScheduler`` (the packing-aware one of
  NVIDIA/Megatron-LM#5154, merge commit d2e7ec5b on the ``dev`` branch), the schedule is computed by
  :func:`dynamic_cp_schedule`, which makes Megatron's decisions (same float arithmetic, same
  order, same tie-breaking, same errors) on per-group state: a candidate placement costs one
  comparison per CP group instead of one pass over every rank. Any other scheduler class (a
  subclass, another Megatron-Core version's algorithm, a test's stand-in returned by verl's
  ``get_megatron_dynamic_cp_scheduler_cls``) is called as verl calls it. The class is looked up
  through verl's module when it is loaded, so verl's lookup (and its error: Megatron-Core builds
  without the class, e.g. megatron-core 0.16.1 on PyPI, raise verl's ``RuntimeError``, which is also
  an ``ImportError``) applies; only when it is used.
* The rows: each nested field is gathered with one :func:`verl_ops.jagged_gather` per micro-batch
  from offsets read once per batch (verl unbinds the whole batch for every micro-batch); dense
  fields are indexed as in verl. Nested fields with holes or ragged in another dim, and fields of
  other kinds, take verl's path.
* The padding mask is :func:`verl_ops.integrations.verl_r3.local_padding_mask`, computed for all
  rows at once (verl loops over the sequences).
"""

from __future__ import annotations

import math
import pickle
import sys

import torch

__all__ = ["DynamicCPScheduler", "dynamic_cp_schedule", "postprocess_dynamic_cp_batch"]

_OWNER = "verl.utils.dynamic_cp_scheduler"
_MCORE = "megatron.core.datasets.data_schedule"
_MCORE_UTILS = "megatron.core.datasets.data_schedule_utils"
DCP_GROUP_LEADER = "_dcp_group_leader"
DCP_LOCAL_NUM_TOKENS = "_dcp_local_num_tokens"
DCP_PADDING_MASK = "_dcp_padding_mask"
DCP_SAMPLE_IDS = "_dcp_sample_ids"
# Megatron-Core's workload cap: 5 % above tallest-sequence-length x max_seqlen_per_dp_cp_rank.
_CAP_DELTA = 0.05


class DynamicCPUnavailable(RuntimeError, ImportError):
    """verl's ``RuntimeError`` for a Megatron-Core without ``DefaultDynamicCPScheduler`` (also an
    ``ImportError``: the class could not be imported)."""


_MISSING = (
    "Dynamic CP requires a Megatron-Core build containing NVIDIA/Megatron-LM#5154 (merge commit d2e7ec5b)."
)


def _scheduler_cls():
    """verl's ``get_megatron_dynamic_cp_scheduler_cls()`` when verl's module is loaded (so a
    replacement of it is honoured), else the same lookup here."""
    owner = sys.modules.get(_OWNER)
    lookup = getattr(owner, "get_megatron_dynamic_cp_scheduler_cls", None)
    if lookup is not None:
        return lookup()
    try:
        from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler
    except ImportError as exc:
        raise DynamicCPUnavailable(
            f"{_MISSING} (megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler cannot be "
            f"imported: {exc}; megatron-core releases up to 0.16.1 lack it, Megatron-LM's dev branch has it)"
        ) from exc
    return DefaultDynamicCPScheduler


def _is_known_megatron(scheduler) -> bool:
    """True when ``scheduler`` is Megatron-Core's ``DefaultDynamicCPScheduler`` with the #5154
    algorithm and the settings verl uses (min CP size 1, no VPP alignment)."""
    fn = getattr(type(scheduler), "get_groups_and_subsamples", None)
    if fn is None or getattr(fn, "__module__", None) != _MCORE:
        return False
    if getattr(fn, "__qualname__", None) != "DefaultDynamicCPScheduler.get_groups_and_subsamples":
        return False
    utils = sys.modules.get(_MCORE_UTILS)
    if utils is None or getattr(utils, "_DYNAMIC_CP_WORKLOAD_CAP_DELTA", None) != _CAP_DELTA:
        return False
    if not hasattr(utils, "next_hdp_group_packing_aware"):
        return False
    return getattr(scheduler, "min_cp_size", 1) == 1 and getattr(scheduler, "microbatch_group_size_per_vp_stage", None) is None


# --------------------------------------------------------------------------------------------
# The schedule (Megatron-Core's DefaultDynamicCPScheduler.get_groups_and_subsamples).


def _cp_needed(seq_len: int, max_seq_len_per_rank: int) -> int:
    """Smallest power-of-two CP size for a sequence, as Megatron computes it (in floats)."""
    return max(1, 2 ** math.ceil(math.log2(seq_len / max_seq_len_per_rank)))


class _Group:
    __slots__ = ("size", "start", "time", "packed", "ids")

    def __init__(self, size, start, time, packed, sample_id):
        self.size, self.start, self.time, self.packed, self.ids = size, start, time, packed, [sample_id]


def _one_micro_batch(seqs, total: int, mslpr: int, needed: dict):
    """One micro-batch from ``seqs`` ((id, length), longest first, stable): (per-rank sample id
    lists, leftovers). Megatron's greedy: each sequence, longest first, joins the CP group (same
    size, room for it) or opens a group on the lowest free ranks, whichever gives the lowest
    maximum rank workload (``len**2 / cp``) within the cap, smallest CP size and oldest group
    first on ties; it waits for a later micro-batch when nothing fits. Then empty ranks are filled
    by doubling the smallest groups (moving the groups after them up), or, when that is not
    possible, the whole micro-batch becomes one group of every rank."""
    sid, n = seqs[0]
    cp = needed[n]
    if cp > total:
        raise AssertionError(
            f"Sequence length {n} requires CP size {cp}, but only {total} DPxCP ranks are available."
        )
    cap = float(n) * float(mslpr) * (1.0 + _CAP_DELTA)
    groups = [_Group(cp, 0, (n * n) / cp, n / cp, sid)]
    by_size = {cp: [groups[0]]}
    used = cp  # ranks [0, used) are in groups (each new group takes the lowest free ranks)
    leftovers = []
    for sid, n in seqs[1:]:
        # the two largest group times (every rank of a group has its group's time; free ranks 0.0)
        top1 = top2 = 0.0
        top1_group = None
        for g in groups:
            if g.time > top1:
                top1, top2, top1_group = g.time, top1, g
            elif g.time > top2:
                top2 = g.time
        best = None
        cp = needed[n]
        while cp <= total:
            cost = (n * n) / cp
            share = n / cp
            for g in by_size.get(cp, ()):
                if g.packed + share > mslpr:
                    continue
                projected = max(g.time + cost, top2 if g is top1_group else top1)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, cp, g)
            if total - used >= cp:
                projected = max(cost, top1)
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, cp, None)
            cp *= 2
        if best is None:
            leftovers.append((sid, n))
            continue
        _, cp, g = best
        if g is not None:
            g.packed += n / cp
            g.time += (n * n) / cp
            g.ids.append(sid)
        else:
            g = _Group(cp, used, (n * n) / cp, n / cp, sid)
            groups.append(g)
            by_size.setdefault(cp, []).append(g)
            used += cp

    ranks = [[] for _ in range(total)]
    for g in groups:
        for r in range(g.start, g.start + g.size):
            ranks[r] = g.ids
    members = {id(g): list(range(g.start, g.start + g.size)) for g in groups}
    while not ranks[-1]:  # (empty ranks are always the last ones)
        if not _double_smallest_group(ranks, groups, members, total):
            return _one_full_group(seqs, total, mslpr)
    return [list(ids) for ids in ranks], leftovers


def _double_smallest_group(ranks, groups, members, total) -> bool:
    """Megatron's fill step: the first group of the smallest size that can grow (to twice its
    size, at most ``total``) takes the ranks after it; the ranks behind it move up. False when
    none can."""
    empty = next(r for r, ids in enumerate(ranks) if not ids)
    smallest = min(g.size for g in groups)
    grown = min(smallest * 2, total)
    extra = grown - smallest
    for g in groups:
        if g.size != smallest:
            continue
        m = members[id(g)]
        first, last = m[0], m[-1]
        if last + 1 > empty or last + extra >= total:
            continue
        moved = ranks[last + 1 : empty]
        new = [[] for _ in range(total)]
        new[:first] = ranks[:first]
        for r in range(first, last + extra + 1):
            new[r] = ranks[last]
        for i, ids in enumerate(moved):
            new[last + extra + 1 + i] = ids  # (an IndexError past the last rank, as in Megatron)
        ranks[:] = new
        g.size = grown
        members[id(g)] = list(range(first, last + extra + 1))
        for h in groups:
            if h is not g and min(members[id(h)]) > last:
                members[id(h)] = [r + extra for r in members[id(h)]]
        return True
    return False


def _one_full_group(seqs, total, mslpr):
    """Megatron's fallback: every rank in one group, taking the sequences (longest first) while
    their per-rank share fits."""
    packed = 0.0
    chosen, rest = [], []
    for sid, n in seqs:
        share = n / total
        if packed + share <= mslpr:
            chosen.append(sid)
            packed += share
        else:
            rest.append((sid, n))
    if not chosen:
        raise AssertionError(
            "At least one sequence should fit in the full DPxCP group; "
            "try to increase 'max-seqlen-per-dp-cp-rank'."
        )
    return [list(chosen) for _ in range(total)], rest


def dynamic_cp_schedule(seq_lens, dp_size: int, cp_size: int, max_seqlen_per_dp_cp_rank: int) -> list:
    """Megatron-Core's dynamic CP schedule (``DefaultDynamicCPScheduler(max_seqlen_per_dp_cp_rank,
    cp_size, dp_size, None).get_groups_and_subsamples(list(enumerate(seq_lens)))``, NVIDIA/Megatron-LM
    d2e7ec5b), the same lists.

    Args:
        seq_lens: the sequence lengths (positive ints, sample id = position).

    Returns:
        One entry per micro-batch: ``dp_size * cp_size`` lists of sample ids, one per DPxCP rank;
        the ranks of one CP group hold equal lists (the group's sequences, longest first).

    Raises:
        AssertionError: Megatron's, for a sequence whose CP size (next power of two of
            ``len / max_seqlen_per_dp_cp_rank``) exceeds the ranks.
    """
    total = dp_size * cp_size
    mslpr = max_seqlen_per_dp_cp_rank
    seqs = sorted(enumerate(int(n) for n in seq_lens), key=lambda x: x[1], reverse=True)
    needed = {n: _cp_needed(n, mslpr) for n in {n for _, n in seqs}}
    out = []
    while seqs:
        ranks, seqs = _one_micro_batch(seqs, total, mslpr, needed)
        out.append(ranks)
    return out


# --------------------------------------------------------------------------------------------
# The adapter.


class _Rows:
    """Row selection of a batch's fields: nested fields through jagged_gather (offsets read once)."""

    def __init__(self, batch):
        self.batch = batch
        self.nested = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.is_nested and self._plain_jagged(value):
                offsets = value.offsets()
                host = offsets.to("cpu", torch.int64)
                self.nested[key] = (host[:-1], host.diff(), offsets.device)

    @staticmethod
    def _plain_jagged(x) -> bool:
        return (
            x.layout == torch.jagged and x._lengths is None and x._ragged_idx == 1 and x.dim() >= 2
        )

    def select(self, ids: list):
        from tensordict import TensorDict

        from .._jagged import jagged_gather

        index = torch.tensor(ids)
        data = {}
        for key, value in self.batch.items():
            if isinstance(value, torch.Tensor) and not value.is_nested:
                data[key] = value[index]
            elif isinstance(value, torch.Tensor) and key in self.nested:
                starts, lengths, device = self.nested[key]
                lens = lengths[index]
                offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
                torch.cumsum(lens, 0, out=offsets[1:])
                total = int(offsets[-1])
                both = torch.cat([starts[index], offsets]).to(device)
                values = value._values
                rows = jagged_gather(values, both[: len(ids)], both[len(ids) :].to(torch.int32), total,
                                     validate=False)
                cache = {}
                if value.dim() == 2:  # verl rebuilds 1-D sequences with torch's list constructor
                    cache = {"min_seqlen": int(lens.min()), "max_seqlen": int(lens.max())}
                data[key] = torch.nested.nested_tensor_from_jagged(rows, both[len(ids) :], **cache)
            elif isinstance(value, torch.Tensor):
                data[key] = _verl_nested_select(value, index)
            else:
                data[key] = value[index] if value.shape else value
        return TensorDict(source=data, batch_size=len(ids))


def _verl_nested_select(value, index):
    """verl's selection of a nested field (unbind, pick, rebuild), for the irregular ones."""
    parts = value.unbind()
    picked = [parts[i] for i in index]
    ragged_idx = getattr(value, "_ragged_idx", value.dim() - 1)
    if not picked:
        raise AssertionError("Must provide at least one tensor")
    dims = picked[0].dim()
    if not 1 <= ragged_idx <= dims:
        raise AssertionError(f"ragged_idx must be in [1, {dims}]. Got {ragged_idx=} and sample_dim={dims}")
    if dims == 1:
        return torch.nested.as_nested_tensor(picked, layout=torch.jagged)
    cat_dim = ragged_idx - 1
    values = torch.cat(picked, dim=cat_dim)
    lengths = torch.tensor([p.shape[cat_dim] for p in picked], dtype=torch.long, device=values.device)
    offsets = torch.zeros(len(picked) + 1, dtype=torch.long, device=values.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    out = torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)
    out._ragged_idx = ragged_idx
    return out


def _check_group(members: list) -> None:
    """verl's checks of one CP group of a micro-batch: consecutive ranks, aligned to its size."""
    if members != list(range(members[0], members[0] + len(members))):
        raise RuntimeError(f"Dynamic CP group members must be contiguous, got {members}")
    if members[0] % len(members) != 0:
        raise RuntimeError(f"Dynamic CP group {members} is not aligned to its size")


class DynamicCPScheduler:
    """verl's ``DynamicCPScheduler``: this rank's micro-batches of a replicated batch under
    Megatron-Core's dynamic CP schedule (see the module doc).

    Args:
        max_seqlen_per_dp_cp_rank: most tokens of one sequence per rank (positive int).
        dp_size, cp_size: the DPxCP group is ``dp_size * cp_size`` ranks (positive ints).
    """

    def __init__(self, max_seqlen_per_dp_cp_rank: int, dp_size: int, cp_size: int):
        if any(type(v) is not int or v <= 0 for v in (max_seqlen_per_dp_cp_rank, dp_size, cp_size)):
            raise ValueError("Dynamic CP scheduler sizes must be positive integers")
        self.max_seqlen_per_dp_cp_rank = max_seqlen_per_dp_cp_rank
        self.dp_size = dp_size
        self.cp_size = cp_size
        self.total_ranks = dp_size * cp_size

    def schedule(self, batch, dcp_group, *, tp_size: int, cp_layout: str = "zigzag",
                 min_local_rows: int | None = None) -> list:
        """This rank's micro-batches (TensorDicts), as verl's ``schedule``.

        Raises:
            ValueError: ``input_ids`` is not nested, an empty batch, a group of another size than
                ``dp_size * cp_size``, an empty sequence, a sequence longer than the group holds.
            RuntimeError: Megatron-Core without the scheduler (also an ``ImportError``), or a
                schedule this rank cannot use (an empty rank, a non-contiguous or misaligned group).
        """
        from tensordict.tensorclass import NonTensorData

        from .verl_r3 import local_padding_mask

        input_ids = batch.get("input_ids", None)
        if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
            raise ValueError("Dynamic CP requires input_ids to be a jagged NestedTensor")
        if len(batch) == 0:
            raise ValueError("Dynamic CP cannot schedule an empty batch")
        if dcp_group.size() != self.total_ranks:
            raise ValueError(
                f"DPxCP group size {dcp_group.size()} does not match "
                f"dp_size * cp_size ({self.dp_size} * {self.cp_size})"
            )
        lens_t = input_ids.offsets().diff().to("cpu")
        seq_lens = lens_t.tolist()
        if bool((lens_t <= 0).any()):
            raise ValueError("Dynamic CP requires every input sequence to contain at least one token")
        max_seq_len = int(lens_t.max())
        required = math.ceil(max_seq_len / self.max_seqlen_per_dp_cp_rank)
        if required > self.total_ranks:
            raise ValueError(
                f"A sequence with {max_seq_len} tokens needs at least {required} ranks at "
                f"max_seqlen_per_dp_cp_rank={self.max_seqlen_per_dp_cp_rank}, but the DPxCP group only has "
                f"{self.total_ranks} ranks. Increase max_seqlen_per_dp_cp_rank or cap the rollout sequence length."
            )
        scheduler = _scheduler_cls()(
            max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank,
            cp_size=self.cp_size,
            dp_size=self.dp_size,
            microbatch_group_size_per_vp_stage=None,
        )
        if _is_known_megatron(scheduler):
            groups = dynamic_cp_schedule(seq_lens, self.dp_size, self.cp_size, self.max_seqlen_per_dp_cp_rank)
        else:
            groups = scheduler.get_groups_and_subsamples(list(enumerate(seq_lens)))

        rank = dcp_group.rank()
        rows = _Rows(batch)
        out = []
        for assignment in groups:
            if len(assignment) != self.total_ranks or any(not ids for ids in assignment):
                raise RuntimeError(
                    f"Megatron-Core Dynamic CP must assign all {self.total_ranks} ranks in every micro-batch"
                )
            ids = assignment[rank]
            members = [peer for peer, other in enumerate(assignment) if other == ids]
            local_cp_size = len(members)
            _check_group(members)
            micro_batch = rows.select(ids)
            mask = local_padding_mask(
                [seq_lens[i] for i in ids], cp_size=local_cp_size, cp_rank=members.index(rank), tp_size=tp_size,
                cp_layout=cp_layout, min_local_rows=min_local_rows,
            )
            micro_batch["local_cp_size"] = NonTensorData(local_cp_size)
            micro_batch[DCP_SAMPLE_IDS] = NonTensorData(list(ids))
            micro_batch[DCP_GROUP_LEADER] = NonTensorData(rank == members[0])
            micro_batch[DCP_PADDING_MASK] = NonTensorData(mask)
            micro_batch[DCP_LOCAL_NUM_TOKENS] = NonTensorData(mask.numel() - int(mask.sum().item()))
            out.append(micro_batch)
        # Every CP group of every micro-batch, not only this rank's, once this rank's own ran as
        # verl's do (so that where verl's scheduler raises, this raises the same): each rank
        # computes the same schedule, so a bad group makes every rank raise here; a rank whose own
        # groups are fine would otherwise go on to the micro-batches' collectives and wait there.
        for assignment in groups:
            by_ids = {}
            for peer, other in enumerate(assignment):
                by_ids.setdefault(tuple(other), []).append(peer)
            for members in by_ids.values():
                _check_group(members)
        return out


# --------------------------------------------------------------------------------------------
# verl's postprocess_dynamic_cp_batch: the group leaders' outputs, collected in sample order.


def _append_to_dict():
    """verl's ``append_to_dict`` as verl's module uses it (its module global when the module is
    loaded, else ``verl.utils.py_functional``'s)."""
    owner = sys.modules.get(_OWNER)
    fn = getattr(owner, "append_to_dict", None)
    if fn is not None:
        return fn
    from verl.utils.py_functional import append_to_dict

    return append_to_dict


def _local_blocks(model_output: dict, sample_ids: list) -> dict:
    """verl's ``_detach_model_output`` without the copy to the host (same checks, errors and
    messages): per key, ``(blocks, parts)``: the detached tensors whose bytes are sent (one per
    output where its samples are consecutive in memory: a jagged nested tensor without holes, a
    dense tensor; else one per sample) and, per sample, ``(block index, byte offset in the block,
    bytes, dtype, shape)`` of its part, which is what verl's ``unbind`` gives."""
    out = {}
    for key, value in model_output.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Dynamic CP model output {key!r} must be a tensor, got {type(value).__name__}")
        nested = value.is_nested
        offs = vals = None
        if nested and value.layout == torch.jagged and value._lengths is None and value._ragged_idx == 1:
            # (the jagged tensor's own fields: values() / offsets() each cost a trip through its
            # __torch_function__, ~50 us, and are the same tensors)
            vals = value._values
            offs = value._offsets.tolist()
            # only offsets that tile the values exactly (verl's unbind rejects the others)
            fast = offs[0] == 0 and offs[-1] == vals.shape[0]
        else:
            fast = not nested and value.layout == torch.strided and value.dim() >= 1
        if fast:
            block = (vals if nested else value).detach().contiguous()
            row = math.prod(block.shape[1:]) * block.element_size()  # bytes of a token (nested) / a sample
            feat = tuple(block.shape[1:])
            n = len(offs) - 1 if nested else value.shape[0]
            if n != len(sample_ids):
                raise ValueError(f"Dynamic CP output {key!r} has {n} samples for ids {sample_ids}")
            if nested:
                parts = [(0, offs[i] * row, (offs[i + 1] - offs[i]) * row, block.dtype, (offs[i + 1] - offs[i], *feat))
                         for i in range(n)]
            else:
                parts = [(0, i * row, row, block.dtype, feat) for i in range(n)]
            out[key] = ([block], parts)
            continue
        p = list(value.unbind()) if nested else list(value.unbind(0))
        if len(p) != len(sample_ids):
            raise ValueError(f"Dynamic CP output {key!r} has {len(p)} samples for ids {sample_ids}")
        blocks = [x.detach() for x in p]
        for x in blocks:
            if x.layout != torch.strided:  # (sparse, ...): verl's error is its pickling's; else ours
                pickle.dumps(x.cpu())
                raise NotImplementedError(
                    f"postprocess_dynamic_cp_batch: output {key!r} has layout {x.layout}; only strided parts are sent")
        out[key] = (blocks, [(i, 0, x.numel() * x.element_size(), x.dtype, tuple(x.shape)) for i, x in enumerate(blocks)])
    return out


_ALIGN = 16  # bytes: each block of the byte buffer starts aligned for any dtype's view


def _comm_device(group, output_device):
    """Where the bytes travel: the GPU when the group has NCCL (alone, or for CUDA tensors in a
    ``"cpu:gloo,cuda:nccl"`` group, as verl creates it), the CPU under gloo alone, else the outputs'
    device (another device backend)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or output_device is None:
        return torch.device("cpu")
    return output_device


def postprocess_dynamic_cp_batch(output_lst: list, batch_size: int, dcp_group, include_model_output: bool = True) -> dict:
    """verl's ``postprocess_dynamic_cp_batch``: every CP group leader's micro-batch outputs
    collected over ``dcp_group`` and put back in sample order, as ``{"model_output": {key: jagged
    nested tensor [batch_size, j, ...]}, "loss": [...], "metrics": {...}}`` on every rank (the same
    values, dtypes, devices, orders and errors as verl's).

    How it differs from verl's code: the model outputs do not go through the host and pickle.
    verl copies every sample's part of every output to the CPU, all-gathers them as Python objects
    and copies the nested result back to the device. Here only the small things (sample ids, loss,
    metrics, each part's shape and dtype) are all-gathered as objects; the parts' bytes travel in
    one all-gather of a byte buffer on the group's device (the GPU under NCCL), and the nested
    tensors are built there. A rank whose own outputs are wrong (verl's ``TypeError`` /
    ``ValueError``, or any other error of this rank's part) raises verl's error, and the other ranks
    a ``RuntimeError`` naming it, instead of waiting in the collective (verl's other ranks hang
    there). Where verl's own pickling fails on every rank (float8, uint16 / uint32 and complex32
    outputs under torch 2.11: ``AttributeError`` on unpickling), this returns the outputs.
    """
    import torch.distributed as dist

    # This rank's part, all of it before the first collective, so that an error here (verl's, or
    # one of this path's own) reaches every rank instead of leaving the others in a collective:
    # the leader records (sample ids, loss, metrics, and per key each part's byte offset, size,
    # dtype and shape) and the bytes of every part in one buffer on the group's device.
    records, nbytes, local, error = [], 0, None, None
    try:
        output_device = next(
            (
                value.device
                for output in output_lst
                for value in output.get("model_output", {}).values()
                if isinstance(value, torch.Tensor)
            ),
            None,
        )
        comm_device = _comm_device(dcp_group, output_device)
        blocks = []
        for output in output_lst:
            if not output.get(DCP_GROUP_LEADER, False):
                continue
            sample_ids = [int(sample_id) for sample_id in output[DCP_SAMPLE_IDS]]
            meta = {}
            for key, (key_blocks, parts) in _local_blocks(output.get("model_output", {}), sample_ids).items():
                starts = []
                for b in key_blocks:  # each block at an aligned offset of this rank's buffer
                    starts.append(nbytes)
                    if b.numel():
                        # the bytes as stored (a lazily conjugated / negated view resolved first)
                        blocks.append((nbytes, b.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)))
                    nbytes += -(-(b.numel() * b.element_size()) // _ALIGN) * _ALIGN
                # (offset, bytes, dtype name, shape) of each sample's part
                meta[key] = [(starts[i] + off, size, str(dtype).removeprefix("torch."), shape)
                             for i, off, size, dtype, shape in parts]
            records.append({
                "sample_ids": sample_ids,
                "loss": output.get("loss", None),
                "metrics": output.get("metrics", {}),
                "model_output": meta,
            })
        pickle.dumps(records)  # what all_gather_object would fail on (a loss or metric that does not pickle)
        local = torch.empty(nbytes, dtype=torch.uint8, device=comm_device)
        for offset, flat in blocks:
            local[offset : offset + flat.numel()].copy_(flat)
    except Exception as e:  # noqa: BLE001  (verl's error, raised here after every rank knows of it)
        error = e

    # One object all-gather of the records (or this rank's error), as verl's one of everything.
    world = dcp_group.size()
    mine = {"records": records, "nbytes": nbytes, "error": None if error is None else f"{type(error).__name__}: {error}"}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine, group=dcp_group)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        if error is not None:
            raise error
        r, what = failed[0]
        raise RuntimeError(f"postprocess_dynamic_cp_batch: rank {r} of the dynamic CP group failed: {what}")

    # The parts' bytes: one buffer per rank, padded to the longest, in one all-gather.
    longest = max(g["nbytes"] for g in gathered)
    buffers = None
    if longest > 0:
        if local.numel() < longest:
            local = torch.cat([local, local.new_zeros(longest - local.numel())])
        if comm_device.type != "cpu":
            out = torch.empty(world * longest, dtype=torch.uint8, device=comm_device)
            dist.all_gather_into_tensor(out, local, group=dcp_group)
            buffers = list(out.view(world, longest).unbind(0))
        else:
            buffers = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(buffers, local, group=dcp_group)

    all_records = [(rank, rec) for rank, g in enumerate(gathered) for rec in g["records"]]
    collected_ids = [sample_id for _, rec in all_records for sample_id in rec["sample_ids"]]
    expected_ids = set(range(batch_size))
    if sorted(collected_ids) != list(range(batch_size)):
        raise RuntimeError(
            f"Dynamic CP output collection must contain each sample once, got ids {sorted(collected_ids)}"
        )

    all_records.sort(key=lambda item: min(item[1]["sample_ids"]))
    append_to_dict = _append_to_dict()
    by_key: dict = {}
    losses = []
    metrics = {}
    for rank, rec in all_records:
        if rec["loss"] is not None:
            losses.append(rec["loss"])
        append_to_dict(metrics, rec["metrics"])
        for key, entries in rec["model_output"].items():
            values = by_key.setdefault(key, {})
            for sample_id, (offset, size, dtype, shape) in zip(rec["sample_ids"], entries, strict=True):
                values[sample_id] = (rank, offset, size, getattr(torch, dtype), shape)

    model_output = {}
    if include_model_output:
        target = output_device if output_device is not None else torch.device("cpu")
        for key, values in by_key.items():
            missing = expected_ids.difference(values)
            if missing:
                raise RuntimeError(f"Dynamic CP output {key!r} is missing sample ids {sorted(missing)}")
            parts = []
            for sample_id in range(batch_size):
                rank, offset, size, dtype, shape = values[sample_id]
                raw = buffers[rank][offset : offset + size] if size else torch.empty(0, dtype=torch.uint8, device=comm_device)
                parts.append(raw.view(dtype).reshape(shape))
            # verl's construction (torch.nested.as_nested_tensor of the parts in sample order), on
            # the group's device instead of the host, then to the outputs' device as in verl.
            model_output[key] = torch.nested.as_nested_tensor(parts, layout=torch.jagged).to(target)

    return {"model_output": model_output, "loss": losses, "metrics": metrics}
