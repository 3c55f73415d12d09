"""verl_ops.integrations.verl_dcp: the DynamicCPScheduler drop-in (verl/utils/dynamic_cp_scheduler.py).

* The schedule (:func:`dynamic_cp_schedule`) against Megatron-Core's ``DefaultDynamicCPScheduler``
  read at run time from a Megatron-LM checkout (megatron-core 0.16.1 on PyPI lacks the class; it is
  on Megatron-LM's dev branch from d2e7ec5b, #5154): ``MEGATRON_LM_GIT_DIR`` (a git dir, revisions
  ``MEGATRON_LM_REVS``, default d2e7ec5b and dev) or ``MEGATRON_LM_SRC`` (a source tree); skipped,
  saying so, without one. Schedules pinned from that algorithm run everywhere.
* The adapter against verl's own ``DynamicCPScheduler`` (the installed verl, read from its file;
  verl 0.9.1 and verl main 1dda039b have the same module) over the same Megatron class, and
  verl's documented behaviour (its tests' cases, written here from their assertions) with a
  stand-in scheduler: every rank's micro-batches, fields, non-tensor entries, errors and messages.
  Needs tensordict (verl's dependency); skipped without it.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import random
import subprocess
import sys
import types
import typing

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs

from verl_ops.integrations import verl_dcp as dcp

OWNER = "verl.utils.dynamic_cp_scheduler"
MCORE = "megatron.core.datasets.data_schedule"
MCORE_UTILS = "megatron.core.datasets.data_schedule_utils"
_DEFAULT_GIT_DIR = "/work/.mirror/NVIDIA+Megatron-LM/repo"


# --------------------------------------------------------------------------------------------
# Megatron-Core's scheduler, from a checkout (only its scheduling code is run).


def _megatron_sources():
    """{label: (data_schedule.py text, data_schedule_utils.py text)} of the checkouts found."""
    out = {}
    src = os.environ.get("MEGATRON_LM_SRC")
    if src:
        base = os.path.join(src, "megatron", "core", "datasets")
        with open(os.path.join(base, "data_schedule.py")) as a, open(os.path.join(base, "data_schedule_utils.py")) as b:
            out["src"] = (a.read(), b.read())
    git_dir = os.environ.get("MEGATRON_LM_GIT_DIR", _DEFAULT_GIT_DIR)
    if os.path.isdir(git_dir):
        for rev in os.environ.get("MEGATRON_LM_REVS", "d2e7ec5b,dev").split(","):
            try:
                texts = tuple(
                    subprocess.run(["git", "--git-dir", git_dir, "show", f"{rev}:megatron/core/datasets/{f}"],
                                   capture_output=True, text=True, check=True, timeout=60).stdout
                    for f in ("data_schedule.py", "data_schedule_utils.py")
                )
            except (subprocess.SubprocessError, OSError):
                continue
            out[rev] = texts
    return out


def _module_from(name: str, text: str, keep, namespace: dict) -> types.ModuleType:
    """A module ``name`` holding the top-level definitions of ``text`` that ``keep`` selects."""
    tree = ast.parse(text)
    body = [n for n in tree.body if keep(n)]
    mod = types.ModuleType(name)
    mod.__dict__.update(namespace)
    exec(compile(ast.Module(body=body, type_ignores=[]), f"<{name}>", "exec"), mod.__dict__)  # noqa: S102
    return mod


def load_megatron_scheduler(schedule_text: str, utils_text: str):
    """(data_schedule, data_schedule_utils) stand-ins with Megatron's scheduling code."""
    ns = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Optional", "Sequence", "Tuple", "Type")}
    ns.update(ceil=math.ceil, log2=math.log2, lru_cache=functools.lru_cache, torch=torch)
    utils_names = {"next_hdp_group_packing_aware", "align_sample_id_groups", "dcp_gpus_needed"}

    def keep_utils(node):
        if isinstance(node, ast.Assign):
            return any(isinstance(t, ast.Name) and t.id == "_DYNAMIC_CP_WORKLOAD_CAP_DELTA" for t in node.targets)
        return isinstance(node, ast.FunctionDef) and node.name in utils_names

    utils = _module_from(MCORE_UTILS, utils_text, keep_utils, ns)
    if not hasattr(utils, "next_hdp_group_packing_aware"):
        raise LookupError("this Megatron-LM has no next_hdp_group_packing_aware")
    classes = {"BasePackingScheduler", "DpBalancedScheduler", "DefaultDynamicCPScheduler"}
    sched_ns = dict(ns, **{n: getattr(utils, n) for n in utils_names})
    sched = _module_from(MCORE, schedule_text, lambda n: isinstance(n, ast.ClassDef) and n.name in classes, sched_ns)
    if not hasattr(sched, "DefaultDynamicCPScheduler"):
        raise LookupError("this Megatron-LM has no DefaultDynamicCPScheduler")
    return sched, utils


