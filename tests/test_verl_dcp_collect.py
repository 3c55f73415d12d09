"""verl_ops.integrations.verl_dcp.postprocess_dynamic_cp_batch against verl's own function (the
installed verl's ``verl/utils/dynamic_cp_scheduler.py``, read from its file), over gloo with 2 and 4
ranks: the same model outputs (values, dtypes, nested offsets, devices), losses, metrics and errors
on every rank, for group leaders holding several micro-batches, nested and dense outputs of several
dtypes, empty samples, and ranks that do not keep the model output (include_model_output=False).
"""

from __future__ import annotations

import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from _dist import dist_params, dist_runner

LEADER, IDS = "_dcp_group_leader", "_dcp_sample_ids"
OWNER = "verl.utils.dynamic_cp_scheduler"


class _Metric:  # verl.utils.metric.Metric's place in append_to_dict (no value here is one)
    pass


def verl_functions():
    """verl's postprocess_dynamic_cp_batch (with its _detach_model_output and append_to_dict), from
    the installed verl's files; LookupError when verl lacks them."""
    append = verl_stubs.load_verl_functions("utils/py_functional.py", ["append_to_dict"], {"Metric": _Metric})
    ns = {"DCP_GROUP_LEADER": LEADER, "DCP_SAMPLE_IDS": IDS, **append}
    fns = verl_stubs.load_verl_functions("utils/dynamic_cp_scheduler.py",
                                         ["_detach_model_output", "postprocess_dynamic_cp_batch"], ns)
    return fns["postprocess_dynamic_cp_batch"], append["append_to_dict"]


def _owner_module(append_to_dict):
    """verl's module as the drop-in sees it once installed (its append_to_dict)."""
    mod = types.ModuleType(OWNER)
    mod.append_to_dict = append_to_dict
    sys.modules[OWNER] = mod


def _outputs(rank, world, seed, batch_size, mb_groups):
    """This rank's output list: for each micro-batch, the groups (lists of ranks) and the sample ids
    each group holds; every member of a group has outputs, the first is the leader."""
    rng = random.Random(seed * 1000 + rank)
    out = []
    for mb, groups in enumerate(mb_groups):
        for g, (ranks, ids) in enumerate(groups):
            if rank not in ranks:
                continue
            lens = [random.Random(seed * 7919 + s).choice([0, 1, 3, 8, 17]) for s in ids]

            def seq(s, n, feat=(), dtype=torch.float32):
                gen = torch.Generator().manual_seed(seed * 104729 + s * 31 + len(feat))
                return (torch.randn(n, *feat, generator=gen) * 100).to(dtype)

            model_output = {
                "log_probs": torch.nested.as_nested_tensor([seq(s, n) for s, n in zip(ids, lens)], layout=torch.jagged),
                "entropy": torch.nested.as_nested_tensor([seq(s, n, dtype=torch.bfloat16) for s, n in zip(ids, lens)],
                                                         layout=torch.jagged),
                "routes": torch.nested.as_nested_tensor([seq(s, n, (3,), torch.int16) for s, n in zip(ids, lens)],
                                                        layout=torch.jagged),
                "values": torch.stack([seq(s, 5) for s in ids]) if ids else torch.zeros(0, 5),
                # a nested tensor with holes (per-sample windows of a padded buffer: verl's unbind path)
                "window": torch.nested.narrow(torch.stack([seq(s, 20) for s in ids]), 1,
                                              torch.tensor([s % 3 for s in ids]),
                                              torch.tensor([min(n, 17) for n in lens]), layout=torch.jagged),
                "pairs": torch.stack([seq(s, 2) for s in ids]).t().contiguous().t(),  # non-contiguous [n, 2]
            }
            out.append({
                LEADER: rank == ranks[0],
                IDS: list(ids),
                "model_output": model_output,
                "loss": torch.tensor(float(rng.randint(0, 99))),
                "metrics": {"mb": mb, "group": [g, rank], f"only_{mb % 2}": 1.5},
            })
    return out


