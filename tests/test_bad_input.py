"""The project's bad-input battery: every public function and every raw op, fed what a
new user might pass by mistake, must raise a clear error of the expected type whose message names
the op and the argument ("<op>: <argument> ..."), never crash, hang or accept it silently.

Causes covered (one section each):

1. lengths: only non-negative ints (Python ints, integer tensors of one dimension, lists / tuples
   of ints) in [0, 2**31 - 1]; floats, bools, strings, 2**64, negatives rejected everywhere.
2. nested inputs: only torch.jagged nested tensors without holes, one message everywhere.
3. meta inputs: shape inference runs through every public function; what needs host values says
   so ("needs host lengths").
4. vague messages made clear (from_padded_offsets not at 0, 0-d masks, nested tensors where a
   plain tensor is required, ...), plus the other arguments of every public function.
5. raw ops (``test_raw_op_*``): bounds-checked sizes and ranks, overflow-checked arithmetic,
   Meta kernels that reject what CPU/CUDA kernels reject. These are written against the ported
   binding layer: int enums (cp_layout 0 zigzag / 1 contiguous, backend 0 auto / 1 padded /
   2 native), router_topk_record taking one [L, T, K] tensor, C++ messages "<op>: <arg> ...".
6. dense tensor arguments (``test_raw_op_dense_*``): every tensor argument of every raw op given a
   jagged nested tensor, a strided nested tensor or None ("<op>: <arg> must be a dense (strided)
   tensor, got ..."), recording gradients, under no_grad and (nested tensors) inference mode.

Every case runs on the CPU, and the tensor cases on CUDA too when a GPU is present.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import verl_ops
import verl_stubs
from conftest import DEVICE_PARAMS
from verl_ops import (
    DynamicCPGroups,
    ThdLayout,
    dynamic_cp_merge,
    dynamic_cp_split,
    jagged_gather,
    jagged_scatter,
    merge_router_topk,
    mla_forward_padded,
    plan_dynamic_cp,
    postprocess_thd,
    preprocess_thd,
    scatter_router_topk,
)
from verl_ops.integrations import verl as verl_dropins
from verl_ops.integrations import verl_router
from verl_ops.integrations.megatron_mla import mla_thd_core_attention

ops = torch.ops.verl_ops


JAGGED_MSG = re.escape(
    "must be a torch.jagged nested tensor without holes (layout=torch.jagged, contiguous offsets)"
)


@dataclass
class Case:
    """One bad input: ``call(device)`` must raise ``exc`` with a message naming ``op`` and
    ``arg`` (in that order), then matching ``detail`` when given."""

    id: str
    op: str
    arg: str
    exc: type | tuple
    call: object
    detail: str | None = None
    devices: str = "any"  # "any": cpu and cuda; "cpu": host-only input

    @property
    def match(self) -> str:
        pattern = rf"{re.escape(self.op)}: (.*\W)?{re.escape(self.arg)}"
        return pattern + (f".*{self.detail}" if self.detail else "")


def params(cases, *, host_only_ids=()):
    """pytest params: (case, device) for every device the case runs on."""
    out = []
    for c in cases:
        for p in DEVICE_PARAMS:
            d = p.values[0]
            if d != "cpu" and (c.devices == "cpu" or c.id in host_only_ids):
                continue
            out.append(pytest.param(c, d, id=f"{c.id}-{d}", marks=p.marks))
    return out


def check(case: Case, device: str):
    with pytest.raises(case.exc, match=case.match) as info:
        case.call(device)
    # The op name leads the message (or follows the prefix of a drop-in that wraps it).
    assert case.op in str(info.value)
    return info


# --------------------------------------------------------------------------------------------
# Shared inputs.


def nt(values, offsets, device="cpu", lengths=None):
    values, offsets = values.to(device), torch.as_tensor(offsets, dtype=torch.int64).to(device)
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.int64).to(device)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, lengths=lengths)


def holes(device="cpu", feature=(4,), dtype=torch.float32):
    """A jagged nested tensor with holes: offsets [0, 3, 8] plus lengths [3, 5] over 10 rows."""
    return nt(torch.zeros((10, *feature), dtype=dtype), [0, 3, 8], device, lengths=[3, 5])


def strided(device="cpu", feature=(4,), dtype=torch.float32):
    """A strided (not jagged) nested tensor of two sequences of 3 and 5 tokens."""
    return torch.nested.nested_tensor(
        [torch.zeros((3, *feature), dtype=dtype), torch.zeros((5, *feature), dtype=dtype)], device=device
    )


def good_nested(device="cpu", feature=(4,), dtype=torch.float32):
    return nt(torch.zeros((8, *feature), dtype=dtype), [0, 3, 8], device)


def layout(device="cpu", **kw):
    return ThdLayout.from_lengths([3, 5], device=device, **kw)


def split_of(lengths=(2, 3)):
    return dynamic_cp_split(torch.zeros(sum(lengths)), 8, lengths=list(lengths))


def mla_dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def mla_inputs(device, T=8, H=2, dqk=16, dv=8):
    dt = mla_dtype(device)
    q = torch.zeros(T, H, dqk, dtype=dt, device=device)
    v = torch.zeros(T, H, dv, dtype=dt, device=device)
    cu = torch.tensor([0, 3, T], dtype=torch.int32, device=device)
    return q, q.clone(), v, cu, cu.clone()


def latent_inputs(device, T=8, H=2):
    """A valid mla_latent_forward call's tensors: q, q_pe, k, k_pe (shared by the heads), v,
    cu_seqlens_q, cu_seqlens_kv (MLA's head dims: 128 + 64 rope, v 128)."""
    dt = mla_dtype(device)
    z = lambda *shape: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
    cu = torch.tensor([0, 3, T], dtype=torch.int32, device=device)
    return z(T, H, 128), z(T, H, 64), z(T, H, 128), z(T, 1, 64), z(T, H, 128), cu, cu.clone()


TF_CONFIG = SimpleNamespace()  # no fp8 attribute, no attention variant: the plain layout


def psp_with_layout(lay):
    """A PackedSeqParams (the stub's) carrying ``lay`` as verl_ops' preprocess attaches it."""
    psp = verl_stubs.PackedSeqParamsWithPartitionMode(
        qkv_format="thd",
        cu_seqlens_q=lay.cu_seqlens_padded,
        cu_seqlens_kv=lay.cu_seqlens_padded,
        cu_seqlens_q_padded=lay.cu_seqlens_padded,
        cu_seqlens_kv_padded=lay.cu_seqlens_padded,
        max_seqlen_q=lay.max_seqlen,
        max_seqlen_kv=lay.max_seqlen,
    )
    setattr(psp, verl_dropins.LAYOUT_ATTR, lay)
    return psp


@pytest.fixture(autouse=True)
def megatron(monkeypatch):
    """megatron-core's parallel_state / PackedSeqParams stand-ins (tp = cp = 1) for the drop-ins."""
    return verl_stubs.install_megatron_stub(monkeypatch)


# --------------------------------------------------------------------------------------------
# 1. Lengths: every entry point, every bad form.

BAD_LENGTHS = [
    # (id, make(device) -> lengths, exception, argument as named, detail)
    ("float", lambda d: [3.7, 5], ValueError, "lengths[0]", "must be an int, got 3.7"),
    ("integral_float", lambda d: [3, 5.0], ValueError, "lengths[1]", "must be an int"),
    ("bool", lambda d: [True, 5], ValueError, "lengths[0]", "must be an int, got True"),
    ("str_entry", lambda d: ["3", 5], ValueError, "lengths[0]", "must be an int"),
    ("str", lambda d: "35", ValueError, "lengths", "must be a list of ints"),
    ("none_entry", lambda d: [None, 5], ValueError, "lengths[0]", "must be an int"),
    ("2**64", lambda d: [2**64, 5], ValueError, "lengths[0]", "too large"),
    ("2**31", lambda d: [3, 2**31], ValueError, "lengths[1]", "too large"),
    ("negative", lambda d: [3, -1], ValueError, "lengths", "must be >= 0"),
    ("negative_tuple", lambda d: (-3, 5), ValueError, "lengths", "must be >= 0"),
    ("float_tensor", lambda d: torch.tensor([3.0, 5.0], device=d), ValueError, "lengths", "must be integers"),
    ("bool_tensor", lambda d: torch.tensor([True, True], device=d), ValueError, "lengths", "must be integers"),
    ("2d_tensor", lambda d: torch.tensor([[3, 5]], device=d), ValueError, "lengths", "must be 1-D"),
    ("0d_tensor", lambda d: torch.tensor(8, device=d), ValueError, "lengths", "must be 1-D"),
    ("negative_tensor", lambda d: torch.tensor([3, -1], device=d), ValueError, "lengths", "must be >= 0"),
    ("huge_tensor", lambda d: torch.tensor([2**40, 5], device=d), ValueError, "lengths[0]", "too large"),
    ("float_0d_entry", lambda d: [torch.tensor(3.0), 5], ValueError, "lengths[0]", "must be an int"),
]
HOST_ONLY_LENGTHS = {"float", "integral_float", "bool", "str_entry", "str", "none_entry", "2**64", "2**31",
                     "negative", "negative_tuple", "float_0d_entry"}

LENGTH_ENTRY_POINTS = {
    "ThdLayout.from_lengths": lambda L, d: ThdLayout.from_lengths(L),
    "ThdLayout.from_padded_offsets": lambda L, d: ThdLayout.from_padded_offsets(
        L, torch.tensor([0, 4, 8], device=d)
    ),
    "plan_dynamic_cp": lambda L, d: plan_dynamic_cp(L, 1, 8),
    "dynamic_cp_split": lambda L, d: dynamic_cp_split(torch.zeros(8, device=d), 8, lengths=L),
    "dynamic_cp_merge": lambda L, d: dynamic_cp_merge(torch.zeros(8, device=d), split_of((3, 5)), lengths=L),
}

LENGTH_CASES = [
    Case(f"{op}-{lid}", op, arg, exc, (lambda d, f=fn, m=make: f(m(d), d)), detail,
         "cpu" if lid in HOST_ONLY_LENGTHS else "any")
    for op, fn in LENGTH_ENTRY_POINTS.items()
    for lid, make, exc, arg, detail in BAD_LENGTHS
]


@pytest.mark.parametrize("case, device", params(LENGTH_CASES))
def test_lengths(case, device):
    check(case, device)


def test_lengths_valid_forms_still_accepted():
    """What the strict check keeps: ints, tuples, integer tensors of any integer dtype, numpy-like
    __index__ ints, empty batches."""
    for lengths in ([3, 5], (3, 5), torch.tensor([3, 5], dtype=torch.int32), torch.tensor([3, 5]),
                    torch.tensor([3, 5], dtype=torch.uint8), [torch.tensor(3), 5]):
        assert ThdLayout.from_lengths(lengths).lengths == (3, 5)
        assert plan_dynamic_cp(lengths, 1, 8).lengths == (3, 5)
    assert ThdLayout.from_lengths([]).total_padded == 0


def test_dynamic_cp_merge_negative_lengths_when_one_group_holds_everything():
    """The sum matches the rows (5 + -2 = 3) and one group holds the batch: still rejected."""
    with pytest.raises(ValueError, match=r"dynamic_cp_merge: lengths must be >= 0, got lengths\[1\]=-2"):
        dynamic_cp_merge(torch.zeros(3), split_of((1, 2)), lengths=[5, -2])


def test_plan_float_lengths_not_truncated():
    with pytest.raises(ValueError, match=r"plan_dynamic_cp: lengths\[0\] must be an int, got 3.7"):
        plan_dynamic_cp([3.7, 2], 2, 10)


# --------------------------------------------------------------------------------------------
# 2. Nested inputs: holes or strided layout, every entry point that takes a nested tensor.


def _routes(device, kind, L=2, K=2):
    return {"holes": holes, "strided": strided}[kind](device, (L, K), torch.int16)


def _nested_cases(kind):
    bad = {"holes": holes, "strided": strided}[kind]
    return [
        Case(f"from_nested-{kind}", "ThdLayout.from_nested", "x", ValueError,
             lambda d: ThdLayout.from_nested(bad(d)), JAGGED_MSG),
        Case(f"preprocess_thd-{kind}", "preprocess_thd", "x", ValueError,
             lambda d: preprocess_thd(bad(d), layout(d)), JAGGED_MSG),
        Case(f"scatter_router_topk-routes-{kind}", "scatter_router_topk", "routes", ValueError,
             lambda d: scatter_router_topk(_routes(d, kind), layout(d)), JAGGED_MSG),
        Case(f"scatter_router_topk-replay_mask-{kind}", "scatter_router_topk", "replay_mask", ValueError,
             lambda d: scatter_router_topk(good_nested(d, (2, 2), torch.int16), layout(d),
                                           replay_mask=bad(d, (), torch.bool)), JAGGED_MSG),
        Case(f"dynamic_cp_split-{kind}", "dynamic_cp_split", "batch", ValueError,
             lambda d: dynamic_cp_split(bad(d), 8), JAGGED_MSG),
        Case(f"dynamic_cp_split-dict-{kind}", "dynamic_cp_split", "batch['x']", ValueError,
             lambda d: dynamic_cp_split({"x": bad(d)}, 8), JAGGED_MSG),
        Case(f"dynamic_cp_merge-{kind}", "dynamic_cp_merge", "outputs", ValueError,
             lambda d: dynamic_cp_merge(bad(d), split_of((3, 5))), JAGGED_MSG),
        Case(f"preprocess_thd_engine-{kind}", "preprocess_thd_engine", "input_ids", ValueError,
             lambda d: verl_dropins.preprocess_thd_engine(bad(d)), JAGGED_MSG),
        Case(f"postprocess_thd_engine-{kind}", "postprocess_thd_engine", "input_ids", ValueError,
             lambda d: verl_dropins.postprocess_thd_engine(
                 torch.zeros(1, 8, 4, device=d), psp_with_layout(layout(d)), bad(d), 2), JAGGED_MSG),
        Case(f"merge_router_topk_indices-{kind}", "merge_router_topk_indices", "input_ids", ValueError,
             lambda d: verl_router.merge_router_topk_indices(
                 None, bad(d), [torch.zeros(8, 2, dtype=torch.int64, device=d)], TF_CONFIG), JAGGED_MSG),
        Case(f"set_router_replay_data-{kind}", "set_router_replay_data", "layers_topk_idx", ValueError,
             lambda d: verl_router.set_router_replay_data(_routes(d, kind), None, TF_CONFIG), JAGGED_MSG),
    ]


NESTED_CASES = _nested_cases("holes") + _nested_cases("strided")


@pytest.mark.parametrize("case, device", params(NESTED_CASES))
def test_nested_layouts(case, device):
    check(case, device)


def test_nested_with_holes_message_says_what_to_do():
    with pytest.raises(ValueError, match=r"with holes \(offsets plus lengths\); call \.contiguous\(\) first"):
        ThdLayout.from_nested(holes())
    with pytest.raises(ValueError, match="got layout=torch.strided"):
        ThdLayout.from_nested(strided())


# Nested tensors where a plain tensor is required (the Python API's message, not the dispatcher's).
PLAIN_CASES = [
    Case("postprocess_thd-packed", "postprocess_thd", "packed", ValueError,
         lambda d: postprocess_thd(good_nested(d), layout(d)), "plain"),
    Case("jagged_gather-values", "jagged_gather", "values", ValueError,
         lambda d: jagged_gather(good_nested(d), torch.tensor([0], device=d),
                                 torch.tensor([0, 3], dtype=torch.int32, device=d), 3), "plain"),
    Case("jagged_gather-src_starts", "jagged_gather", "src_starts", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=d), nt(torch.zeros(2, dtype=torch.int64), [0, 1, 2], d),
                                 torch.tensor([0, 3], dtype=torch.int32, device=d), 3), "plain"),
    Case("jagged_scatter-grad", "jagged_scatter", "grad", ValueError,
         lambda d: jagged_scatter(good_nested(d), torch.tensor([0], device=d),
                                  torch.tensor([0, 3], dtype=torch.int32, device=d), 8), "plain"),
    Case("mla_forward_padded-q", "mla_forward_padded", "q", ValueError,
         lambda d: mla_forward_padded(good_nested(d, (2, 16), mla_dtype(d)), *mla_inputs(d)[1:], 5, 5), "plain"),
    Case("mla_forward_padded-cu_seqlens_kv", "mla_forward_padded", "cu_seqlens_kv", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d)[:4], good_nested(d, (), torch.int32), 5, 5), "plain"),
    Case("merge_router_topk-indices", "merge_router_topk", "indices", ValueError,
         lambda d: merge_router_topk(good_nested(d, (2,), torch.int64), layout(d)), "nested"),
    Case("merge_router_topk-indices[1]", "merge_router_topk", "indices[1]", ValueError,
         lambda d: merge_router_topk([torch.zeros(8, 2, device=d), good_nested(d, (2,), torch.int64)],
                                     layout(d)), "nested"),
    Case("preprocess_packed_seqs-input_ids", "preprocess_packed_seqs", "input_ids", ValueError,
         lambda d: verl_dropins.preprocess_packed_seqs(good_nested(d), torch.ones(2, 5, dtype=torch.bool, device=d)),
         "plain"),
    Case("postprocess_packed_seqs-attention_mask", "postprocess_packed_seqs", "attention_mask", ValueError,
         lambda d: verl_dropins.postprocess_packed_seqs(
             torch.zeros(1, 8, 4, device=d), psp_with_layout(layout(d)), good_nested(d, (), torch.bool), 2, 5),
         "nested"),
]


@pytest.mark.parametrize("case, device", params(PLAIN_CASES))
def test_nested_where_plain_required(case, device):
    check(case, device)


