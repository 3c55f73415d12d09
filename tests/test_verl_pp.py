"""verl_ops.integrations.verl_pp: the pipeline-parallel router-map helpers (pp_gather,
reorder_and_merge_vpp_layers, merge_nested_router_maps), against verl's own functions (read from
the installed verl at run time, skipped when verl or megatron-core is absent), against short
references written from their documented behaviour, and, for the collective pp_gather, on gloo
process groups of 2 and 4 ranks (tests/_dist.py)."""

from __future__ import annotations

import inspect
import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from _dist import dist_params, dist_runner
from conftest import DEVICE_PARAMS

from verl_ops.integrations import verl_pp as pp

OWNER = "verl.utils.megatron.router_replay_utils"
NAMES = ["pp_gather", "reorder_and_merge_vpp_layers", "merge_nested_router_maps",
         "get_moe_num_layers_to_build", "get_num_layers_to_build", "is_moe_layer"]


def _megatron_namespace():
    """megatron-core's functions verl's module imports (pure functions of the config)."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return dict(
        inspect=inspect, get_schedule_table=get_schedule_table, is_vp_first_stage=is_vp_first_stage,
        is_vp_last_stage=is_vp_last_stage, get_transformer_layer_offset=get_transformer_layer_offset,
        TransformerConfig=object, device_name="cpu", mpu=types.SimpleNamespace(),
    )


def load_verl_pp():
    """verl's functions (the installed verl), or raise LookupError / ImportError saying why not."""
    return verl_stubs.load_verl_functions("utils/megatron/router_replay_utils.py", NAMES, _megatron_namespace())


@pytest.fixture(scope="module")
def megatron():
    pytest.importorskip("megatron.core.pipeline_parallel.schedules", reason="needs megatron-core")


@pytest.fixture(scope="module")
def verl_fns(megatron):
    try:
        return load_verl_pp()
    except LookupError as e:
        pytest.skip(str(e))


def nested(rows, device="cpu"):
    return torch.nested.as_nested_tensor([r.to(device) for r in rows], layout=torch.jagged)


def same(a, b):
    """Same kind, dtype, device, shape, values (and offsets, for nested tensors)."""
    assert a.is_nested == b.is_nested and a.dtype == b.dtype and a.device == b.device, (a, b)
    if a.is_nested:
        assert torch.equal(a.offsets(), b.offsets()) and a.offsets().dtype == b.offsets().dtype
        assert a.offsets().device == b.offsets().device
        assert torch.equal(a.values(), b.values())
    else:
        assert a.shape == b.shape and torch.equal(a, b)


def raises_like(fn_a, fn_b, *args):
    errors = []
    for fn in (fn_a, fn_b):
        with pytest.raises(Exception) as info:  # noqa: PT011  (compared below)
            fn(*args)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), errors


def routes(lengths, layers, topk=3, dtype=torch.int16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return nested([torch.randint(0, 256, (n, layers, topk), generator=g).to(dtype) for n in lengths], device)


# --------------------------------------------------------------------------------------------
# References written from the documented behaviour.


def ref_merge(router_maps):
    """Every sequence of every map, in order, int16 (jagged)."""
    seqs = [seq.to(torch.int16) for m in router_maps for seq in m.unbind()]
    return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)


def ref_schedule(num_microbatches, vpp_size, group):
    """megatron's interleaved schedule: micro-batches in groups of ``group``; each group runs every
    model chunk in turn over its micro-batches (the last group takes the remainder)."""
    table = []
    for start in range(0, num_microbatches, group):
        ids = range(start, min(start + group, num_microbatches))
        if start + group >= num_microbatches:
            ids = range(start, num_microbatches)
        table += [(mb, chunk) for chunk in range(vpp_size) for mb in ids]
    return table


