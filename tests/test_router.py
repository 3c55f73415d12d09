"""Router replay (docs/router_replay.md): merge_router_topk / scatter_router_topk, their ops, the verl
drop-ins, and the layout they share with the model.

Multi-rank gathers are emulated here (every rank's recording is at hand, the gathers are
torch.cat); tests/test_router_dist.py runs the real collectives over gloo.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from conftest import DEVICE_PARAMS, random_lengths
from router_reference import RouterCase, verl_stack

import verl_ops
from verl_ops import merge_router_topk, scatter_router_topk
from verl_ops._library import HAS_LAYERS
from verl_ops.layout import CP_LAYOUT_CODES
from verl_ops.integrations import verl as vi
from verl_ops.integrations import verl_router as vr

OPS = torch.ops.verl_ops
LAYOUT_CP = [("zigzag", 1), ("zigzag", 2), ("zigzag", 4), ("contiguous", 2), ("contiguous", 4)]
LAYOUT_CP_IDS = [f"{lay}-cp{cp}" for lay, cp in LAYOUT_CP]
FORMS = ["list", "strided", "stacked", "stacked_strided"]


def case_for(rng, tp, cp, cp_layout, fp8, L=3, K=4, n=None, **kw):
    factor = 2 if (cp_layout == "zigzag" and cp > 1) else 1
    lengths = random_lengths(rng, n if n is not None else rng.randint(1, 6), tp * cp * factor, long=60)
    return RouterCase(rng, lengths, L, K, tp=tp, cp=cp, cp_layout=cp_layout, fp8=fp8, **kw)


def to_dev(x, device):
    if isinstance(x, list):
        return [t.to(device) for t in x]
    return x.to(device)


def op_list(x):
    """Raw record input: L tensors [T, K] (a list) or one [L, T, K] tensor."""
    return x


def record_op(x, *args):
    """router_topk_record on one [L, T, K] tensor; router_topk_record_layers on a list of [T, K]
    (under torch < 2.10, which has no list op, the list goes through the Python API's fallback,
    which checks the layers with router_topk_record_layers' words and stacks them)."""
    if isinstance(x, torch.Tensor):
        return OPS.router_topk_record(x, *args)
    if HAS_LAYERS:
        return OPS.router_topk_record_layers(list(x), *args)
    from verl_ops.router import _layer_list

    return OPS.router_topk_record(_layer_list("router_topk_record", list(x))[0], *args)


def emulated_merge(case, form, device, attention_mask=None):
    """Record on every (tp, cp) rank with the op, gather by concatenation, unpack with postprocess_thd."""
    shards = []
    for c in range(case.cp):
        parts = []
        for p in range(case.tp):
            local, overflow = record_op(op_list(to_dev(case.recorded(p, c, form), device)))
            assert not overflow.any()
            assert torch.equal(local.cpu(), verl_stack(case.recorded(p, c, "list")))
            parts.append(local)
        shards.append(torch.cat(parts))
    packed = torch.stack(shards) if case.cp > 1 else shards[0]
    layout = case.layout.to(device)
    return OPS.postprocess_thd(
        packed, layout.cu_seqlens, layout.cu_seqlens_padded, layout.total_tokens, case.cp,
        -1 if case.cp > 1 else 0, layout.cp_layout_code, False, attention_mask,
    )


# --------------------------------------------------------------------------------------------
# Record side.


@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_record_then_gathers_gives_every_token(device, rng, cp_layout, cp, tp, fp8):
    """Record op per rank + the gathers + unpack == the truth, for every input form; the local step
    is bit-identical to verl's stack / permute / int16."""
    for form in FORMS:
        case = case_for(rng, tp, cp, cp_layout, fp8)
        got = emulated_merge(case, form, device)
        assert got.dtype == torch.int16 and got.device.type == device
        assert torch.equal(got.cpu(), case.routes.to(torch.int16)), (form, case.lengths)


@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_merge_fused_single_rank(device, rng, fp8):
    """tp = cp = 1: one fused launch from the layer tensors to the per-sequence result."""
    for form in FORMS:
        case = case_for(rng, 1, 1, "zigzag", fp8, L=5, K=rng.choice([1, 3, 8]))
        rec = to_dev(case.recorded(0, 0, form), device)
        out = merge_router_topk(rec, case.layout)
        assert out.is_nested and out.dtype == torch.int16
        assert torch.equal(out.values().cpu(), case.routes.to(torch.int16))
        vals = merge_router_topk(rec, case.layout, as_nested=False)
        assert torch.equal(vals.cpu(), case.routes.to(torch.int16))
        _, mask, _ = case.padded(rng)
        padded = merge_router_topk(rec, case.layout, attention_mask=mask.to(device))
        assert torch.equal(padded.cpu(), case.padded_expected(mask))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_record_dtypes(rng, dtype):
    case = case_for(rng, 1, 1, "zigzag", False, high=100)
    out = merge_router_topk(case.recorded(0, 0, "strided", dtype=dtype), case.layout, as_nested=False)
    assert torch.equal(out, case.routes.to(torch.int16))


def test_record_int16_edges_and_negative_ids(rng):
    """The full int16 range survives (including negative values); no silent clamping."""
    layers = [torch.tensor([[-32768, 32767], [0, -1]]), torch.tensor([[5, 6], [7, 8]])]
    layout = verl_ops.ThdLayout.from_lengths([2])
    out = merge_router_topk(layers, layout, as_nested=False)
    assert out.tolist() == [[[-32768, 32767], [5, 6]], [[0, -1], [7, 8]]]


def test_record_empty_batch_and_empty_sequences():
    layout = verl_ops.ThdLayout.from_lengths([0, 3, 0], tp_size=2)
    layers = [torch.arange(layout.local_rows // 2 * 2).view(-1, 2) for _ in range(2)]
    assert layout.tp_size == 2 and layout.local_rows == 4
    local, _ = record_op(layers)
    assert local.shape == (2, 2, 2)
    empty = verl_ops.ThdLayout.from_lengths([])
    out = merge_router_topk([torch.zeros(0, 4, dtype=torch.long)] * 3, empty, as_nested=False)
    assert out.shape == (0, 3, 4)


def test_record_many_layers(rng):
    """More layers than one CUDA launch's pointer table (128) and odd K."""
    case = case_for(rng, 1, 1, "zigzag", False, L=130, K=3, n=2)
    assert torch.equal(merge_router_topk(case.recorded(0, 0, "strided"), case.layout, as_nested=False),
                       case.routes.to(torch.int16))


# --------------------------------------------------------------------------------------------
# Replay side.


@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_scatter_matches_reference(device, rng, cp_layout, cp, tp, fp8):
    case = case_for(rng, tp, cp, cp_layout, fp8)
    routes, replay = case.nested_routes(device=device), case.nested_replay(device)
    mroutes, mask, mreplay = case.padded(rng)
    for c in range(cp):
        for p in range(tp):
            want, want_mask = case.expected_targets(p, c), case.expected_replay(p, c)
            targets, packed = scatter_router_topk(routes, case.layout, tp_rank=p, cp_rank=c, replay_mask=replay)
            assert targets.dtype == torch.int64 and targets.device.type == device
            assert torch.equal(targets.cpu(), want) and torch.equal(packed.cpu(), want_mask)
            # values form, no replay mask
            t2, none = scatter_router_topk(routes.values(), case.layout, tp_rank=p, cp_rank=c)
            assert none is None and torch.equal(t2.cpu(), want)
            # padded + mask form
            t3, m3 = scatter_router_topk(
                mroutes.to(device), case.layout, tp_rank=p, cp_rank=c,
                attention_mask=mask.to(device), replay_mask=mreplay.to(device),
            )
            assert torch.equal(t3.cpu(), want) and torch.equal(m3.cpu(), want_mask)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_scatter_dtypes(rng, dtype):
    case = case_for(rng, 2, 2, "zigzag", True, high=100)
    targets, _ = scatter_router_topk(case.routes.to(dtype), case.layout, tp_rank=1, cp_rank=1)
    assert torch.equal(targets, case.expected_targets(1, 1))


def test_scatter_targets_are_views_of_one_buffer(rng):
    case = case_for(rng, 2, 1, "zigzag", False)
    targets, _ = scatter_router_topk(case.routes, case.layout, tp_rank=0)
    assert targets.is_contiguous() and targets[1].is_contiguous()
    assert targets[1].data_ptr() == targets.data_ptr() + targets.stride(0) * 8


@pytest.mark.parametrize("fp8", [False, True], ids=["nofp8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("cp_layout, cp", LAYOUT_CP, ids=LAYOUT_CP_IDS)
def test_record_replay_identity(rng, cp_layout, cp, tp, fp8):
    """merge then scatter gives every rank back what it recorded, on every valid row."""
    case = case_for(rng, tp, cp, cp_layout, fp8)
    records = {(p, c): case.recorded_rows(p, c) for c in range(cp) for p in range(tp)}
    shards = [torch.cat([record_op(list(records[p, c].permute(1, 0, 2)))[0] for p in range(tp)])
              for c in range(cp)]
    merged = OPS.postprocess_thd(
        torch.stack(shards) if cp > 1 else shards[0], case.layout.cu_seqlens, case.layout.cu_seqlens_padded,
        case.layout.total_tokens, cp, -1 if cp > 1 else 0, CP_LAYOUT_CODES[cp_layout], False, None,
    )
    for (p, c), rec in records.items():
        targets, _ = scatter_router_topk(merged, case.layout, tp_rank=p, cp_rank=c)
        valid = case._chunk(case.valid[c], p)
        assert torch.equal(targets.permute(1, 0, 2)[valid], rec[valid])
        assert not targets.permute(1, 0, 2)[~valid].any()


# --------------------------------------------------------------------------------------------
# The router's layout is the model's.

FP8_MODES = [None, False, "e4m3", "hybrid", "delayed", "missing"]


def tf_config(fp8, **attrs):
    cfg = types.SimpleNamespace(**attrs)
    if fp8 != "missing":
        cfg.fp8 = fp8
    return cfg


@pytest.fixture
def mpu(monkeypatch):
    cfg = verl_stubs.install_megatron_stub(monkeypatch)
    ps = sys.modules["megatron.core.parallel_state"]
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: cfg.tp_rank, raising=False)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: "tp-group", raising=False)
    cfg.tp_rank = 0
    return cfg


@pytest.mark.parametrize("fp8", FP8_MODES)
@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_router_layout_is_model_layout(mpu, rng, fp8, tp, cp):
    """For every FP8 mode (and a config without the attribute), the router path builds exactly
    the layout the model's forward packs with (verl's model engine and legacy paths)."""
    mpu.tp, mpu.cp = tp, cp
    cfg = tf_config(fp8)
    model_fp8 = getattr(cfg, "fp8", None) in ["e4m3", "hybrid"]  # verl's model-forward rule
    for _ in range(3):
        lengths = random_lengths(rng, rng.randint(1, 6), tp * cp * 2)
        nested = torch.nested.nested_tensor_from_jagged(
            torch.zeros(sum(lengths), dtype=torch.long), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        )
        _, psp, _ = vi.preprocess_thd_engine(nested, pre_process=False, use_fp8_padding=model_fp8)
        model = getattr(psp, vi.LAYOUT_ATTR)
        ours = vr.router_layout(lengths, cfg, tp_size=tp, cp_size=cp)
        assert ours.same_as(model) and ours.fp8_padding == model_fp8 == model.fp8_padding
        mask = torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
        _, psp_legacy = vi.preprocess_packed_seqs(torch.zeros(mask.shape, dtype=torch.long), mask, False, model_fp8)
        legacy = vr.router_layout(lengths, cfg, tp_size=tp, cp_size=cp, nested=False)
        assert legacy.same_as(getattr(psp_legacy, vi.LAYOUT_ATTR))


def test_router_layout_dsv4_hybrid(mpu):
    cfg = tf_config("e4m3", experimental_attention_variant="dsv4_hybrid", csa_window_size=512)
    opts = vr.layout_options(cfg)
    assert opts == {"cp_layout": "contiguous", "fp8_padding": True, "min_local_rows": 512}
    assert vr.layout_options(cfg, nested=False) == {"cp_layout": "zigzag", "fp8_padding": True, "min_local_rows": None}
    assert vr.layout_options(types.SimpleNamespace()) == {"cp_layout": "zigzag", "fp8_padding": False, "min_local_rows": None}


# --------------------------------------------------------------------------------------------
# verl drop-ins (one process; tests/test_router_dist.py covers tp/cp > 1 with real groups).


class FakeRouter:
    def __init__(self, with_mask=True):
        self.calls = []
        self.with_mask = with_mask

    def set_target_indices(self, topk_indices, **kw):
        self.calls.append((topk_indices, kw))


@pytest.mark.parametrize("fp8", [None, "e4m3", "missing"])
def test_drop_ins_single_rank(mpu, rng, fp8):
    cfg = tf_config(fp8)
    case = case_for(rng, 1, 1, "zigzag", getattr(cfg, "fp8", None) == "e4m3", L=4, K=2)
    nested_ids = torch.nested.nested_tensor_from_jagged(
        torch.zeros(case.layout.total_tokens, dtype=torch.long), case.layout.cu_seqlens_cpu.to(torch.int64)
    )
    merged = vr.merge_router_topk_indices(None, nested_ids, case.recorded(0, 0, "strided"), cfg)
    assert merged.is_nested and torch.equal(merged.values(), case.routes.to(torch.int16))
    routers = [FakeRouter() for _ in range(4)]
    targets, packed = vr.set_router_replay_data(merged, None, cfg, replay_mask=case.nested_replay(), routers=routers)
    assert torch.equal(targets, case.expected_targets(0, 0)) and torch.equal(packed, case.expected_replay(0, 0))
    for l, r in enumerate(routers):
        (t, kw), = r.calls
        assert t.data_ptr() == targets[l].data_ptr() and kw["replay_mask"] is packed
    # No replay mask: set_target_indices gets no replay_mask keyword (older RouterReplay signature).
    routers = [FakeRouter() for _ in range(4)]
    vr.set_router_replay_data(merged, None, cfg, routers=routers)
    assert all(r.calls[0][1] == {} for r in routers)
    # Legacy padded path.
    routes, mask, replay = case.padded(rng)
    ids = torch.zeros(mask.shape, dtype=torch.long)
    padded = vr.merge_router_topk_indices(mask.long(), ids, case.recorded(0, 0, "stacked"), cfg)
    assert torch.equal(padded, case.padded_expected(mask))
    targets, packed = vr.set_router_replay_data(routes, mask, cfg, replay_mask=replay)
    assert torch.equal(targets, case.expected_targets(0, 0)) and torch.equal(packed, case.expected_replay(0, 0))


def test_drop_in_reuses_packed_seq_params_layout(mpu, rng):
    """With the model's packed_seq_params the router path uses that very ThdLayout object."""
    mpu.tp = 2
    case = case_for(rng, 2, 1, "zigzag", True)
    nested_ids = torch.nested.nested_tensor_from_jagged(
        torch.zeros(case.layout.total_tokens, dtype=torch.long), case.layout.cu_seqlens_cpu.to(torch.int64)
    )
    _, psp, _ = vi.preprocess_thd_engine(nested_ids, pre_process=False, use_fp8_padding=True)
    mpu.tp_rank = 1
    targets, _ = vr.set_router_replay_data(case.nested_routes(), None, tf_config("e4m3"), packed_seq_params=psp)
    assert torch.equal(targets, case.expected_targets(1, 0))
    with pytest.raises(ValueError, match="set_router_replay_data: the batch's sequence lengths"):
        other = torch.nested.nested_tensor_from_jagged(torch.zeros(3, 2, 2, dtype=torch.int16), torch.tensor([0, 3]))
        vr.set_router_replay_data(other, None, tf_config("e4m3"), packed_seq_params=psp)


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def opcheck_cases(device):
    import random

    rng = random.Random(7)
    case = case_for(rng, 1, 1, "zigzag", True, L=3, K=8, n=4)
    lay = case.layout.to(device)
    rec = to_dev(case.recorded(0, 0, "strided"), device)
    routes, mask, replay = case.padded(rng)
    routes, mask, replay = routes.to(device), mask.to(device), replay.to(device)
    tp_case = case_for(rng, 2, 2, "zigzag", False, L=2, K=3, n=3)
    tl = tp_case.layout.to(device)
    record = [
        (rec,),
        (to_dev(case.recorded(0, 0, "stacked_strided"), device),),
        (to_dev(tp_case.recorded(1, 1, "list", dtype=torch.int32), device),),
        (rec, lay.cu_seqlens, lay.cu_seqlens_padded, lay.total_tokens, None),
        (rec, lay.cu_seqlens, lay.cu_seqlens_padded, 0, mask),
    ]
    vals = tp_case.routes.to(torch.int16).to(device)
    scatter = [
        (vals, tl.cu_seqlens, tl.cu_seqlens_padded, tl.local_rows, 2, 1, 2, 0, 0, None, None),
        (vals, tl.cu_seqlens, tl.cu_seqlens_padded, tl.local_rows, 2, 0, 2, 1, 0, None,
         tp_case.replay.to(device)),
        (routes, lay.cu_seqlens, lay.cu_seqlens_padded, lay.local_rows, 1, 0, 1, 0, 1, mask, replay),
    ]
    return record, scatter


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_opcheck(device):
    record, scatter = opcheck_cases(device)
    for args in record:
        if isinstance(args[0], torch.Tensor):
            torch.library.opcheck(OPS.router_topk_record.default, args)
        elif HAS_LAYERS:
            torch.library.opcheck(OPS.router_topk_record_layers.default, args)
    for args in scatter:
        torch.library.opcheck(OPS.router_topk_scatter.default, args)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_compile_fullgraph_dynamic(device, rng):
    torch._dynamo.reset()

    def merge(layers, layout):
        return merge_router_topk(layers, layout, as_nested=False)

    def merge_stacked(stacked, layout, mask):
        return merge_router_topk(stacked, layout, attention_mask=mask)

    def scatter(routes, layout, replay, tp_rank):
        return scatter_router_topk(routes, layout, tp_rank=tp_rank, replay_mask=replay)

    cm = torch.compile(merge, fullgraph=True, dynamic=True)
    cms = torch.compile(merge_stacked, fullgraph=True, dynamic=True)
    cs = torch.compile(scatter, fullgraph=True, dynamic=True)
    for n in (3, 5):
        case = case_for(rng, 1, 1, "zigzag", True, L=3, K=2, n=n)
        layout = case.layout.to(device)
        rec = to_dev(case.recorded(0, 0, "list"), device)
        assert torch.equal(cm(rec, layout).cpu(), case.routes.to(torch.int16))
        _, mask, _ = case.padded(rng)
        stacked = to_dev(case.recorded(0, 0, "stacked"), device)
        assert torch.equal(cms(stacked, layout, mask.to(device)).cpu(), case.padded_expected(mask))
        tcase = case_for(rng, 2, 1, "zigzag", False, L=3, K=2, n=n)
        tl = tcase.layout.to(device)
        t, m = cs(tcase.routes.to(torch.int16).to(device), tl, tcase.replay.to(device), 1)
        assert torch.equal(t.cpu(), tcase.expected_targets(1, 0)) and torch.equal(m.cpu(), tcase.expected_replay(1, 0))


# --------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input_record(rng):
    case = case_for(rng, 1, 1, "zigzag", False, L=2, K=4)
    layout = case.layout
    rec = case.recorded(0, 0, "list")
    T = rec[0].shape[0]
    with pytest.raises(RuntimeError, match=r"merge_router_topk: indices hold 1 value\(s\) outside the int16 range"):
        bad = [t.clone() for t in rec]
        bad[1][0, 2] = 40000
        merge_router_topk(bad, layout)
    with pytest.raises(RuntimeError, match="router_topk_record: indices hold .* outside the int16 range"):
        record_op([torch.full((2, 2), -40000)])
    with pytest.raises(RuntimeError, match=r"merge_router_topk: indices\[1\] has top-k 3 but indices\[0\] has 4"):
        merge_router_topk([rec[0], torch.zeros(T, 3, dtype=torch.long)], layout)
    with pytest.raises(RuntimeError, match=r"router_topk_record: indices\[1\] has \d+ rows but indices\[0\] has"):
        record_op([rec[0], rec[1][:-1]])
    with pytest.raises(RuntimeError, match=r"router_topk_record: indices\[1\] is Int but indices\[0\] is Long"):
        record_op([rec[0], rec[1].int()])
    with pytest.raises(RuntimeError, match="router_topk_record: indices must be an integer tensor"):
        record_op([rec[0].float()])
    with pytest.raises(RuntimeError, match="router_topk_record: indices hold L \\* K = 4194305 indices per token"):
        record_op(torch.zeros(5, 1, 838861, dtype=torch.int16).unbind(0))
    with pytest.raises(RuntimeError, match="router_topk_record: indices have top-k K=1048577, more than"):
        record_op([torch.zeros(1, (1 << 20) + 1, dtype=torch.int16)])
    with pytest.raises(ValueError, match="merge_router_topk: indices must be a non-empty list"):
        merge_router_topk([], layout)
    # (ValueError from the Python fallback under torch < 2.10, RuntimeError from the list op.)
    with pytest.raises((RuntimeError, ValueError), match=r"router_topk_record: indices\[0\] must be (a )?\[T_local_sp, K\]"):
        record_op([torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="router_topk_record: cu_seqlens_padded\\[-1\\]=.* does not match"):
        record_op([t[:-1] for t in rec], layout.cu_seqlens, layout.cu_seqlens_padded, layout.total_tokens)
    with pytest.raises(RuntimeError, match="router_topk_record: total_tokens=1 but cu_seqlens"):
        record_op(rec, layout.cu_seqlens, layout.cu_seqlens_padded, 1)
    with pytest.raises(RuntimeError, match="router_topk_record: cu_seqlens and cu_seqlens_padded must be given together"):
        record_op(rec, layout.cu_seqlens)
    with pytest.raises(RuntimeError, match="router_topk_record: cu_seqlens is on meta but the data is on cpu"):
        record_op(rec, layout.cu_seqlens.to("meta"), layout.cu_seqlens_padded, layout.total_tokens)
    with pytest.raises(RuntimeError, match=r"router_topk_record: indices\[1\] is on meta but indices\[0\] is on cpu"):
        record_op([rec[0], rec[1].to("meta")])
    # Python API: lengths that do not match the layout, wrong forms, missing groups.
    with pytest.raises(ValueError, match=r"merge_router_topk: indices hold \d+ rows per layer but the layout gives"):
        merge_router_topk([t[:-1] for t in rec], layout)
    with pytest.raises(ValueError, match="merge_router_topk: indices must be a list of L tensors"):
        merge_router_topk(rec[0], layout)
    with pytest.raises(ValueError, match=r"merge_router_topk: indices\[1\] must be a \[T_local_sp, K\] tensor"):
        merge_router_topk([rec[0], None], layout)
    with pytest.raises(ValueError, match="merge_router_topk: layout.tp_size=2 needs tp_group"):
        tp2 = case_for(rng, 2, 1, "zigzag", False)
        merge_router_topk(tp2.recorded(0, 0), tp2.layout)
    with pytest.raises(ValueError, match="merge_router_topk: layout.cp_size=2 needs cp_group"):
        cp2 = case_for(rng, 1, 2, "zigzag", False)
        merge_router_topk(cp2.recorded(0, 0), cp2.layout)
    with pytest.raises(ValueError, match="merge_router_topk: attention_mask row 0 has"):
        mask = torch.zeros(len(case.lengths), 100, dtype=torch.bool)
        mask[0, : case.lengths[0] + 1] = True
        merge_router_topk(rec, layout, attention_mask=mask)
    with pytest.raises(TypeError, match="merge_router_topk: layout must be a verl_ops.ThdLayout"):
        merge_router_topk(rec, None)


def test_bad_input_scatter(rng):
    case = RouterCase(rng, [3, 5, 2], 2, 4, tp=2, cp=2)
    layout = case.layout
    vals = case.routes.to(torch.int16)
    with pytest.raises(ValueError, match=r"scatter_router_topk: routes must be \[total_tokens, L, K\] with total_tokens="):
        scatter_router_topk(vals[:-1], layout)
    with pytest.raises(ValueError, match="scatter_router_topk: tp_rank must be an int in \\[0, 2\\), got 2"):
        scatter_router_topk(vals, layout, tp_rank=2)
    with pytest.raises(ValueError, match="scatter_router_topk: cp_rank must be an int in \\[0, 2\\), got -1"):
        scatter_router_topk(vals, layout, cp_rank=-1)
    with pytest.raises(ValueError, match="scatter_router_topk: routes's offsets do not match"):
        off = torch.tensor([0, 4, 8, 10])
        scatter_router_topk(torch.nested.nested_tensor_from_jagged(vals, off), layout)
    with pytest.raises(ValueError, match="scatter_router_topk: replay_mask must be a bool tensor, got torch.int64"):
        scatter_router_topk(vals, layout, replay_mask=case.replay.long())
    with pytest.raises(ValueError, match=r"scatter_router_topk: replay_mask must be \[total_tokens\]"):
        scatter_router_topk(vals, layout, replay_mask=case.replay[:-1])
    routes, mask, replay = case.padded(rng)
    with pytest.raises(ValueError, match=r"scatter_router_topk: with padded routes, replay_mask must be \[B, S\]"):
        scatter_router_topk(routes, layout, attention_mask=mask, replay_mask=replay[:, :-1])
    with pytest.raises(ValueError, match=r"scatter_router_topk: padded routes must be \[B, S, L, K\]"):
        scatter_router_topk(routes[:, :-1], layout, attention_mask=mask)
    # Raw op.
    args = (layout.cu_seqlens, layout.cu_seqlens_padded, layout.local_rows)
    with pytest.raises(RuntimeError, match="router_topk_scatter: routes must be an integer tensor"):
        OPS.router_topk_scatter(vals.float(), *args, 2, 0, 2, 0)
    with pytest.raises(RuntimeError, match=r"router_topk_scatter: routes has \d+ token rows but cu_seqlens\[-1\]"):
        OPS.router_topk_scatter(vals[:-1], *args, 2, 0, 2, 0)
    with pytest.raises(RuntimeError, match=r"router_topk_scatter: cu_seqlens_padded\[-1\]=.* does not match"):
        OPS.router_topk_scatter(vals, layout.cu_seqlens, layout.cu_seqlens_padded, layout.local_rows - 2, 2, 0, 2, 0)
    with pytest.raises(RuntimeError, match="router_topk_scatter: local_rows=.* is not divisible by tp_size=3"):
        OPS.router_topk_scatter(vals, layout.cu_seqlens, layout.cu_seqlens_padded, 1, 3, 0, 2, 0)
    with pytest.raises(RuntimeError, match=r"router_topk_scatter: cp_rank must be in \[0, cp_size=2\), got 2"):
        OPS.router_topk_scatter(vals, *args, 2, 0, 2, 2)
    with pytest.raises(RuntimeError, match="router_topk_scatter: routes hold L \\* K = 4194305 indices per token"):
        one = verl_ops.ThdLayout.from_lengths([1])
        OPS.router_topk_scatter(torch.zeros(1, 5, 838861, dtype=torch.int16), one.cu_seqlens,
                                one.cu_seqlens_padded, one.local_rows)
    with pytest.raises(RuntimeError, match=r"router_topk_scatter: cp_layout must be 0 \(zigzag\) or 1 \(contiguous\), got 5"):
        OPS.router_topk_scatter(vals, *args, 2, 0, 2, 0, 5)
    with pytest.raises(RuntimeError, match="router_topk_scatter: attention_mask row .* valid tokens but the layout says"):
        bad = mask.clone()
        bad[0] = ~bad[0]
        OPS.router_topk_scatter(routes, *args, 2, 0, 2, 0, 0, bad)
    with pytest.raises(RuntimeError, match="router_topk_scatter: replay_mask is on meta but routes are on cpu"):
        OPS.router_topk_scatter(vals, *args, 2, 0, 2, 0, 0, None, case.replay.to("meta"))
    # The masks' devices, dtypes and shapes are checked before any offset is read: with bad layout
    # values as well, the error names the mask (the GPU fuzzer's case: a replay mask on the GPU
    # with local_rows off).
    with pytest.raises(RuntimeError, match="router_topk_scatter: replay_mask is on meta but routes are on cpu"):
        OPS.router_topk_scatter(vals, layout.cu_seqlens, layout.cu_seqlens_padded, layout.local_rows - 2, 2, 0, 2, 0,
                                0, None, case.replay.to("meta"))
    with pytest.raises(RuntimeError, match=r"router_topk_scatter: replay_mask must be \[total_tokens\]"):
        cu_dec = layout.cu_seqlens.clone()
        cu_dec[1] = cu_dec[2] + 1
        OPS.router_topk_scatter(vals, cu_dec, layout.cu_seqlens_padded, layout.local_rows, 2, 0, 2, 0, 0, None,
                                case.replay[:-1])
    with pytest.raises(RuntimeError, match="router_topk_scatter: attention_mask is on meta but the data is on cpu"):
        OPS.router_topk_scatter(routes, layout.cu_seqlens, layout.cu_seqlens_padded, layout.local_rows - 2, 2, 0, 2,
                                0, 0, mask.to("meta"))
    with pytest.raises(RuntimeError, match="router_topk_scatter: zigzag with cp_size=2 needs every padded length"):
        cu_bad = layout.cu_seqlens_padded.clone()
        cu_bad[1:-1] += 1
        OPS.router_topk_scatter(vals, layout.cu_seqlens, cu_bad, layout.local_rows, 2, 0, 2, 0)


def test_bad_layout_for_sequence_parallel_split():
    """A contiguous layout whose min_local_rows is no multiple of tp cannot be split over TP ranks
    (merge_router_topk runs the same check; test_router_dist.py exercises it over gloo)."""
    layout = verl_ops.ThdLayout.from_lengths([3], tp_size=2, cp_size=2, cp_layout="contiguous", min_local_rows=7)
    assert layout.local_rows == 7
    with pytest.raises(ValueError, match="scatter_router_topk: local_rows=7 is not divisible by tp_size=2"):
        scatter_router_topk(torch.zeros(3, 1, 2, dtype=torch.int16), layout)


# --------------------------------------------------------------------------------------------
# CUDA only.


@pytest.mark.gpu
@pytest.mark.parametrize("K", [1, 6, 8, 16])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_cuda_matches_cpu_large(rng, dtype, K):
    lengths = [rng.randint(0, 400) for _ in range(40)]
    case = RouterCase(rng, lengths, 48, K, tp=2, cp=2, cp_layout="zigzag", fp8=True, high=100)
    for form in ("list", "strided", "stacked_strided"):
        rec = case.recorded(1, 0, form, dtype=dtype)
        got, overflow = record_op(op_list(to_dev(rec, "cuda")))
        assert not overflow.any() and torch.equal(got.cpu(), record_op(op_list(rec))[0])
    for form in ("list", "strided"):
        one = RouterCase(rng, lengths, 48, K, fp8=True, high=100)
        rec = one.recorded(0, 0, form, dtype=dtype)
        got = merge_router_topk(to_dev(rec, "cuda"), one.layout, as_nested=False)
        assert torch.equal(got.cpu(), one.routes.to(torch.int16))
    routes = case.routes.to(dtype)
    for c in range(2):
        for p in range(2):
            t, m = scatter_router_topk(routes.cuda(), case.layout, tp_rank=p, cp_rank=c, replay_mask=case.replay.cuda())
            assert torch.equal(t.cpu(), case.expected_targets(p, c)) and torch.equal(m.cpu(), case.expected_replay(p, c))


@pytest.mark.gpu
def test_cuda_many_layers_and_misaligned(rng):
    case = case_for(rng, 1, 1, "zigzag", False, L=200, K=8, n=5)
    rows = case.recorded_rows(0, 0).to(torch.int16).cuda()
    # An odd element offset breaks 16-byte alignment: the scalar path must give the same result.
    buf = torch.zeros(rows.numel() + 1, dtype=torch.int16, device="cuda")
    buf[1:] = rows.flatten()
    mis = buf[1:].view_as(rows)
    layers = [mis[:, l] for l in range(200)]
    got = merge_router_topk(layers, case.layout.to("cuda"), as_nested=False)
    assert torch.equal(got.cpu(), case.routes.to(torch.int16))


@pytest.mark.gpu
def test_cuda_out_of_range_raises_lazily(rng):
    case = RouterCase(rng, [3, 2, 5], 2, 8)
    rec = to_dev(case.recorded(0, 0, "list"), "cuda")
    rec[1][0, 3] = 1 << 20
    _, overflow = record_op(rec)  # no host synchronisation inside the op
    assert overflow.any()
    with pytest.raises(RuntimeError, match="merge_router_topk: indices hold values outside the int16 range"):
        merge_router_topk(rec, case.layout)
    out = merge_router_topk(rec, case.layout, as_nested=False, validate=False)
    assert int(out[0, 1, 3]) == -1


@pytest.mark.gpu
def test_cuda_graph_capture(rng):
    case = case_for(rng, 2, 2, "zigzag", True, L=4, K=8, n=5)
    layout = case.layout.to("cuda")
    rec = to_dev(case.recorded(1, 1, "strided"), "cuda")
    vals = case.routes.to(torch.int16).cuda()
    replay = case.replay.cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        record_op(rec)
        scatter_router_topk(vals, layout, tp_rank=1, cp_rank=1, replay_mask=replay)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        local, _ = record_op(rec)
        t, m = scatter_router_topk(vals, layout, tp_rank=1, cp_rank=1, replay_mask=replay)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(local.cpu(), verl_stack(case.recorded(1, 1, "list")))
    assert torch.equal(t.cpu(), case.expected_targets(1, 1)) and torch.equal(m.cpu(), case.expected_replay(1, 1))


@pytest.mark.gpu
def test_cuda_device_mix_is_a_clear_error(rng):
    case = case_for(rng, 1, 1, "zigzag", False, L=2, K=8, n=3)
    rec = case.recorded(0, 0, "list")
    lay = case.layout.to("cuda")
    with pytest.raises(RuntimeError, match="router_topk_record: cu_seqlens is on cuda:0 but the data is on cpu"):
        record_op(rec, lay.cu_seqlens, lay.cu_seqlens_padded, lay.total_tokens)
    with pytest.raises(RuntimeError, match=r"router_topk_record: indices\[1\] is on cuda:0 but indices\[0\] is on cpu"):
        record_op([rec[0], rec[1].cuda()])
    with pytest.raises(RuntimeError, match="router_topk_scatter: cu_seqlens is on cuda:0 but the data is on cpu"):
        OPS.router_topk_scatter(case.routes.to(torch.int16), lay.cu_seqlens, lay.cu_seqlens_padded, lay.local_rows)
    with pytest.raises(ValueError, match="scatter_router_topk: replay_mask is on cpu but the routes are on cuda:0"):
        scatter_router_topk(case.routes.cuda(), lay, replay_mask=case.replay)
    # merge_router_topk's mask check runs before the kernel's: it must see the device mix too.
    mask = torch.ones(1, 3, dtype=torch.bool, device="cuda")
    idx = [torch.zeros(3, 2, dtype=torch.int16, device="cuda")]
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="merge_router_topk: cu_seqlens is on cpu but the data is on cuda:0"):
        OPS.merge_router_topk(idx, cu, cu.cuda(), 3, 3, attention_mask=mask)
    with pytest.raises(RuntimeError, match="merge_router_topk: attention_mask is on cpu but the data is on cuda:0"):
        OPS.merge_router_topk(idx, cu.cuda(), cu.cuda(), 3, 3, attention_mask=mask.cpu())