# --------------------------------------------------------------------------------------------
# 3. Meta tensors: shape inference through every public function; clear errors where host
#    values are needed.

M = "meta"


def _meta_layout(**kw):
    return ThdLayout.from_lengths([3, 5, 0, 7], device=M, **kw)


def _meta_nested(feature=(4,), dtype=torch.float32):
    return nt(torch.zeros((15, *feature), dtype=dtype, device=M), [0, 3, 8, 8, 15], M)


def _shape(x):
    if isinstance(x, torch.Tensor):
        assert x.device.type == "meta", x.device
        return ("nested", *x.values().shape) if x.is_nested else tuple(x.shape)
    if isinstance(x, (tuple, list)):
        return tuple(_shape(y) for y in x)
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    return x


def _mla_meta():
    q = torch.zeros(15, 4, 16, device=M)
    v = torch.zeros(15, 4, 8, device=M)
    cu = torch.tensor([0, 3, 8, 8, 15], dtype=torch.int32, device=M)
    return q, q, v, cu, cu


def _latent_meta(k_pe_heads=1):
    """mla_latent_attention's arguments on Meta: q [15, 4, 192], kv [15, 4, 256], k_pe [15, 1 or 4, 64],
    RoPE tables [9, 64] and positions [15]."""
    from verl_ops._mla_latent import RopePlan

    rope = RopePlan(torch.zeros(9, 64, device=M), torch.zeros(9, 64, device=M),
                    torch.zeros(15, dtype=torch.int64, device=M), True)
    cu = torch.tensor([0, 3, 8, 8, 15], dtype=torch.int32, device=M)
    return (torch.zeros(15, 4, 192, device=M), torch.zeros(15, 4, 256, device=M),
            torch.zeros(15, k_pe_heads, 64, device=M), rope, rope, cu, cu)


_MASK = lambda: torch.zeros(4, 9, dtype=torch.bool, device=M)  # noqa: E731
_SPLIT = lambda: dynamic_cp_split(torch.zeros(15, 4, device=M), 8, lengths=[3, 5, 0, 7])  # noqa: E731

# (id, call, expected shapes); the layout has cp_size=2 (local_rows 10) unless noted.
META_CASES = [
    ("ThdLayout.from_lengths-device_meta", lambda: _meta_layout(cp_size=2).cu_seqlens_padded, (5,)),
    ("ThdLayout.to-meta", lambda: ThdLayout.from_lengths([3, 5]).to(M).cu_seqlens, (3,)),
    ("preprocess_thd-values", lambda: preprocess_thd(torch.zeros(15, 4, device=M), _meta_layout(cp_size=2), 1),
     ((10, 4), (10,))),
    ("preprocess_thd-nested", lambda: preprocess_thd(_meta_nested(), _meta_layout(cp_size=2), 1), ((10, 4), (10,))),
    ("preprocess_thd-padded", lambda: preprocess_thd(torch.zeros(4, 9, 4, device=M), _meta_layout(cp_size=2),
                                                     attention_mask=_MASK()), ((10, 4), (10,))),
    ("preprocess_thd-host_layout", lambda: preprocess_thd(torch.zeros(15, 4, device=M), ThdLayout.from_lengths(
        [3, 5, 0, 7])), ((15, 4), (15,))),
    ("postprocess_thd-nested", lambda: postprocess_thd(torch.zeros(2, 10, 4, device=M), _meta_layout(cp_size=2)),
     ("nested", 15, 4)),
    ("postprocess_thd-values", lambda: postprocess_thd(torch.zeros(15, 4, device=M), _meta_layout(),
                                                       as_nested=False), (15, 4)),
    ("postprocess_thd-padded", lambda: postprocess_thd(torch.zeros(2, 10, 4, device=M), _meta_layout(cp_size=2),
                                                       attention_mask=_MASK()), (4, 9, 4)),
    ("jagged_gather", lambda: jagged_gather(torch.zeros(15, 4, device=M), torch.tensor([0, 8], device=M),
                                            torch.tensor([0, 3, 10], dtype=torch.int32, device=M), 10), (10, 4)),
    ("jagged_scatter", lambda: jagged_scatter(torch.zeros(10, 4, device=M), torch.tensor([0, 8], device=M),
                                              torch.tensor([0, 3, 10], dtype=torch.int32, device=M), 15), (15, 4)),
    ("dynamic_cp_split-nested", lambda: dynamic_cp_split(_meta_nested(), 8, lengths=[3, 5, 0, 7]).batch,
     ("nested", 15, 4)),
    ("dynamic_cp_split-values", lambda: _SPLIT().batch[0], (15, 4)),
    ("dynamic_cp_split-dict", lambda: dynamic_cp_split({"x": _meta_nested(), "adv": torch.zeros(4, device=M)}, 8,
                                                       lengths=[3, 5, 0, 7]).batch, {"x": ("nested", 15, 4),
                                                                                     "adv": (4,)}),
    ("dynamic_cp_merge-nested", lambda: dynamic_cp_merge(_meta_nested(), _SPLIT()), ("nested", 15, 4)),
    ("dynamic_cp_merge-values", lambda: dynamic_cp_merge(torch.zeros(15, 4, device=M), _SPLIT(),
                                                         lengths=[3, 5, 0, 7])[0], (15, 4)),
    ("merge_router_topk-list", lambda: merge_router_topk(
        [torch.zeros(15, 2, dtype=torch.int64, device=M)] * 3, _meta_layout()), ("nested", 15, 3, 2)),
    ("merge_router_topk-tensor", lambda: merge_router_topk(
        torch.zeros(3, 15, 2, dtype=torch.int32, device=M), _meta_layout(), as_nested=False), (15, 3, 2)),
    ("merge_router_topk-padded", lambda: merge_router_topk(
        [torch.zeros(15, 2, dtype=torch.int64, device=M)] * 3, _meta_layout(), attention_mask=_MASK()), (4, 9, 3, 2)),
    ("scatter_router_topk-values", lambda: scatter_router_topk(
        torch.zeros(15, 3, 2, dtype=torch.int16, device=M), _meta_layout())[0], (3, 15, 2)),
    ("scatter_router_topk-nested", lambda: scatter_router_topk(
        _meta_nested((3, 2), torch.int16), _meta_layout(), replay_mask=_meta_nested((), torch.bool)),
     ((3, 15, 2), (15,))),
    ("scatter_router_topk-padded", lambda: scatter_router_topk(
        torch.zeros(4, 9, 3, 2, dtype=torch.int16, device=M), _meta_layout(tp_size=2), tp_rank=1,
        attention_mask=_MASK(), replay_mask=_MASK()), ((3, 9, 2), (9,))),
    ("mla_forward_padded", lambda: mla_forward_padded(*_mla_meta(), 7, 7), (15, 4, 8)),
    ("mla_forward_padded-validate", lambda: mla_forward_padded(*_mla_meta(), 7, 7, validate=True), (15, 4, 8)),
    ("mla_thd_core_attention", lambda: mla_thd_core_attention(
        *_mla_meta()[:3], SimpleNamespace(cu_seqlens_q=_mla_meta()[3], cu_seqlens_kv=_mla_meta()[3],
                                          max_seqlen_q=7, max_seqlen_kv=7)), (15, 32)),
    ("postprocess_packed_seqs-attached_layout", lambda: verl_dropins.postprocess_packed_seqs(
        torch.zeros(1, 15, 4, device=M), psp_with_layout(_meta_layout()), _MASK(), 4, 9), (4, 9, 4)),
    ("postprocess_thd_engine-attached_layout", lambda: verl_dropins.postprocess_thd_engine(
        torch.zeros(1, 15, 4, device=M), psp_with_layout(_meta_layout()), _meta_nested(), 4), ("nested", 15, 4)),
    ("set_router_replay_data-attached_layout", lambda: verl_router.set_router_replay_data(
        _meta_nested((3, 2), torch.int16), None, TF_CONFIG, packed_seq_params=psp_with_layout(_meta_layout())),
     ((3, 15, 2), None)),
    ("merge_router_topk_indices-attached_layout", lambda: verl_router.merge_router_topk_indices(
        None, _meta_nested((), torch.int64), [torch.zeros(15, 2, dtype=torch.int64, device=M)] * 3, TF_CONFIG,
        packed_seq_params=psp_with_layout(_meta_layout())), ("nested", 15, 3, 2)),
    ("mla_cp_attention-no_group", lambda: verl_ops.mla_cp_attention(*_mla_meta()[:4], 7), (15, 4, 8)),
    ("mla_rope", lambda: verl_ops.mla_rope(torch.zeros(15, 4, 8, device=M), torch.zeros(9, 8, device=M),
                                           torch.zeros(9, 8, device=M), torch.zeros(15, dtype=torch.int64, device=M)),
     (15, 4, 8)),
    ("mla_latent_attention", lambda: verl_ops.mla_latent_attention(*_latent_meta(), 7, 7), (15, 4, 128)),
    ("mla_latent_attention-k_pe_per_head", lambda: verl_ops.mla_latent_attention(
        *_latent_meta(k_pe_heads=4), 7, 7, softmax_scale=0.1), (15, 4, 128)),
    ("vocab_parallel_log_probs", lambda: verl_ops.vocab_parallel_log_probs(
        torch.zeros(2, 15, 32, device=M, dtype=torch.bfloat16), torch.zeros(2, 15, dtype=torch.int64, device=M)),
     (2, 15)),
    ("cuda_available", lambda: verl_ops.cuda_available(), verl_ops.cuda_available()),
]


@pytest.mark.parametrize("name, call, want", META_CASES, ids=[c[0] for c in META_CASES])
def test_meta_shape_inference(name, call, want):
    assert _shape(call()) == want


def test_meta_cases_cover_every_public_function():
    """Every name of verl_ops.__all__ has a meta case or is host-only by design (documented)."""
    host_only = {
        "DynamicCPGroups": "process groups; no tensors",
        "DynamicCPPlan": "the result of plan_dynamic_cp",
        "plan_dynamic_cp": "decides from the lengths' values: host lengths only (see META_HOST_CASES)",
        "__version__": "a string",
        "mla_cache_info": "process-wide counters of the varlen plan cache, read on the host; no tensor arguments",
    }
    covered = {c[0].split("-")[0].split(".")[0] for c in META_CASES}
    missing = [n for n in verl_ops.__all__ if n not in covered and n not in host_only]
    assert not missing, missing


META_HOST_CASES = [
    Case("from_lengths-meta", "ThdLayout.from_lengths", "lengths", ValueError,
         lambda d: ThdLayout.from_lengths(torch.tensor([3, 5], device=M)), "needs host lengths"),
    Case("from_padded_offsets-meta_offsets", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", ValueError,
         lambda d: ThdLayout.from_padded_offsets([3, 5], torch.tensor([0, 4, 8], device=M)), "needs host offsets"),
    Case("from_padded_offsets-meta_lengths", "ThdLayout.from_padded_offsets", "lengths", ValueError,
         lambda d: ThdLayout.from_padded_offsets(torch.tensor([3, 5], device=M), torch.tensor([0, 4, 8])),
         "needs host lengths"),
    Case("from_nested-meta", "ThdLayout.from_nested", "x", ValueError,
         lambda d: ThdLayout.from_nested(_meta_nested()), "needs host offsets"),
    Case("plan_dynamic_cp-meta", "plan_dynamic_cp", "lengths", ValueError,
         lambda d: plan_dynamic_cp(torch.tensor([3, 5], device=M), 1, 8), "needs host lengths"),
    Case("dynamic_cp_split-meta_no_lengths", "dynamic_cp_split", "batch", ValueError,
         lambda d: dynamic_cp_split(_meta_nested(), 8), "pass lengths="),
    Case("dynamic_cp_split-meta_wrong_count", "dynamic_cp_split", "batch", ValueError,
         lambda d: dynamic_cp_split(_meta_nested(), 8, lengths=[3, 12]), "4 sequences but lengths= has 2"),
    Case("jagged_gather-meta_no_total_out", "jagged_gather", "cu_seqlens_out", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=M), torch.tensor([0], device=M),
                                 torch.tensor([0, 3], dtype=torch.int32, device=M)), "total_out="),
    Case("preprocess_packed_seqs-meta_mask", "preprocess_packed_seqs", "attention_mask", ValueError,
         lambda d: verl_dropins.preprocess_packed_seqs(torch.zeros(4, 9, device=M), _MASK()), "needs host lengths"),
    Case("postprocess_packed_seqs-meta_no_layout", "postprocess_packed_seqs", "attention_mask", ValueError,
         lambda d: verl_dropins.postprocess_packed_seqs(
             torch.zeros(1, 16, device=M), SimpleNamespace(cu_seqlens_q_padded=_meta_layout().cu_seqlens_padded),
             _MASK(), 4, 9), "needs host lengths"),
    Case("preprocess_thd_engine-meta", "preprocess_thd_engine", "input_ids", ValueError,
         lambda d: verl_dropins.preprocess_thd_engine(_meta_nested()), "needs host offsets"),
    Case("postprocess_thd_engine-meta_no_layout", "postprocess_thd_engine", "input_ids", ValueError,
         lambda d: verl_dropins.postprocess_thd_engine(
             torch.zeros(1, 16, 4, device=M), SimpleNamespace(cu_seqlens_q_padded=None), _meta_nested(), 4),
         "needs host offsets"),
    Case("merge_router_topk_indices-meta_no_layout", "merge_router_topk_indices", "the batch", ValueError,
         lambda d: verl_router.merge_router_topk_indices(
             None, _meta_nested(), [torch.zeros(16, 2, dtype=torch.int64, device=M)], TF_CONFIG),
         "needs host lengths"),
    Case("set_router_replay_data-meta_mask", "set_router_replay_data", "attention_mask", ValueError,
         lambda d: verl_router.set_router_replay_data(
             torch.zeros(4, 9, 3, 2, dtype=torch.int16, device=M), _MASK(), TF_CONFIG), "needs host lengths"),
]


@pytest.mark.parametrize("case, device", params(META_HOST_CASES, host_only_ids={c.id for c in META_HOST_CASES}))
def test_meta_needs_host_values(case, device):
    check(case, device)


# --------------------------------------------------------------------------------------------
# 4. Clear messages for the other arguments of every public function.


def _pre(d, **kw):
    return preprocess_thd(torch.zeros(8, 4, device=d), layout(d, cp_size=2), **kw)


def _cu(values, d, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=d)


def _cp_call(d, **kw):
    q = torch.zeros(4, 2, 8, device=d)
    return verl_ops.mla_cp_attention(q, q, q[..., :4], _cu([0, 4], d), 4, **kw)


def _lz(d, *shape, dtype=None):
    """Zeros of MLA's dtype on ``d`` (float32 on the CPU, bfloat16 on CUDA) unless ``dtype``."""
    return torch.zeros(shape, dtype=mla_dtype(d) if dtype is None else dtype, device=d)


def _latent_api_inputs(d):
    """A valid mla_latent_attention call's arguments: q [8, 2, 192], kv [8, 2, 256], k_pe [8, 1, 64],
    RoPE plans (tables [9, 64], positions [8]), offsets [0, 3, 8], max_seqlen 5."""
    from verl_ops._mla_latent import RopePlan

    rope = RopePlan(_lz(d, 9, 64), _lz(d, 9, 64), torch.zeros(8, dtype=torch.int64, device=d), True)
    return dict(q=_lz(d, 8, 2, 192), kv=_lz(d, 8, 2, 256), k_pe=_lz(d, 8, 1, 64), rope_q=rope, rope_k=rope,
                cu_seqlens_q=_cu([0, 3, 8], d), cu_seqlens_kv=_cu([0, 3, 8], d),
                max_seqlen_q=5, max_seqlen_kv=5)


def _latent_call(d, **bad):
    """mla_latent_attention on :func:`_latent_api_inputs`, the arguments named in ``bad`` replaced."""
    args = _latent_api_inputs(d)
    args.update(bad)
    return verl_ops.mla_latent_attention(**args)