_SOURCES = None


def _megatron_params():
    global _SOURCES
    if _SOURCES is None:
        _SOURCES = _megatron_sources()
    return list(_SOURCES) or [pytest.param(None, marks=pytest.mark.skip(reason=(
        "no Megatron-LM checkout with DefaultDynamicCPScheduler (megatron-core 0.16.1 on PyPI lacks it; "
        "it is on NVIDIA/Megatron-LM's dev branch from d2e7ec5b): set MEGATRON_LM_GIT_DIR or MEGATRON_LM_SRC")))]


@pytest.fixture(params=_megatron_params())
def megatron(request, monkeypatch):
    """Megatron's scheduler modules, installed as megatron.core.datasets.data_schedule(_utils)."""
    try:
        sched, utils = load_megatron_scheduler(*_SOURCES[request.param])
    except LookupError as e:
        pytest.skip(f"Megatron-LM {request.param}: {e}")
    monkeypatch.setitem(sys.modules, MCORE, sched)
    monkeypatch.setitem(sys.modules, MCORE_UTILS, utils)
    return sched


def theirs_schedule(sched, lens, dp, cp, mslpr):
    s = sched.DefaultDynamicCPScheduler(max_seqlen_per_dp_cp_rank=mslpr, cp_size=cp, dp_size=dp,
                                        microbatch_group_size_per_vp_stage=None)
    return s.get_groups_and_subsamples(list(enumerate(lens)))


def rl_lengths(rng, n, short=(16, 600), long=(600, 8000), p_long=0.2):
    """RL-like lengths: mostly short responses, some long ones, a few repeated lengths."""
    out = []
    for _ in range(n):
        if out and rng.random() < 0.1:
            out.append(rng.choice(out))
        else:
            lo, hi = long if rng.random() < p_long else short
            out.append(rng.randint(lo, hi))
    return out


CONFIGS = [(1, 2), (2, 1), (2, 2), (4, 1), (2, 4), (8, 1), (3, 2), (1, 6), (4, 4), (16, 1)]


# --------------------------------------------------------------------------------------------
# The schedule.


@pytest.mark.parametrize("dp,cp", CONFIGS)
def test_schedule_matches_megatron(megatron, dp, cp):
    rng = random.Random(dp * 100 + cp)
    for trial in range(12):
        total = dp * cp
        mslpr = rng.choice([512, 1000, 2048, 4096, 8192])
        n = rng.choice([1, 2, total, 7, 33, 128])
        lens = rl_lengths(rng, n)
        lens = [min(x, mslpr * total) for x in lens]
        try:
            theirs = theirs_schedule(megatron, lens, dp, cp, mslpr)
        except AssertionError as e:
            with pytest.raises(AssertionError) as info:
                dcp.dynamic_cp_schedule(lens, dp, cp, mslpr)
            assert str(info.value) == str(e)
            continue
        assert dcp.dynamic_cp_schedule(lens, dp, cp, mslpr) == theirs, (lens, dp, cp, mslpr)