def ref_reorder(maps, num_microbatches, vpp_size, group):
    """Chunk c's maps in micro-batch order, stacked; the chunks side by side along the layer dim."""
    by_chunk = {c: {} for c in range(vpp_size)}
    for m, (mb, c) in zip(maps, ref_schedule(num_microbatches, vpp_size, group)):
        by_chunk[c][mb] = m
    if maps[0].is_nested:
        per_chunk = [[seq for mb in sorted(by_chunk[c]) for seq in by_chunk[c][mb].unbind()] for c in range(vpp_size)]
        seqs = [torch.cat([per_chunk[c][i] for c in range(vpp_size)], dim=1).to(torch.int16)
                for i in range(len(per_chunk[0]))]
        return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    return torch.cat([torch.cat([by_chunk[c][mb] for mb in sorted(by_chunk[c])], 0) for c in range(vpp_size)], 2)


def ref_pp_gather(maps, split=None):
    """``maps[r]``: pipeline rank r's map. The layers side by side: rank by rank, or (``split[r][c]``:
    layers of model chunk c on rank r) chunk by chunk, each chunk rank by rank. Dense maps come back
    as int16 (their bytes), jagged ones keep their dtype and take rank 0's lengths."""
    def pieces(r, m):
        if split is None:
            return [(0, m.shape[-2 if m.is_nested else 2])]
        return [(sum(split[r][:c]), sum(split[r][: c + 1])) for c in range(len(split[r]))]

    n_chunks = 1 if split is None else len(split[0])
    order = [(c, r) for c in range(n_chunks) for r in range(len(maps))]
    if maps[0].is_nested:
        seqs = []
        for i in range(maps[0].size(0)):
            parts = [maps[r].unbind()[i][:, slice(*pieces(r, maps[r])[c])] for c, r in order]
            seqs.append(torch.cat(parts, dim=1))
        return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    int16 = [m.contiguous().view(torch.uint8).view(torch.int16) for m in maps]
    return torch.cat([int16[r][:, :, slice(*pieces(r, maps[r])[c])] for c, r in order], dim=2)


# --------------------------------------------------------------------------------------------
# merge_nested_router_maps


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_merge_nested_router_maps_matches_reference(device):
    g = random.Random(0)
    for dtype in (torch.int16, torch.int32, torch.uint8, torch.float32):
        for trial in range(6):
            maps = [routes([g.choice([0, 1, g.randint(1, 40)]) for _ in range(g.randint(1, 5))], 4, dtype=dtype,
                           seed=trial * 10 + k, device=device) for k in range(g.randint(1, 4))]
            same(pp.merge_nested_router_maps(maps), ref_merge(maps))
    dense = [torch.randint(0, 9, (3, 5, 2, 2), device=device), torch.randint(0, 9, (1, 5, 2, 2), device=device)]
    same(pp.merge_nested_router_maps(dense), ref_merge(dense))
    mixed = [routes([3, 5], 2, 2, device=device), torch.randint(0, 9, (2, 4, 2, 2), device=device)]
    same(pp.merge_nested_router_maps(mixed), ref_merge(mixed))


def test_merge_nested_router_maps_matches_verl(verl_fns):
    theirs = verl_fns["merge_nested_router_maps"]
    cases = [
        [routes([5, 1, 9], 4), routes([2], 4, seed=1), routes([0, 7], 4, seed=2)],
        [routes([4, 4], 3, dtype=torch.int64)],
        [routes([3], 2), routes([2, 6], 2, dtype=torch.float32, seed=3)],
        [torch.randint(0, 9, (2, 6, 3, 2))],
        [routes([0, 0], 2)],
        [routes([3, 3], 2), routes([3], 5)],  # rectangular rows, ragged in the layer dim: torch decides
        tuple([routes([2, 5], 3)]),
    ]
    for maps in cases:
        ours, ref = pp.merge_nested_router_maps(maps), theirs(maps)
        same(ours, ref)
        assert ours._ragged_idx == ref._ragged_idx
        assert ours._metadata_cache.keys() == ref._metadata_cache.keys()
    base = torch.arange(3 * 6 * 2 * 3, dtype=torch.int16).view(3, 6, 2, 3)
    holes = torch.nested.narrow(base, 1, torch.tensor([0, 2, 1]), torch.tensor([5, 1, 3]), layout=torch.jagged)
    same(pp.merge_nested_router_maps([holes, routes([2], 2)]), theirs([holes, routes([2], 2)]))