ARG_CASES = [
    # mla_cp_attention: names checked before any collective (the same on every rank)
    Case("mla_cp_attention-cp_layout", "mla_cp_attention", "cp_layout", ValueError,
         lambda d: _cp_call(d, cp_layout="ring"), "one of"),
    Case("mla_cp_attention-backend", "mla_cp_attention", "backend", ValueError,
         lambda d: _cp_call(d, backend="fa4"), "one of"),
    Case("mla_cp_attention-cp_comm_type", "mla_cp_attention", "cp_comm_type", ValueError,
         lambda d: _cp_call(d, cp_comm_type="a2a"), "one of"),
    # mla_rope (its raw op's cases are below)
    Case("mla_rope-x_list", "mla_rope", "x", TypeError,
         lambda d: verl_ops.mla_rope([[[0.0, 1.0]]], *_rope_inputs(d)[1:]), "must be a tensor, got list"),
    Case("mla_rope-positions_nested", "mla_rope", "positions", ValueError,
         lambda d: verl_ops.mla_rope(*_rope_inputs(d)[:3], torch.nested.nested_tensor(
             [_i64([0, 1], d), _i64([2], d)], layout=torch.jagged)), "nested"),
    # vocab_parallel_log_probs (its raw ops' cases are below)
    Case("vocab_parallel_log_probs-logits_list", "vocab_parallel_log_probs", "logits", TypeError,
         lambda d: verl_ops.vocab_parallel_log_probs([[0.0, 1.0]], _i64([0], d)), "must be a tensor, got list"),
    Case("vocab_parallel_log_probs-labels_nested", "vocab_parallel_log_probs", "labels", ValueError,
         lambda d: verl_ops.vocab_parallel_log_probs(torch.zeros(3, 4, device=d), torch.nested.nested_tensor(
             [_i64([0, 1], d), _i64([2], d)], layout=torch.jagged)), "nested"),
    Case("vocab_parallel_log_probs-vocab_start_negative", "vocab_parallel_log_probs", "vocab_start", ValueError,
         lambda d: verl_ops.vocab_parallel_log_probs(torch.zeros(3, 4, device=d), _i64([0, 1, 2], d), vocab_start=-1),
         ">= 0"),
    Case("vocab_parallel_log_probs-labels_shape", "vocab_parallel_log_probs", "labels", ValueError,
         lambda d: verl_ops.vocab_parallel_log_probs(torch.zeros(3, 4, device=d), _i64([0, 1], d)), "logits' shape"),
    Case("vocab_parallel_log_probs-logits_int", "vocab_parallel_log_probs", "logits", ValueError,
         lambda d: verl_ops.vocab_parallel_log_probs(torch.zeros(3, 4, dtype=torch.int32, device=d), _i64([0, 1, 2], d)),
         "float32"),
    Case("mla_cp_attention-cp_comm_type_p2p_contiguous", "mla_cp_attention", "cp_comm_type", ValueError,
         lambda d: _cp_call(d, cp_comm_type="p2p", cp_layout="contiguous"), "zigzag layout only"),
    # ThdLayout
    Case("from_padded_offsets-not_at_0", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", ValueError,
         lambda d: ThdLayout.from_padded_offsets([3, 1], _cu([1, 4, 8], d)), "must start at 0, got 1"),
    Case("from_padded_offsets-decreasing", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", ValueError,
         lambda d: ThdLayout.from_padded_offsets([0, 0], _cu([0, 4, 2], d)), "non-decreasing"),
    Case("from_padded_offsets-too_short", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", ValueError,
         lambda d: ThdLayout.from_padded_offsets([3, 5], _cu([0, 4, 8], d)), "does not fit the lengths"),
    Case("from_padded_offsets-list", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", TypeError,
         lambda d: ThdLayout.from_padded_offsets([3, 5], [0, 4, 8]), "tensor", "cpu"),
    Case("from_padded_offsets-float", "ThdLayout.from_padded_offsets", "cu_seqlens_padded", ValueError,
         lambda d: ThdLayout.from_padded_offsets([3, 5], torch.tensor([0.0, 4, 8], device=d)), "integers"),
    Case("from_lengths-cp_size_2**62+1", "ThdLayout.from_lengths", "cp_size", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], cp_size=2**62 + 1), r"\[1, 2147483647\]", "cpu"),
    Case("from_lengths-tp_size_2**31", "ThdLayout.from_lengths", "tp_size", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], tp_size=2**31), r"\[1, 2147483647\]", "cpu"),
    Case("from_lengths-cp_size_float", "ThdLayout.from_lengths", "cp_size", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], cp_size=2.0), "must be an int", "cpu"),
    Case("from_lengths-tp_size_bool", "ThdLayout.from_lengths", "tp_size", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], tp_size=True), "must be an int", "cpu"),
    Case("from_lengths-cp_layout", "ThdLayout.from_lengths", "cp_layout", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], cp_layout="ring"), "one of", "cpu"),
    Case("from_lengths-cp_layout_int", "ThdLayout.from_lengths", "cp_layout", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], cp_layout=0), "one of", "cpu"),
    Case("from_lengths-fp8_padding_str", "ThdLayout.from_lengths", "fp8_padding", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], fp8_padding="no"), "must be a bool", "cpu"),
    Case("from_lengths-bucket_float", "ThdLayout.from_lengths", "pad_to_length_bucket", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], pad_to_length_bucket=2.5), "must be an int", "cpu"),
    Case("from_lengths-bucket_0", "ThdLayout.from_lengths", "pad_to_length_bucket", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], pad_to_length_bucket=0), "got 0", "cpu"),
    Case("from_lengths-min_local_rows_negative", "ThdLayout.from_lengths", "min_local_rows", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], min_local_rows=-1), "got -1", "cpu"),
    Case("from_lengths-min_local_rows_2**40", "ThdLayout.from_lengths", "min_local_rows", ValueError,
         lambda d: ThdLayout.from_lengths([3, 5], min_local_rows=2**40), "2147483647", "cpu"),
    Case("from_nested-plain", "ThdLayout.from_nested", "x", ValueError,
         lambda d: ThdLayout.from_nested(torch.zeros(8, 4, device=d)), "got a plain tensor"),
    # preprocess_thd / postprocess_thd
    Case("preprocess_thd-x_list", "preprocess_thd", "x", TypeError,
         lambda d: preprocess_thd([1, 2, 3], layout(d)), "must be a tensor", "cpu"),
    Case("preprocess_thd-layout", "preprocess_thd", "layout", TypeError,
         lambda d: preprocess_thd(torch.zeros(8, 4, device=d), [3, 5]), "ThdLayout"),
    Case("preprocess_thd-cp_rank_2", "preprocess_thd", "cp_rank", ValueError, lambda d: _pre(d, cp_rank=2),
         r"\[0, cp_size=2\)"),
    Case("preprocess_thd-cp_rank_2**32", "preprocess_thd", "cp_rank", ValueError,
         lambda d: _pre(d, cp_rank=2**32), "got 4294967296"),
    Case("preprocess_thd-cp_rank_float", "preprocess_thd", "cp_rank", ValueError, lambda d: _pre(d, cp_rank=1.0)),
    Case("preprocess_thd-values_rows", "preprocess_thd", "values", ValueError,
         lambda d: preprocess_thd(torch.zeros(7, 4, device=d), layout(d)), "total_tokens=8"),
    Case("preprocess_thd-mask_0d", "preprocess_thd", "attention_mask", ValueError,
         lambda d: preprocess_thd(torch.zeros(2, 5, device=d), layout(d), attention_mask=torch.tensor(True, device=d)),
         r"\[B=2, S\]"),
    Case("preprocess_thd-mask_int", "preprocess_thd", "attention_mask", ValueError,
         lambda d: preprocess_thd(torch.zeros(2, 5, device=d), layout(d),
                                  attention_mask=torch.ones(2, 5, dtype=torch.int64, device=d)), "must be bool"),
    Case("preprocess_thd-mask_list", "preprocess_thd", "attention_mask", TypeError,
         lambda d: preprocess_thd(torch.zeros(2, 5, device=d), layout(d), attention_mask=[[1, 1]]), "bool tensor"),
    Case("preprocess_thd-mask_counts", "preprocess_thd", "attention_mask", ValueError,
         lambda d: preprocess_thd(torch.zeros(2, 5, device=d), layout(d),
                                  attention_mask=torch.ones(2, 5, dtype=torch.bool, device=d)), "row 0 has 5"),
    Case("preprocess_thd-nested_offsets", "preprocess_thd", "x", ValueError,
         lambda d: preprocess_thd(nt(torch.zeros(8, 4), [0, 4, 8], d), layout(d)), "offsets do not match"),
    Case("preprocess_thd-nested_with_mask", "preprocess_thd", "attention_mask", ValueError,
         lambda d: preprocess_thd(good_nested(d), layout(d), attention_mask=torch.ones(2, 5, dtype=torch.bool,
                                                                                        device=d)), "nested"),
    Case("postprocess_thd-layout", "postprocess_thd", "layout", TypeError,
         lambda d: postprocess_thd(torch.zeros(8, 4, device=d), None), "ThdLayout"),
    Case("postprocess_thd-packed_rows", "postprocess_thd", "packed", ValueError,
         lambda d: postprocess_thd(torch.zeros(7, 4, device=d), layout(d)), "local_rows=8"),
    Case("postprocess_thd-packed_shards", "postprocess_thd", "packed", ValueError,
         lambda d: postprocess_thd(torch.zeros(8, 4, device=d), layout(d, cp_size=2)), "cp_size"),
    Case("postprocess_thd-cp_rank", "postprocess_thd", "cp_rank", ValueError,
         lambda d: postprocess_thd(torch.zeros(8, 4, device=d), layout(d), cp_rank=-1), r"\[0, cp_size=1\)"),
    Case("postprocess_thd-mask_0d", "postprocess_thd", "attention_mask", ValueError,
         lambda d: postprocess_thd(torch.zeros(8, 4, device=d), layout(d), attention_mask=torch.tensor(True, device=d)),
         r"\[B=2, S\]"),
    # jagged_gather / jagged_scatter
    Case("jagged_gather-src_starts_int32", "jagged_gather", "src_starts", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=d), _cu([0], d), _cu([0, 3], d), 3), "int64"),
    Case("jagged_gather-cu_len", "jagged_gather", "cu_seqlens_out", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=d), _cu([0], d, torch.int64), _cu([0, 3, 4], d), 4),
         r"len\(src_starts\) \+ 1"),
    Case("jagged_gather-src_starts_list", "jagged_gather", "src_starts", TypeError,
         lambda d: jagged_gather(torch.zeros(8, device=d), [0], _cu([0, 3], d), 3), "tensor"),
    Case("jagged_gather-total_out_negative", "jagged_gather", "total_out", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=d), _cu([0], d, torch.int64), _cu([0, 3], d), -1), "got -1"),
    Case("jagged_gather-total_out_float", "jagged_gather", "total_out", ValueError,
         lambda d: jagged_gather(torch.zeros(8, device=d), _cu([0], d, torch.int64), _cu([0, 3], d), 3.0),
         "must be an int"),
    Case("jagged_gather-out_of_range", "jagged_gather", "src_starts", RuntimeError,
         lambda d: jagged_gather(torch.zeros(8, device=d), _cu([6], d, torch.int64), _cu([0, 3], d), 3),
         "outside the 8 rows of values"),
    Case("jagged_scatter-overlap", "jagged_scatter", "src_starts", RuntimeError,
         lambda d: jagged_scatter(torch.zeros(6, device=d), _cu([0, 2], d, torch.int64), _cu([0, 3, 6], d), 8),
         "overlapping"),
    Case("jagged_scatter-total_in_negative", "jagged_scatter", "total_in", ValueError,
         lambda d: jagged_scatter(torch.zeros(3, device=d), _cu([0], d, torch.int64), _cu([0, 3], d), -8), "got -8"),
    Case("jagged_scatter-total_in_str", "jagged_scatter", "total_in", ValueError,
         lambda d: jagged_scatter(torch.zeros(3, device=d), _cu([0], d, torch.int64), _cu([0, 3], d), "8"),
         "must be an int"),
    # plan_dynamic_cp / dynamic_cp_split / dynamic_cp_merge / DynamicCPGroups
    Case("plan_dynamic_cp-dp_size", "plan_dynamic_cp", "dp_size", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 0, 8), ">= 1", "cpu"),
    Case("plan_dynamic_cp-dp_size_float", "plan_dynamic_cp", "dp_size", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 2.0, 8), "int", "cpu"),
    Case("plan_dynamic_cp-max_seqlen", "plan_dynamic_cp", "max_seqlen_per_dp_cp_rank", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 1, 0), ">= 1", "cpu"),
    Case("plan_dynamic_cp-max_seqlen_2**64", "plan_dynamic_cp", "max_seqlen_per_dp_cp_rank", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 1, 2**64), "2\\*\\*31 - 1", "cpu"),
    Case("plan_dynamic_cp-dp_rank", "plan_dynamic_cp", "dp_rank", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 2, 8, dp_rank=2), r"\[0, dp_size=2\)", "cpu"),
    Case("plan_dynamic_cp-assignment", "plan_dynamic_cp", "assignment", ValueError,
         lambda d: plan_dynamic_cp([3, 5], 2, 8, assignment="lpt"), "one of", "cpu"),
    Case("plan_dynamic_cp-too_long", "plan_dynamic_cp", "the longest sequence", ValueError,
         lambda d: plan_dynamic_cp([3, 50], 2, 8), "dp_size is 2", "cpu"),
    Case("dynamic_cp_split-batch_list", "dynamic_cp_split", "batch", TypeError,
         lambda d: dynamic_cp_split([1, 2], 8), "must be a tensor", "cpu"),
    Case("dynamic_cp_split-max_seqlen", "dynamic_cp_split", "max_seqlen_per_dp_cp_rank", ValueError,
         lambda d: dynamic_cp_split(good_nested(d), 0), ">= 1"),
    Case("dynamic_cp_split-values_rows", "dynamic_cp_split", "values", ValueError,
         lambda d: dynamic_cp_split(torch.zeros(7, device=d), 8, lengths=[3, 5]), r"sum\(lengths\)=8"),
    Case("dynamic_cp_merge-outputs_list", "dynamic_cp_merge", "outputs", TypeError,
         lambda d: dynamic_cp_merge([1, 2], split_of()), "tensors", "cpu"),
    Case("dynamic_cp_merge-count", "dynamic_cp_merge", "outputs", ValueError,
         lambda d: dynamic_cp_merge(good_nested(d), split_of((1, 2, 3))), "have 2"),
    Case("dynamic_cp_merge-lengths_dict", "dynamic_cp_merge", "lengths", ValueError,
         lambda d: dynamic_cp_merge({"x": torch.zeros(5, device=d)}, split_of(), lengths=[2, 3]), "dict"),
    Case("DynamicCPGroups-no_dist", "DynamicCPGroups", "torch.distributed", RuntimeError,
         lambda d: DynamicCPGroups(), "not initialized", "cpu"),
    # merge_router_topk / scatter_router_topk
    Case("merge_router_topk-layout", "merge_router_topk", "layout", TypeError,
         lambda d: merge_router_topk([torch.zeros(8, 2, device=d)], "layout"), "ThdLayout"),
    Case("merge_router_topk-indices_2d", "merge_router_topk", "indices", ValueError,
         lambda d: merge_router_topk(torch.zeros(8, 2, dtype=torch.int64, device=d), layout(d)), r"\[L, T_local_sp, K\]"),
    Case("merge_router_topk-indices_empty", "merge_router_topk", "indices", ValueError,
         lambda d: merge_router_topk([], layout(d)), "non-empty", "cpu"),
    Case("merge_router_topk-rows", "merge_router_topk", "indices", ValueError,
         lambda d: merge_router_topk([torch.zeros(7, 2, dtype=torch.int64, device=d)], layout(d)), "7 rows"),
    Case("merge_router_topk-tp_group", "merge_router_topk", "tp_group", ValueError,
         lambda d: merge_router_topk([torch.zeros(4, 2, dtype=torch.int64, device=d)], layout(d, tp_size=2)),
         ),
    Case("merge_router_topk-mask_0d", "merge_router_topk", "attention_mask", ValueError,
         lambda d: merge_router_topk([torch.zeros(8, 2, dtype=torch.int64, device=d)], layout(d),
                                     attention_mask=torch.tensor(True, device=d)), r"\[B=2, S\]"),
    Case("scatter_router_topk-mask_0d", "scatter_router_topk", "attention_mask", ValueError,
         lambda d: scatter_router_topk(torch.zeros(2, 5, 2, 2, dtype=torch.int16, device=d), layout(d),
                                       attention_mask=torch.tensor(True, device=d)), r"\[B=2, S\]"),
    Case("scatter_router_topk-mask_0d_values", "scatter_router_topk", "attention_mask", ValueError,
         lambda d: scatter_router_topk(torch.zeros(8, 2, 2, dtype=torch.int16, device=d), layout(d),
                                       attention_mask=torch.tensor(True, device=d)), r"\[B=2, S\]"),
    Case("scatter_router_topk-mask_list", "scatter_router_topk", "attention_mask", TypeError,
         lambda d: scatter_router_topk(torch.zeros(2, 5, 2, 2, dtype=torch.int16, device=d), layout(d),
                                       attention_mask=[[True]]), "bool tensor"),
    Case("scatter_router_topk-routes_list", "scatter_router_topk", "routes", TypeError,
         lambda d: scatter_router_topk([[1]], layout(d)), "must be a tensor", "cpu"),
    Case("scatter_router_topk-routes_rows", "scatter_router_topk", "routes", ValueError,
         lambda d: scatter_router_topk(torch.zeros(7, 2, 2, dtype=torch.int16, device=d), layout(d)),
         "total_tokens=8"),
    Case("scatter_router_topk-tp_rank", "scatter_router_topk", "tp_rank", ValueError,
         lambda d: scatter_router_topk(torch.zeros(8, 2, 2, dtype=torch.int16, device=d), layout(d), tp_rank=1),
         r"\[0, 1\)"),
    Case("scatter_router_topk-cp_rank_2**62+1", "scatter_router_topk", "cp_rank", ValueError,
         lambda d: scatter_router_topk(torch.zeros(8, 2, 2, dtype=torch.int16, device=d), layout(d),
                                       cp_rank=2**62 + 1)),
    Case("scatter_router_topk-replay_mask_int", "scatter_router_topk", "replay_mask", ValueError,
         lambda d: scatter_router_topk(torch.zeros(8, 2, 2, dtype=torch.int16, device=d), layout(d),
                                       replay_mask=torch.ones(8, dtype=torch.int64, device=d)), "bool"),
    # mla_forward_padded
    Case("mla-backend", "mla_forward_padded", "backend", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5, 5, backend="flash"), "one of"),
    Case("mla-backend_int", "mla_forward_padded", "backend", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5, 5, backend=1), "one of"),
    Case("mla-q_list", "mla_forward_padded", "q", TypeError,
         lambda d: mla_forward_padded([1.0], *mla_inputs(d)[1:], 5, 5), "tensor"),
    Case("mla-max_seqlen_float", "mla_forward_padded", "max_seqlen_q", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5.5, 5), "must be an int"),
    Case("mla-max_seqlen_negative", "mla_forward_padded", "max_seqlen_kv", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5, -1), "got -1"),
    Case("mla-max_seqlen_2**40", "mla_forward_padded", "max_seqlen_q", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 2**40, 5), "2147483647"),
    Case("mla-causal_str", "mla_forward_padded", "causal", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5, 5, causal="yes"), "bool"),
    Case("mla-softmax_scale_str", "mla_forward_padded", "softmax_scale", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 5, 5, softmax_scale="0.5"), "float"),
    Case("mla-cu_int64", "mla_forward_padded", "cu_seqlens_q", (ValueError, RuntimeError),
         lambda d: mla_forward_padded(*mla_inputs(d)[:3], _cu([0, 3, 8], d, torch.int64), _cu([0, 3, 8], d), 5, 5,
                                      validate=True), "int32"),
    Case("mla-cu_not_at_0", "mla_forward_padded", "cu_seqlens_q", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d)[:3], _cu([1, 3, 8], d), _cu([0, 3, 8], d), 5, 5, validate=True),
         "start at 0"),
    Case("mla-max_seqlen_small", "mla_forward_padded", "max_seqlen_q", ValueError,
         lambda d: mla_forward_padded(*mla_inputs(d), 3, 5, validate=True), "=3"),
    # mla_latent_attention (nested tensors and None: DENSE_API_CASES). The offsets' values (start,
    # order, last entry, max_seqlen against the lengths) are read on the host only: CPU cases.
    # Left out, their errors not naming kv (the argument) or mla_latent_attention (the op):
    # - kv of another dtype than q (or q of another than kv): "mla_latent_attention: k must have q's
    #   dtype torch.float32, got torch.float64" (k, the part of kv, not kv); kv on another device than
    #   q: "k is on meta but q is on cpu"; kv with 3 heads for q's 2: "q's heads (2) must be a
    #   multiple of k's (3)"; kv of 7 rows (k_pe 8): "k_pe must be [7, 1, 64] ... got (8, 1, 64)"
    #   (blames k_pe, which is right).
    # - a RopePlan whose contents do not fit (positions of another length than q's / k_pe's rows,
    #   int32 positions, float64 tables with float32 q, tables [9, 32], a position past the table):
    #   the error is mla_rope's ("mla_rope: positions must be [7] (one per row of x), got [8]"),
    #   raised while computing, naming neither mla_latent_attention nor rope_q / rope_k.
    Case("mla_latent_attention-q_head_dim", "mla_latent_attention", "q", ValueError,
         lambda d: _latent_call(d, q=_lz(d, 8, 2, 160)), r"\[T, H, 192\], got \(8, 2, 160\)"),
    Case("mla_latent_attention-q_2d", "mla_latent_attention", "q", ValueError,
         lambda d: _latent_call(d, q=_lz(d, 8, 192)), r"3-D .*got \(8, 192\)"),
    Case("mla_latent_attention-q_int", "mla_latent_attention", "q", ValueError,
         lambda d: _latent_call(d, q=_lz(d, 8, 2, 192, dtype=torch.int32)),
         "float16, bfloat16, float32 or float64"),
    Case("mla_latent_attention-q_list", "mla_latent_attention", "q", TypeError,
         lambda d: _latent_call(d, q=[1.0]), "must be a tensor, got list"),
    Case("mla_latent_attention-q_heads", "mla_latent_attention", "q", RuntimeError,
         lambda d: _latent_call(d, q=_lz(d, 8, 3, 192)), r"heads \(3\) must be a positive multiple"),
    Case("mla_latent_attention-kv_head_dim", "mla_latent_attention", "kv", ValueError,
         lambda d: _latent_call(d, kv=_lz(d, 8, 2, 192)), r"\[T, H, 256\], got \(8, 2, 192\)"),
    Case("mla_latent_attention-kv_4d", "mla_latent_attention", "kv", ValueError,
         lambda d: _latent_call(d, kv=_lz(d, 1, 8, 2, 256)), "3-D"),
    Case("mla_latent_attention-k_pe_head_dim", "mla_latent_attention", "k_pe", ValueError,
         lambda d: _latent_call(d, k_pe=_lz(d, 8, 1, 32)), r"\[T, H, 64\], got \(8, 1, 32\)"),
    Case("mla_latent_attention-k_pe_heads", "mla_latent_attention", "k_pe", RuntimeError,
         lambda d: _latent_call(d, k_pe=_lz(d, 8, 3, 64)),
         re.escape("[8, 1, 64] (shared by every kv head) or [8, 2, 64]")),
    Case("mla_latent_attention-k_pe_rows", "mla_latent_attention", "k_pe", RuntimeError,
         lambda d: _latent_call(d, k_pe=_lz(d, 7, 1, 64)), r"got \(7, 1, 64\)"),
    Case("mla_latent_attention-k_pe_dtype", "mla_latent_attention", "k_pe", ValueError,
         lambda d: _latent_call(d, k_pe=_lz(d, 8, 1, 64, dtype=torch.float64)), "q's dtype"),
    Case("mla_latent_attention-rope_q_none", "mla_latent_attention", "rope_q", TypeError,
         lambda d: _latent_call(d, rope_q=None), "RopePlan, got NoneType"),
    Case("mla_latent_attention-rope_k_tuple", "mla_latent_attention", "rope_k", TypeError,
         lambda d: _latent_call(d, rope_k=(_lz(d, 9, 64), _lz(d, 9, 64))), "RopePlan, got tuple"),
    Case("mla_latent_attention-rope_k_tensor", "mla_latent_attention", "rope_k", TypeError,
         lambda d: _latent_call(d, rope_k=_lz(d, 9, 64)), "RopePlan, got Tensor"),
    Case("mla_latent_attention-cu_int64", "mla_latent_attention", "cu_seqlens_q", ValueError,
         lambda d: _latent_call(d, cu_seqlens_q=_cu([0, 3, 8], d, torch.int64)), "int32, got torch.int64"),
    Case("mla_latent_attention-cu_float", "mla_latent_attention", "cu_seqlens_kv", ValueError,
         lambda d: _latent_call(d, cu_seqlens_kv=_cu([0, 3, 8], d, torch.float32)),
         "int32, got torch.float32"),
    Case("mla_latent_attention-cu_2d", "mla_latent_attention", "cu_seqlens_kv", ValueError,
         lambda d: _latent_call(d, cu_seqlens_kv=_cu([[0, 3, 8]], d)), r"1-D \[B \+ 1\], got \(1, 3\)"),
    Case("mla_latent_attention-cu_empty", "mla_latent_attention", "cu_seqlens_q", ValueError,
         lambda d: _latent_call(d, cu_seqlens_q=_cu([], d), cu_seqlens_kv=_cu([], d)), r"1-D .*got \(0,\)"),
    Case("mla_latent_attention-cu_entries", "mla_latent_attention", "cu_seqlens_kv", RuntimeError,
         lambda d: _latent_call(d, cu_seqlens_kv=_cu([0, 3, 5, 8], d)),
         r"as many entries as cu_seqlens_q \(3\), got 4"),
    Case("mla_latent_attention-cu_not_at_0", "mla_latent_attention", "cu_seqlens_q", ValueError,
         lambda d: _latent_call(d, cu_seqlens_q=_cu([1, 3, 8], d)), "start at 0", devices="cpu"),
    Case("mla_latent_attention-cu_decreasing", "mla_latent_attention", "cu_seqlens_kv", ValueError,
         lambda d: _latent_call(d, cu_seqlens_q=_cu([0, 3, 5, 8], d), cu_seqlens_kv=_cu([0, 5, 3, 8], d)),
         "non-decreasing, got 5 then 3", devices="cpu"),
    Case("mla_latent_attention-cu_last", "mla_latent_attention", "cu_seqlens_q", ValueError,
         lambda d: _latent_call(d, cu_seqlens_q=_cu([0, 3, 7], d)), "=7 must equal the number of rows 8",
         devices="cpu"),
    Case("mla_latent_attention-cu_kv_rows", "mla_latent_attention", "cu_seqlens_kv", ValueError,
         lambda d: _latent_call(d, kv=_lz(d, 7, 2, 256), k_pe=_lz(d, 7, 1, 64)),
         "=8 must equal the number of rows 7", devices="cpu"),
    Case("mla_latent_attention-max_seqlen_negative", "mla_latent_attention", "max_seqlen_kv", ValueError,
         lambda d: _latent_call(d, max_seqlen_kv=-1), "got -1"),
    Case("mla_latent_attention-max_seqlen_2**40", "mla_latent_attention", "max_seqlen_q", ValueError,
         lambda d: _latent_call(d, max_seqlen_q=2**40), "2147483647"),
    Case("mla_latent_attention-max_seqlen_float", "mla_latent_attention", "max_seqlen_q", ValueError,
         lambda d: _latent_call(d, max_seqlen_q=5.5), "must be an int, got 5.5"),
    Case("mla_latent_attention-max_seqlen_bool", "mla_latent_attention", "max_seqlen_kv", ValueError,
         lambda d: _latent_call(d, max_seqlen_kv=True), "must be an int, got True"),
    Case("mla_latent_attention-max_seqlen_none", "mla_latent_attention", "max_seqlen_q", ValueError,
         lambda d: _latent_call(d, max_seqlen_q=None), "must be an int, got None"),
    Case("mla_latent_attention-max_seqlen_small", "mla_latent_attention", "max_seqlen_q", ValueError,
         lambda d: _latent_call(d, max_seqlen_q=3), "=3", devices="cpu"),
    Case("mla_latent_attention-max_seqlen_kv_small", "mla_latent_attention", "max_seqlen_kv", ValueError,
         lambda d: _latent_call(d, max_seqlen_kv=4), "=4", devices="cpu"),
    Case("mla_latent_attention-softmax_scale_nan", "mla_latent_attention", "softmax_scale", ValueError,
         lambda d: _latent_call(d, softmax_scale=float("nan")), "finite"),
    Case("mla_latent_attention-softmax_scale_inf", "mla_latent_attention", "softmax_scale", ValueError,
         lambda d: _latent_call(d, softmax_scale=float("inf")), "finite"),
    Case("mla_latent_attention-softmax_scale_str", "mla_latent_attention", "softmax_scale", ValueError,
         lambda d: _latent_call(d, softmax_scale="0.5"), "float or None, got '0.5'"),
    Case("mla_latent_attention-softmax_scale_bool", "mla_latent_attention", "softmax_scale", ValueError,
         lambda d: _latent_call(d, softmax_scale=True), "float or None, got True"),
    # drop-ins
    Case("preprocess_packed_seqs-mask_0d", "preprocess_packed_seqs", "attention_mask", ValueError,
         lambda d: verl_dropins.preprocess_packed_seqs(torch.zeros(2, 5, device=d), torch.tensor(True, device=d)),
         r"\[B, S\]"),
    Case("postprocess_packed_seqs-mask_shape", "postprocess_packed_seqs", "attention_mask", ValueError,
         lambda d: verl_dropins.postprocess_packed_seqs(
             torch.zeros(1, 8, 4, device=d), psp_with_layout(layout(d)), torch.ones(2, 5, device=d), 2, 6),
         "seq_len=6"),
    # (an unknown cp_layout raises verl's own ValueError text, word for word: tests/test_verl_bshd.py)
    Case("preprocess_thd_engine-plain", "preprocess_thd_engine", "input_ids", ValueError,
         lambda d: verl_dropins.preprocess_thd_engine(torch.zeros(8, 4, device=d)), JAGGED_MSG),
    Case("postprocess_thd_engine-output", "postprocess_thd_engine", "output", ValueError,
         lambda d: verl_dropins.postprocess_thd_engine(
             torch.zeros(8, 4, device=d), psp_with_layout(layout(d)), good_nested(d), 2), r"\[1, local_rows"),
    Case("postprocess_thd_engine-batch_size", "postprocess_thd_engine", "input_ids", ValueError,
         lambda d: verl_dropins.postprocess_thd_engine(
             torch.zeros(1, 8, 4, device=d), psp_with_layout(layout(d)), good_nested(d), 3), "batch_size=3"),
    Case("set_router_replay_data-routes_list", "set_router_replay_data", "layers_topk_idx", TypeError,
         lambda d: verl_router.set_router_replay_data([1], None, TF_CONFIG), "tensor", "cpu"),
    Case("set_router_replay_data-mask_0d", "set_router_replay_data", "attention_mask", ValueError,
         lambda d: verl_router.set_router_replay_data(
             torch.zeros(2, 5, 2, 2, dtype=torch.int16, device=d), torch.tensor(True, device=d), TF_CONFIG),
         r"\[B, S\]"),
    Case("set_router_replay_data-replay_mask_1d", "set_router_replay_data", "replay_mask", ValueError,
         lambda d: verl_router.set_router_replay_data(
             torch.zeros(2, 5, 2, 2, dtype=torch.int16, device=d), torch.ones(2, 5, dtype=torch.bool, device=d),
             TF_CONFIG, replay_mask=torch.ones(10, dtype=torch.bool, device=d)), r"\[B, S\]"),
    Case("mla_cache_info-capacity_negative", "mla_cache_info", "capacity", ValueError,
         lambda d: verl_ops.mla_cache_info(capacity=-1), "-1", devices="cpu"),
    Case("mla_cache_info-capacity_bool", "mla_cache_info", "capacity", ValueError,
         lambda d: verl_ops.mla_cache_info(capacity=True), "True", devices="cpu"),
    Case("mla_cache_info-capacity_float", "mla_cache_info", "capacity", ValueError,
         lambda d: verl_ops.mla_cache_info(capacity=8.0), "8.0", devices="cpu"),
    Case("merge_router_topk_indices-mask_0d", "merge_router_topk_indices", "attention_mask", ValueError,
         lambda d: verl_router.merge_router_topk_indices(
             torch.tensor(True, device=d), torch.zeros(2, 5, device=d), [torch.zeros(8, 2, device=d)], TF_CONFIG),
         r"\[B, S\]"),
]