def test_schedule_matches_megatron_edges(megatron):
    cases = [
        ([100, 90], 2, 2, 100), ([5] * 9, 4, 1, 5), ([1], 8, 1, 1), ([64, 64, 64, 64], 2, 2, 16),
        ([300, 1, 1, 1, 1, 1, 1, 1], 4, 2, 100), ([17, 33, 65, 129, 257], 8, 1, 32), ([8] * 64, 4, 2, 8),
        ([1000, 999, 998, 10, 9, 8, 7, 6, 5], 3, 2, 250), ([7, 7, 7], 6, 1, 2),  # CP 4 on 6 ranks
        ([50, 40, 30, 20, 10], 7, 1, 20), ([2**20 + 1, 3], 4, 1, 2**18),
    ]
    rng = random.Random(5)
    cases += [([rng.randint(1, 64) for _ in range(rng.randint(1, 40))], *rng.choice(CONFIGS), rng.choice([8, 16, 64]))
              for _ in range(200)]
    for lens, dp, cp, mslpr in cases:
        lens = [min(x, mslpr * dp * cp) for x in lens]
        try:
            theirs = theirs_schedule(megatron, lens, dp, cp, mslpr)
        except (AssertionError, IndexError) as e:
            with pytest.raises(type(e)) as info:
                dcp.dynamic_cp_schedule(lens, dp, cp, mslpr)
            assert str(info.value) == str(e), (lens, dp, cp, mslpr)
            continue
        assert dcp.dynamic_cp_schedule(lens, dp, cp, mslpr) == theirs, (lens, dp, cp, mslpr)


# Megatron's schedules for a few batches (from d2e7ec5b's algorithm; checked against it above
# when a checkout is present): (lengths, dp, cp, max_seqlen_per_dp_cp_rank) -> micro-batches.
PINNED = [
    # a sequence on its own rank, the second one on the next; the two empty ranks are filled by
    # doubling each group in turn
    (([100, 90], 2, 2, 100), [[[0], [0], [1], [1]]]),
    # one sequence, more ranks than it needs: the group doubles until it spans every rank
    (([1], 8, 1, 1), [[[0]] * 8]),
]


@pytest.mark.parametrize("case,expected", PINNED)
def test_schedule_pinned(case, expected):
    assert dcp.dynamic_cp_schedule(*case) == expected


def test_schedule_pinned_matches_megatron(megatron):
    for case, expected in PINNED:
        assert theirs_schedule(megatron, *case) == expected


def test_schedule_properties():
    """Every sample once per batch; ranks of a group hold equal lists, longest first."""
    rng = random.Random(1)
    for dp, cp in CONFIGS:
        lens = rl_lengths(rng, 64)
        mslpr = 8192
        seen = []
        for mb in dcp.dynamic_cp_schedule(lens, dp, cp, mslpr):
            assert len(mb) == dp * cp and all(mb)
            groups = {tuple(ids) for ids in mb}
            for ids in groups:
                assert [lens[i] for i in ids] == sorted((lens[i] for i in ids), reverse=True)
            seen += [i for ids in groups for i in ids]
        assert sorted(seen) == list(range(len(lens)))


def test_schedule_too_long_sequence():
    with pytest.raises(AssertionError, match=r"^Sequence length 700 requires CP size 8, but only 6 DPxCP ranks"):
        dcp.dynamic_cp_schedule([700, 3], 3, 2, 100)


# --------------------------------------------------------------------------------------------
# The adapter.


@pytest.fixture(scope="module")
def td():
    return pytest.importorskip("tensordict", reason="needs tensordict (verl's dependency, not installed): "
                               "verl's DynamicCPScheduler schedules TensorDicts")


class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def verl_tu(td):
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    fns = verl_stubs.load_verl_functions("utils/tensordict_utils.py", [
        "index_select_tensor_dict", "nested_tensor_from_tensor_list", "assign_non_tensor_data",
        "get_non_tensor_data", "unwrap_non_tensor_data"],
        {"TensorDict": td.TensorDict, "NonTensorData": NonTensorData, "NonTensorStack": NonTensorStack})
    return types.SimpleNamespace(**fns)


def load_verl_dcp_module():
    """verl's dynamic_cp_scheduler module (the installed verl's file, its definitions only: its
    imports of verl's packages are not run), or LookupError / ImportError saying why not."""
    import tensordict

    path = os.path.join(verl_stubs._verl_root(), "utils", "dynamic_cp_scheduler.py")
    if not os.path.exists(path):
        raise LookupError(f"this verl has no {path}")
    with open(path) as f:
        text = f.read()
    ns = {"math": math, "torch": torch, "TensorDict": tensordict.TensorDict, "tu": verl_tu(tensordict),
          "append_to_dict": None}
    return _module_from(OWNER, text, lambda n: isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign)), ns)


@pytest.fixture
def verl_mod(td, monkeypatch):
    """verl's module (load_verl_dcp_module), registered as verl.utils.dynamic_cp_scheduler (so the
    drop-in looks the Megatron class up through it, as once installed)."""
    try:
        mod = load_verl_dcp_module()
    except LookupError as e:
        pytest.skip(str(e))
    monkeypatch.setitem(sys.modules, OWNER, mod)
    return mod