def test_merge_nested_router_maps_errors_match_verl(verl_fns):
    theirs = verl_fns["merge_nested_router_maps"]
    raises_like(pp.merge_nested_router_maps, theirs, [])
    raises_like(pp.merge_nested_router_maps, theirs, [[torch.zeros(2, 3)]])
    raises_like(pp.merge_nested_router_maps, theirs, [torch.zeros(4)])
    raises_like(pp.merge_nested_router_maps, theirs, [routes([2, 3], 2), routes([2, 3], 4, topk=5)])


# --------------------------------------------------------------------------------------------
# reorder_and_merge_vpp_layers

SCHEDULES = [(4, 2, 2), (5, 2, 2), (3, 3, 4), (6, 2, 3), (1, 4, 1), (4, 1, 2)]


def _chunk_maps(num_mb, vpp, group, nested_maps, device, dtype=torch.int16, seed=0):
    """One map per schedule entry: micro-batch mb has its own lengths; chunk c has c + 1 layers."""
    g = random.Random(seed)
    lens = {mb: [g.choice([1, g.randint(1, 30)]) for _ in range(g.randint(1, 3))] for mb in range(num_mb)}
    out = []
    for k, (mb, c) in enumerate(ref_schedule(num_mb, vpp, group)):
        if nested_maps:
            out.append(routes(lens[mb], c + 1, dtype=dtype, seed=seed * 100 + k, device=device))
        else:
            gen = torch.Generator().manual_seed(seed * 100 + k)
            out.append(torch.randint(0, 99, (len(lens[mb]), 7, c + 1, 2), generator=gen).to(dtype).to(device))
    return out


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("nested_maps", [True, False], ids=["jagged", "dense"])
def test_reorder_and_merge_vpp_layers_matches_reference(megatron, device, nested_maps):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for num_mb, vpp, group in SCHEDULES:
        assert get_schedule_table(num_mb, vpp, group) == ref_schedule(num_mb, vpp, group)
        for dtype in (torch.int16, torch.int32):
            maps = _chunk_maps(num_mb, vpp, group, nested_maps, device, dtype, seed=num_mb * vpp)
            same(pp.reorder_and_merge_vpp_layers(maps, num_mb, vpp, group), ref_reorder(maps, num_mb, vpp, group))


@pytest.mark.parametrize("nested_maps", [True, False], ids=["jagged", "dense"])
def test_reorder_and_merge_vpp_layers_matches_verl(verl_fns, nested_maps):
    theirs = verl_fns["reorder_and_merge_vpp_layers"]
    for num_mb, vpp, group in SCHEDULES:
        for dtype in (torch.int16, torch.int64, torch.float32):
            maps = _chunk_maps(num_mb, vpp, group, nested_maps, "cpu", dtype, seed=vpp + group)
            same(pp.reorder_and_merge_vpp_layers(maps, num_mb, vpp, group), theirs(maps, num_mb, vpp, group))
    # irregular: mixed dtypes (dense), a chunk with zero layers, a micro-batch without sequences rows
    maps = _chunk_maps(4, 2, 2, nested_maps, "cpu")
    maps[1] = maps[1].to(torch.int32) if not nested_maps else maps[1]
    same(pp.reorder_and_merge_vpp_layers(maps, 4, 2, 2), theirs(maps, 4, 2, 2))
    if nested_maps:
        zero = [routes([4, 2], 0 if c == 1 else 3, seed=k) for k, (_, c) in enumerate(ref_schedule(2, 2, 2))]
    else:
        zero = [torch.ones(2, 5, 0 if c == 1 else 3, 2, dtype=torch.int16) for _, c in ref_schedule(2, 2, 2)]
    same(pp.reorder_and_merge_vpp_layers(zero, 2, 2, 2), theirs(zero, 2, 2, 2))