@pytest.mark.parametrize("case, device", params(ARG_CASES))
def test_arguments(case, device):
    check(case, device)


def test_every_public_function_has_bad_input_cases():
    """Each name of verl_ops.__all__ that takes arguments appears in some case of this file."""
    ops_named = {c.op.split(".")[0] for c in LENGTH_CASES + NESTED_CASES + PLAIN_CASES + META_HOST_CASES + ARG_CASES}
    # DynamicCPPlan: plan_dynamic_cp's result.
    no_arguments = {"cuda_available", "__version__", "DynamicCPPlan"}
    missing = [n for n in verl_ops.__all__ if n not in ops_named and n not in no_arguments]
    assert not missing, missing


# --------------------------------------------------------------------------------------------
# 5. Raw ops (torch.ops.verl_ops.*), against the ported signatures.

CP_LAYOUT_NAMES = ("zigzag", "contiguous")
BACKEND_NAMES = ("auto", "padded", "native", "varlen")


def _raw_layout(d, cp=2, cp_layout="zigzag", lengths=(3, 5)):
    lay = ThdLayout.from_lengths(list(lengths), cp_size=cp, cp_layout=cp_layout, device=d)
    return lay.cu_seqlens, lay.cu_seqlens_padded, lay.local_rows, lay.total_tokens


def _raw_pre(d, *, cp_size=2, cp_rank=0, cp_layout=0, local_rows=None, values=None, cu=None, cup=None,
             mask=None, layout_kw=None):
    c, cp_, lr, total = _raw_layout(d, **(layout_kw or {}))
    values = torch.zeros(total, 4, device=d) if values is None else values
    return ops.preprocess_thd(values, c if cu is None else cu, cp_ if cup is None else cup,
                              lr if local_rows is None else local_rows, cp_size, cp_rank,
                              cp_layout, False, mask)


def _raw_post(d, *, cp_size=2, cp_rank=-1, cp_layout=0, total_tokens=None, packed=None, cu=None, cup=None,
              mask=None, layout_kw=None):
    c, cp_, lr, total = _raw_layout(d, **(layout_kw or {}))
    packed = torch.zeros(2, lr, 4, device=d) if packed is None else packed
    return ops.postprocess_thd(packed, c if cu is None else cu, cp_ if cup is None else cup,
                               total if total_tokens is None else total_tokens, cp_size, cp_rank,
                               cp_layout, False, mask)


def _contig_total(d):
    """The issue's silent-overflow case: contiguous cp=1 layout with 16 padded rows, and
    cp_size = 2**62 + 1 so that cp_size * 16 wraps to 16 in int64."""
    return _raw_layout(d, cp=1, cp_layout="contiguous", lengths=(16,))


def _raw_scatter(d, *, tp_size=1, tp_rank=0, cp_size=1, cp_rank=0, cp_layout=0, routes=None, local_rows=None,
                 mask=None, replay=None, lengths=(16,), layout_cp=1):
    c, cp_, lr, total = _raw_layout(d, cp=layout_cp, cp_layout="contiguous", lengths=lengths)
    routes = torch.zeros(total, 2, 2, dtype=torch.int16, device=d) if routes is None else routes
    return ops.router_topk_scatter(routes, c, cp_, lr if local_rows is None else local_rows, tp_size, tp_rank,
                                   cp_size, cp_rank, cp_layout, mask, replay)


def _raw_mla(d, *, backend=0, max_q=5, max_kv=5, q=None, v=None, cu_q=None, scale=None):
    q0, k, v0, cq, ckv = mla_inputs(d)
    return ops.mla_forward_padded(q0 if q is None else q, k, v0 if v is None else v, cq if cu_q is None else cu_q,
                                  ckv, max_q, max_kv, True, scale, backend)


def _raw_mla_bwd(d, *, backend=0, grad=None, lse=None):
    q, k, v, cq, ckv = mla_inputs(d)
    out = torch.zeros_like(v)
    lse = torch.zeros(2, 8, device=d) if lse is None else lse
    grad = out if grad is None else grad
    return ops.mla_backward_padded(grad, q, k, v, out, lse, cq, ckv, 5, 5, True, None, backend)