def make_batch(td, lens, seed=0, extra=True, holes=False):
    from tensordict.tensorclass import NonTensorData

    g = torch.Generator().manual_seed(seed)
    fields = {
        "input_ids": torch.nested.as_nested_tensor([torch.randint(0, 1000, (n,), generator=g) for n in lens],
                                                   layout=torch.jagged),
        "sample": torch.arange(len(lens)),
    }
    if extra:
        fields["routes"] = torch.nested.as_nested_tensor(
            [torch.randint(0, 64, (n, 3, 2), generator=g, dtype=torch.int16) for n in lens], layout=torch.jagged)
        fields["scores"] = torch.randn(len(lens), 4, generator=g)
    if holes:
        base = torch.randn(len(lens), max(lens) + 2, generator=g)
        fields["holey"] = torch.nested.narrow(base, 1, torch.ones(len(lens), dtype=torch.int64),
                                              torch.tensor(lens), layout=torch.jagged)
    batch = td.TensorDict(fields, batch_size=[len(lens)])
    if extra:
        batch["temperature"] = NonTensorData(0.7)
    return batch


def empty_batch(td):
    ids = torch.nested.nested_tensor_from_jagged(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    return td.TensorDict({"input_ids": ids}, batch_size=[0])


def _same_value(a, b, where):
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor) and a.is_nested:
        assert a.layout == b.layout and a.dtype == b.dtype and a.device == b.device, where
        assert a._ragged_idx == b._ragged_idx and a.shape[0] == b.shape[0], where
        assert torch.equal(a.offsets(), b.offsets()) and a.offsets().dtype == b.offsets().dtype, where
        assert (a._lengths is None) == (b._lengths is None), where
        assert torch.equal(a.values(), b.values()), where
        assert a._metadata_cache.keys() == b._metadata_cache.keys(), where
        if "max_seqlen" in a._metadata_cache:
            assert a._max_seqlen == b._max_seqlen and a._min_seqlen == b._min_seqlen, where
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, (NonTensorData, NonTensorStack)):
        _same_value(a.tolist() if isinstance(a, NonTensorStack) else a.data,
                    b.tolist() if isinstance(b, NonTensorStack) else b.data, where)
        assert a.batch_size == b.batch_size, where
    else:
        assert a == b and type(a) is type(b), where