def test_reorder_and_merge_vpp_layers_errors_match_verl(verl_fns):
    theirs = verl_fns["reorder_and_merge_vpp_layers"]
    maps = _chunk_maps(4, 2, 2, True, "cpu")
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, maps[:-1], 4, 2, 2)
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, maps + maps[:1], 4, 2, 2)
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, [], 0, 2, 2)
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, maps, 4, 2, 0)
    dense = _chunk_maps(4, 2, 2, False, "cpu")
    dense[2] = dense[2][:, :3]  # a micro-batch of another sequence length
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, dense, 4, 2, 2)
    jag = _chunk_maps(2, 2, 1, True, "cpu", seed=3)
    jag[1] = routes([500, 500], 2)  # chunk 1 has more rows than chunk 0
    raises_like(pp.reorder_and_merge_vpp_layers, theirs, jag, 2, 2, 1)


def test_reorder_and_merge_vpp_layers_error_text(megatron):
    """verl 0.9.1's check (verl main indexes past the end instead)."""
    with pytest.raises(RuntimeError, match=r"R2 RECORD must capture every scheduled microbatch/chunk, including "
                       r"zero-layer chunks: captured=3, expected=4"):
        pp.reorder_and_merge_vpp_layers(_chunk_maps(2, 2, 2, True, "cpu")[:3], 2, 2, 2)


# --------------------------------------------------------------------------------------------
# pp_gather: in one process (pp_size 1 and the errors before any collective)


def test_pp_gather_single_stage_returns_input():
    x = torch.ones(2, 3, 4, 2, dtype=torch.int16)
    cfg = types.SimpleNamespace(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None)
    assert pp.pp_gather(x, cfg) is x
    j = routes([2, 3], 2)
    assert pp.pp_gather(j, cfg) is j


def test_pp_gather_group_size_mismatch(monkeypatch):
    cfg = verl_stubs.install_megatron_stub(monkeypatch)
    del cfg
    ps = sys.modules["megatron.core.parallel_state"]
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: "pp-group", raising=False)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    tf = types.SimpleNamespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=None)
    with pytest.raises(RuntimeError, match=r"^pipeline group size 2 does not match configured PP size 4\.$"):
        pp.pp_gather(torch.zeros(1, 2, 3, 1, dtype=torch.int16), tf)


# --------------------------------------------------------------------------------------------
# pp_gather over gloo: the check functions run on every rank (tests/_dist.py).


def _rank_setup(pp_world, vp_split, device_name="cpu"):
    """This rank's pipeline group (consecutive blocks of ``pp_world`` ranks), stand-ins for
    megatron's parallel_state and verl's owner module, and verl's pp_gather (or None), which moves
    dense maps to ``device_name`` (verl's get_device_name(): "cuda" under NCCL) to gather them."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + pp_world))) for s in range(0, world, pp_world)]
    group = groups[rank // pp_world]
    verl_stubs.stand_in_pipeline_group(group)
    owner = types.ModuleType(OWNER)
    owner.get_moe_num_layers_to_build = lambda cfg, vp, pp_rank: vp_split[pp_rank][vp]
    sys.modules[OWNER] = owner
    try:
        # verl's pp_gather alone: it reads mpu, device_name and get_moe_num_layers_to_build
        theirs = verl_stubs.load_verl_functions("utils/megatron/router_replay_utils.py", ["pp_gather"], dict(
            device_name=device_name, mpu=types.SimpleNamespace(get_pipeline_model_parallel_group=lambda: group),
            get_moe_num_layers_to_build=owner.get_moe_num_layers_to_build))["pp_gather"]
    except LookupError:
        theirs = None
    return group, dist.get_rank(group), theirs


def _case_maps(kind, pp_world, layers, seed, device):
    """Every pipeline rank's map (so each rank can compute the reference)."""
    g = random.Random(seed)
    lens = [g.choice([1, g.randint(1, 20)]) for _ in range(g.randint(1, 4))]
    if kind == "jagged":
        return [routes(lens, layers[r], seed=seed + r, device=device) for r in range(pp_world)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-300, 300, (len(lens), 9, layers[r], 4), generator=gen).to(torch.int16).to(device)
            for r in range(pp_world)]


