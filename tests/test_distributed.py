"""Context parallel across processes: postprocess_thd over a process group and dynamic CP
split / merge, on gloo (CPU, 2 and 4 ranks) and on NCCL (when at least 2 / 4 GPUs are present).

The check functions (``check_*``) run on every rank of a pooled process group (tests/_dist.py);
the tests dispatch them and fail on any rank's error or on a timeout (a hang). Plan arithmetic is
tested in-process at the end of the file.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from _dist import dist_params, dist_runner

import verl_ops
from verl_ops import DynamicCPGroups, ThdLayout, dynamic_cp_merge, dynamic_cp_split, plan_dynamic_cp

# --------------------------------------------------------------------------------------------
# Pools.


@pytest.fixture(params=dist_params(("gloo", "nccl"), (2, 4)))
def dist_run(request):
    """run(check_name, *args) on every rank of a (backend, world_size) pool."""
    return dist_runner(request, "test_distributed")


# --------------------------------------------------------------------------------------------
# Helpers used on the ranks.


def _setup(rank, backend):
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    return dist, device


def _data(rng: random.Random, lengths, feature_shape, dtype):
    from conftest import random_data

    g = torch.Generator().manual_seed(rng.randrange(2**31))
    seqs = [random_data((n, *feature_shape), dtype, g) for n in lengths]
    values = torch.cat(seqs) if seqs else torch.zeros((0, *feature_shape), dtype=dtype)
    return seqs, values


def _expect_raises(exc, pattern, fn):
    import re

    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), f"wrong message: {e}"
        return str(e)
    raise AssertionError(f"expected {exc.__name__} matching {pattern!r}")


# --------------------------------------------------------------------------------------------
# postprocess_thd over a process group.

LAYOUT_CASES = [
    # (cp_layout, roll, fp8, tp)
    ("zigzag", False, False, 1),
    ("zigzag", True, False, 2),
    ("zigzag", False, True, 1),
    ("contiguous", False, False, 1),
    ("contiguous", True, True, 2),
]


def _valid_rows_of_pack(seqs, cu_padded, cp, cp_layout, roll, feature_shape, dtype, values):
    """What an unrolled unpack reads back from the (reference) pack: the valid positions' rows
    (with roll, verl's rolled rows: token p+1, or what verl's roll puts at a sequence's end)."""
    from reference import ref_pack

    if not seqs:
        return values
    total = cu_padded[-1]
    glob = torch.zeros((total, *feature_shape), dtype=dtype)
    ids = [torch.arange(a, b) for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    for r in range(cp):
        gid, _ = ref_pack(ids, cu_padded, cp, r, cp_layout, False, feature_shape=(), dtype=torch.int64)
        shard, _ = ref_pack(seqs, cu_padded, cp, r, cp_layout, roll, feature_shape=feature_shape, dtype=dtype)
        glob[gid] = shard
    return torch.cat([glob[a : a + x.shape[0]] for a, x in zip(cu_padded[:-1], seqs)])


def _roundtrip_one(rank, cp, group, device, rng, lengths, case, feature_shape, dtype, min_local_rows=None):
    from reference import ref_pack

    cp_layout, roll, fp8, tp = case
    layout = ThdLayout.from_lengths(
        lengths, tp_size=tp, cp_size=cp, cp_layout=cp_layout, fp8_padding=fp8, min_local_rows=min_local_rows,
        device=device,
    )
    seqs, values = _data(rng, lengths, feature_shape, dtype)
    cu_padded = layout.cu_seqlens_padded_cpu.tolist()
    packed, _ = verl_ops.preprocess_thd(values.to(device), layout, rank, roll=roll)
    expected_shard, _ = ref_pack(seqs, cu_padded, cp, rank, cp_layout, roll, feature_shape=feature_shape, dtype=dtype)
    assert torch.equal(packed.cpu(), expected_shard), (case, lengths)
    out = verl_ops.postprocess_thd(packed, layout, rank, group=group, as_nested=False)
    expected = _valid_rows_of_pack(seqs, cu_padded, cp, cp_layout, roll, feature_shape, dtype, values)
    assert torch.equal(out.cpu(), expected), (case, lengths)
    # The single-process path on every rank's reference shard gives the same.
    shards = torch.stack(
        [ref_pack(seqs, cu_padded, cp, r, cp_layout, roll, feature_shape=feature_shape, dtype=dtype)[0] for r in range(cp)]
    )
    single = verl_ops.postprocess_thd(shards.to(device), layout, as_nested=False)
    assert torch.equal(single.cpu(), out.cpu())
    return layout


def check_postprocess_roundtrip(rank, world, backend, seed):
    from conftest import random_lengths

    dist, device = _setup(rank, backend)
    rng = random.Random(seed)  # the same on every rank: every rank holds the same batch
    group = dist.group.WORLD
    for case in LAYOUT_CASES:
        for feature_shape, dtype in (((), torch.int64), ((3,), torch.bfloat16), ((2, 2), torch.float32)):
            lengths = random_lengths(rng, rng.randint(1, 6), 2 * world * case[3])
            _roundtrip_one(rank, world, group, device, rng, lengths, case, feature_shape, dtype)
    # CP over sub-groups: pairs of consecutive ranks at 4 ranks.
    if world >= 4:
        groups = DynamicCPGroups.for_group()
        sub = groups.cp_group(2)
        assert dist.get_process_group_ranks(sub) == [rank - rank % 2, rank - rank % 2 + 1]
        lengths = [9, 0, 31] if rank < 2 else [4, 17]  # each pair has its own batch
        for case in LAYOUT_CASES[:4]:
            _roundtrip_one(rank % 2, 2, sub, device, random.Random(seed + rank // 2), lengths, case, (5,), torch.float16)
    return True


def check_all_padding_rank(rank, world, backend):
    dist, device = _setup(rank, backend)
    rng = random.Random(7)
    group = dist.group.WORLD
    # Rank 0 holds the only tokens; the other ranks' shards are all padding.
    layout = _roundtrip_one(rank, world, group, device, rng, [3], ("contiguous", False, False, 1), (4,), torch.float32,
                            min_local_rows=8)
    if rank > 0:
        assert layout.local_rows == 8
    # Every sequence empty, every shard padding; and an empty batch.
    _roundtrip_one(rank, world, group, device, rng, [0, 0], ("zigzag", False, False, 1), (2,), torch.float32,
                   min_local_rows=2)
    _roundtrip_one(rank, world, group, device, rng, [], ("zigzag", False, False, 1), (2,), torch.float32)
    return True


def check_postprocess_grad(rank, world, backend):
    from reference import ref_pack

    dist, device = _setup(rank, backend)
    rng = random.Random(11)
    for cp_layout in ("zigzag", "contiguous"):
        lengths = [5, 12, 1, 8]
        layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout=cp_layout, device=device)
        seqs, values = _data(rng, lengths, (3,), torch.float64)
        packed, _ = verl_ops.preprocess_thd(values.to(device), layout, rank)
        packed = packed.detach().requires_grad_()
        out = verl_ops.postprocess_thd(packed, layout, rank, group=dist.group.WORLD, as_nested=False)
        w_seqs, w = _data(rng, lengths, (3,), torch.float64)
        loss = (out * w.to(device)).sum()
        loss.backward(retain_graph=True)
        # The gradient of this rank's shard is the pack of the output gradient for this rank;
        # rows holding other ranks' tokens get nothing.
        expected, _ = ref_pack(w_seqs, layout.cu_seqlens_padded_cpu.tolist(), world, rank, cp_layout, False)
        assert torch.equal(packed.grad.cpu(), expected)
        # No collective in backward: rank 0 runs a second backward alone (a collective would hang).
        if rank == 0:
            packed.grad = None
            loss.backward()
            assert torch.equal(packed.grad.cpu(), expected)
    return True


def check_postprocess_compile(rank, world, backend):
    """The group path traces under torch.compile(fullgraph=True) (functional collectives)."""
    dist, device = _setup(rank, backend)
    torch._dynamo.reset()
    group = dist.group.WORLD

    def f(packed, layout):
        return verl_ops.postprocess_thd(packed, layout, rank, group=group, as_nested=False) * 2

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for lengths in ([7, 12, 3], [5, 1, 9, 30]):
        layout = ThdLayout.from_lengths(lengths, cp_size=world, device=device)
        _, values = _data(random.Random(len(lengths)), lengths, (2,), torch.float32)
        packed, _ = verl_ops.preprocess_thd(values.to(device), layout, rank)
        assert torch.equal(cf(packed, layout).cpu(), values * 2)
    return True


def check_layout_mismatch(rank, world, backend):
    dist, device = _setup(rank, backend)
    lengths = [5, 7] if rank == 0 else [5, 8]
    layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout="contiguous", device=device)
    packed = torch.ones(layout.local_rows, 2, device=device)
    _expect_raises(
        RuntimeError, "CP ranks disagree on the THD layout",
        lambda: verl_ops.postprocess_thd(packed, layout, rank, group=dist.group.WORLD),
    )
    # Same offsets, different CP layout (zigzag vs contiguous): rows would land elsewhere.
    lengths = [4 * world, 8 * world]
    layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout="zigzag" if rank == 0 else "contiguous", device=device)
    packed = torch.ones(layout.local_rows, 2, device=device)
    _expect_raises(
        RuntimeError, "CP ranks disagree on the THD layout",
        lambda: verl_ops.postprocess_thd(packed, layout, rank, group=dist.group.WORLD),
    )
    # One rank with a wrong argument: its own ValueError there, a RuntimeError on the others.
    layout = ThdLayout.from_lengths([6, 2], cp_size=world, device=device)
    packed = torch.ones(layout.local_rows, 2, device=device)
    if rank == 1:
        _expect_raises(ValueError, "cp_rank=0 but this process is rank 1", lambda: verl_ops.postprocess_thd(
            packed, layout, 0, group=dist.group.WORLD))
    else:
        _expect_raises(RuntimeError, "CP rank\\(s\\) \\[1\\] rejected", lambda: verl_ops.postprocess_thd(
            packed, layout, rank, group=dist.group.WORLD))
    # The group is still in step afterwards.
    _roundtrip_one(rank, world, dist.group.WORLD, device, random.Random(3), [6, 2], ("zigzag", False, False, 1), (2,),
                   torch.float32)
    return True


# --------------------------------------------------------------------------------------------
# Dynamic CP.


def _sample_values(lengths, feature=2, dtype=torch.float32):
    """Sequence i's rows are i * 1000 + row, repeated over the feature: every row names its sample."""
    seqs = [
        (i * 1000 + torch.arange(n, dtype=torch.float64)).unsqueeze(1).expand(n, feature).to(dtype) for i, n in enumerate(lengths)
    ]
    return seqs


def _fake_model(seq: torch.Tensor, sample_id: int) -> torch.Tensor:
    """An output of another length than the input (like log-probs of the response tokens)."""
    return torch.cat([seq[:, 0].to(torch.float32) * 2 + 1, torch.tensor([float(sample_id)], device=seq.device)])


def _nested(seqs, device):
    values = torch.cat(seqs) if seqs else torch.zeros(0, 2)
    offsets = torch.tensor([0] + [int(x) for x in torch.tensor([s.shape[0] for s in seqs]).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values.to(device), offsets.to(device))


def _expected_local_cp(lengths, dp_size, max_per):
    if len(lengths) < dp_size:
        return dp_size
    need = max(1, math.ceil(max(lengths) / max_per))
    return 1 << (need - 1).bit_length()


DYNAMIC_CASES = [
    # (lengths, max_seqlen_per_dp_cp_rank, assignment)
    ("few", 16, "contiguous"),  # fewer sequences than ranks: whole batch
    ("short", 64, "contiguous"),  # local_cp_size 1, B not a multiple of the groups
    ("short", 64, "balanced"),
    ("long2", 40, "contiguous"),  # local_cp_size 2
    ("long2", 40, "balanced"),
    ("zeros", 8, "contiguous"),  # zero-length sequences
]


def _case_lengths(name, world, rng):
    if name == "few":
        return [rng.randint(1, 30) for _ in range(world - 1)]
    if name == "short":
        return [rng.randint(1, 60) for _ in range(3 * world + 1)]
    if name == "long2":
        return [rng.randint(1, 40) for _ in range(2 * world + 1)] + [75]
    return [0, 3, 0, 0, 5, 0, 1, 0, 0][: max(world + 1, 5)]


def check_dynamic_split_merge(rank, world, backend, seed):
    dist, device = _setup(rank, backend)
    groups = DynamicCPGroups.for_group()
    for case_index, (name, max_per, assignment) in enumerate(DYNAMIC_CASES):
        rng = random.Random(seed + case_index)
        lengths = _case_lengths(name, world, rng)
        seqs = _sample_values(lengths)
        split = dynamic_cp_split(_nested(seqs, device), max_per, groups=groups, assignment=assignment)
        plan = split.plan
        lcs = _expected_local_cp(lengths, world, max_per)
        assert split.local_cp_size == lcs == plan.local_cp_size, (name, lengths)
        assert plan.local_dp_rank == rank // lcs
        if lcs > 1:
            members = list(range(rank - rank % lcs, rank - rank % lcs + lcs))
            assert dist.get_process_group_ranks(split.cp_group) == members
        else:
            assert split.cp_group is None
        # This rank's batch is exactly its group's sequences, in order.
        local = split.batch
        ids = list(plan.sample_ids)
        assert local.offsets().diff().tolist() == [lengths[i] for i in ids]
        for k, i in enumerate(ids):
            assert torch.equal(local[k].cpu(), seqs[i])
        # Completeness: the groups cover every sample exactly once; members of a group agree.
        everyone = [None] * world
        dist.all_gather_object(everyone, ids)
        per_group = [everyone[g * lcs] for g in range(world // lcs)]
        for r in range(world):
            assert everyone[r] == per_group[r // lcs]
        assert sorted(i for g in per_group for i in g) == list(range(len(lengths)))
        assert all(per_group) or len(lengths) == 0  # no empty group
        # Merge: outputs of another length, in several forms, back in sample order.
        outs = [_fake_model(local[k], i) for k, i in enumerate(ids)]
        expected = [_fake_model(s.to(device), i).cpu() for i, s in enumerate(seqs)]
        merged = dynamic_cp_merge(_nested(outs, device) if outs else _nested([], device), split)
        assert merged.offsets().diff().tolist() == [e.shape[0] for e in expected]
        assert torch.equal(merged.values().cpu(), torch.cat(expected))
        # values + lengths form, and a dict of outputs with other dtypes / feature shapes.
        vals = torch.cat(outs) if outs else torch.zeros(0, device=device)
        mv, ml = dynamic_cp_merge(vals, split, lengths=[o.shape[0] for o in outs])
        assert torch.equal(mv.cpu(), torch.cat(expected)) and ml.tolist() == [e.shape[0] for e in expected]
        ids_out = [torch.full((lengths[i], 3), i, dtype=torch.int64, device=device) for i in ids]
        flags = [torch.tensor([i % 2 == 0], device=device) for i in ids]
        md = dynamic_cp_merge({"ids": _nested(ids_out, device), "flag": _nested(flags, device)}, split)
        assert md["ids"].offsets().diff().tolist() == lengths
        assert torch.equal(md["ids"].values().cpu(), torch.cat([torch.full((n, 3), i) for i, n in enumerate(lengths)]))
        assert md["flag"].values().cpu().tolist() == [i % 2 == 0 for i in range(len(lengths))]
    return True


def check_dynamic_end_to_end(rank, world, backend):
    """split -> pack for the group's CP -> postprocess over the CP group -> merge == the batch."""
    dist, device = _setup(rank, backend)
    rng = random.Random(5)
    lengths = [rng.randint(1, 30) for _ in range(2 * world)] + [50]
    seqs = _sample_values(lengths, feature=3)
    for assignment in ("contiguous", "balanced"):
        split = dynamic_cp_split(_nested(seqs, device), 32, assignment=assignment)
        assert split.local_cp_size == 2
        layout = ThdLayout.from_nested(split.batch, cp_size=split.local_cp_size)
        packed, _ = verl_ops.preprocess_thd(split.batch, layout, split.plan.cp_rank)
        outputs = verl_ops.postprocess_thd(packed, layout, split.plan.cp_rank, group=split.cp_group)
        merged = dynamic_cp_merge(outputs, split)
        assert torch.equal(merged.values().cpu(), torch.cat(seqs))
        assert merged.offsets().diff().tolist() == lengths
    return True


def _expect_rank_zero_error(rank, exc, pattern, fn):
    """fn() raises rank 0's own ``exc`` (matching ``pattern``) there, and on every other rank the
    RuntimeError naming rank 0 (not a hang)."""
    if rank == 0:
        _expect_raises(exc, pattern, fn)
    else:
        _expect_raises(RuntimeError, "rank\\(s\\) \\[0\\] of the group rejected their outputs", fn)


def _expect_rank_zero_rejects_its_outputs(rank, device, split):
    """Rank 0 passes one output too many: it gets its own ValueError, every other rank a RuntimeError
    naming rank 0 (not a hang)."""
    n = len(split.plan.sample_ids)
    outs = [torch.ones(2, device=device)] * (n + (1 if rank == 0 else 0))
    _expect_rank_zero_error(rank, ValueError, "group holds .* sequences but the outputs have",
                            lambda: dynamic_cp_merge(_nested(outs, device), split))


def _expect_merge_in_sample_order(device, split, num_samples):
    """A correct merge of per-sample outputs [i, i] comes back in sample order on every rank."""
    outs = [torch.full((2,), float(i), device=device) for i in split.plan.sample_ids]
    merged = dynamic_cp_merge(_nested(outs, device), split)
    assert merged.values().cpu().tolist() == [float(i) for i in range(num_samples) for _ in range(2)]


def check_dynamic_merge_error_reaches_every_group(rank, world, backend):
    """With several CP groups of several ranks (4 ranks, local_cp_size 2: merge groups {0, 2} and
    {1, 3}), a rank that rejects its outputs makes every rank raise, those of the other merge group
    included (they would otherwise finish and wait in their next collective with it)."""
    dist, device = _setup(rank, backend)
    if world < 4:
        return True
    lengths = [3, 4, 5, 6, 7, 8, 50]
    split = dynamic_cp_split(_nested(_sample_values(lengths), device), 32)
    assert split.local_cp_size == 2 and split.plan.num_groups == world // 2
    _expect_rank_zero_rejects_its_outputs(rank, device, split)
    _expect_merge_in_sample_order(device, split, len(lengths))  # still in step
    return True


def check_dynamic_merge_disagreements(rank, world, backend):
    """Ranks that disagree on what the merge's collectives look like (another micro-batch's split,
    an empty dict of outputs, an unknown or another local_cp_size through the registered op) raise
    on every rank instead of waiting in mismatched collectives; a correct merge still runs after."""
    dist, device = _setup(rank, backend)
    ops = torch.ops.verl_ops
    name = DynamicCPGroups.for_group().group.group_name
    split = dynamic_cp_split(_nested(_sample_values([3] * (2 * world)), device), 64)
    # Rank 0 merges with the split of another micro-batch, the others with theirs:
    # - more samples (a longer header);
    other = dynamic_cp_split(_nested(_sample_values([3] * (2 * world + 1)), device), 64)
    assert split.plan.num_groups == other.plan.num_groups == world
    # - as many samples and the same grouping (contiguous, other lengths): the fingerprints differ;
    same_b = dynamic_cp_split(_nested(_sample_values([4] * (2 * world)), device), 64)
    assert same_b.plan.groups == split.plan.groups
    # - one group (fewer samples than ranks: every rank holds them all, no copy) against several.
    one = dynamic_cp_split(_nested(_sample_values([3] * (world - 1)), device), 64)
    assert one.plan.num_groups == 1
    for theirs in (other, same_b, one):
        mine = theirs if rank == 0 else split
        outs = [torch.ones(2, device=device)] * len(mine.plan.sample_ids)
        _expect_raises(RuntimeError, "outputs disagree", lambda: dynamic_cp_merge(_nested(outs, device), mine))
    # One group on every rank, rank 0 with an output too many: its own error, the others one naming it.
    _expect_rank_zero_rejects_its_outputs(rank, device, one)
    merged = dynamic_cp_merge(_nested([torch.ones(2, device=device)] * (world - 1), device), one)
    assert merged.offsets().diff().tolist() == [2] * (world - 1)
    # An empty dict on rank 0 only; then on every rank.
    outs = {} if rank == 0 else {"a": _nested([torch.ones(2, device=device)] * len(split.plan.sample_ids), device)}
    _expect_raises(RuntimeError, "outputs disagree", lambda: dynamic_cp_merge(outs, split))
    assert dynamic_cp_merge({}, split) == {}
    # The registered op: rank 0 with a local_cp_size the group has no CP groups of, then with
    # another valid one (one group for it, one per rank for the others).
    B = world
    values = torch.ones(1, 2, device=device)
    lengths = torch.ones(1, dtype=torch.int64, device=device)
    ids = torch.tensor([rank], dtype=torch.int64, device=device)
    _expect_rank_zero_error(rank, ValueError, "local_cp_size must be one of", lambda: ops.dynamic_cp_merge(
        values, lengths, ids, B, 3 if rank == 0 else 1, name))
    _expect_raises(RuntimeError, "outputs disagree", lambda: ops.dynamic_cp_merge(
        values, lengths, ids, B, world if rank == 0 else 1, name))
    # Ranks that disagree on validate (the checks decide whether a rank raises).
    _expect_raises(RuntimeError, "outputs disagree", lambda: ops.dynamic_cp_merge(
        values, lengths, ids, B, 1, name, rank != 0))
    # One group (local_cp_size = world: each rank merges its own outputs, no second exchange), rank
    # 0's lengths not summing to its rows: its own error, the others a RuntimeError naming it.
    own = torch.arange(world, dtype=torch.int64, device=device)
    rows = world + (1 if rank == 0 else 0)
    _expect_rank_zero_error(rank, ValueError, "group 0's outputs have", lambda: ops.dynamic_cp_merge(
        torch.ones(rows, 2, device=device), torch.ones(world, dtype=torch.int64, device=device), own, B, world, name))
    mv, ml = ops.dynamic_cp_merge(values * rank, lengths, ids, B, 1, name)
    assert ml.tolist() == [1] * world and mv[:, 0].cpu().tolist() == [float(r) for r in range(world)]
    _expect_merge_in_sample_order(device, split, 2 * world)  # still in step
    return True


def check_dynamic_split_too_large_for_int32(rank, world, backend):
    """A plan whose first group holds more rows than int32 offsets take (rows without features: no
    memory): the same ValueError on every rank, not only in that group."""
    dist, device = _setup(rank, backend)
    top = 2**31 - 1
    lengths = [top - 10, 20] + [1] * (2 * world - 2)
    values = torch.empty((sum(lengths), 0), device=device)
    _expect_raises(ValueError, "would hold .* rows, more than the int32 offsets", lambda: dynamic_cp_split(
        values, top, lengths=lengths))
    split = dynamic_cp_split(_nested(_sample_values([2] * world), device), 64)  # still in step
    _expect_merge_in_sample_order(device, split, world)
    return True


def check_dynamic_split_per_sample_only(rank, world, backend):
    """A dict of per-sample tensors only, with lengths=: each follows the plan's selection (this
    rank's group's samples, in order)."""
    dist, device = _setup(rank, backend)
    lengths = [5, 1, 9, 3, 7, 2, 8, 4][: 2 * world] + [6] * max(0, 2 * world - 8)
    adv = torch.arange(len(lengths), dtype=torch.float32, device=device) * 0.5
    ids = torch.arange(2 * len(lengths), device=device).view(-1, 2)
    split = dynamic_cp_split({"adv": adv, "ids": ids}, 64, lengths=lengths, assignment="balanced")
    assert split.plan.num_groups == world
    mine = list(split.plan.sample_ids)
    assert split.batch["adv"].cpu().tolist() == [0.5 * i for i in mine]
    assert split.batch["ids"].cpu().tolist() == [[2 * i, 2 * i + 1] for i in mine]
    return True


def check_dynamic_all_empty_outputs(rank, world, backend):
    dist, device = _setup(rank, backend)
    lengths = [2] * (2 * world)
    split = dynamic_cp_split(_nested(_sample_values(lengths), device), 4)
    n = len(split.plan.sample_ids)
    # Every output empty, and only the first group's outputs non-empty.
    mv, ml = dynamic_cp_merge(torch.zeros(0, 4, device=device), split, lengths=[0] * n)
    assert mv.shape == (0, 4) and ml.tolist() == [0] * len(lengths)
    first = split.plan.local_dp_rank == 0
    mine = [3 if first else 0] * n
    vals = torch.arange(sum(mine) * 4, dtype=torch.float32, device=device).view(-1, 4)
    mv, ml = dynamic_cp_merge(vals, split, lengths=mine)
    assert ml.tolist() == [3] * len(split.plan.groups[0]) + [0] * (len(lengths) - len(split.plan.groups[0]))
    assert torch.equal(mv.cpu(), torch.arange(3 * len(split.plan.groups[0]) * 4, dtype=torch.float32).view(-1, 4))
    return True


def check_dynamic_errors(rank, world, backend):
    dist, device = _setup(rank, backend)
    lengths = [10] * (2 * world)
    seqs = _sample_values(lengths)
    # The longest sequence needs more ranks than there are: the same ValueError on every rank.
    _expect_raises(ValueError, "needs local_cp_size=.* but dp_size is", lambda: dynamic_cp_split(
        _nested(_sample_values([10 * world + 1] * world), device), 10))
    # Ranks holding different batches: RuntimeError on every rank, not a hang.
    mine = lengths if rank else lengths[:-1] + [11]
    _expect_raises(RuntimeError, "hold different micro-batches", lambda: dynamic_cp_split(
        _nested(_sample_values(mine), device), 64))
    # One rank passes a bad argument: it gets its own error, the others a RuntimeError naming it.
    bad = "lpt" if rank == world - 1 else "contiguous"
    if rank == world - 1:
        _expect_raises(ValueError, "assignment must be one of", lambda: dynamic_cp_split(
            _nested(seqs, device), 64, assignment=bad))
    else:
        _expect_raises(RuntimeError, f"rank\\(s\\) \\[{world - 1}\\] of the group rejected", lambda: dynamic_cp_split(
            _nested(seqs, device), 64, assignment=bad))
    split = dynamic_cp_split(_nested(seqs, device), 64)
    assert split.plan.num_groups == world
    # Merge: one rank with a wrong number of sequences; then a dtype that differs across groups.
    _expect_rank_zero_rejects_its_outputs(rank, device, split)
    n = len(split.plan.sample_ids)
    dtype = torch.float16 if rank == 1 else torch.float32
    outs = [torch.ones(2, dtype=dtype, device=device)] * n
    _expect_raises(RuntimeError, "outputs disagree", lambda: dynamic_cp_merge(_nested(outs, device), split))
    _expect_merge_in_sample_order(device, split, len(lengths))  # still in step
    return True


def _split_merge_roundtrip(device, groups, lengths, max_per, expect_cp):
    seqs = _sample_values(lengths)
    split = dynamic_cp_split(_nested(seqs, device), max_per, groups=groups)
    assert split.local_cp_size == expect_cp
    outs = [_fake_model(split.batch[k], i) for k, i in enumerate(split.plan.sample_ids)]
    merged = dynamic_cp_merge(_nested(outs, device), split)
    expected = torch.cat([_fake_model(s.to(device), i).cpu() for i, s in enumerate(seqs)])
    assert torch.equal(merged.values().cpu(), expected)
    return split


def check_dynamic_subgroup_parent(rank, world, backend):
    """DynamicCPGroups of sub-groups of the world (the DPxCP groups of a job with TP / PP)."""
    dist, device = _setup(rank, backend)
    half = world // 2
    parents = [list(range(0, half)), list(range(half, world))]
    pgs = [dist.new_group(p) for p in parents]
    parent = pgs[rank // half]
    groups = DynamicCPGroups(parent, all_group_ranks=parents)
    assert groups.dp_size == half and groups.dp_rank == rank % half
    lengths = [3, 9, 4, 1, 7][: half + 1] if rank < half else [2, 2, 8, 5, 6, 1][: 2 * half]
    _split_merge_roundtrip(device, groups, lengths, 16, 1)
    if half > 1:
        assert groups.cp_group(half) is parent
    # A parent spanning every rank that is not the world group object: sub-groups of size 2 are
    # created, from the list of all DPxCP groups, or group-locally when the backend allows it.
    everyone = dist.new_group(list(range(world)))
    modes = [{"all_group_ranks": [list(range(world))]}]
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None
    if bound:
        _expect_raises(RuntimeError, "pass all_group_ranks=", lambda: DynamicCPGroups(everyone))
    else:
        modes.append({})
    for kwargs in modes:
        groups = DynamicCPGroups(everyone, **kwargs)
        # The ops, given the group's c10d name, use this instance (its sub-groups), never build
        # another one inside a call (which a device-bound NCCL job cannot do).
        from verl_ops.dynamic_cp import _groups_of

        assert _groups_of("test", everyone.group_name) is groups
        if world > 2:
            assert dist.get_process_group_ranks(groups.merge_group(2)) == list(range(rank % 2, world, 2))
            assert dist.get_process_group_ranks(groups.cp_group(2)) == [rank - rank % 2, rank - rank % 2 + 1]
        _split_merge_roundtrip(device, groups, [5] * world + [12], 8, 2)
    return True


def check_registered_ops_compiled(rank, world, backend):
    """The registered ops under torch.compile(fullgraph=True) on every rank, their process group
    passed by its c10d name: dynamic_cp_split -> a model on the local rows -> dynamic_cp_merge
    gives the model's output of the whole batch in sample order; the split's gradient reaches only
    this rank's rows; merge_router_topk over a CP group of every rank gives every token's route."""
    from router_reference import RouterCase

    dist, device = _setup(rank, backend)
    ops = torch.ops.verl_ops
    groups = DynamicCPGroups.for_group()
    name = groups.group.group_name

    def step(values, lengths, max_per):
        sel, local_lengths, ids, lcs = ops.dynamic_cp_split(values, lengths, max_per, name)
        merged, merged_lengths = ops.dynamic_cp_merge(sel * 2 + 1, local_lengths, ids, lengths.shape[0], lcs, name)
        return merged, merged_lengths, lcs

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    rng = random.Random(7)
    for case_index, (case, max_per, _) in enumerate(DYNAMIC_CASES):
        lengths = _case_lengths(case, world, random.Random(case_index))
        values = torch.cat(_sample_values(lengths)).to(device) if lengths else torch.zeros(0, 2, device=device)
        host = torch.tensor(lengths, dtype=torch.int64)
        merged, merged_lengths, lcs = compiled(values, host, max_per)
        assert lcs == _expected_local_cp(lengths, world, max_per), (case, lengths, lcs)
        assert merged_lengths.tolist() == lengths
        assert torch.equal(merged, values * 2 + 1), (rank, case)
        # Eager, with a gradient: this rank's selected rows get it, the others get zeros.
        x = values.clone().requires_grad_()
        sel, local_lengths, ids, _ = ops.dynamic_cp_split(x, host, max_per, name)
        sel.sum().backward()
        rows = torch.zeros(values.shape[0], dtype=torch.bool)
        starts = [0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()
        for i in ids.tolist():
            rows[starts[i] : starts[i + 1]] = True
        assert torch.equal(x.grad.cpu(), rows.unsqueeze(1).expand_as(x.grad).to(x.dtype))
        assert local_lengths.tolist() == [lengths[i] for i in ids.tolist()]
    # merge_router_topk, CP over every rank, zigzag.
    route_case = RouterCase(rng, [5, 9, 1, 12, 0, 7], 3, 2, cp=world)
    lay = route_case.layout.to(device)
    rec = route_case.recorded(0, rank, "stacked").to(device)
    merge = torch.compile(
        lambda r, cu, cup: ops.merge_router_topk([r], cu, cup, lay.total_tokens, lay.local_rows, 1, world, 0, None,
                                                 name),
        fullgraph=True,
    )
    out = merge(rec, lay.cu_seqlens, lay.cu_seqlens_padded)
    assert torch.equal(out.cpu(), route_case.routes.to(torch.int16)), rank
    return True


# --------------------------------------------------------------------------------------------
# dynamic_cp_merge's reorder index against its definition, and its host reads.

_HOST_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _count_host_reads(fn):
    """Run ``fn()`` counting its device-to-host reads: calls of ``Tensor.cpu()``, and host reads of
    values (``.tolist()``, ``.item()``, ``bool()``, ``int()``, ...) of any tensor whose memory is not
    inside what one of those ``.cpu()`` calls returned (on a CPU-only machine ``.cpu()`` returns its
    tensor itself, so the memory, not the object, tells the host copy from the rest). Returns
    ``(fn's result, number of .cpu() calls, [the other reads])``."""
    copies, others = [], []
    saved = {name: getattr(torch.Tensor, name) for name in ("cpu",) + _HOST_READS}

    def in_copy(t):
        if t.numel() == 0:
            return True
        p = t.data_ptr()
        return any(c.data_ptr() <= p < c.data_ptr() + c.numel() * c.element_size() for c in copies if c.numel())

    def cpu(self, *args, **kwargs):
        out = saved["cpu"](self, *args, **kwargs)
        copies.append(out)
        return out

    def read(name):
        def f(self, *args, **kwargs):
            if not in_copy(self):
                others.append(f"{name} of {self.dtype} {tuple(self.shape)}")
            return saved[name](self, *args, **kwargs)

        return f

    torch.Tensor.cpu = cpu
    for name in _HOST_READS:
        setattr(torch.Tensor, name, read(name))
    try:
        result = fn()
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
    return result, len(copies), others


def _merge_outputs(out_lengths, ids, device, dtype=torch.float32, feature=(3,)):
    """Outputs of samples ``ids`` in that order: sample i has ``out_lengths[i]`` rows, row r holding
    ``i * 1000 + r`` in every feature entry (each row names its sample and position)."""
    seqs = [
        (i * 1000 + torch.arange(out_lengths[i], dtype=torch.float64)).view(-1, *[1] * len(feature))
        .expand(-1, *feature).to(dtype)
        for i in ids
    ]
    values = torch.cat(seqs) if seqs else torch.zeros((0, *feature), dtype=dtype)
    return values.to(device), seqs


MERGE_DTYPES = [(torch.float32, (3,)), (torch.int32, (2, 2)), (torch.float64, ())]


def _merge_cases(world, rng):
    """(input lengths, max_seqlen_per_dp_cp_rank, assignment, output lengths): ragged, with empty
    sequences in and out; local_cp_size 1 (one group per rank), 2, and one group."""
    cases = []
    for assignment in ("balanced", "contiguous"):
        for _ in range(3):
            B = rng.randint(world, 5 * world + 3)
            lengths = [rng.choice([0, 0, 1, 3, 9, 17, 30, 41]) for _ in range(B)]
            out = [rng.choice([0, 0, 1, 2, 5, 13]) for _ in range(B)]
            cases.append((lengths, 64, assignment, out))
        B = 3 * world
        lengths = [rng.randint(0, 60) for _ in range(B - 1)] + [100]  # local_cp_size 2
        cases.append((lengths, 64, assignment, [rng.choice([0, 3, 8]) for _ in range(B)]))
        # Only the samples of a few groups have outputs; then none has any.
        cases.append(([rng.randint(1, 40) for _ in range(B)], 64, assignment, [7 if i % 5 == 0 else 0 for i in range(B)]))
        cases.append(([rng.randint(1, 40) for _ in range(B)], 64, assignment, [0] * B))
    cases.append(([5] * (world - 1), 64, "balanced", [2, 0, 4][: world - 1] + [1] * max(0, world - 4)))  # one group
    return cases


def check_merge_reference(rank, world, backend, seed):
    """dynamic_cp_merge equals its definition: sample i's output rows, taken from the group that
    holds i, in sample order; through the Python API and the registered op, with each rank's
    sequences in a shuffled order, with and without validate; two host reads per op call (the
    ranks' fixed-size agreement, then the index)."""
    dist, device = _setup(rank, backend)
    ops = torch.ops.verl_ops
    groups = DynamicCPGroups.for_group()
    name = groups.group.group_name
    rng = random.Random(seed)
    interleaved = False
    for lengths, max_per, assignment, out_lengths in _merge_cases(world, rng):
        B = len(lengths)
        seqs = _sample_values(lengths)
        split = dynamic_cp_split(_nested(seqs, device), max_per, groups=groups, assignment=assignment)
        plan, lcs = split.plan, split.local_cp_size
        interleaved |= any(list(g) != list(range(g[0], g[0] + len(g))) for g in plan.groups if g)
        ids = list(plan.sample_ids)
        for dtype, feature in MERGE_DTYPES:
            expected, _ = _merge_outputs(out_lengths, range(B), "cpu", dtype, feature)
            mine, mine_seqs = _merge_outputs(out_lengths, ids, device, dtype, feature)
            what = (rank, lengths, assignment, out_lengths, dtype)
            # The Python API: values + lengths, and nested.
            mv, ml = dynamic_cp_merge(mine, split, lengths=[out_lengths[i] for i in ids])
            assert ml.device.type == "cpu" and ml.dtype == torch.int64 and ml.tolist() == out_lengths, what
            assert mv.dtype == dtype and torch.equal(mv.cpu(), expected), what
            if feature:
                merged = dynamic_cp_merge(_nested(mine_seqs, device), split)
                assert merged.offsets().diff().tolist() == out_lengths, what
                assert torch.equal(merged.values().cpu(), expected), what
            # The registered op, this rank's sequences in another order, lengths on the device.
            order = list(range(len(ids)))
            random.Random(seed + rank + B).shuffle(order)
            held = [ids[k] for k in order]
            values, _ = _merge_outputs(out_lengths, held, device, dtype, feature)
            held_lengths = torch.tensor([out_lengths[i] for i in held], dtype=torch.int64, device=device)
            held_ids = torch.tensor(held, dtype=torch.int64, device=device)
            for validate in (True, False):
                (mv, ml), transfers, others = _count_host_reads(
                    lambda: ops.dynamic_cp_merge(values, held_lengths, held_ids, B, lcs, name, validate)
                )
                assert ml.device.type == "cpu" and ml.tolist() == out_lengths, what
                assert torch.equal(mv.cpu(), expected), what
                # two host reads: the fixed-size agreement of every rank, then this merge's index
                assert transfers == 2 and others == [], (what, transfers, others)
    assert interleaved  # the balanced assignment gave some group non-consecutive samples
    return True


def check_merge_header_errors(rank, world, backend):
    """Sample ids or lengths that disagree across groups raise the same error on every rank, with
    every group's lists; then a correct merge still runs."""
    dist, device = _setup(rank, backend)
    ops = torch.ops.verl_ops
    name = DynamicCPGroups.for_group().group.group_name
    B = world + 1

    def merge(ids, lengths, rows=None):
        values = torch.ones(sum(lengths) if rows is None else rows, 2, device=device)
        return ops.dynamic_cp_merge(values, torch.tensor(lengths, device=device), torch.tensor(ids, device=device),
                                    B, 1, name)

    # Rank r holds sample r, rank 0 also sample world: each once.
    ids = [[r] + ([world] if r == 0 else []) for r in range(world)]
    lens = [[r + 1] + ([0] if r == 0 else []) for r in range(world)]
    mv, ml = merge(ids[rank], lens[rank])
    assert ml.tolist() == [r + 1 for r in range(world)] + [0] and mv.shape == (sum(ml.tolist()), 2)
    # Every sample covered, but the last rank holds sample 0 again.
    bad = [list(g) + ([0] if r == world - 1 else []) for r, g in enumerate(ids)]
    bad_lens = [list(g) + ([4] if r == world - 1 else []) for r, g in enumerate(lens)]
    msg = _expect_raises(RuntimeError, "sample ids do not cover", lambda: merge(bad[rank], bad_lens[rank]))
    assert msg == (f"dynamic_cp_merge: the groups' sample ids do not cover the {B} samples once each (per group: "
                   f"{bad}); the groups disagree on the plan"), msg
    # A sample nobody holds; a sample id out of range.
    for wrong in (-1, B):
        bad = [list(g) for g in ids]
        bad[world - 1][0] = wrong
        msg = _expect_raises(RuntimeError, "sample ids do not cover", lambda: merge(bad[rank], lens[rank]))
        assert f"(per group: {bad})" in msg, msg
    # Rank 1's lengths do not sum to its rows; a negative length with the right sum.
    rows = sum(lens[rank]) + (2 if rank == 1 else 0)
    msg = _expect_raises(ValueError, "group 1's outputs", lambda: merge(ids[rank], lens[rank], rows))
    assert msg == (f"dynamic_cp_merge: group 1's outputs have {lens[1][0] + 2} rows but their lengths "
                   f"{lens[1]} (each >= 0) sum to {lens[1][0]}"), msg
    neg = [list(g) for g in lens]
    neg[0] = [lens[0][0] + 3, -3]
    msg = _expect_raises(ValueError, "group 0's outputs", lambda: merge(ids[rank], neg[rank]))
    assert msg == (f"dynamic_cp_merge: group 0's outputs have {lens[0][0]} rows but their lengths "
                   f"{neg[0]} (each >= 0) sum to {lens[0][0]}"), msg
    # Still in step.
    mv, ml = merge(ids[rank], lens[rank])
    assert ml.tolist() == [r + 1 for r in range(world)] + [0]
    return True


# --------------------------------------------------------------------------------------------
# The tests.


def test_postprocess_roundtrip(dist_run):
    assert dist_run("check_postprocess_roundtrip", 1234) == [True] * dist_run.world


def test_postprocess_all_padding_rank(dist_run):
    assert all(dist_run("check_all_padding_rank"))


def test_postprocess_gradient_local_shard_only(dist_run):
    assert all(dist_run("check_postprocess_grad"))


def test_postprocess_compile(dist_run):
    assert all(dist_run("check_postprocess_compile"))


def test_postprocess_layout_mismatch_raises(dist_run):
    assert all(dist_run("check_layout_mismatch"))


def test_dynamic_split_merge(dist_run):
    assert all(dist_run("check_dynamic_split_merge", 99))


def test_dynamic_end_to_end(dist_run):
    assert all(dist_run("check_dynamic_end_to_end"))


def test_dynamic_empty_outputs(dist_run):
    assert all(dist_run("check_dynamic_all_empty_outputs"))


def test_dynamic_errors_raise_on_every_rank(dist_run):
    assert all(dist_run("check_dynamic_errors"))


def test_dynamic_merge_error_reaches_every_group(dist_run):
    assert all(dist_run("check_dynamic_merge_error_reaches_every_group"))


def test_dynamic_merge_disagreements_raise_on_every_rank(dist_run):
    assert all(dist_run("check_dynamic_merge_disagreements", timeout_s=60.0))


def test_dynamic_split_too_large_for_int32(dist_run):
    assert all(dist_run("check_dynamic_split_too_large_for_int32", timeout_s=60.0))


def test_dynamic_split_per_sample_only(dist_run):
    assert all(dist_run("check_dynamic_split_per_sample_only"))


def test_dynamic_groups_of_a_subgroup(dist_run):
    assert all(dist_run("check_dynamic_subgroup_parent"))


def test_registered_ops_compile(dist_run):
    assert all(dist_run("check_registered_ops_compiled"))


def test_merge_matches_reference(dist_run):
    assert all(dist_run("check_merge_reference", 2024))


def test_merge_header_errors_raise_on_every_rank(dist_run):
    assert all(dist_run("check_merge_header_errors"))


def test_a_hang_fails_instead_of_blocking():
    """The harness turns a rank that never reaches a collective into a failure."""
    from _dist import DistPool, DistTimeout

    pool = DistPool(2, "gloo", pg_timeout_s=60.0)
    try:
        with pytest.raises(DistTimeout, match="a hang"):
            pool.run("test_distributed:check_hang", timeout_s=5.0)
    finally:
        pool.close(force=True)


def check_hang(rank, world):
    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        import time

        time.sleep(30)
    return True


# --------------------------------------------------------------------------------------------
# Plan arithmetic, in-process.


def ref_contiguous(lengths, dp_size, max_per):
    """docs/cp.md#assignment with contiguous blocks whose sizes differ by at most one."""
    lcs = _expected_local_cp(lengths, dp_size, max_per)
    G = dp_size // lcs
    base, rem = divmod(len(lengths), G)
    out, start = [], 0
    for g in range(G):
        n = base + (g < rem)
        out.append(tuple(range(start, start + n)))
        start += n
    return lcs, out


def test_plan_contiguous_matches_rules():
    rng = random.Random(0)
    for _ in range(300):
        dp = rng.choice([1, 2, 4, 8, 16])
        max_per = rng.choice([8, 32, 100])
        B = rng.randint(0, 40)
        lengths = [rng.randint(0, max_per * dp) for _ in range(B)]
        lcs, groups = ref_contiguous(lengths, dp, max_per)
        if lcs > dp:
            with pytest.raises(ValueError, match="plan_dynamic_cp: the longest sequence"):
                plan_dynamic_cp(lengths, dp, max_per)
            continue
        for dp_rank in range(dp):
            plan = plan_dynamic_cp(lengths, dp, max_per, dp_rank=dp_rank)
            assert plan.local_cp_size == lcs and list(plan.groups) == groups
            assert plan.local_dp_rank == dp_rank // lcs and plan.cp_rank == dp_rank % lcs
            assert plan.sample_ids == groups[dp_rank // lcs]
        if B >= dp:
            assert all(plan.groups)  # no empty group
        # Where B divides evenly this is verl's ceil-sized chunking.
        G = dp // lcs
        if B % G == 0:
            chunk = math.ceil(B / G)
            assert list(plan.groups) == [tuple(range(g * chunk, min((g + 1) * chunk, B))) for g in range(G)]


def test_plan_balanced_is_a_partition_in_order_and_no_worse():
    rng = random.Random(1)
    for _ in range(200):
        dp = rng.choice([2, 4, 8])
        B = rng.randint(dp, 60)
        lengths = [max(0, int(rng.lognormvariate(5, 1))) for _ in range(B)]
        max_per = max(lengths + [1])
        c = plan_dynamic_cp(lengths, dp, max_per)
        b = plan_dynamic_cp(lengths, dp, max_per, assignment="balanced")
        assert b.local_cp_size == c.local_cp_size
        assert sorted(i for g in b.groups for i in g) == list(range(B))
        assert all(list(g) == sorted(g) for g in b.groups) and all(b.groups)
        # LPT is within 4/3 of the optimum, which is at least max(mean, longest sequence).
        opt_lb = max(sum(lengths) / b.num_groups, max(lengths))
        assert max(b.group_tokens()) <= 4 / 3 * opt_lb + 1e-9
        assert max(b.group_tokens()) <= max(c.group_tokens())


def test_plan_edge_cases():
    # All sequences empty: local_cp_size 1 (verl's bit trick would give 2 for ceil(0 / m) = 0).
    assert plan_dynamic_cp([0] * 4, 4, 8).local_cp_size == 1
    # Non-power-of-two dp_size: sizes that do not divide it round up to dp_size.
    assert plan_dynamic_cp([20] * 6, 6, 8).local_cp_size == 6
    assert plan_dynamic_cp([9] * 6, 6, 8).local_cp_size == 2
    # Balanced with ties keeps groups non-empty.
    assert all(plan_dynamic_cp([0] * 8, 4, 8, assignment="balanced").groups)
    for kwargs, pattern in (
        ({"dp_size": 0}, "dp_size must be an int >= 1"),
        ({"max_seqlen_per_dp_cp_rank": 0}, "max_seqlen_per_dp_cp_rank must be an int >= 1"),
        ({"dp_rank": 4}, "dp_rank must be an int in \\[0, dp_size=4\\)"),
        ({"assignment": "lpt"}, "assignment must be one of"),
        ({"lengths": [3, -1, 2, 2]}, "lengths must be >= 0"),
    ):
        args = {"lengths": [4] * 4, "dp_size": 4, "max_seqlen_per_dp_cp_rank": 8, **kwargs}
        with pytest.raises(ValueError, match=f"plan_dynamic_cp: {pattern}"):
            plan_dynamic_cp(args.pop("lengths"), args.pop("dp_size"), args.pop("max_seqlen_per_dp_cp_rank"), **args)


def test_split_merge_without_distributed():
    """dp_size 1: the whole batch, local_cp_size 1, no collective; dicts and dense entries."""
    lengths = [3, 0, 5]
    seqs = _sample_values(lengths)
    nt = _nested(seqs, "cpu")
    adv = torch.tensor([0.5, -1.0, 2.0])
    split = dynamic_cp_split({"input_ids": nt, "advantages": adv}, 8)
    assert split.local_cp_size == 1 and split.cp_group is None and split.plan.dp_size == 1
    assert torch.equal(split.batch["input_ids"].values(), nt.values()) and torch.equal(split.batch["advantages"], adv)
    merged = dynamic_cp_merge(split.batch["input_ids"], split)
    assert torch.equal(merged.values(), nt.values())
    vals, lens = dynamic_cp_split(torch.cat(seqs), 8, lengths=lengths).batch
    assert torch.equal(vals, torch.cat(seqs)) and lens.tolist() == lengths
    # Per-sample tensors only, with lengths=: the whole batch.
    only = dynamic_cp_split({"advantages": adv}, 8, lengths=lengths)
    assert only.local_cp_size == 1 and torch.equal(only.batch["advantages"], adv)
    # The selection is differentiable.
    x = torch.cat(seqs).requires_grad_()
    v, _ = dynamic_cp_split(x, 8, lengths=lengths).batch
    v.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_split_bad_batches():
    nt = _nested(_sample_values([2, 3]), "cpu")
    with pytest.raises(ValueError, match="dynamic_cp_split: a values tensor \\[total, \\*F\\] needs lengths="):
        dynamic_cp_split(torch.zeros(5, 2), 8)
    with pytest.raises(ValueError, match="dynamic_cp_split: values must be \\[sum\\(lengths\\)=4"):
        dynamic_cp_split(torch.zeros(5, 2), 8, lengths=[2, 2])
    with pytest.raises(ValueError, match="dynamic_cp_split: batch\\['adv'\\] must be nested or have one row per sequence"):
        dynamic_cp_split({"x": nt, "adv": torch.zeros(3)}, 8)
    with pytest.raises(ValueError, match="dynamic_cp_split: batch\\['y'\\] has other sequence lengths"):
        dynamic_cp_split({"x": nt, "y": _nested(_sample_values([3, 2]), "cpu")}, 8)
    with pytest.raises(TypeError, match="dynamic_cp_split: batch must be a tensor"):
        dynamic_cp_split([1, 2], 8)
    split = dynamic_cp_split(nt, 8)
    with pytest.raises(ValueError, match="dynamic_cp_merge: this rank's group holds 2 sequences but the outputs have 1"):
        dynamic_cp_merge(_nested(_sample_values([2]), "cpu"), split)
    with pytest.raises(ValueError, match="dynamic_cp_merge: a values tensor \\[rows, \\*F\\] needs lengths="):
        dynamic_cp_merge(torch.zeros(3), split)


def _ref_merge(out_lengths, B):
    """(values, lengths) of the merge by definition: sample i's rows, in sample order."""
    return torch.cat([torch.zeros(0, 2)] + [torch.full((out_lengths[i], 2), float(i)) for i in range(B)]), out_lengths


@pytest.mark.parametrize("held, out_lengths", [
    ([2, 0, 3, 1], [4, 0, 1, 2]),
    ([0, 1, 2], [0, 0, 0]),  # nothing to copy
    ([], []),  # no samples
    ([5, 1, 4, 0, 3, 2, 6], [3, 0, 0, 7, 1, 0, 2]),
])
def test_merge_op_one_host_read(held, out_lengths):
    """The op's success path without a group reads from the device once: one .cpu() of a small
    tensor, no other host read of a device value."""
    B = len(held)
    values = torch.cat([torch.full((out_lengths[i], 2), float(i)) for i in held]) if held else torch.zeros(0, 2)
    lengths = torch.tensor([out_lengths[i] for i in held], dtype=torch.int64)
    ids = torch.tensor(held, dtype=torch.int64)
    for validate in (True, False):
        (merged, merged_lengths), transfers, others = _count_host_reads(
            lambda: torch.ops.verl_ops.dynamic_cp_merge(values, lengths, ids, B, 1, None, validate)
        )
        ref_values, ref_lengths = _ref_merge(out_lengths, B)
        assert merged_lengths.tolist() == ref_lengths and torch.equal(merged, ref_values)
        assert transfers == 1 and others == [], (transfers, others)


def test_host_read_counter():
    """_count_host_reads counts every .cpu(), and value reads outside what .cpu() returned."""
    x = torch.arange(6)
    _, transfers, others = _count_host_reads(lambda: (x[:2].cpu().tolist(), int(x.cpu()[3]), x[1:].cpu()))
    assert transfers == 3 and others == []
    _, transfers, others = _count_host_reads(lambda: (x[:2].cpu().tolist(), x[2:].tolist(), bool(x.sum() > 0)))
    assert transfers == 1 and others == ["tolist of torch.int64 (4,)", "__bool__ of torch.bool ()"]


@pytest.mark.parametrize("lengths, ids, B, exc, message", [
    ([2, 2], [0, 1], 2, ValueError, "group 0's outputs have 5 rows but their lengths [2, 2] (each >= 0) sum to 4"),
    ([6, -1], [0, 1], 2, ValueError, "group 0's outputs have 5 rows but their lengths [6, -1] (each >= 0) sum to 5"),
    ([2, 3], [1, 1], 2, RuntimeError, "sample ids do not cover the 2 samples once each (per group: [[1, 1]])"),
    ([2, 3], [0, 2], 2, RuntimeError, "sample ids do not cover the 2 samples once each (per group: [[0, 2]])"),
    ([2, 3], [-1, 1], 2, RuntimeError, "sample ids do not cover the 2 samples once each (per group: [[-1, 1]])"),
    ([5], [1], 2, RuntimeError, "sample ids do not cover the 2 samples once each (per group: [[1]])"),
    ([0, 5, 0], [2, 0, -7], 3, RuntimeError, "sample ids do not cover the 3 samples once each (per group: [[2, 0, -7]])"),
])
def test_merge_op_header_errors(lengths, ids, B, exc, message):
    values = torch.zeros(5, 2)
    with pytest.raises(exc) as e:
        torch.ops.verl_ops.dynamic_cp_merge(values, torch.tensor(lengths), torch.tensor(ids), B, 1)
    assert message in str(e.value)
    # validate=False skips the checks (a sample nobody holds merges as empty).
    if exc is RuntimeError and sorted(ids)[-1] < B and len(set(ids)) == len(ids):
        merged, merged_lengths = torch.ops.verl_ops.dynamic_cp_merge(
            values, torch.tensor(lengths), torch.tensor(ids), B, 1, None, False)
        expect = [dict(zip(ids, lengths)).get(i, 0) for i in range(B)]
        assert merged_lengths.tolist() == expect and merged.shape == (sum(expect), 2)