def same_micro_batches(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a.batch_size == b.batch_size, i
        assert list(a.keys()) == list(b.keys()), (i, list(a.keys()), list(b.keys()))
        for key in a.keys():
            _same_value(a.get(key), b.get(key), (i, key))


SCHEDULE_CASES = [
    # (lengths, dp, cp, max_seqlen_per_dp_cp_rank, tp, cp_layout, min_local_rows)
    ([7, 3, 5], 2, 2, 4, 1, "zigzag", None),
    ([100, 90], 2, 2, 100, 2, "contiguous", None),
    ([37, 5, 64, 1, 12, 12, 90, 33], 2, 2, 32, 1, "zigzag", 8),
    ([37, 5, 64, 1, 12, 12, 90, 33], 4, 1, 64, 2, "contiguous", 3),
    ([3] * 5, 8, 1, 4, 1, "zigzag", None),
    ([250, 17, 17, 400, 9, 130, 64, 2], 2, 4, 128, 1, "zigzag", None),
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_adapter_matches_verl(megatron, verl_mod, td, case):
    lens, dp, cp, mslpr, tp, layout, mlr = case
    for holes in (False, True):
        batch = make_batch(td, lens, seed=len(lens), holes=holes)
        ours_s = dcp.DynamicCPScheduler(mslpr, dp, cp)
        theirs_s = verl_mod.DynamicCPScheduler(mslpr, dp, cp)
        for rank in range(dp * cp):
            kw = dict(tp_size=tp, cp_layout=layout, min_local_rows=mlr)
            try:
                theirs = theirs_s.schedule(batch, FakeGroup(dp * cp, rank), **kw)
            except RuntimeError as e:  # a schedule verl cannot use on this rank (misaligned group)
                with pytest.raises(RuntimeError) as info:
                    ours_s.schedule(batch, FakeGroup(dp * cp, rank), **kw)
                assert str(info.value) == str(e)
                continue
            same_micro_batches(ours_s.schedule(batch, FakeGroup(dp * cp, rank), **kw), theirs)


def test_adapter_uses_megatron_directly_without_verl_module(megatron, td, monkeypatch):
    """Without verl's module loaded, the drop-in imports Megatron's class itself; the schedule
    comes from dynamic_cp_schedule (checked: the Megatron class is never asked)."""
    monkeypatch.delitem(sys.modules, OWNER, raising=False)
    monkeypatch.setattr(megatron.DefaultDynamicCPScheduler, "get_groups_and_subsamples",
                        lambda self, s: pytest.fail("the Megatron algorithm should not run"))
    monkeypatch.setattr(megatron.DefaultDynamicCPScheduler.get_groups_and_subsamples, "__qualname__",
                        "DefaultDynamicCPScheduler.get_groups_and_subsamples", raising=False)
    monkeypatch.setattr(megatron.DefaultDynamicCPScheduler.get_groups_and_subsamples, "__module__", MCORE,
                        raising=False)
    out = dcp.DynamicCPScheduler(100, 2, 2).schedule(make_batch(td, [100, 90]), FakeGroup(4, 3), tp_size=1)
    assert [mb["sample"].tolist() for mb in out] == [[1]]


class _StandIn:
    """verl's tests' stand-in scheduler: checks its arguments, returns a fixed assignment."""

    assignment = [[[0], [0], [1], [2]]]

    def __init__(self, **kwargs):
        assert kwargs == {"max_seqlen_per_dp_cp_rank": 4, "cp_size": 2, "dp_size": 2,
                          "microbatch_group_size_per_vp_stage": None}

    def get_groups_and_subsamples(self, samples):
        assert samples == [(0, 7), (1, 3), (2, 5)]
        return self.assignment


def _stand_in_owner(monkeypatch, cls):
    owner = types.ModuleType(OWNER)
    owner.get_megatron_dynamic_cp_scheduler_cls = lambda: cls
    monkeypatch.setitem(sys.modules, OWNER, owner)


def test_adapter_verl_documented_assignment(td, monkeypatch):
    """verl's test_schedule_adapts_mcore_assignments: per rank (sample ids, local CP size, leader,
    real tokens of its padding mask)."""
    _stand_in_owner(monkeypatch, _StandIn)
    expected = [([0], 2, True, 3), ([0], 2, False, 4), ([1], 1, True, 3), ([2], 1, True, 5)]
    scheduler = dcp.DynamicCPScheduler(max_seqlen_per_dp_cp_rank=4, dp_size=2, cp_size=2)
    for rank, (ids, cp, leader, tokens) in enumerate(expected):
        (mb,) = scheduler.schedule(make_batch(td, [7, 3, 5]), FakeGroup(4, rank), tp_size=1)
        assert mb["sample"].tolist() == ids
        assert mb.get("local_cp_size").data == cp
        assert mb.get(dcp.DCP_SAMPLE_IDS).data == ids
        assert mb.get(dcp.DCP_GROUP_LEADER).data is leader
        assert mb.get(dcp.DCP_LOCAL_NUM_TOKENS).data == tokens
        mask = mb.get(dcp.DCP_PADDING_MASK).data
        assert mask.dtype == torch.bool and mask.numel() - int(mask.sum()) == tokens
        assert mb.batch_size == torch.Size([len(ids)])
        assert [s.tolist() for s in mb["input_ids"].unbind()] == [
            s.tolist() for s in make_batch(td, [7, 3, 5])["input_ids"].unbind()[ids[0] : ids[0] + 1]]


def test_adapter_errors(td, monkeypatch):
    """verl's errors, word for word (verl's tests match parts of these)."""
    with pytest.raises(ValueError, match=r"^Dynamic CP scheduler sizes must be positive integers$"):
        dcp.DynamicCPScheduler(0, 1, 1)
    for bad in ((4, 2, 2.0), (4, True, 2), (-1, 1, 1)):
        with pytest.raises(ValueError, match="positive integers"):
            dcp.DynamicCPScheduler(*bad)
    s = dcp.DynamicCPScheduler(4, 2, 2)
    with pytest.raises(ValueError, match=r"^A sequence with 100 tokens needs at least 25 ranks at "
                       r"max_seqlen_per_dp_cp_rank=4, but the DPxCP group only has 4 ranks\. Increase"):
        s.schedule(make_batch(td, [100]), FakeGroup(4), tp_size=1)
    dense = td.TensorDict({"input_ids": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(ValueError, match=r"^Dynamic CP requires input_ids to be a jagged NestedTensor$"):
        s.schedule(dense, FakeGroup(4), tp_size=1)
    with pytest.raises(ValueError, match=r"^Dynamic CP cannot schedule an empty batch$"):
        s.schedule(empty_batch(td), FakeGroup(4), tp_size=1)
    with pytest.raises(ValueError, match=r"^DPxCP group size 8 does not match dp_size \* cp_size \(2 \* 2\)$"):
        s.schedule(make_batch(td, [3]), FakeGroup(8), tp_size=1)
    with pytest.raises(ValueError, match=r"^Dynamic CP requires every input sequence to contain at least one token$"):
        s.schedule(make_batch(td, [3, 0, 2], extra=False), FakeGroup(4), tp_size=1)

    class Unaligned(_StandIn):
        assignment = [[[0], [1], [1], [2]]]

        def __init__(self, **kwargs):
            pass

        def get_groups_and_subsamples(self, samples):
            return self.assignment

    _stand_in_owner(monkeypatch, Unaligned)
    # Every rank raises, not only the bad group's members: the ranks whose own group is fine would
    # otherwise go on to the micro-batch's collectives and wait there for the others.
    for rank in range(4):
        with pytest.raises(RuntimeError, match=r"^Dynamic CP group \[1, 2\] is not aligned to its size$"):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4, rank=rank), tp_size=1)
    Unaligned.assignment = [[[0], [1], [0], [2]]]
    for rank in range(4):
        with pytest.raises(RuntimeError, match=r"^Dynamic CP group members must be contiguous, got \[0, 2\]$"):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4, rank=rank), tp_size=1)
    # Two bad groups: a member of either gets its own group's error (verl's), the others the first one's.
    Unaligned.assignment = [[[0], [1], [0], [1]]]
    for rank, bad in ((0, "0, 2"), (1, "1, 3"), (2, "0, 2"), (3, "1, 3")):
        with pytest.raises(RuntimeError, match=rf"^Dynamic CP group members must be contiguous, got \[{bad}\]$"):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4, rank=rank), tp_size=1)
    # A bad group in the first micro-batch and another in the second: each rank raises what verl's
    # scheduler raises where it raises (its own group, micro-batch by micro-batch; a bad layout
    # first where the rank's own groups are fine), the others the first bad group's error.
    Unaligned.assignment = [[[0], [1], [1], [2]], [[0], [1], [0], [2]]]
    for rank, msg in ((0, r"members must be contiguous, got \[0, 2\]"), (1, r"group \[1, 2\] is not aligned"),
                      (2, r"group \[1, 2\] is not aligned"), (3, r"group \[1, 2\] is not aligned")):
        with pytest.raises(RuntimeError, match=msg):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4, rank=rank), tp_size=1)
    Unaligned.assignment = [[[0], [1], [1], [2]]]
    for rank, exc in ((0, ValueError), (1, RuntimeError), (3, ValueError)):
        with pytest.raises(exc):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4, rank=rank), tp_size=1, cp_layout="interleaved")
    for bad in ([[[0], [1], [], [2]]], [[[0], [1], [2]]]):
        Unaligned.assignment = bad
        with pytest.raises(RuntimeError, match=r"^Megatron-Core Dynamic CP must assign all 4 ranks in every micro-batch$"):
            s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4), tp_size=1)
    Unaligned.assignment = [[[0], [0], [1], [2]]]
    with pytest.raises(ValueError, match=r"^Unsupported context parallel layout: interleaved$"):
        s.schedule(make_batch(td, [3, 5, 7]), FakeGroup(4), tp_size=1, cp_layout="interleaved")


