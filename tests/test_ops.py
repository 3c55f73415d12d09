"""The registered ops of the product card: every name exists in torch.ops.verl_ops; the three
Python-registered ones (merge_router_topk, dynamic_cp_split, dynamic_cp_merge) pass opcheck
(schema, fake kernel, autograd registration, AOT dispatch), run under torch.compile(fullgraph=True)
as one node each, and give what docs/ops.md says on one process (the multi-rank cases, compiled too,
are in test_distributed.py)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE_PARAMS
from router_reference import RouterCase

import verl_ops

ops = torch.ops.verl_ops

PRODUCT_CARD = ["preprocess_thd", "postprocess_thd", "merge_router_topk", "dynamic_cp_split", "dynamic_cp_merge",
                "mla_forward_padded"]


def test_product_card_ops_are_registered():
    for name in PRODUCT_CARD:
        packet = getattr(ops, name)
        assert isinstance(packet, torch._ops.OpOverloadPacket), name
        assert packet.default._schema.name == f"verl_ops::{name}"


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


# --------------------------------------------------------------------------------------------
# merge_router_topk (tp = cp = 1: the record step; the gathers are in test_router_dist.py)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_merge_router_topk_op(device, form):
    case = RouterCase(random.Random(form), [5, 0, 9, 3], 3, 4)
    lay = case.layout.to(device)
    rec = [t.to(device) for t in case.recorded(0, 0, form)] if form == "list" else [case.recorded(0, 0, form).to(device)]
    args = (rec, lay.cu_seqlens, lay.cu_seqlens_padded, lay.total_tokens, lay.local_rows)
    out = ops.merge_router_topk(*args)
    assert out.dtype == torch.int16 and torch.equal(out.cpu(), case.routes.to(torch.int16))
    _opcheck(ops.merge_router_topk.default, args)
    mask_routes, mask, _ = case.padded(random.Random(1))
    padded = ops.merge_router_topk(*args, attention_mask=mask.to(device))
    assert torch.equal(padded.cpu(), case.padded_expected(mask))
    _opcheck(ops.merge_router_topk.default, (*args, 1, 1, 0, None, None, mask.to(device)))
    compiled = torch.compile(lambda *a: ops.merge_router_topk(*a) + 0, fullgraph=True)
    assert torch.equal(compiled(*args).cpu(), case.routes.to(torch.int16))


def test_merge_router_topk_op_needs_its_groups():
    case = RouterCase(random.Random(0), [4, 4], 2, 2, cp=2)
    lay = case.layout
    with pytest.raises(ValueError, match="merge_router_topk: cp_size=2 needs cp_group"):
        ops.merge_router_topk([case.recorded(0, 0, "stacked")], lay.cu_seqlens, lay.cu_seqlens_padded,
                              lay.total_tokens, lay.local_rows, 1, 2, 0)


# --------------------------------------------------------------------------------------------
# dynamic_cp_split / dynamic_cp_merge without a process group (dp_size 1: one group)


def _batch(lengths, device, feature=3):
    values = torch.cat([torch.full((n, feature), float(i)) for i, n in enumerate(lengths)]) if lengths else \
        torch.zeros(0, feature)
    return values.to(device), torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_dynamic_cp_split_op_one_group(device):
    values, lengths = _batch([3, 0, 5, 2], device)
    sel, local_lengths, ids, lcs = ops.dynamic_cp_split(values, lengths, 8)
    assert lcs == 1 and ids.tolist() == [0, 1, 2, 3] and local_lengths.tolist() == [3, 0, 5, 2]
    assert torch.equal(sel, values) and sel.data_ptr() != values.data_ptr()
    _opcheck(ops.dynamic_cp_split.default, (values, lengths, 8))
    # Differentiable: the gradient of the selected rows goes back to their rows.
    x = values.clone().requires_grad_()
    out = ops.dynamic_cp_split(x, lengths, 8)[0]
    (out * torch.arange(out.shape[0], device=device).unsqueeze(1)).sum().backward()
    assert torch.equal(x.grad, torch.arange(10, device=device, dtype=x.dtype).unsqueeze(1).expand(10, 3))
    _opcheck(ops.dynamic_cp_split.default, (x, lengths, 8))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_dynamic_cp_merge_op_reorders_by_sample_ids(device):
    # Outputs held in the order 2, 0, 3, 1 (lengths of another size than the inputs): the merge
    # puts sample i's rows at i.
    held = [2, 0, 3, 1]
    out_lengths = {0: 4, 1: 0, 2: 1, 3: 2}
    seqs = [torch.full((out_lengths[i], 2), float(i)) for i in held]
    values = torch.cat(seqs).to(device)
    lengths = torch.tensor([out_lengths[i] for i in held], dtype=torch.int64)
    ids = torch.tensor(held, dtype=torch.int64)
    merged, merged_lengths = ops.dynamic_cp_merge(values, lengths, ids, 4, 1)
    assert merged_lengths.tolist() == [4, 0, 1, 2]
    expected = torch.cat([torch.full((out_lengths[i], 2), float(i)) for i in range(4)])
    assert torch.equal(merged.cpu(), expected)
    _opcheck(ops.dynamic_cp_merge.default, (values, lengths, ids, 4, 1))


def test_dynamic_cp_merge_op_checks_the_header():
    values = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="dynamic_cp_merge: group 0's outputs have 5 rows but their lengths"):
        ops.dynamic_cp_merge(values, torch.tensor([2, 2]), torch.tensor([0, 1]), 2, 1)
    with pytest.raises(RuntimeError, match="dynamic_cp_merge: the groups' sample ids do not cover the 2 samples"):
        ops.dynamic_cp_merge(values, torch.tensor([2, 3]), torch.tensor([1, 1]), 2, 1)


def test_dynamic_cp_ops_compile_fullgraph():
    values, lengths = _batch([3, 7, 2, 0, 5], "cpu")

    def step(v, ls):
        sel, local_lengths, ids, lcs = ops.dynamic_cp_split(v, ls, 8)
        merged, merged_lengths = ops.dynamic_cp_merge(sel * 2 + 1, local_lengths, ids, ls.shape[0], lcs)
        return merged, merged_lengths

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lens in ([3, 7, 2, 0, 5], [1, 2], [8] * 6):
        v, ls = _batch(lens, "cpu")
        merged, merged_lengths = compiled(v, ls)
        assert torch.equal(merged, v * 2 + 1) and merged_lengths.tolist() == lens


def test_python_api_is_a_thin_wrapper_over_the_ops():
    """The Python functions reach the registered ops (one node each under a graph)."""
    seen = []

    class Mode(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name())
            return func(*args, **(kwargs or {}))

    lengths = [3, 1, 4]
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(8.0).unsqueeze(1),
                                                torch.tensor([0, 3, 4, 8]))
    case = RouterCase(random.Random(3), lengths, 2, 2)
    with Mode():
        verl_ops.dynamic_cp_split(nt, 8)
        verl_ops.merge_router_topk(case.recorded(0, 0, "list"), case.layout, as_nested=False)
    assert "verl_ops::dynamic_cp_split" in seen and "verl_ops::merge_router_topk" in seen


# --------------------------------------------------------------------------------------------
# thd_layout_info: the layout's fast path (one op from lengths or nested offsets to every size)


@pytest.mark.parametrize("rules", [dict(), dict(tp_size=2, cp_size=4), dict(cp_size=2, cp_layout=1, fp8_padding=True),
                                   dict(tp_size=2, cp_size=2, min_local_rows=4096, pad_to_length_bucket=96)])
def test_thd_layout_info_matches_thd_layout(rules):
    g = torch.Generator().manual_seed(len(rules))
    lengths = torch.randint(0, 3000, (37,), generator=g)
    lengths[[3, 10]] = 0
    args = (rules.get("tp_size", 1), rules.get("cp_size", 1), rules.get("cp_layout", 0),
            rules.get("fp8_padding", False), rules.get("min_local_rows"), rules.get("pad_to_length_bucket"))
    cu, cu_padded = ops.thd_layout(lengths, *args)
    offsets = torch.cat([torch.tensor([5]), 5 + lengths.cumsum(0)])  # offsets need not start at 0
    for x, is_offsets in ((lengths, False), (lengths.to(torch.int32), False), (offsets, True)):
        both, info = ops.thd_layout_info(x, is_offsets, *args)
        assert both.dtype == torch.int32 and torch.equal(both[0], cu) and torch.equal(both[1], cu_padded)
        padded = cu_padded.diff()
        assert info.tolist() == [-1, 0, int(lengths.sum()), int(cu_padded[-1]), int(padded.max()),
                                 int(lengths.max()), int(lengths.min()), *lengths.tolist()]
        _opcheck(ops.thd_layout_info.default, (x, is_offsets, *args))


def test_thd_layout_info_reports_the_first_bad_length():
    _, info = ops.thd_layout_info(torch.tensor([0, 4, 2, 9, 1]), True)  # lengths 4, -2, 7, -8
    assert info[:2].tolist() == [1, -2]
    _, info = ops.thd_layout_info(torch.tensor([3, 2**31, -1]), False)
    assert info[:2].tolist() == [1, 2**31]
    with pytest.raises(ValueError, match=r"from_lengths: lengths must be >= 0, got lengths\[1\]=-2"):
        verl_ops.ThdLayout.from_nested(torch.nested.nested_tensor_from_jagged(
            torch.zeros(9), offsets=torch.tensor([0, 4, 2, 9])))


def test_thd_layout_info_empty_batch():
    both, info = ops.thd_layout_info(torch.zeros(1, dtype=torch.int64), True, 2, 2)
    assert both.tolist() == [[0], [0]] and info.tolist() == [-1, 0, 0, 0, 0, 0, 0]


def test_docs_op_table_matches_the_registered_schemas():
    """docs/ops.md#op-table lists every registered op with the schema the dispatcher holds."""
    import os
    import re

    import verl_ops.dynamic_cp  # noqa: F401  (Python-registered ops)
    import verl_ops.router  # noqa: F401

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "ops.md")) as f:
        text = f.read()
    documented = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]] if line.startswith("| `") else []
        if len(cells) < 2:
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        schemas = re.findall(r"`(\(.*?\) -> .*?)`(?: / |$)", cells[1])
        if len(names) == len(schemas):
            documented.update(zip(names, schemas))
    registered = sorted(n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                        if n.startswith("verl_ops::"))
    assert registered, "no verl_ops op is registered"
    for name in registered:
        schema = str(getattr(ops, name).default._schema)
        want = schema[schema.index("("):]
        assert name in documented, f"{name} is missing from the op table of docs/ops.md"
        assert documented[name] == want, (name, documented[name], want)