_LATENT_ARGS = ("q", "q_pe", "k", "k_pe", "v", "cu_seqlens_q", "cu_seqlens_kv")


def _latent_args(d, backward=False, *, grad_out=None, out=None, softmax_lse=None, max_seqlen_q=5,
                 max_seqlen_kv=5, softmax_scale=None, **bad):
    """A valid positional mla_latent_forward (or _backward: grad_out and out zeros [8, 2, 128],
    softmax_lse zeros [2, 8]) call, the arguments named in ``bad`` (and the keywords) replaced."""
    args = dict(zip(_LATENT_ARGS, latent_inputs(d)))
    args.update(bad)
    a = list(args.values())
    if backward:
        zero_out = torch.zeros(8, 2, 128, dtype=mla_dtype(d), device=d)
        a = [zero_out.clone() if grad_out is None else grad_out, *a[:5], zero_out if out is None else out,
             torch.zeros(2, 8, device=d) if softmax_lse is None else softmax_lse, *a[5:]]
    return a + [max_seqlen_q, max_seqlen_kv, True, softmax_scale]


def _raw_latent(d, **bad):
    return ops.mla_latent_forward(*_latent_args(d, **bad))


def _raw_latent_bwd(d, **bad):
    return ops.mla_latent_backward(*_latent_args(d, backward=True, **bad))


def _rope_inputs(d):
    """A valid mla_rope call: x [3, 2, 8] float32, cos / sin [4, 8], positions int64 [3]."""
    return (torch.zeros(3, 2, 8, device=d), torch.zeros(4, 8, device=d), torch.zeros(4, 8, device=d),
            _i64([0, 1, 2], d))


def _i32(v, d):
    return torch.tensor(v, dtype=torch.int32, device=d)


def _i64(v, d):
    return torch.tensor(v, dtype=torch.int64, device=d)