def test_adapter_errors_match_verl(megatron, verl_mod, td):
    cases = [
        ((4, 2, 2), make_batch(td, [100]), FakeGroup(4), {}),
        ((4, 2, 2), empty_batch(td), FakeGroup(4), {}),
        ((4, 2, 2), make_batch(td, [3]), FakeGroup(8), {}),
        ((4, 2, 2), make_batch(td, [3, 0, 2], extra=False), FakeGroup(4), {}),
        ((4, 2, 2), td.TensorDict({"input_ids": torch.zeros(2, 3)}, batch_size=[2]), FakeGroup(4), {}),
        ((100, 3, 2), make_batch(td, [700, 3]), FakeGroup(6), {}),  # Megatron's assertion: CP 8 > 6 ranks
        ((4, 2, 2), make_batch(td, [3, 5, 7]), FakeGroup(4), {"cp_layout": "interleaved"}),
        ((4, 2, 2), make_batch(td, [3, 5, 7]), FakeGroup(4), {"min_local_rows": 0}),
    ]
    for args, batch, group, kw in cases:
        errors = []
        for cls in (dcp.DynamicCPScheduler, verl_mod.DynamicCPScheduler):
            with pytest.raises(Exception) as info:  # noqa: PT011  (compared below)
                cls(*args).schedule(batch, group, tp_size=1, **kw)
            errors.append(info.value)
        assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), errors