def _same(a, b, path="out"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device == b.device and a.is_nested == b.is_nested, path
        if a.is_nested:
            assert torch.equal(a.offsets(), b.offsets()), path
            assert torch.equal(a.values(), b.values()), path
        else:
            assert a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


def _run_both(rank, world, outputs, batch_size, group, include):
    from verl_ops.integrations import verl_dcp

    theirs_fn, append = verl_functions()
    _owner_module(append)
    results = []
    for fn in (theirs_fn, verl_dcp.postprocess_dynamic_cp_batch):
        try:
            results.append(("ok", fn(outputs, batch_size, group, include_model_output=include)))
        except Exception as e:  # noqa: BLE001 (compared below)
            results.append(("error", e))
    return results


def check_collect(rank, world, seed):
    import torch.distributed as dist

    group = dist.group.WORLD
    # micro-batches: (ranks of each group, the samples it holds)
    if world == 2:
        mbs = [[([0, 1], [3, 0])], [([0], [1]), ([1], [4, 2])], [([1, 0], [5])]]
        batch_size = 6
    else:
        mbs = [[([0, 1], [3, 0]), ([2, 3], [6])], [([0, 1, 2, 3], [1, 7, 2])], [([3], [4]), ([1], [5]), ([0], [8])]]
        batch_size = 9
    outputs = _outputs(rank, world, seed, batch_size, mbs)
    if rank == 1:  # lazily conjugated / negated views on one rank: their values, not their storage
        for o in outputs:
            if o[LEADER]:
                n = len(o[IDS])
                o["model_output"]["z"] = (torch.arange(n * 2.0).to(torch.complex64) * (1 + 2j)).view(n, 2).conj()
                o["model_output"]["neg"] = torch._neg_view(torch.arange(n * 3, dtype=torch.float32).view(n, 3))
    else:
        for o in outputs:
            if o[LEADER]:
                n = len(o[IDS])
                o["model_output"]["z"] = torch.arange(n * 2.0).to(torch.complex64).view(n, 2)
                o["model_output"]["neg"] = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    for include in (True, rank % 2 == 0):
        (k1, theirs), (k2, ours) = _run_both(rank, world, outputs, batch_size, group, include)
        assert k1 == k2 == "ok", (theirs, ours)
        _same(ours, theirs)
        assert set(ours["model_output"]) == ({"log_probs", "entropy", "routes", "values", "window", "pairs", "z",
                                              "neg"} if include else set())
    # a sample collected twice, or one missing: verl's RuntimeError, on every rank, both ways
    for bad in ([[([0], [0, 1])], [([world - 1], [1])]] + mbs[1:], mbs[:1]):
        outputs = _outputs(rank, world, seed, batch_size, bad)
        (k1, theirs), (k2, ours) = _run_both(rank, world, outputs, batch_size, group, True)
        assert k1 == k2 == "error" and type(ours) is type(theirs) is RuntimeError, (theirs, ours)
        assert str(ours) == str(theirs)
        assert "must contain each sample once" in str(ours)
    return True


def check_bad_output_raises_everywhere(rank, world):
    """A leader's non-tensor output: verl's TypeError on that rank (verl's other ranks would wait in
    its all_gather_object); the drop-in's other ranks raise a RuntimeError naming it."""
    import torch.distributed as dist

    from verl_ops.integrations import verl_dcp

    _, append = verl_functions()
    _owner_module(append)
    outputs = [{LEADER: True, IDS: [rank], "model_output": {"log_probs": torch.zeros(1, 2)}, "loss": None, "metrics": {}}]
    if rank == 1:
        outputs[0]["model_output"]["bad"] = [1.0]
    try:
        verl_dcp.postprocess_dynamic_cp_batch(outputs, world, dist.group.WORLD)
    except TypeError as e:
        assert rank == 1 and str(e) == "Dynamic CP model output 'bad' must be a tensor, got list", e
    except RuntimeError as e:
        assert rank != 1 and "rank 1" in str(e) and "must be a tensor" in str(e), e
    else:
        raise AssertionError("no error")
    # an output verl's own unbind rejects (0-d): verl's exception on that rank, RuntimeError elsewhere
    detach = verl_stubs.load_verl_functions("utils/dynamic_cp_scheduler.py", ["_detach_model_output"])
    try:
        detach["_detach_model_output"]({"x": torch.tensor(1.0)}, [0])
    except Exception as e:  # noqa: BLE001
        expected = e
    outputs = [{LEADER: True, IDS: [rank], "model_output": {"x": torch.tensor(1.0) if rank == 0 else torch.zeros(1)},
                "loss": None, "metrics": {}}]
    try:
        verl_dcp.postprocess_dynamic_cp_batch(outputs, world, dist.group.WORLD)
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            assert type(e) is type(expected) and str(e) == str(expected), (e, expected)
        else:
            assert type(e) is RuntimeError and "rank 0" in str(e), e
    else:
        raise AssertionError("no error")
    # offsets that do not tile the values: verl's unbind error on that rank (the drop-in must not
    # read past the output into the next one), RuntimeError elsewhere
    vals = torch.arange(4.0)
    bad_nt = torch.nested.nested_tensor_from_jagged(vals, torch.tensor([0, 8]))
    try:
        detach["_detach_model_output"]({"x": bad_nt}, [0])
    except Exception as e:  # noqa: BLE001
        expected = e
    outputs = [{LEADER: True, IDS: [rank], "model_output": {
        "x": bad_nt if rank == world - 1 else torch.nested.nested_tensor_from_jagged(vals, torch.tensor([0, 4])),
        "y": torch.ones(1, 4)}, "loss": None, "metrics": {}}]
    try:
        verl_dcp.postprocess_dynamic_cp_batch(outputs, world, dist.group.WORLD)
    except Exception as e:  # noqa: BLE001
        if rank == world - 1:
            assert type(e) is type(expected) and str(e) == str(expected), (e, expected)
        else:
            assert type(e) is RuntimeError and f"rank {world - 1}" in str(e), e
    else:
        raise AssertionError("no error")
    # and the group still works after it (nobody is left inside a collective)
    outputs = [{LEADER: True, IDS: [rank], "model_output": {"x": torch.full((1, 2), float(rank))}, "loss": None,
                "metrics": {}}]
    res = verl_dcp.postprocess_dynamic_cp_batch(outputs, world, dist.group.WORLD)
    x = res["model_output"]["x"]  # sample s: rank s's [2] row
    assert torch.equal(x.values(), torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    assert torch.equal(x.offsets(), torch.arange(0, 2 * world + 1, 2))
    return True


@pytest.fixture(params=dist_params(("gloo",), (2, 4)))
def dist_run(request):
    run = dist_runner(request, "test_verl_dcp_collect", pass_backend=False)
    try:
        verl_functions()
    except LookupError as e:
        pytest.skip(str(e))
    return run


@pytest.mark.parametrize("seed", [0, 1])
def test_collect_matches_verl(dist_run, seed):
    assert dist_run("check_collect", seed) == [True] * dist_run.world


def test_bad_output_raises_on_every_rank(dist_run):
    assert dist_run("check_bad_output_raises_everywhere") == [True] * dist_run.world


@pytest.mark.parametrize("backend,output_device,want", [
    ("gloo", None, "cpu"),
    ("gloo", "cpu", "cpu"),
    ("cpu:gloo,cuda:nccl", "cuda", "cuda"),  # verl's groups: the bytes go over NCCL when there is a GPU
    ("nccl", "cuda", "cuda"),
    ("xccl", "meta", "meta"),  # another device backend: the outputs' device
    ("xccl", None, "cpu"),
])
def test_comm_device(monkeypatch, backend, output_device, want):
    from verl_ops.integrations import verl_dcp

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dev = verl_dcp._comm_device(object(), None if output_device is None else torch.device(output_device))
    assert dev.type == want