RT = RuntimeError
RAW_CASES = [
    # thd_layout (CPU lengths; Meta: the fake kernel rejects what the CPU kernel rejects)
    Case("raw-thd_layout-tp_size_0", "thd_layout", "tp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 0, 1, 0), devices="cpu"),
    Case("raw-thd_layout-cp_size_0", "thd_layout", "cp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 0, 0), devices="cpu"),
    Case("raw-thd_layout-cp_size_2**62+1", "thd_layout", "cp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2**62 + 1, 1), devices="cpu"),
    Case("raw-thd_layout-tp_size_2**31", "thd_layout", "tp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 2**31, 1, 0), devices="cpu"),
    Case("raw-thd_layout-cp_layout_2", "thd_layout", "cp_layout", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, 2), devices="cpu"),
    Case("raw-thd_layout-cp_layout_-1", "thd_layout", "cp_layout", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, -1), devices="cpu"),
    Case("raw-thd_layout-lengths_float", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(torch.tensor([3.0, 5.0]), 1, 1, 0), devices="cpu"),
    Case("raw-thd_layout-lengths_2d", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(_i64([[3, 5]], "cpu"), 1, 1, 0), devices="cpu"),
    Case("raw-thd_layout-lengths_negative", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(_i64([3, -5], "cpu"), 1, 1, 0), devices="cpu"),
    Case("raw-thd_layout-min_local_rows_negative", "thd_layout", "min_local_rows", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, 0, False, -1), devices="cpu"),
    Case("raw-thd_layout-min_local_rows_2**40", "thd_layout", "min_local_rows", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, 0, False, 2**40), devices="cpu"),
    Case("raw-thd_layout-bucket_0", "thd_layout", "pad_to_length_bucket", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, 0, False, None, 0), devices="cpu"),
    Case("raw-thd_layout-bucket_2**40", "thd_layout", "pad_to_length_bucket", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "cpu"), 1, 2, 0, False, None, 2**40), devices="cpu"),
    Case("raw-thd_layout-meta_tp_size_0", "thd_layout", "tp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "meta"), 0, 1, 0), devices="cpu"),
    Case("raw-thd_layout-meta_cp_size_-1", "thd_layout", "cp_size", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "meta"), 1, -1, 0), devices="cpu"),
    Case("raw-thd_layout-meta_cp_layout_5", "thd_layout", "cp_layout", RT,
         lambda d: ops.thd_layout(_i64([3, 5], "meta"), 1, 1, 5), devices="cpu"),
    Case("raw-thd_layout-meta_lengths_float", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(torch.zeros(2, device="meta"), 1, 1, 0), devices="cpu"),
    # thd_layout_info (lengths or offsets on the CPU; a length outside [0, 2**31 - 1] is reported in
    # info[0:2] for the Python layout to raise, see test_ops; everything else raises here)
    Case("raw-thd_layout_info-tp_size_0", "thd_layout_info", "tp_size", RT,
         lambda d: ops.thd_layout_info(_i64([3, 5], "cpu"), False, 0, 1, 0), devices="cpu"),
    Case("raw-thd_layout_info-cp_layout_2", "thd_layout_info", "cp_layout", RT,
         lambda d: ops.thd_layout_info(_i64([0, 3, 5], "cpu"), True, 1, 2, 2), devices="cpu"),
    Case("raw-thd_layout_info-bucket_0", "thd_layout_info", "pad_to_length_bucket", RT,
         lambda d: ops.thd_layout_info(_i64([3, 5], "cpu"), False, 1, 2, 0, False, None, 0), devices="cpu"),
    Case("raw-thd_layout_info-lengths_float", "thd_layout_info", "lengths", RT,
         lambda d: ops.thd_layout_info(torch.tensor([3.0, 5.0]), False), devices="cpu"),
    Case("raw-thd_layout_info-offsets_bool", "thd_layout_info", "offsets", RT,
         lambda d: ops.thd_layout_info(torch.tensor([False, True]), True), devices="cpu"),
    Case("raw-thd_layout_info-offsets_2d", "thd_layout_info", "offsets", RT,
         lambda d: ops.thd_layout_info(_i64([[0, 3, 5]], "cpu"), True), devices="cpu"),
    Case("raw-thd_layout_info-offsets_empty", "thd_layout_info", "offsets", RT,
         lambda d: ops.thd_layout_info(_i64([], "cpu"), True), devices="cpu"),
    Case("raw-thd_layout_info-padded_total_int32", "thd_layout_info", "padded total", RT,
         lambda d: ops.thd_layout_info(_i64([2**31 - 1, 2**31 - 1], "cpu"), False), devices="cpu"),
    Case("raw-thd_layout_info-min_local_rows_empty_batch", "thd_layout_info", "min_local_rows", RT,
         lambda d: ops.thd_layout_info(_i64([0], "cpu"), True, 1, 1, 0, False, 4), devices="cpu"),
    Case("raw-thd_layout_info-meta_cp_size_-1", "thd_layout_info", "cp_size", RT,
         lambda d: ops.thd_layout_info(_i64([0, 3], "meta"), True, 1, -1, 0), devices="cpu"),
    Case("raw-thd_layout_info-meta_offsets_empty", "thd_layout_info", "offsets", RT,
         lambda d: ops.thd_layout_info(torch.zeros(0, dtype=torch.int64, device="meta"), True), devices="cpu"),
    # preprocess_thd
    Case("raw-preprocess_thd-cp_size_2**62+1", "preprocess_thd", "cp_size", RT,
         lambda d: _raw_pre(d, cp_size=2**62 + 1, cp_layout=1, layout_kw=dict(cp=1, cp_layout="contiguous",
                                                                               lengths=(16,)))),
    Case("raw-preprocess_thd-cp_size_2**62+1_zigzag", "preprocess_thd", "cp_size", RT,
         lambda d: _raw_pre(d, cp_size=2**62 + 1)),
    Case("raw-preprocess_thd-cp_rank_2**32", "preprocess_thd", "cp_rank", RT, lambda d: _raw_pre(d, cp_rank=2**32)),
    Case("raw-preprocess_thd-cp_rank_-2", "preprocess_thd", "cp_rank", RT, lambda d: _raw_pre(d, cp_rank=-2)),
    Case("raw-preprocess_thd-cp_size_0", "preprocess_thd", "cp_size", RT, lambda d: _raw_pre(d, cp_size=0)),
    Case("raw-preprocess_thd-cp_layout_7", "preprocess_thd", "cp_layout", RT, lambda d: _raw_pre(d, cp_layout=7)),
    Case("raw-preprocess_thd-local_rows_-1", "preprocess_thd", "local_rows", RT, lambda d: _raw_pre(d, local_rows=-1)),
    Case("raw-preprocess_thd-local_rows_2**61", "preprocess_thd", "local_rows", RT,
         lambda d: _raw_pre(d, local_rows=2**61)),
    Case("raw-preprocess_thd-cu_seqlens_float", "preprocess_thd", "cu_seqlens", RT,
         lambda d: _raw_pre(d, cu=torch.tensor([0.0, 3, 8], device=d)), "int32"),
    Case("raw-preprocess_thd-cu_seqlens_padded_int64", "preprocess_thd", "cu_seqlens_padded", RT,
         lambda d: _raw_pre(d, cup=_i64([0, 4, 8], d)), "int32"),
    Case("raw-preprocess_thd-cu_seqlens_not_at_0", "preprocess_thd", "cu_seqlens", RT,
         lambda d: _raw_pre(d, cu=_i32([1, 3, 8], d)), devices="cpu"),
    Case("raw-preprocess_thd-cu_seqlens_on_cpu", "preprocess_thd", "cu_seqlens", RT,
         lambda d: _raw_pre(d, cu=_i32([0, 3, 8], "cpu"), values=torch.zeros(8, 4, device=d))
         if d != "cpu" else _raw_pre(d, cu=_i32([0, 3, 8], "meta")), "is on"),
    Case("raw-preprocess_thd-values_0d", "preprocess_thd", "values", RT,
         lambda d: _raw_pre(d, values=torch.tensor(1.0, device=d))),
    Case("raw-preprocess_thd-values_rows", "preprocess_thd", "values", RT,
         lambda d: _raw_pre(d, values=torch.zeros(7, 4, device=d)), devices="cpu"),
    Case("raw-preprocess_thd-mask_int", "preprocess_thd", "attention_mask", RT,
         lambda d: _raw_pre(d, values=torch.zeros(2, 5, device=d), mask=torch.ones(2, 5, device=d)), "bool"),
    Case("raw-preprocess_thd-mask_0d", "preprocess_thd", "attention_mask", RT,
         lambda d: _raw_pre(d, values=torch.zeros(2, 5, device=d), mask=torch.tensor(True, device=d))),
    Case("raw-preprocess_thd-meta_cp_size_2**62+1", "preprocess_thd", "cp_size", RT,
         lambda d: _raw_pre("meta", cp_size=2**62 + 1), devices="cpu"),
    Case("raw-preprocess_thd-meta_cp_layout_3", "preprocess_thd", "cp_layout", RT,
         lambda d: _raw_pre("meta", cp_layout=3), devices="cpu"),
    # postprocess_thd
    Case("raw-postprocess_thd-cp_size_2**62+1", "postprocess_thd", "cp_size", RT,
         lambda d: _raw_post(d, cp_size=2**62 + 1, cp_rank=0, cp_layout=1, packed=torch.zeros(16, 4, device=d),
                             layout_kw=dict(cp=1, cp_layout="contiguous", lengths=(16,)))),
    Case("raw-postprocess_thd-cp_rank_5", "postprocess_thd", "cp_rank", RT, lambda d: _raw_post(d, cp_rank=5)),
    Case("raw-postprocess_thd-cp_rank_-2", "postprocess_thd", "cp_rank", RT, lambda d: _raw_post(d, cp_rank=-2)),
    Case("raw-postprocess_thd-cp_rank_2**33", "postprocess_thd", "cp_rank", RT, lambda d: _raw_post(d, cp_rank=2**33)),
    Case("raw-postprocess_thd-cp_layout_-1", "postprocess_thd", "cp_layout", RT, lambda d: _raw_post(d, cp_layout=-1)),
    Case("raw-postprocess_thd-total_tokens_-1", "postprocess_thd", "total_tokens", RT,
         lambda d: _raw_post(d, total_tokens=-1)),
    Case("raw-postprocess_thd-total_tokens_mismatch", "postprocess_thd", "total_tokens", RT,
         lambda d: _raw_post(d, total_tokens=9), devices="cpu"),
    Case("raw-postprocess_thd-packed_0d", "postprocess_thd", "packed", RT,
         lambda d: _raw_post(d, packed=torch.tensor(0.0, device=d))),
    Case("raw-postprocess_thd-packed_shards", "postprocess_thd", "packed", RT,
         lambda d: _raw_post(d, packed=torch.zeros(3, 4, 4, device=d))),
    Case("raw-postprocess_thd-cu_seqlens_decreasing", "postprocess_thd", "cu_seqlens", RT,
         lambda d: _raw_post(d, cu=_i32([0, 3, 2], d)), "non-decreasing", "cpu"),
    Case("raw-postprocess_thd-mask_float", "postprocess_thd", "attention_mask", RT,
         lambda d: _raw_post(d, mask=torch.ones(2, 5, device=d)), "bool"),
    Case("raw-postprocess_thd-meta_cp_rank_9", "postprocess_thd", "cp_rank", RT,
         lambda d: _raw_post("meta", cp_rank=9), devices="cpu"),
    # dynamic_cp_merge's header and index steps
    Case("raw-dynamic_cp_merge_header-lengths_float", "dynamic_cp_merge_header", "lengths", RT,
         lambda d: ops.dynamic_cp_merge_header(torch.zeros(2, device=d), _i64([0, 1], d), 2, 0, 0, 0, 4, 0, 1),
         "int32/int64"),
    Case("raw-dynamic_cp_merge_header-sample_ids_2d", "dynamic_cp_merge_header", "sample_ids", RT,
         lambda d: ops.dynamic_cp_merge_header(_i64([1, 2], d), _i64([0, 1], d).view(1, 2), 2, 3, 0, 0, 4, 0, 1),
         "1-D"),
    Case("raw-dynamic_cp_merge_header-num_samples_too_small", "dynamic_cp_merge_header", "num_samples", RT,
         lambda d: ops.dynamic_cp_merge_header(_i64([1, 2], d), _i64([0, 1], d), 1, 3, 0, 0, 4, 0, 1)),
    Case("raw-dynamic_cp_merge_index-header_width", "dynamic_cp_merge_index", "header", RT,
         lambda d: ops.dynamic_cp_merge_index(torch.zeros(2, 12, dtype=torch.int64, device=d), 2), "9 \\+ 2"),
    Case("raw-dynamic_cp_merge_index-header_int32", "dynamic_cp_merge_index", "header", RT,
         lambda d: ops.dynamic_cp_merge_index(torch.zeros(2, 13, dtype=torch.int32, device=d), 2), "int64"),
    Case("raw-dynamic_cp_merge_index-num_samples_-1", "dynamic_cp_merge_index", "num_samples", RT,
         lambda d: ops.dynamic_cp_merge_index(torch.zeros(2, 7, dtype=torch.int64, device=d), -1)),
    # jagged_gather / jagged_scatter
    Case("raw-jagged_gather-src_starts_int32", "jagged_gather", "src_starts", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i32([0], d), _i32([0, 3], d), 3), "int64"),
    Case("raw-jagged_gather-cu_seqlens_out_int64", "jagged_gather", "cu_seqlens_out", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i64([0], d), _i64([0, 3], d), 3), "int32"),
    Case("raw-jagged_gather-total_out_-1", "jagged_gather", "total_out", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i64([0], d), _i32([0, 3], d), -1)),
    Case("raw-jagged_gather-total_out_mismatch", "jagged_gather", "cu_seqlens_out", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i64([0], d), _i32([0, 3], d), 4), devices="cpu"),
    Case("raw-jagged_gather-src_starts_range", "jagged_gather", "src_starts", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i64([2**62], d), _i32([0, 3], d), 3), devices="cpu"),
    Case("raw-jagged_gather-values_0d", "jagged_gather", "values", RT,
         lambda d: ops.jagged_gather(torch.tensor(1.0, device=d), _i64([0], d), _i32([0, 3], d), 3)),
    Case("raw-jagged_gather-cu_len", "jagged_gather", "cu_seqlens_out", RT,
         lambda d: ops.jagged_gather(torch.zeros(8, device=d), _i64([0], d), _i32([0, 3, 4], d), 4)),
    Case("raw-jagged_scatter-overlap", "jagged_scatter", "src_starts", RT,
         lambda d: ops.jagged_scatter(torch.zeros(6, device=d), _i64([0, 2], d), _i32([0, 3, 6], d), 8),
         "overlapping", "cpu"),
    Case("raw-jagged_scatter-total_in_-1", "jagged_scatter", "total_in", RT,
         lambda d: ops.jagged_scatter(torch.zeros(3, device=d), _i64([0], d), _i32([0, 3], d), -1)),
    Case("raw-jagged_scatter-src_starts_negative", "jagged_scatter", "src_starts", RT,
         lambda d: ops.jagged_scatter(torch.zeros(3, device=d), _i64([-1], d), _i32([0, 3], d), 8), devices="cpu"),
    Case("raw-jagged_scatter-meta_src_starts_int32", "jagged_scatter", "src_starts", RT,
         lambda d: ops.jagged_scatter(torch.zeros(3, device="meta"), _i32([0], "meta"), _i32([0, 3], "meta"), 8),
         "int64", "cpu"),
    # router_topk_record
    Case("raw-router_topk_record-float", "router_topk_record", "indices", RT,
         lambda d: ops.router_topk_record((torch.zeros(2, 8, 2, device=d))), "integer"),
    Case("raw-router_topk_record-2d", "router_topk_record", "indices", RT,
         lambda d: ops.router_topk_record((torch.zeros(8, 2, dtype=torch.int64, device=d)))),
    Case("raw-router_topk_record-int16_overflow", "router_topk_record", "indices", RT,
         lambda d: ops.router_topk_record((torch.full((2, 8, 2), 40000, dtype=torch.int64, device=d))),
         "int16", "cpu"),
    Case("raw-router_topk_record-total_tokens_-1", "router_topk_record", "total_tokens", RT,
         lambda d: ops.router_topk_record((torch.zeros(2, 8, 2, dtype=torch.int64, device=d)),
                                          _i32([0, 3, 8], d), _i32([0, 3, 8], d), -1)),
    Case("raw-router_topk_record-cu_seqlens_float", "router_topk_record", "cu_seqlens", RT,
         lambda d: ops.router_topk_record((torch.zeros(2, 8, 2, dtype=torch.int64, device=d)),
                                          torch.tensor([0.0, 3, 8], device=d), _i32([0, 3, 8], d), 8), "int32"),
    Case("raw-router_topk_record-mask_int", "router_topk_record", "attention_mask", RT,
         lambda d: ops.router_topk_record((torch.zeros(2, 8, 2, dtype=torch.int64, device=d)),
                                          _i32([0, 3, 8], d), _i32([0, 3, 8], d), 8, torch.ones(2, 5, device=d)),
         "bool"),
    Case("raw-router_topk_record-meta_float", "router_topk_record", "indices", RT,
         lambda d: ops.router_topk_record((torch.zeros(2, 8, 2, device="meta"))), "integer", "cpu"),
    # router_topk_record_layers (the list form; messages are router_topk_record's)
    Case("raw-router_topk_record_layers-float", "router_topk_record", "indices", RT,
         lambda d: ops.router_topk_record_layers([torch.zeros(8, 2, device=d)]), "integer"),
    Case("raw-router_topk_record_layers-dtype_mix", "router_topk_record", "indices[1]", RT,
         lambda d: ops.router_topk_record_layers([torch.zeros(8, 2, dtype=torch.int64, device=d),
                                                  torch.zeros(8, 2, dtype=torch.int32, device=d)]), "same dtype"),
    Case("raw-router_topk_record_layers-rows_mix", "router_topk_record", "indices[1]", RT,
         lambda d: ops.router_topk_record_layers([torch.zeros(8, 2, dtype=torch.int64, device=d),
                                                  torch.zeros(7, 2, dtype=torch.int64, device=d)]), "rows"),
    Case("raw-router_topk_record_layers-3d", "router_topk_record", "indices[0]", RT,
         lambda d: ops.router_topk_record_layers([torch.zeros(2, 8, 2, dtype=torch.int64, device=d)])),
    # router_topk_scatter
    Case("raw-router_topk_scatter-cp_size_2**62+1", "router_topk_scatter", "cp_size", RT,
         lambda d: _raw_scatter(d, cp_size=2**62 + 1, cp_layout=1)),
    Case("raw-router_topk_scatter-cp_rank_2**32", "router_topk_scatter", "cp_rank", RT,
         lambda d: _raw_scatter(d, cp_size=1, cp_rank=2**32)),
    Case("raw-router_topk_scatter-tp_size_0", "router_topk_scatter", "tp_size", RT, lambda d: _raw_scatter(d, tp_size=0)),
    Case("raw-router_topk_scatter-tp_size_2**32+1", "router_topk_scatter", "tp_size", RT,
         lambda d: _raw_scatter(d, tp_size=2**32 + 1)),
    Case("raw-router_topk_scatter-tp_rank_1", "router_topk_scatter", "tp_rank", RT, lambda d: _raw_scatter(d, tp_rank=1)),
    Case("raw-router_topk_scatter-cp_layout_9", "router_topk_scatter", "cp_layout", RT,
         lambda d: _raw_scatter(d, cp_layout=9)),
    Case("raw-router_topk_scatter-local_rows_-4", "router_topk_scatter", "local_rows", RT,
         lambda d: _raw_scatter(d, local_rows=-4)),
    Case("raw-router_topk_scatter-local_rows_tp", "router_topk_scatter", "local_rows", RT,
         lambda d: _raw_scatter(d, tp_size=3), "not divisible by tp_size=3"),
    Case("raw-router_topk_scatter-routes_float", "router_topk_scatter", "routes", RT,
         lambda d: _raw_scatter(d, routes=torch.zeros(16, 2, 2, device=d))),
    Case("raw-router_topk_scatter-routes_2d", "router_topk_scatter", "routes", RT,
         lambda d: _raw_scatter(d, routes=torch.zeros(16, 2, dtype=torch.int16, device=d))),
    Case("raw-router_topk_scatter-replay_mask_int", "router_topk_scatter", "replay_mask", RT,
         lambda d: _raw_scatter(d, replay=torch.ones(16, dtype=torch.int64, device=d)), "bool"),
    Case("raw-router_topk_scatter-mask_0d", "router_topk_scatter", "attention_mask", RT,
         lambda d: _raw_scatter(d, routes=torch.zeros(1, 16, 2, 2, dtype=torch.int16, device=d),
                                mask=torch.tensor(True, device=d))),
    Case("raw-router_topk_scatter-meta_cp_size_2**62+1", "router_topk_scatter", "cp_size", RT,
         lambda d: _raw_scatter("meta", cp_size=2**62 + 1, cp_layout=1), devices="cpu"),
    # mla_forward_padded / mla_backward_padded
    Case("raw-mla_forward_padded-backend_4", "mla_forward_padded", "backend", RT, lambda d: _raw_mla(d, backend=4)),
    Case("raw-mla_forward_padded-backend_-1", "mla_forward_padded", "backend", RT, lambda d: _raw_mla(d, backend=-1)),
    Case("raw-mla_forward_padded-max_seqlen_q_-1", "mla_forward_padded", "max_seqlen_q", RT,
         lambda d: _raw_mla(d, max_q=-1)),
    Case("raw-mla_forward_padded-max_seqlen_kv_2**40", "mla_forward_padded", "max_seqlen_kv", RT,
         lambda d: _raw_mla(d, max_kv=2**40)),
    Case("raw-mla_forward_padded-v_head_dim", "mla_forward_padded", "v", RT,
         lambda d: _raw_mla(d, v=torch.zeros(8, 2, 32, dtype=mla_dtype(d), device=d)), "Dv"),
    Case("raw-mla_forward_padded-q_2d", "mla_forward_padded", "q", RT,
         lambda d: _raw_mla(d, q=torch.zeros(8, 16, dtype=mla_dtype(d), device=d))),
    Case("raw-mla_forward_padded-cu_seqlens_q_int64", "mla_forward_padded", "cu_seqlens_q", RT,
         lambda d: _raw_mla(d, cu_q=_i64([0, 3, 8], d)), "int32"),
    Case("raw-mla_forward_padded-softmax_scale_nan", "mla_forward_padded", "softmax_scale", RT,
         lambda d: _raw_mla(d, scale=float("nan")), "finite"),
    Case("raw-mla_forward_padded-meta_backend_4", "mla_forward_padded", "backend", RT,
         lambda d: ops.mla_forward_padded(*_mla_meta(), 7, 7, True, None, 4), devices="cpu"),
    # The Python-registered ops (their errors are the Python API's: ValueError / RuntimeError).
    Case("raw-dynamic_cp_split-lengths_negative", "dynamic_cp_split", "lengths", ValueError,
         lambda d: ops.dynamic_cp_split(torch.zeros(8, device=d), _i64([9, -1], "cpu"), 8), "must be >= 0"),
    Case("raw-dynamic_cp_split-values_rows", "dynamic_cp_split", "values", ValueError,
         lambda d: ops.dynamic_cp_split(torch.zeros(7, device=d), _i64([3, 5], "cpu"), 8), "sum"),
    Case("raw-dynamic_cp_split-assignment_2", "dynamic_cp_split", "assignment", ValueError,
         lambda d: ops.dynamic_cp_split(torch.zeros(8, device=d), _i64([3, 5], "cpu"), 8, None, 2)),
    Case("raw-dynamic_cp_split-max_seqlen_0", "dynamic_cp_split", "max_seqlen_per_dp_cp_rank", ValueError,
         lambda d: ops.dynamic_cp_split(torch.zeros(8, device=d), _i64([3, 5], "cpu"), 0)),
    Case("raw-dynamic_cp_split-group_name_unknown", "dynamic_cp_split", "group_name", RT,
         lambda d: ops.dynamic_cp_split(torch.zeros(8, device=d), _i64([3, 5], "cpu"), 8, "no-such-group"),
         "not initialized", devices="cpu"),
    Case("raw-dynamic_cp_merge-lengths_2d", "dynamic_cp_merge", "lengths", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([[3, 5]], d), _i64([0, 1], d), 2, 1)),
    Case("raw-dynamic_cp_merge-sample_ids_count", "dynamic_cp_merge", "sample_ids", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0], d), 2, 1)),
    Case("raw-dynamic_cp_merge-num_samples_-1", "dynamic_cp_merge", "num_samples", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), -1, 1)),
    Case("raw-dynamic_cp_merge-lengths_sum", "dynamic_cp_merge", "group 0's outputs", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(9, device=d), _i64([3, 5], d), _i64([0, 1], d), 2, 1), "sum to 8"),
    Case("raw-dynamic_cp_merge-sample_ids_repeat", "dynamic_cp_merge", "sample ids", RT,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([1, 1], d), 2, 1)),
    Case("raw-merge_router_topk-indices_rows", "merge_router_topk", "indices", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(2, 7, 2, dtype=torch.int64, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8), "7 rows"),
    Case("raw-merge_router_topk-tp_group_name", "merge_router_topk", "tp_group_name", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(2, 8, 2, dtype=torch.int64, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8, 2, 1, 0, "no-such-group"), "names no process group"),
    Case("raw-merge_router_topk-tp_group_missing", "merge_router_topk", "tp_size", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(2, 8, 2, dtype=torch.int64, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8, 2), "needs tp_group"),
    Case("raw-merge_router_topk-attention_mask_counts", "merge_router_topk", "attention_mask", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(2, 8, 2, dtype=torch.int64, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8,
                                         attention_mask=torch.ones(2, 5, dtype=torch.bool, device=d)), "row 0"),
    # Found by tests/test_fuzz_raw_ops.py (each once a crash, a hang, a wrong name or a silent accept).
    Case("raw-dynamic_cp_merge-num_samples_2**31", "dynamic_cp_merge", "num_samples", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), 2**31, 1)),
    Case("raw-dynamic_cp_merge-num_samples_2**62", "dynamic_cp_merge", "num_samples", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), 2**62, 1)),
    Case("raw-dynamic_cp_merge-local_cp_size_-1", "dynamic_cp_merge", "local_cp_size", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), 2, -1)),
    Case("raw-dynamic_cp_merge-local_cp_size_2", "dynamic_cp_merge", "local_cp_size", ValueError,
         lambda d: ops.dynamic_cp_merge(torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), 2, 2),
         "without a process group"),
    Case("raw-merge_router_topk-cu_seqlens_padded_float", "merge_router_topk", "cu_seqlens_padded", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)], _i32([0, 3, 8], d),
                                         torch.tensor([0.0, 3.0, 8.0], device=d), 8, 8), "int32"),
    Case("raw-merge_router_topk-layers_dtype", "merge_router_topk", "indices[1]", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d),
                                          torch.zeros(8, 2, dtype=torch.int32, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8)),
    Case("raw-merge_router_topk-attention_mask_1d", "merge_router_topk", "attention_mask", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8,
                                         attention_mask=torch.ones(8, dtype=torch.bool, device=d)), r"\[B, S\]"),
    Case("raw-merge_router_topk-cu_seqlens_0d_with_mask", "merge_router_topk", "cu_seqlens", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)],
                                         torch.tensor(8, dtype=torch.int32, device=d), _i32([0, 3, 8], d), 8, 8,
                                         attention_mask=torch.ones(2, 5, dtype=torch.bool, device=d)), "1-D"),
    Case("raw-merge_router_topk-cu_seqlens_empty_with_mask", "merge_router_topk", "cu_seqlens", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)], _i32([], d),
                                         _i32([0, 3, 8], d), 8, 8,
                                         attention_mask=torch.ones(2, 5, dtype=torch.bool, device=d)), "1-D"),
    Case("raw-merge_router_topk-cu_seqlens_padded_empty_with_mask", "merge_router_topk", "cu_seqlens_padded", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)], _i32([0, 3, 8], d),
                                         _i32([], d), 8, 8,
                                         attention_mask=torch.zeros(2, 5, dtype=torch.bool, device=d)), "1-D"),
    Case("raw-merge_router_topk-indices_float_with_mask", "merge_router_topk", "indices", RT,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, device=d)], _i32([0, 3, 8], d), _i32([0, 3, 8], d), 8, 8,
                                         attention_mask=torch.zeros(2, 5, dtype=torch.bool, device=d)),
         "integer tensor"),
    Case("raw-merge_router_topk-cp_layout_2", "merge_router_topk", "cp_layout", ValueError,
         lambda d: ops.merge_router_topk([torch.zeros(8, 2, dtype=torch.int16, device=d)], _i32([0, 3, 8], d),
                                         _i32([0, 3, 8], d), 8, 8, 1, 1, 2)),
    Case("raw-thd_layout-lengths_int64_max", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(_i64([2**63 - 1], "cpu"), 1, 1, 0, False, 37, 16), "int32", devices="cpu"),
    Case("raw-thd_layout-lengths_uint32", "thd_layout", "lengths", RT,
         lambda d: ops.thd_layout(torch.tensor([3, 5], dtype=torch.uint32), 1, 1, 0), "uint8, int8", devices="cpu"),
    Case("raw-jagged_scatter-total_in_2**40", "jagged_scatter", "cannot allocate the output sized by total_in", RT,
         lambda d: ops.jagged_scatter(torch.zeros(3, 4, device=d), _i64([0], d), _i32([0, 3], d), 2**40)),
    Case("raw-mla_backward_padded-backend_5", "mla_backward_padded", "backend", RT, lambda d: _raw_mla_bwd(d, backend=5)),
    Case("raw-mla_backward_padded-grad_out_shape", "mla_backward_padded", "grad_out", RT,
         lambda d: _raw_mla_bwd(d, grad=torch.zeros(8, 2, 4, dtype=mla_dtype(d), device=d))),
    Case("raw-mla_backward_padded-softmax_lse_shape", "mla_backward_padded", "softmax_lse", RT,
         lambda d: _raw_mla_bwd(d, lse=torch.zeros(8, 2, device=d))),
    # mla_cache_info: host counters, returned on the CPU only.
    Case("raw-mla_cache_info-like_meta", "mla_cache_info", "like", RT,
         lambda d: ops.mla_cache_info(torch.empty(0, device="meta")), "CPU", devices="cpu"),
    Case("raw-mla_cache_info-like_device", "mla_cache_info", "like", RT,
         lambda d: ops.mla_cache_info(torch.empty(0, device="meta" if d == "cpu" else d)), "CPU"),
    # mla_rope (x [rows, heads, dim], cos / sin [table_rows, dim] in x's dtype, int64 positions [rows])
    Case("raw-mla_rope-positions_int32", "mla_rope", "positions", RT,
         lambda d: ops.mla_rope(*_rope_inputs(d)[:3], _i32([0, 1, 2], d)), "int64"),
    Case("raw-mla_rope-positions_short", "mla_rope", "positions", RT,
         lambda d: ops.mla_rope(*_rope_inputs(d)[:3], _i64([0, 1], d)), r"\[3\]"),
    Case("raw-mla_rope-positions_outside_the_table", "mla_rope", "positions", RT,
         lambda d: ops.mla_rope(*_rope_inputs(d)[:3], _i64([0, 4, 1], d)), "outside the 4 rows", devices="cpu"),
    Case("raw-mla_rope-cos_dtype", "mla_rope", "cos", RT,
         lambda d: ops.mla_rope(_rope_inputs(d)[0], _rope_inputs(d)[1].double(), *_rope_inputs(d)[2:]), "dtype"),
    Case("raw-mla_rope-sin_dim", "mla_rope", "sin", RT,
         lambda d: ops.mla_rope(*_rope_inputs(d)[:2], _rope_inputs(d)[2][:, :4], _rope_inputs(d)[3]), r"\[table_rows, 8\]"),
    Case("raw-mla_rope-x_odd_dim", "mla_rope", "rope dim", RT,
         lambda d: ops.mla_rope(torch.zeros(3, 2, 7, device=d), torch.zeros(4, 7, device=d), torch.zeros(4, 7, device=d),
                                _i64([0, 1, 2], d)), "even"),
    Case("raw-mla_rope-x_int", "mla_rope", "x", RT,
         lambda d: ops.mla_rope(torch.zeros(3, 2, 8, dtype=torch.int32, device=d),
                                *(torch.zeros(4, 8, dtype=torch.int32, device=d) for _ in range(2)), _i64([0, 1, 2], d)),
         "float32, float64, float16 or bfloat16"),
    Case("raw-mla_rope_-positions_short", "mla_rope_", "positions", RT,
         lambda d: ops.mla_rope_(*_rope_inputs(d)[:3], _i64([0, 1], d)), r"\[3\]"),
    Case("raw-mla_rope_-x_int", "mla_rope_", "x", RT,
         lambda d: ops.mla_rope_(torch.zeros(3, 2, 8, dtype=torch.int32, device=d),
                                 *(torch.zeros(4, 8, dtype=torch.int32, device=d) for _ in range(2)), _i64([0, 1, 2], d)),
         "float32, float64, float16 or bfloat16"),
    Case("raw-mla_rope_-x_expanded", "mla_rope_", "x", RT,
         lambda d: ops.mla_rope_(torch.zeros(1, 2, 8, device=d).expand(3, 2, 8), *_rope_inputs(d)[1:]),
         "must not overlap itself"),
    Case("raw-mla_rope_-positions_outside_the_table", "mla_rope_", "positions", RT,
         lambda d: ops.mla_rope_(*_rope_inputs(d)[:3], _i64([0, 4, 1], d)), "outside the 4 rows", devices="cpu"),
    # vocab_log_probs_forward / _backward (logits [*, V] floating, labels [*] int64 / int32; the
    # backward's grad_log_probs, logits_max, sum_exp float32 [*])
    Case("raw-vocab_log_probs_forward-logits_int", "vocab_log_probs_forward", "logits", RT,
         lambda d: ops.vocab_log_probs_forward(torch.zeros(3, 5, dtype=torch.int64, device=d), _i64([0, 1, 4], d)),
         "float32, float64, float16 or bfloat16"),
    Case("raw-vocab_log_probs_forward-logits_0d", "vocab_log_probs_forward", "logits", RT,
         lambda d: ops.vocab_log_probs_forward(torch.zeros((), device=d), _i64([0], d)), r"\[\*, vocab\]"),
    Case("raw-vocab_log_probs_forward-labels_shape", "vocab_log_probs_forward", "labels", RT,
         lambda d: ops.vocab_log_probs_forward(torch.zeros(3, 5, device=d), _i64([0, 1], d)), "logits' shape"),
    Case("raw-vocab_log_probs_forward-labels_float", "vocab_log_probs_forward", "labels", RT,
         lambda d: ops.vocab_log_probs_forward(torch.zeros(3, 5, device=d), torch.zeros(3, device=d)),
         "int64 or int32"),
    Case("raw-vocab_log_probs_forward-vocab_start", "vocab_log_probs_forward", "vocab_start", RT,
         lambda d: ops.vocab_log_probs_forward(torch.zeros(3, 5, device=d), _i64([0, 1, 4], d), -1), ">= 0"),
    Case("raw-vocab_log_probs_backward-sum_exp_shape", "vocab_log_probs_backward", "sum_exp", RT,
         lambda d: ops.vocab_log_probs_backward(torch.zeros(3, device=d), torch.zeros(3, 5, device=d),
                                                _i64([0, 1, 4], d), torch.zeros(3, device=d), torch.ones(2, device=d)),
         "labels' shape"),
    Case("raw-vocab_log_probs_backward-grad_dtype", "vocab_log_probs_backward", "grad_log_probs", RT,
         lambda d: ops.vocab_log_probs_backward(torch.zeros(3, dtype=torch.float64, device=d), torch.zeros(3, 5, device=d),
                                                _i64([0, 1, 4], d), torch.zeros(3, device=d), torch.ones(3, device=d)),
         "float32"),
    Case("raw-vocab_log_probs_backward-logits_max_dtype", "vocab_log_probs_backward", "logits_max", RT,
         lambda d: ops.vocab_log_probs_backward(torch.zeros(3, device=d), torch.zeros(3, 5, device=d), _i64([0, 1, 4], d),
                                                torch.zeros(3, dtype=torch.float16, device=d), torch.ones(3, device=d)),
         "float32"),
    Case("raw-mla_cache_info-capacity_negative", "mla_cache_info", "capacity", RT,
         lambda d: ops.mla_cache_info(torch.empty(0), -2), "-2", devices="cpu"),
    # mla_latent_forward / mla_latent_backward (q [Tq, Hq, 128], q_pe [Tq, Hq, 64], k [Tk, Hk, 128],
    # k_pe [Tk, 1 or Hk, 64], v [Tk, Hk, 128]). The CPU and fake (Meta) kernels check in Python
    # (verl_ops/_mla_latent.py: ValueError, RuntimeError for the shapes checked with torch._check),
    # CUDA's in C++ (RuntimeError). Host-only (CPU cases): the offsets' values (start, order, last
    # entry, max_seqlen against the lengths), which the CUDA kernels trust and Meta has none of, and
    # the backward's grad_out / out / softmax_lse, which CUDA checks after the SM90 kernels'
    # availability (a GPU without them gets that error first).
    Case("raw-mla_latent_forward-q_2d", "mla_latent_forward", "q", (ValueError, RT),
         lambda d: _raw_latent(d, q=torch.zeros(8, 128, dtype=mla_dtype(d), device=d)), "3-D"),
    Case("raw-mla_latent_forward-q_head_dim", "mla_latent_forward", "q", (ValueError, RT),
         lambda d: _raw_latent(d, q=torch.zeros(8, 2, 96, dtype=mla_dtype(d), device=d)), "128.*96"),
    Case("raw-mla_latent_forward-q_pe_head_dim", "mla_latent_forward", "q_pe", (ValueError, RT),
         lambda d: _raw_latent(d, q_pe=torch.zeros(8, 2, 32, dtype=mla_dtype(d), device=d)), "64.*32"),
    Case("raw-mla_latent_forward-q_pe_rows", "mla_latent_forward", "q_pe", (ValueError, RT),
         lambda d: _raw_latent(d, q_pe=torch.zeros(7, 2, 64, dtype=mla_dtype(d), device=d)),
         "like q's rows and heads"),
    Case("raw-mla_latent_forward-q_pe_dtype", "mla_latent_forward", "q_pe", (ValueError, RT),
         lambda d: _raw_latent(d, q_pe=torch.zeros(8, 2, 64, dtype=torch.float64, device=d))),
    Case("raw-mla_latent_forward-k_head_dim", "mla_latent_forward", "k", (ValueError, RT),
         lambda d: _raw_latent(d, k=torch.zeros(8, 2, 192, dtype=mla_dtype(d), device=d)), "128.*192"),
    Case("raw-mla_latent_forward-k_pe_heads", "mla_latent_forward", "k_pe", (ValueError, RT),
         lambda d: _raw_latent(d, k_pe=torch.zeros(8, 3, 64, dtype=mla_dtype(d), device=d)),
         re.escape("[8, 1, 64] (shared by every kv head) or [8, 2, 64]")),
    Case("raw-mla_latent_forward-k_pe_rows", "mla_latent_forward", "k_pe", (ValueError, RT),
         lambda d: _raw_latent(d, k_pe=torch.zeros(7, 1, 64, dtype=mla_dtype(d), device=d)), r"\[8, 1, 64\]"),
    Case("raw-mla_latent_forward-v_rows", "mla_latent_forward", "v", (ValueError, RT),
         lambda d: _raw_latent(d, v=torch.zeros(7, 2, 128, dtype=mla_dtype(d), device=d)),
         "like k's rows and heads"),
    Case("raw-mla_latent_forward-v_head_dim", "mla_latent_forward", "v", (ValueError, RT),
         lambda d: _raw_latent(d, v=torch.zeros(8, 2, 64, dtype=mla_dtype(d), device=d)), "128.*64"),
    Case("raw-mla_latent_forward-q_int", "mla_latent_forward", "q", (ValueError, RT),
         lambda d: _raw_latent(d, q=torch.zeros(8, 2, 128, dtype=torch.int32, device=d)), "float16"),
    Case("raw-mla_latent_forward-q_heads", "mla_latent_forward", "q", (ValueError, RT),
         lambda d: _raw_latent(d, q=_lz(d, 8, 3, 128), q_pe=_lz(d, 8, 3, 64)),
         r"heads \(3\) must be a positive multiple"),
    Case("raw-mla_latent_forward-cu_seqlens_q_int64", "mla_latent_forward", "cu_seqlens_q", (ValueError, RT),
         lambda d: _raw_latent(d, cu_seqlens_q=_i64([0, 3, 8], d)), "int32"),
    Case("raw-mla_latent_forward-cu_seqlens_kv_2d", "mla_latent_forward", "cu_seqlens_kv", (ValueError, RT),
         lambda d: _raw_latent(d, cu_seqlens_kv=_cu([[0, 3, 8]], d)), r"1-D \[B \+ 1\]"),
    Case("raw-mla_latent_forward-cu_seqlens_kv_entries", "mla_latent_forward", "cu_seqlens_kv", RT,
         lambda d: _raw_latent(d, cu_seqlens_kv=_cu([0, 3, 5, 8], d)), "as many entries|same length"),
    Case("raw-mla_latent_forward-cu_seqlens_kv_not_at_0", "mla_latent_forward", "cu_seqlens_kv", ValueError,
         lambda d: _raw_latent(d, cu_seqlens_kv=_cu([1, 3, 8], d)), r"start at 0, got \[1\]", devices="cpu"),
    Case("raw-mla_latent_forward-cu_seqlens_q_decreasing", "mla_latent_forward", "cu_seqlens_q", ValueError,
         lambda d: _raw_latent(d, cu_seqlens_q=_cu([0, 5, 3, 8], d), cu_seqlens_kv=_cu([0, 5, 3, 8], d)),
         "non-decreasing, got 5 then 3 at index 1", devices="cpu"),
    Case("raw-mla_latent_forward-cu_seqlens_kv_last", "mla_latent_forward", "cu_seqlens_kv", ValueError,
         lambda d: _raw_latent(d, cu_seqlens_kv=_cu([0, 3, 7], d)), "=7 must equal the number of rows 8",
         devices="cpu"),
    Case("raw-mla_latent_forward-max_seqlen_q_small", "mla_latent_forward", "max_seqlen_q", ValueError,
         lambda d: _raw_latent(d, max_seqlen_q=3), "=3", devices="cpu"),
    Case("raw-mla_latent_forward-max_seqlen_kv_-1", "mla_latent_forward", "max_seqlen_kv", (ValueError, RT),
         lambda d: _raw_latent(d, max_seqlen_kv=-1), r"\[0, 2147483647\], got -1"),
    Case("raw-mla_latent_forward-max_seqlen_q_2**40", "mla_latent_forward", "max_seqlen_q", (ValueError, RT),
         lambda d: _raw_latent(d, max_seqlen_q=2**40), r"\[0, 2147483647\]"),
    Case("raw-mla_latent_forward-softmax_scale_nan", "mla_latent_forward", "softmax_scale", (ValueError, RT),
         lambda d: _raw_latent(d, softmax_scale=float("nan")), "finite"),
    # Meta: the fake kernel's checks (shapes, dtypes, devices, scalars; no values to read).
    Case("raw-mla_latent_forward-meta_q_head_dim", "mla_latent_forward", "q", ValueError,
         lambda d: _raw_latent("meta", q=_lz("meta", 8, 2, 96)), r"\[T, H, 128\] .*got \(8, 2, 96\)", "cpu"),
    Case("raw-mla_latent_forward-meta_q_2d", "mla_latent_forward", "q", ValueError,
         lambda d: _raw_latent("meta", q=_lz("meta", 8, 128)), r"3-D .*got \(8, 128\)", devices="cpu"),
    Case("raw-mla_latent_forward-meta_k_pe_heads", "mla_latent_forward", "k_pe", RT,
         lambda d: _raw_latent("meta", k_pe=_lz("meta", 8, 3, 64)), "shared by every kv head", devices="cpu"),
    Case("raw-mla_latent_forward-meta_v_rows", "mla_latent_forward", "v", RT,
         lambda d: _raw_latent("meta", v=_lz("meta", 7, 2, 128)), "like k's rows and heads", devices="cpu"),
    Case("raw-mla_latent_forward-meta_cu_seqlens_q_int64", "mla_latent_forward", "cu_seqlens_q", ValueError,
         lambda d: _raw_latent("meta", cu_seqlens_q=_i64([0, 3, 8], "meta")), "int32", devices="cpu"),
    Case("raw-mla_latent_forward-meta_max_seqlen_q_-1", "mla_latent_forward", "max_seqlen_q", ValueError,
         lambda d: _raw_latent("meta", max_seqlen_q=-1), "got -1", devices="cpu"),
    Case("raw-mla_latent_forward-meta_softmax_scale_nan", "mla_latent_forward", "softmax_scale", ValueError,
         lambda d: _raw_latent("meta", softmax_scale=float("nan")), "finite", devices="cpu"),
    Case("raw-mla_latent_forward-meta_among_cpu", "mla_latent_forward", "k_pe", ValueError,
         lambda d: _raw_latent(d, k_pe=_lz("meta", 8, 1, 64, dtype=torch.float32)),
         "is on meta but q is on cpu", devices="cpu"),
    Case("raw-mla_latent_backward-meta_softmax_lse_shape", "mla_latent_backward", "softmax_lse", RT,
         lambda d: _raw_latent_bwd("meta", softmax_lse=_lz("meta", 8, 2, dtype=torch.float32)),
         r"\[2, 8\], got \(8, 2\)", devices="cpu"),
    Case("raw-mla_latent_backward-meta_grad_out_shape", "mla_latent_backward", "grad_out", RT,
         lambda d: _raw_latent_bwd("meta", grad_out=_lz("meta", 8, 2, 64)), r"\[8, 2, 128\]", devices="cpu"),
    Case("raw-mla_latent_backward-q_head_dim", "mla_latent_backward", "q", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, q=torch.zeros(8, 2, 96, dtype=mla_dtype(d), device=d)), "128.*96"),
    Case("raw-mla_latent_backward-k_pe_heads", "mla_latent_backward", "k_pe", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, k_pe=torch.zeros(8, 3, 64, dtype=mla_dtype(d), device=d)),
         "shared by every kv head"),
    Case("raw-mla_latent_backward-v_rows", "mla_latent_backward", "v", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, v=torch.zeros(7, 2, 128, dtype=mla_dtype(d), device=d)),
         "like k's rows and heads"),
    Case("raw-mla_latent_backward-q_pe_dtype", "mla_latent_backward", "q_pe", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, q_pe=torch.zeros(8, 2, 64, dtype=torch.float64, device=d))),
    Case("raw-mla_latent_backward-cu_seqlens_kv_int64", "mla_latent_backward", "cu_seqlens_kv",
         (ValueError, RT),
         lambda d: _raw_latent_bwd(d, cu_seqlens_kv=_i64([0, 3, 8], d)), "int32"),
    Case("raw-mla_latent_backward-softmax_scale_nan", "mla_latent_backward", "softmax_scale",
         (ValueError, RT),
         lambda d: _raw_latent_bwd(d, softmax_scale=float("nan")), "finite"),
    Case("raw-mla_latent_backward-cu_seqlens_q_not_at_0", "mla_latent_backward", "cu_seqlens_q", ValueError,
         lambda d: _raw_latent_bwd(d, cu_seqlens_q=_cu([1, 3, 8], d)), "start at 0", devices="cpu"),
    Case("raw-mla_latent_backward-max_seqlen_kv_small", "mla_latent_backward", "max_seqlen_kv", ValueError,
         lambda d: _raw_latent_bwd(d, max_seqlen_kv=4), "=4", devices="cpu"),
    Case("raw-mla_latent_backward-grad_out_shape", "mla_latent_backward", "grad_out", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, grad_out=_lz(d, 8, 2, 64)), r"\[8, 2, 128\], got \(8, 2, 64\)",
         devices="cpu"),
    Case("raw-mla_latent_backward-grad_out_2d", "mla_latent_backward", "grad_out", ValueError,
         lambda d: _raw_latent_bwd(d, grad_out=_lz(d, 8, 256)), r"3-D .*got \(8, 256\)", devices="cpu"),
    Case("raw-mla_latent_backward-out_rows", "mla_latent_backward", "out", (ValueError, RT),
         lambda d: _raw_latent_bwd(d, out=_lz(d, 7, 2, 128)), r"\[8, 2, 128\], got \(7, 2, 128\)",
         devices="cpu"),
    Case("raw-mla_latent_backward-out_dtype", "mla_latent_backward", "out", ValueError,
         lambda d: _raw_latent_bwd(d, out=_lz(d, 8, 2, 128, dtype=torch.float64)), "q's dtype",
         devices="cpu"),
    Case("raw-mla_latent_backward-softmax_lse_dtype", "mla_latent_backward", "softmax_lse", ValueError,
         lambda d: _raw_latent_bwd(d, softmax_lse=_lz(d, 2, 8, dtype=torch.float64)), "dtype torch.float32",
         devices="cpu"),
    Case("raw-mla_latent_backward-softmax_lse_shape", "mla_latent_backward", "softmax_lse", RT,
         lambda d: _raw_latent_bwd(d, softmax_lse=_lz(d, 8, 2, dtype=torch.float32)),
         r"\[2, 8\], got \(8, 2\)", devices="cpu"),
    Case("raw-mla_latent_backward-softmax_lse_1d", "mla_latent_backward", "softmax_lse", ValueError,
         lambda d: _raw_latent_bwd(d, softmax_lse=_lz(d, 16, dtype=torch.float32)), r"2-D \[Hq, Tq\]",
         devices="cpu"),
]