def test_adapter_without_megatron_class(td, monkeypatch):
    """megatron-core without DefaultDynamicCPScheduler (0.16.1): verl's RuntimeError and text, also
    an ImportError naming the class; raised when a batch is scheduled, not before."""
    monkeypatch.delitem(sys.modules, OWNER, raising=False)
    stand_in = types.ModuleType(MCORE)  # a data_schedule module without the class (as in 0.16.1)
    monkeypatch.setitem(sys.modules, MCORE, stand_in)
    s = dcp.DynamicCPScheduler(4, 2, 2)
    with pytest.raises(RuntimeError) as info:
        s.schedule(make_batch(td, [3, 5]), FakeGroup(4), tp_size=1)
    assert isinstance(info.value, ImportError)
    assert str(info.value).startswith(dcp._MISSING)
    assert "DefaultDynamicCPScheduler" in str(info.value)


def test_adapter_verl_error_without_megatron_class(verl_mod, td, monkeypatch):
    """verl's module loaded: its own lookup runs (and raises verl's error unchanged)."""
    monkeypatch.setitem(sys.modules, MCORE, types.ModuleType(MCORE))
    errors = []
    for cls in (dcp.DynamicCPScheduler, verl_mod.DynamicCPScheduler):
        with pytest.raises(RuntimeError) as info:
            cls(4, 2, 2).schedule(make_batch(td, [3, 5]), FakeGroup(4), tp_size=1)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])


def test_install_registers_scheduler():
    from verl_ops.integrations import verl as vi

    assert vi._all_drop_ins()["DynamicCPScheduler"] is dcp.DynamicCPScheduler
    assert vi._OWNERS["DynamicCPScheduler"] == OWNER


def test_install_patches_stand_in_owner(monkeypatch):
    """install() swaps the class into verl's module (and modules that imported it by name)."""
    from verl_ops.integrations import verl as vi

    class VerlScheduler:
        def __init__(self, max_seqlen_per_dp_cp_rank, dp_size, cp_size):
            pass

    def verl_collect(output_lst, batch_size, dcp_group, include_model_output=True):
        pass

    owner = types.ModuleType(OWNER)
    owner.DynamicCPScheduler = VerlScheduler
    owner.postprocess_dynamic_cp_batch = verl_collect
    user = types.ModuleType("verl.workers.engine.megatron.transformer_impl")
    user.DynamicCPScheduler = VerlScheduler
    user.postprocess_dynamic_cp_batch = verl_collect
    monkeypatch.setitem(sys.modules, OWNER, owner)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    try:
        rep = vi.install(report=True)
        assert f"{OWNER}.DynamicCPScheduler" in rep["patched"]
        assert f"{OWNER}.postprocess_dynamic_cp_batch" in rep["patched"]
        assert owner.DynamicCPScheduler is dcp.DynamicCPScheduler and user.DynamicCPScheduler is dcp.DynamicCPScheduler
        assert owner.postprocess_dynamic_cp_batch is dcp.postprocess_dynamic_cp_batch
        assert user.postprocess_dynamic_cp_batch is dcp.postprocess_dynamic_cp_batch
    finally:
        vi.uninstall()
    assert owner.DynamicCPScheduler is VerlScheduler and user.DynamicCPScheduler is VerlScheduler
    assert owner.postprocess_dynamic_cp_batch is verl_collect and user.postprocess_dynamic_cp_batch is verl_collect