def check_pp_gather(rank, world_size, backend, device, pp_world, kind, layers, vp_split, seed):
    group, pp_rank, theirs = _rank_setup(pp_world, vp_split)
    vp_size = None if vp_split is None else len(vp_split[0])
    tf = types.SimpleNamespace(pipeline_model_parallel_size=pp_world, virtual_pipeline_model_parallel_size=vp_size)
    maps = _case_maps(kind, pp_world, layers, seed, device)
    ours = pp.pp_gather(maps[pp_rank], tf)
    same(ours, ref_pp_gather([m.cpu() for m in maps], vp_split))
    assert ours.device.type == "cpu"
    if theirs is not None:
        same(ours, theirs(maps[pp_rank], tf))


def check_pp_gather_dtypes(rank, world_size, backend, device, pp_world):
    """Jagged maps of different dtypes on different ranks (promoted as torch.cat does); dense maps
    of another dtype (their bytes read as int16); maps without any layer."""
    group, pp_rank, theirs = _rank_setup(pp_world, None)
    tf = types.SimpleNamespace(pipeline_model_parallel_size=pp_world, virtual_pipeline_model_parallel_size=None)
    dtypes = [torch.int16, torch.int32, torch.uint8, torch.float32][:pp_world]
    maps = [routes([3, 5], 2, dtype=dtypes[r], seed=r, device=device) for r in range(pp_world)]
    ours = pp.pp_gather(maps[pp_rank], tf)
    same(ours, ref_pp_gather([m.cpu() for m in maps]))
    int32 = [torch.arange(2 * 3 * 2 * 2, dtype=torch.int32).view(2, 3, 2, 2) * (r + 1) for r in range(pp_world)]
    same(pp.pp_gather(int32[pp_rank].to(device), tf), ref_pp_gather(int32))
    cases = [int32[pp_rank], torch.zeros(2, 3, 0, 4, dtype=torch.int64), torch.zeros(0, 3, 2, 4, dtype=torch.int16),
             torch.zeros(2, 3, 0), routes([3, 5], 0), torch.ones(2, 3, 2, 4, 2, dtype=torch.int16)]
    for x in cases:
        x = x.to(device)
        ours = pp.pp_gather(x, tf)
        assert ours.device.type == "cpu"
        if theirs is not None:
            same(ours, theirs(x, tf))


def check_pp_gather_verl_main_case(rank, world_size, backend, device):
    """verl main's tests/utils/test_megatron_router_replay_dcp.py::test_pp_gather_normalizes_nested_routes_to_cpu
    (which fakes all_gather_object) on two real ranks: jagged int16 routes come back on the CPU,
    int16, the stages' layers side by side."""
    group, pp_rank, _ = _rank_setup(2, None)
    parts = [torch.tensor([[[1]], [[2]]], dtype=torch.int16), torch.tensor([[[3]], [[4]]], dtype=torch.int16)]
    tf = types.SimpleNamespace(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None)
    out = pp.pp_gather(nested([parts[pp_rank]], device), tf)
    assert out.device.type == "cpu" and out.dtype == torch.int16
    assert [part.tolist() for part in out.unbind()] == [[[[1], [3]], [[2], [4]]]]