@pytest.mark.parametrize("case, device", params(RAW_CASES))
def test_raw_op_bad_input(case, device):
    check(case, device)


def test_raw_thd_layout_info_offsets_beyond_int64():
    """Offsets whose difference leaves int64 are a bad length (saturated), not undefined arithmetic
    that lands back in range: INT64_MIN + 4 - INT64_MAX wraps to 5."""
    for offsets, bad in (([2**63 - 1, -2**63 + 4], -2**63), ([-2**63, 2**63 - 1], 2**63 - 1), ([0, 3, -2**63], -2**63)):
        _, info = ops.thd_layout_info(_i64(offsets, "cpu"), True)
        assert info[0].item() == len(offsets) - 2 and info[1].item() == bad, (offsets, info[:2])


def test_raw_op_cases_cover_every_op():
    # A case covers the op it calls: its id is raw-<op>-...
    names = {c.op for c in RAW_CASES} | {c.id.split("-")[1] for c in RAW_CASES}
    # (dir(torch.ops.verl_ops) lists only the packets already looked up: ask the dispatcher.)
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("verl_ops::")}
    assert len(registered) >= 14, sorted(registered)
    assert registered <= names, sorted(registered - names)


def test_case_count():
    """The battery holds at least 100 distinct bad inputs."""
    cases = LENGTH_CASES + NESTED_CASES + PLAIN_CASES + META_HOST_CASES + ARG_CASES + RAW_CASES + DENSE_CASES
    assert len({c.id for c in cases}) == len(cases)
    assert len(cases) + len(META_CASES) >= 100


