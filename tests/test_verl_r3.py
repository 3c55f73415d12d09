"""verl_ops.integrations.verl_r3: the local router padding mask and the R3 replay mask / route
alignment, against verl's own functions (read from the installed verl 0.9.1 at run time, skipped
when verl is absent) and against the project's own layout (docs/layout.md#pack: valid rows of a pack)."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from conftest import DEVICE_PARAMS

import verl_ops
from verl_ops.integrations import verl_r3 as r3


@pytest.fixture(scope="module")
def verl_fns():
    try:
        fns = verl_stubs.load_verl_functions("utils/dynamic_cp_scheduler.py", ["_local_padding_mask"])
        fns.update(verl_stubs.load_verl_functions(
            "utils/megatron/router_replay_utils.py", ["build_r3_replay_mask", "align_r3_router_replay_data"]))
    except LookupError as e:
        pytest.skip(str(e))
    return fns


def raises_like(fn_a, fn_b, *args, **kwargs):
    """Both calls raise the same exception type with the same message."""
    errors = []
    for fn in (fn_a, fn_b):
        with pytest.raises(Exception) as info:  # noqa: PT011  (compared below)
            fn(*args, **kwargs)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), errors


MASK_BATCHES = [[7, 1, 12, 5], [0, 3, 0], [1], [33, 2, 17, 64, 9], [16, 16]]


@pytest.mark.parametrize("cp_layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_padding_mask_matches_verl(verl_fns, cp_layout, tp, cp):
    theirs_fn = verl_fns["_local_padding_mask"]
    for lens in MASK_BATCHES:
        for min_local_rows in (None, 1, 40, 97):
            for rank in range(cp):
                kw = dict(cp_size=cp, cp_rank=rank, tp_size=tp, cp_layout=cp_layout, min_local_rows=min_local_rows)
                theirs = theirs_fn(lens, **kw)
                ours = r3.local_padding_mask(lens, **kw)
                assert ours.dtype == theirs.dtype and ours.device == theirs.device
                assert torch.equal(ours, theirs), (lens, kw)


def test_local_padding_mask_random_matches_verl(verl_fns):
    rng = random.Random(5)
    for _ in range(200):
        lens = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 12))]
        cp, tp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        kw = dict(cp_size=cp, cp_rank=rng.randrange(cp), tp_size=tp, cp_layout=rng.choice(["zigzag", "contiguous"]),
                  min_local_rows=rng.choice([None, rng.randint(1, 500)]))
        assert torch.equal(r3.local_padding_mask(lens, **kw), verl_fns["_local_padding_mask"](lens, **kw)), (lens, kw)


def test_local_padding_mask_errors_match_verl(verl_fns):
    theirs = verl_fns["_local_padding_mask"]
    raises_like(r3.local_padding_mask, theirs, [3, 4], cp_size=2, cp_rank=0, tp_size=1, cp_layout="interleaved")
    raises_like(r3.local_padding_mask, theirs, [3, 4], cp_size=2, cp_rank=0, tp_size=1, min_local_rows=0)
    raises_like(r3.local_padding_mask, theirs, [], cp_size=2, cp_rank=0, tp_size=1)
    raises_like(r3.local_padding_mask, theirs, [], cp_size=2, cp_rank=0, tp_size=1, min_local_rows=4)


@pytest.mark.parametrize("cp_layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_padding_mask_is_the_layouts_padding(cp_layout, cp):
    """Without verl: the mask is True exactly on the padding rows of this rank's pack
    (docs/layout.md#padding-rows), for layouts whose rules are the same (no FP8, tp alignment)."""
    for lens in MASK_BATCHES:
        for tp in (1, 2):
            layout = verl_ops.ThdLayout.from_lengths(lens, tp_size=tp, cp_size=cp, cp_layout=cp_layout)
            ones = torch.ones(sum(lens), dtype=torch.bool)
            for rank in range(cp):
                valid = verl_ops.preprocess_thd(ones, layout, rank)[0]
                mask = r3.local_padding_mask(lens, cp_size=cp, cp_rank=rank, tp_size=tp, cp_layout=cp_layout)
                assert torch.equal(mask, ~valid), (lens, tp, rank)


def nested(rows, device="cpu"):
    return torch.nested.as_nested_tensor([r.to(device) for r in rows], layout=torch.jagged)


def same_nested(a, b):
    assert a.is_nested and b.is_nested
    assert a.dtype == b.dtype and a.device == b.device
    assert torch.equal(a.offsets(), b.offsets()) and a.offsets().dtype == b.offsets().dtype
    assert torch.equal(a.values(), b.values())


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_build_r3_replay_mask_matches_verl(verl_fns, device):
    g = torch.Generator().manual_seed(0)
    for lens in ([5, 1, 9, 4], [1], [3, 0, 2], [64, 31, 16]):
        ids = nested([torch.randint(0, 100, (n,), generator=g) for n in lens], device)
        for resp in (torch.ones(len(lens), 7), torch.zeros(len(lens), 7), (torch.rand(len(lens), 7, generator=g) > 0.5)):
            resp = resp.to(device)
            if any(n == 0 and r for n, r in zip(lens, (resp.sum(-1) > 0).tolist())):
                # an empty sequence with a response: verl's repeat_interleave error, and ours
                raises_like(r3.build_r3_replay_mask, verl_fns["build_r3_replay_mask"], ids, resp)
                continue
            same_nested(r3.build_r3_replay_mask(ids, resp), verl_fns["build_r3_replay_mask"](ids, resp))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("feat", [(), (3,), (2, 4)])
def test_align_r3_router_replay_data_matches_verl(verl_fns, device, feat):
    g = torch.Generator().manual_seed(1)
    for lens in ([5, 1, 9, 4], [1], [3, 0, 2], [64, 31, 16, 2]):
        ids = nested([torch.randint(0, 100, (n,), generator=g) for n in lens], device)
        rng = random.Random(sum(lens))
        route_lens = [n - 1 if n > 0 and rng.random() < 0.5 else n for n in lens]
        for dtype in (torch.int16, torch.int64, torch.float32):
            routes = nested([torch.randint(1, 60, (n, *feat), generator=g).to(dtype) for n in route_lens], device)
            same_nested(r3.align_r3_router_replay_data(routes, ids), verl_fns["align_r3_router_replay_data"](routes, ids))


def test_align_r3_router_replay_data_errors_match_verl(verl_fns):
    theirs = verl_fns["align_r3_router_replay_data"]
    ids = nested([torch.arange(n) for n in (4, 2)])
    routes = nested([torch.zeros(n, 2) for n in (4, 2)])
    raises_like(r3.align_r3_router_replay_data, theirs, routes.values(), ids)
    raises_like(r3.align_r3_router_replay_data, theirs, routes, torch.zeros(6))
    raises_like(r3.align_r3_router_replay_data, theirs, nested([torch.zeros(4, 2)]), ids)
    raises_like(r3.align_r3_router_replay_data, theirs, nested([torch.zeros(4, 2), torch.zeros(0, 2)]), ids)
    raises_like(r3.align_r3_router_replay_data, theirs, nested([torch.zeros(5, 2), torch.zeros(2, 2)]), ids)


def test_install_patches_owner_modules(verl_fns, monkeypatch):
    """install() puts the drop-ins into the verl modules that own them (here stand-ins holding
    verl's own functions) and into a module that imported them by name; uninstall() undoes it."""
    import types

    from verl_ops.integrations import verl as vi

    dcs = types.ModuleType("verl.utils.dynamic_cp_scheduler")
    dcs._local_padding_mask = verl_fns["_local_padding_mask"]
    rru = types.ModuleType("verl.utils.megatron.router_replay_utils")
    rru.build_r3_replay_mask = verl_fns["build_r3_replay_mask"]
    rru.align_r3_router_replay_data = verl_fns["align_r3_router_replay_data"]
    user = types.ModuleType("verl.workers.engine.megatron.transformer_impl")
    user.align_r3_router_replay_data = rru.align_r3_router_replay_data
    for mod in (dcs, rru, user):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    try:
        rep = vi.install(report=True)
        for name in ("verl.utils.dynamic_cp_scheduler._local_padding_mask",
                     "verl.utils.megatron.router_replay_utils.build_r3_replay_mask",
                     "verl.utils.megatron.router_replay_utils.align_r3_router_replay_data",
                     "verl.workers.engine.megatron.transformer_impl.align_r3_router_replay_data"):
            assert name in rep["patched"], (name, rep)
        assert dcs._local_padding_mask is r3.local_padding_mask
        assert user.align_r3_router_replay_data is r3.align_r3_router_replay_data
    finally:
        vi.uninstall()
    assert dcs._local_padding_mask is verl_fns["_local_padding_mask"]
    assert user.align_r3_router_replay_data is verl_fns["align_r3_router_replay_data"]


def test_align_r3_router_replay_data_with_holes_matches_verl(verl_fns):
    """Routes as a jagged view with holes (offsets plus lengths) take the row-gather path."""
    base = torch.arange(4 * 6 * 2, dtype=torch.int16).view(4, 6, 2)
    routes = torch.nested.narrow(base, 1, torch.tensor([0, 2, 0, 1]), torch.tensor([5, 1, 6, 3]), layout=torch.jagged)
    assert routes._lengths is not None
    ids = nested([torch.arange(n) for n in (6, 2, 6, 3)])
    same_nested(r3.align_r3_router_replay_data(routes, ids), verl_fns["align_r3_router_replay_data"](routes, ids))