def check_pp_gather_errors(rank, world_size, backend, device, pp_world):
    """Every rank raises (none waits in a collective): verl's errors, and ranks whose maps do not
    fit together."""
    group, pp_rank, theirs = _rank_setup(pp_world, [[1, 1]] * pp_world)
    tf = types.SimpleNamespace(pipeline_model_parallel_size=pp_world, virtual_pipeline_model_parallel_size=None)
    vtf = types.SimpleNamespace(pipeline_model_parallel_size=pp_world, virtual_pipeline_model_parallel_size=2)
    same_everywhere = [
        (torch.zeros(2, 3), tf),  # no layer dim
        (torch.zeros(2, 3, 2, dtype=torch.int16), tf),  # verl's [:, :, :n, :] slicing
        (torch.zeros(2, 3, 2, 3, dtype=torch.uint8), tf),  # 3 bytes cannot be read as int16
        (nested([torch.zeros(2, dtype=torch.int16), torch.zeros(3, dtype=torch.int16)]), tf),  # no layer dim
        (nested([torch.zeros(2, 2, dtype=torch.int16), torch.zeros(3, 2, dtype=torch.int16)]), vtf),  # [:, piece, :]
    ]
    for x, cfg in same_everywhere:
        errors = []
        for fn in (pp.pp_gather,) + ((theirs,) if theirs is not None else ()):
            with pytest.raises(Exception) as info:  # noqa: PT011
                fn(x.to(device), cfg)
            errors.append(info.value)
        if len(errors) == 2:
            assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), (x.shape, errors)
    # maps that do not fit together: ours raise on every rank (verl's would hang or fail in gloo)
    with pytest.raises(RuntimeError, match="differ outside the layer dim"):
        pp.pp_gather(torch.zeros(2, 3 + pp_rank, 2, 4, dtype=torch.int16, device=device), tf)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 1"):
        pp.pp_gather(routes([2, 3 + pp_rank], 2, device=device), tf)
    with pytest.raises(RuntimeError, match="different kinds of router maps"):
        x = routes([2, 3], 2) if pp_rank == 0 else torch.zeros(2, 3, 2, 4, dtype=torch.int16)
        pp.pp_gather(x.to(device), tf)
    base = torch.zeros(2, 6, 2, 3, dtype=torch.int16)
    holes = torch.nested.narrow(base, 1, torch.tensor([0, 2]), torch.tensor([5, 1]), layout=torch.jagged)
    bad = holes if pp_rank == pp_world - 1 else routes([5, 1], 2)
    with pytest.raises((ValueError, RuntimeError), match="holes" if pp_rank == pp_world - 1 else r"rank\(s\)"):
        pp.pp_gather(bad, tf)


@pytest.fixture(params=dist_params(("gloo",), (2, 4)))
def dist_run(request):
    return dist_runner(request, "test_verl_pp")


def _pp_worlds(world):
    return [world] + ([2] if world == 4 else [])  # one pipeline group, or two groups of 2 ranks


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("kind", ["dense", "jagged"])
def test_pp_gather_over_gloo(dist_run, device, kind):
    for pp_world in _pp_worlds(dist_run.world):
        uniform = [3] * pp_world
        uneven = [2, 0, 3, 1][:pp_world]
        split = [[1, 2], [0, 0], [2, 1], [1, 0]][:pp_world]  # MoE layers per (stage, chunk)
        short = [[1, 1], [0, 0], [2, 0], [1, 0]][:pp_world]  # chunk 1 of stage 2 past its layers
        for seed, (layers, vp_split) in enumerate([(uniform, None), (uneven, None), ([0] * pp_world, None),
                                                   ([sum(s) for s in split], split), ([2, 0, 3, 1][:pp_world], short)]):
            dist_run("check_pp_gather", device, pp_world, kind, layers, vp_split, seed)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_pp_gather_dtypes_over_gloo(dist_run, device):
    for pp_world in _pp_worlds(dist_run.world):
        dist_run("check_pp_gather_dtypes", device, pp_world)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_pp_gather_verl_main_case_over_gloo(dist_run, device):
    dist_run("check_pp_gather_verl_main_case", device)


def test_pp_gather_errors_over_gloo(dist_run):
    for pp_world in _pp_worlds(dist_run.world):
        dist_run("check_pp_gather_errors", "cpu", pp_world)


def test_install_registers_pp_helpers():
    from verl_ops.integrations import verl as vi

    drop_ins = vi._all_drop_ins()
    for name in ("pp_gather", "reorder_and_merge_vpp_layers", "merge_nested_router_maps"):
        assert drop_ins[name] is getattr(pp, name)
        assert vi._OWNERS[name] == OWNER