# --------------------------------------------------------------------------------------------
# 6. Dense tensor arguments of every raw op. Each tensor argument of each op (from the schemas in
#    csrc/registration.cpp, csrc/layers/ and the Python-defined ops) given a nested tensor, jagged
#    or strided, or a None where the schema has a Tensor: ValueError / TypeError naming the op and
#    the argument, whichever the dispatch path (recording gradients, no_grad, inference mode).

T, OPT, LIST = "Tensor", "Tensor?", "Tensor[]"
RAW_TENSOR_ARGUMENTS = {
    "thd_layout": [("lengths", T)],
    "thd_layout_info": [("x", T)],
    "preprocess_thd": [("values", T), ("cu_seqlens", T), ("cu_seqlens_padded", T), ("attention_mask", OPT)],
    "postprocess_thd": [("packed", T), ("cu_seqlens", T), ("cu_seqlens_padded", T), ("attention_mask", OPT)],
    "jagged_gather": [("values", T), ("src_starts", T), ("cu_seqlens_out", T)],
    "jagged_scatter": [("grad", T), ("src_starts", T), ("cu_seqlens_out", T)],
    "dynamic_cp_merge_header": [("lengths", T), ("sample_ids", T)],
    "dynamic_cp_merge_index": [("header", T)],
    "dynamic_cp_split": [("values", T), ("lengths", T)],
    "dynamic_cp_merge": [("values", T), ("lengths", T), ("sample_ids", T)],
    "merge_router_topk": [("indices", LIST), ("cu_seqlens", T), ("cu_seqlens_padded", T), ("attention_mask", OPT)],
    "router_topk_record": [("indices", T), ("cu_seqlens", OPT), ("cu_seqlens_padded", OPT), ("attention_mask", OPT)],
    "router_topk_record_layers": [("indices", LIST), ("cu_seqlens", OPT), ("cu_seqlens_padded", OPT),
                                  ("attention_mask", OPT)],
    "router_topk_scatter": [("routes", T), ("cu_seqlens", T), ("cu_seqlens_padded", T), ("attention_mask", OPT),
                            ("replay_mask", OPT)],
    "mla_forward_padded": [("q", T), ("k", T), ("v", T), ("cu_seqlens_q", T), ("cu_seqlens_kv", T)],
    "mla_backward_padded": [("grad_out", T), ("q", T), ("k", T), ("v", T), ("out", T), ("softmax_lse", T),
                            ("cu_seqlens_q", T), ("cu_seqlens_kv", T)],
    "mla_cache_info": [("like", T)],
    "mla_rope": [("x", T), ("cos", T), ("sin", T), ("positions", T)],
    "mla_rope_": [("x", T), ("cos", T), ("sin", T), ("positions", T)],
    "vocab_log_probs_forward": [("logits", T), ("labels", T)],
    "vocab_log_probs_backward": [("grad_log_probs", T), ("logits", T), ("labels", T), ("logits_max", T),
                                 ("sum_exp", T)],
    "mla_latent_forward": [("q", T), ("q_pe", T), ("k", T), ("k_pe", T), ("v", T), ("cu_seqlens_q", T),
                           ("cu_seqlens_kv", T)],
    "mla_latent_backward": [("grad_out", T), ("q", T), ("q_pe", T), ("k", T), ("k_pe", T), ("v", T),
                            ("out", T), ("softmax_lse", T), ("cu_seqlens_q", T), ("cu_seqlens_kv", T)],
}
# Ops whose tensors live on the host (a CUDA tensor is the op's own error, not this battery's).
HOST_OPS = {"thd_layout", "thd_layout_info", "mla_cache_info", "dynamic_cp_split"}


def _raw_valid_args(name, d):
    """A valid positional call of raw op ``name`` on device ``d``, up to its last tensor argument
    (optional tensors None)."""
    c, cp_, lr, total = _raw_layout(d)
    c1, cp1, lr1, total1 = _raw_layout(d, cp=1, cp_layout="contiguous", lengths=(16,))
    q, k, v, cq, ckv = mla_inputs(d)
    header = ops.dynamic_cp_merge_header(_i64([3, 5], d), _i64([0, 1], d), 2, 8, 0, 0, 16, 0, 1)
    return {
        "thd_layout": lambda: [_i64([3, 5], "cpu")],
        "thd_layout_info": lambda: [_i64([3, 5], "cpu")],
        "preprocess_thd": lambda: [torch.zeros(total, 4, device=d), c, cp_, lr, 2, 0, 0, False, None],
        "postprocess_thd": lambda: [torch.zeros(2, lr, 4, device=d), c, cp_, total, 2, -1, 0, False, None],
        "jagged_gather": lambda: [torch.zeros(8, 4, device=d), _i64([0], d), _i32([0, 3], d), 3],
        "jagged_scatter": lambda: [torch.zeros(3, 4, device=d), _i64([0], d), _i32([0, 3], d), 8],
        "dynamic_cp_merge_header": lambda: [_i64([3, 5], d), _i64([0, 1], d), 2, 8, 0, 0, 16, 0, 1],
        "dynamic_cp_merge_index": lambda: [header.view(1, -1), 2],
        "dynamic_cp_split": lambda: [torch.zeros(8, device=d), _i64([3, 5], "cpu"), 8],
        "dynamic_cp_merge": lambda: [torch.zeros(8, device=d), _i64([3, 5], d), _i64([0, 1], d), 2, 1],
        "merge_router_topk": lambda: [[torch.zeros(2, 8, 2, dtype=torch.int64, device=d)], _i32([0, 3, 8], d),
                                      _i32([0, 3, 8], d), 8, 8, 1, 1, 0, None, None, None],
        "router_topk_record": lambda: [torch.zeros(2, 8, 2, dtype=torch.int16, device=d), _i32([0, 3, 8], d),
                                       _i32([0, 3, 8], d), 8, None],
        "router_topk_record_layers": lambda: [[torch.zeros(8, 2, dtype=torch.int16, device=d)] * 2, None, None, 0,
                                              None],
        "router_topk_scatter": lambda: [torch.zeros(total1, 2, 2, dtype=torch.int16, device=d), c1, cp1, lr1, 1, 0,
                                        1, 0, 0, None, None],
        "mla_forward_padded": lambda: [q, k, v, cq, ckv, 5, 5, True, None, 0],
        "mla_backward_padded": lambda: [torch.zeros_like(v), q, k, v, torch.zeros_like(v),
                                        torch.zeros(2, 8, device=d), cq, ckv, 5, 5, True, None, 0],
        "mla_cache_info": lambda: [torch.empty(0)],
        "mla_rope": lambda: list(_rope_inputs(d)),
        "mla_rope_": lambda: list(_rope_inputs(d)),
        "vocab_log_probs_forward": lambda: [torch.zeros(3, 5, device=d), _i64([0, 1, 4], d)],
        "vocab_log_probs_backward": lambda: [torch.zeros(3, device=d), torch.zeros(3, 5, device=d), _i64([0, 1, 4], d),
                                             torch.zeros(3, device=d), torch.ones(3, device=d)],
        "mla_latent_forward": lambda: _latent_args(d),
        "mla_latent_backward": lambda: _latent_args(d, backward=True),
    }[name]()


_BAD_FORMS = {
    "jagged": "a jagged nested tensor",
    "strided": "a strided nested tensor",
    "None": "None",
}


def _bad_form(form, t, d):
    """``t`` (a valid argument; None for an optional one left out) as a ``form`` input."""
    if form == "None":
        return None
    if t is None:
        t = torch.zeros(2, 5, dtype=torch.bool, device=d)
    if form == "jagged":
        return torch.nested.nested_tensor_from_jagged(t, offsets=torch.tensor([0, t.shape[0]], device=t.device))
    return torch.nested.nested_tensor([t, t])


def _dense_call(name, pos, form, d):
    op = getattr(ops, name).default
    args = _raw_valid_args(name, d)
    value = args[pos]
    if isinstance(value, list):
        args[pos] = [_bad_form(form, value[0], d)] + value[1:]
    else:
        args[pos] = _bad_form(form, value, d)
    return op(*args)


def _dense_cases():
    cases = []
    for name, tensors in RAW_TENSOR_ARGUMENTS.items():
        if not hasattr(ops, name):  # router_topk_record_layers: torch >= 2.10 builds only
            continue
        positions = {a.name: i for i, a in enumerate(getattr(ops, name).default._schema.arguments)}
        for arg, kind in tensors:
            for form, what in _BAD_FORMS.items():
                if form == "None" and kind != T:  # None is an optional argument's default; lists: below
                    continue
                expected = "a dense (strided) tensor" + (" or None" if kind == OPT else "")
                cases.append(Case(
                    f"dense-{name}-{arg}-{form}", name, f"{arg}[0]" if kind == LIST else arg,
                    TypeError if form == "None" else ValueError,
                    lambda d, name=name, pos=positions[arg], form=form: _dense_call(name, pos, form, d),
                    re.escape(f"must be {expected}, got {what}"), devices="cpu" if name in HOST_OPS else "any",
                ))
    return cases


DENSE_CASES = _dense_cases()
_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


@pytest.mark.parametrize("case, device", params(DENSE_CASES))
def test_raw_op_dense_arguments(case, device):
    # A nested tensor is caught whatever the mode; a None beside other tensors by the op's Autograd
    # kernel, so not under inference mode (docs/ops.md#errors).
    modes = ("grad", "no_grad") if case.id.endswith("-None") else tuple(_MODES)
    for mode in modes:
        with _MODES[mode]():
            check(case, device)


@pytest.mark.parametrize("case, device", params([c for c in DENSE_CASES if c.id.endswith("-None")]))
def test_raw_op_none_under_inference_mode(case, device):
    """A None for a Tensor argument beside other tensors under inference mode, where no Autograd
    kernel runs: the backend kernel names the op and the argument (the compiled ops' boxed kernels,
    csrc/ops/stable.h; the Python-defined kernels check it themselves)."""
    with torch.inference_mode():
        with pytest.raises((TypeError, RuntimeError), match=rf"^{case.op}: {re.escape(case.arg)} must be "):
            case.call(device)


def test_raw_op_dense_cases_cover_every_tensor_argument():
    """Every op of the namespace is in RAW_TENSOR_ARGUMENTS with exactly its schema's tensor
    arguments, so a new op or argument needs its cases here."""
    registered = set(verl_ops._library.namespace_ops())
    assert registered == {n for n in RAW_TENSOR_ARGUMENTS if hasattr(ops, n)}, registered
    kinds = {"Tensor": T, "Optional[Tensor]": OPT, "List[Tensor]": LIST}
    for name in registered:
        schema = getattr(ops, name).default._schema
        got = [(a.name, kinds[str(a.type)]) for a in schema.arguments if str(a.type) in kinds]
        assert got == RAW_TENSOR_ARGUMENTS[name], (name, got)
    # jagged + strided for every tensor argument, None for every Tensor one
    n_tensor = sum(kind == T for name in registered for _, kind in RAW_TENSOR_ARGUMENTS[name])
    n_all = sum(len(RAW_TENSOR_ARGUMENTS[name]) for name in registered)
    assert len([c for c in DENSE_CASES if c.op in registered]) == 2 * n_all + n_tensor >= 150


@pytest.mark.parametrize("name", [n for n, args in RAW_TENSOR_ARGUMENTS.items() if args[0][1] == LIST])
def test_raw_op_dense_list_argument_none(name):
    """None for a Tensor[] argument, or inside it, is the schema's error, naming the argument."""
    if not hasattr(ops, name):
        pytest.skip(f"{name}: not in this build")
    op = getattr(ops, name).default
    for bad in (None, [None], [torch.zeros(8, 2, dtype=torch.int16), None]):
        args = _raw_valid_args(name, "cpu")
        args[0] = bad
        with pytest.raises(RuntimeError, match=rf"{name}\(\) Expected a value of type 'List\[Tensor\]' for argument "
                                               r"'indices'"):
            op(*args)


def test_raw_op_dense_no_tensor_at_all():
    """A call whose every tensor argument is None (or an empty list) reaches no kernel of a
    device: the op still names the argument, instead of the dispatcher's 'no tensor arguments'."""
    with pytest.raises(TypeError, match=r"^thd_layout: lengths must be a dense \(strided\) tensor, got None$"):
        ops.thd_layout(None)
    with pytest.raises(TypeError, match=r"^router_topk_record: indices must be a dense \(strided\) tensor, got None$"):
        ops.router_topk_record(None)
    with pytest.raises(TypeError, match=r"^mla_cache_info: like must be a dense \(strided\) tensor, got None$"):
        ops.mla_cache_info(None, 4)
    with pytest.raises(TypeError, match=r"^merge_router_topk: cu_seqlens must be a dense \(strided\) tensor"):
        ops.merge_router_topk([], None, None, 0, 0)
    if hasattr(ops, "router_topk_record_layers"):  # an empty list and no offsets: no tensor at all
        with pytest.raises(ValueError, match=r"^router_topk_record_layers: got no tensor \(indices, cu_seqlens, "):
            ops.router_topk_record_layers([])


def test_raw_op_backend_without_kernel_named():
    """A dense tensor of a backend the op has no kernel for reaches the same default kernel (the one
    of an all-None call): it names the argument and the backend instead of the dispatcher's key."""
    q = torch.quantize_per_tensor(torch.tensor([3.0, 5.0]), 1.0, 0, torch.qint32)
    with pytest.raises(NotImplementedError, match=r"^thd_layout: lengths is a quantized cpu tensor but thd_layout "
                                                  r"has no kernel for quantized cpu tensors"):
        ops.thd_layout(q)


def test_raw_op_dense_first_bad_argument_named():
    """Several bad arguments: the first in schema order is named, whichever kind it is."""
    c, cp_, lr, total = _raw_layout("cpu")
    nested = _bad_form("jagged", torch.zeros(total, 4), "cpu")
    with pytest.raises(TypeError, match=r"preprocess_thd: cu_seqlens must be .*, got None"):
        ops.preprocess_thd(torch.zeros(total, 4), None, _bad_form("strided", cp_, "cpu"), lr, 2)
    with pytest.raises(ValueError, match=r"preprocess_thd: values must be .*, got a jagged nested tensor"):
        ops.preprocess_thd(nested, None, cp_, lr, 2)


def test_raw_op_dense_checks_leave_valid_calls_alone():
    """The guards sit where a dense call never goes: valid calls still run, recording gradients,
    under no_grad and under inference mode, with the right result."""
    c, cp_, lr, total = _raw_layout("cpu", cp=1)
    x = torch.arange(total * 2, dtype=torch.float32).view(total, 2)
    for mode in _MODES.values():
        with mode():
            packed, pos = ops.preprocess_thd(x, c, cp_, lr, 1, 0)
            back = ops.postprocess_thd(packed, c, cp_, total, 1, 0)
        assert torch.equal(back, x)
    xg = x.clone().requires_grad_()
    packed, _ = ops.preprocess_thd(xg, c, cp_, lr, 1, 0)
    packed.sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(x))
    targets, _ = ops.router_topk_scatter(*_raw_valid_args("router_topk_scatter", "cpu"))
    assert targets.dtype == torch.int64 and not targets.requires_grad


def test_raw_op_dense_guard_kernels_registered():
    """Every op has the kernels that reject a nested tensor and an all-None call (see
    verl_ops/_library.py), and no CompositeImplicitAutograd kernel (which would decompose it)."""
    for name in verl_ops._library.namespace_ops():
        qual = f"verl_ops::{name}"
        for key in ("CompositeImplicitAutogradNestedTensor", "CompositeExplicitAutogradNonFunctional"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (name, key)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CompositeImplicitAutograd"), name


def _cp_attention(d, **bad):
    q, k, v, cu, _ = mla_inputs(d)
    args = dict(q=q, k=k, v=v, cu_seqlens_padded=cu)
    args.update(bad)
    return verl_ops.mla_cp_attention(args["q"], args["k"], args["v"], args["cu_seqlens_padded"], 5)


# The Python API with the same hole: mla_cp_attention (without CP it called mla_forward_padded,
# whose messages named the wrong function, or read q.shape first).
DENSE_API_CASES = [
    Case(f"mla_cp_attention-{arg}-{form}", "mla_cp_attention", arg, ValueError,
         lambda d, arg=arg, form=form: _cp_attention(d, **{arg: _bad_form(form, mla_inputs(d)[i], d)}),
         "must be a tensor, got NoneType" if form == "None" else r"must be a plain \(strided\) tensor")
    for i, arg in enumerate(("q", "k", "v", "cu_seqlens_padded"))
    for form in _BAD_FORMS
]

# mla_latent_attention: a nested tensor (ValueError) or None (TypeError) for each tensor argument.
DENSE_API_CASES += [
    Case(f"mla_latent_attention-{arg}-{form}", "mla_latent_attention", arg,
         TypeError if form == "None" else ValueError,
         lambda d, arg=arg, form=form: _latent_call(
             d, **{arg: _bad_form(form, _latent_api_inputs(d)[arg], d)}),
         "must be a tensor, got NoneType" if form == "None"
         else r"must be a plain \(strided\) tensor, got a nested")
    for arg in ("q", "kv", "k_pe", "cu_seqlens_q", "cu_seqlens_kv")
    for form in _BAD_FORMS
]


@pytest.mark.parametrize("case, device", params(DENSE_API_CASES))
def test_api_dense_arguments(case, device):
    check(case, device)
