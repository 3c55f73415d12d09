"""jagged_gather / jagged_scatter: reference, autograd, opcheck, torch.compile, bad input."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DTYPES, random_data, seed_of

import verl_ops
from verl_ops._jagged import jagged_indices

ops = torch.ops.verl_ops


def ref_gather(values, src_starts, lengths):
    """Output sequence j = values[src_starts[j] : src_starts[j] + lengths[j]]."""
    parts = [values[s : s + n] for s, n in zip(src_starts, lengths)]
    return torch.cat(parts) if parts else values[:0]


def ref_scatter(grad, src_starts, lengths, total_in):
    out = torch.zeros((total_in, *grad.shape[1:]), dtype=grad.dtype)
    pos = 0
    for s, n in zip(src_starts, lengths):
        out[s : s + n] = grad[pos : pos + n]
        pos += n
    return out


def random_selection(rng: random.Random, n_in: int, n_out: int, distinct: bool):
    """Source lengths and a selection of them (a permutation subset when distinct)."""
    lengths = [rng.choice([0, 1, 2, 5, 8, 13]) for _ in range(n_in)]
    if distinct:
        sel = rng.sample(range(n_in), min(n_out, n_in))
    else:
        sel = [rng.randrange(n_in) for _ in range(n_out)] if n_in else []
    return lengths, sel


def indices(lengths, sel, device):
    src, cu, total = jagged_indices(lengths, sel, device=device)
    return src, cu, total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature_shape", [(), (3,), (2, 5)], ids=str)
def test_gather_scatter_match_reference(device, rng, dtype, feature_shape):
    g = torch.Generator().manual_seed(seed_of(rng))
    for trial in range(4):
        lengths, sel = random_selection(rng, rng.randint(0, 7), rng.randint(0, 7), distinct=trial % 2 == 0)
        values = random_data((sum(lengths), *feature_shape), dtype, g)
        src, cu, total = indices(lengths, sel, device)
        out = verl_ops.jagged_gather(values.to(device), src, cu, total)
        sel_lengths = [lengths[i] for i in sel]
        expected = ref_gather(values, src.tolist(), sel_lengths)
        assert out.dtype == dtype and out.shape == expected.shape
        assert torch.equal(out.cpu(), expected)
        if trial % 2 == 0:  # scatter needs disjoint spans
            grad = random_data(expected.shape, dtype, g)
            back = verl_ops.jagged_scatter(grad.to(device), src, cu, values.shape[0])
            assert torch.equal(back.cpu(), ref_scatter(grad, src.tolist(), sel_lengths, values.shape[0]))


def test_total_out_defaults_to_last_offset(device):
    values = torch.arange(10.0, device=device)
    src = torch.tensor([6, 0], device=device)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    assert verl_ops.jagged_gather(values, src, cu).tolist() == [6.0, 7.0, 8.0, 0.0, 1.0]


def test_zero_length_sequences_and_empty_batches(device):
    values = torch.arange(12.0, device=device).view(6, 2)
    src = torch.tensor([5, 2, 0, 6], device=device)  # a 0-length span may start at the end
    cu = torch.tensor([0, 0, 3, 3, 3], dtype=torch.int32, device=device)
    out = verl_ops.jagged_gather(values, src, cu, 3)
    assert torch.equal(out, values[2:5])
    back = verl_ops.jagged_scatter(out, src, cu, 6)
    assert torch.equal(back.cpu(), torch.cat([torch.zeros(2, 2), values[2:5].cpu(), torch.zeros(1, 2)]))
    none = torch.zeros(0, dtype=torch.int64, device=device)
    cu0 = torch.zeros(1, dtype=torch.int32, device=device)
    assert verl_ops.jagged_gather(values, none, cu0, 0).shape == (0, 2)
    assert torch.equal(verl_ops.jagged_scatter(values[:0], none, cu0, 6), torch.zeros_like(values))
    assert verl_ops.jagged_gather(values[:0], none, cu0, 0).shape == (0, 2)


def test_autograd_adjoint_and_gradcheck(device, rng):
    lengths, sel = random_selection(rng, 6, 4, distinct=True)
    src, cu, total = indices(lengths, sel, device)
    x = torch.randn(sum(lengths), 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: verl_ops.jagged_gather(v, src, cu, total), (x,))
    y = torch.randn(total, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: verl_ops.jagged_scatter(v, src, cu, x.shape[0]), (y,))
    # <gather(x), y> == <x, scatter(y)>: the two ops are each other's adjoint.
    lhs = (verl_ops.jagged_gather(x, src, cu, total) * y).sum()
    rhs = (x * verl_ops.jagged_scatter(y, src, cu, x.shape[0])).sum()
    torch.testing.assert_close(lhs, rhs)


def test_opcheck(device, rng):
    lengths, sel = random_selection(rng, 5, 4, distinct=True)
    lengths[sel[0]] = max(lengths[sel[0]], 2)
    src, cu, total = indices(lengths, sel, device)
    x = torch.randn(sum(lengths), 4, device=device, requires_grad=True)
    torch.library.opcheck(ops.jagged_gather.default, (x, src, cu, total))
    y = torch.randn(total, 4, device=device, requires_grad=True)
    torch.library.opcheck(ops.jagged_scatter.default, (y, src, cu, x.shape[0]))


def test_compile_fullgraph_dynamic(device, rng):
    torch._dynamo.reset()

    def fn(values, src, cu, total):
        return verl_ops.jagged_gather(values * 2, src, cu, total).sum(0)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for n_in in (5, 8):
        lengths, sel = random_selection(rng, n_in, n_in - 1, distinct=True)
        lengths[sel[0]] = 3
        src, cu, total = indices(lengths, sel, device)
        x = torch.randn(sum(lengths), 2, device=device, requires_grad=True)
        out = compiled(x, src, cu, total)
        torch.testing.assert_close(out, fn(x, src, cu, total))
        out.sum().backward()
        expected = torch.zeros_like(x)
        for s, n in zip(src.tolist(), [lengths[i] for i in sel]):
            expected[s : s + n] = 2
        torch.testing.assert_close(x.grad, expected)


def _i64(v, device):
    return torch.tensor(v, dtype=torch.int64, device=device)


def _i32(v, device):
    return torch.tensor(v, dtype=torch.int32, device=device)


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_bad_input(device, op):
    values = torch.arange(10.0, device=device)
    fn = verl_ops.jagged_gather if op == "gather" else verl_ops.jagged_scatter
    name = "jagged_gather" if op == "gather" else "jagged_scatter"
    data_rows = 10 if op == "gather" else 4
    data = values[:data_rows]
    last = 4 if op == "gather" else 10  # total_out / total_in

    def call(src, cu, total=last, x=data):
        return fn(x, src, cu, total)

    # Span outside the source rows (gather) / output rows (scatter).
    with pytest.raises(RuntimeError, match=f"{name}: src_starts\\[1\\]=8 with length 3 is outside"):
        call(_i64([0, 8], device), _i32([0, 1, 4], device))
    with pytest.raises(RuntimeError, match=f"{name}: src_starts\\[0\\]=-1"):
        call(_i64([-1, 0], device), _i32([0, 1, 4], device))
    # Wrong dtypes / shapes.
    with pytest.raises((RuntimeError, ValueError), match=f"{name}: src_starts must be .*int64"):
        call(_i32([0, 2], device), _i32([0, 1, 4], device))
    with pytest.raises((RuntimeError, ValueError), match=f"{name}: cu_seqlens_out must be .*int32"):
        call(_i64([0, 2], device), _i64([0, 1, 4], device))
    with pytest.raises((RuntimeError, ValueError), match=f"{name}: cu_seqlens_out must have len\\(src_starts\\) \\+ 1"):
        call(_i64([0, 2], device), _i32([0, 4], device))
    # Non-monotone offsets, offsets not starting at 0, wrong total.
    with pytest.raises(RuntimeError, match=f"{name}: cu_seqlens_out must be non-decreasing, got 3 then 1"):
        call(_i64([0, 5], device), _i32([0, 3, 1], device), 1 if op == "gather" else 10,
             data if op == "gather" else values[:1])
    with pytest.raises(RuntimeError, match=f"{name}: cu_seqlens_out must start at 0"):
        call(_i64([0, 5], device), _i32([1, 2, 4], device))
    with pytest.raises(RuntimeError, match=f"{name}: cu_seqlens_out\\[-1\\]=3 but the gathered side has"):
        call(_i64([0, 5], device), _i32([0, 1, 3], device))
    if op == "scatter":
        with pytest.raises(RuntimeError, match="jagged_scatter: src_starts select overlapping rows"):
            call(_i64([0, 1], device), _i32([0, 2, 4], device))
    # A 0-d tensor has no rows.
    with pytest.raises(RuntimeError, match=f"{name}: (values|grad) must be \\[rows, \\*F\\]"):
        getattr(ops, name)(torch.tensor(1.0, device=device), _i64([], device), _i32([0], device), 0)


def test_bad_input_raw_ops_cpu():
    """The registered ops check index values themselves on CPU (not only the Python wrappers)."""
    values = torch.arange(10.0)
    with pytest.raises(RuntimeError, match="jagged_gather: src_starts\\[0\\]=9 with length 2 is outside the 10 rows"):
        ops.jagged_gather(values, _i64([9], "cpu"), _i32([0, 2], "cpu"), 2)
    with pytest.raises(RuntimeError, match="jagged_gather: total_out must be >= 0"):
        ops.jagged_gather(values, _i64([], "cpu"), _i32([0], "cpu"), -1)
    with pytest.raises(RuntimeError, match="jagged_scatter: src_starts select overlapping rows"):
        ops.jagged_scatter(values[:4], _i64([3, 4], "cpu"), _i32([0, 2, 4], "cpu"), 10)


@pytest.mark.gpu
def test_device_mix_is_rejected():
    values = torch.arange(10.0, device="cuda")
    with pytest.raises((RuntimeError, ValueError), match="jagged_gather: src_starts is on cpu"):
        ops.jagged_gather(values, _i64([0], "cpu"), _i32([0, 2], "cuda"), 2)


@pytest.mark.gpu
def test_cuda_offsets_not_starting_at_zero_stay_in_bounds():
    """Device offsets are not read on the host: cu_seqlens_out not starting at 0 puts the rows
    before cu_seqlens_out[0] in sequence 0 at negative source offsets. They come out zero (gather)
    or are dropped (scatter) rather than reaching before the tensors (compute-sanitizer memcheck
    runs the GPU tests); the other rows follow src_starts as usual."""
    values = torch.arange(1.0, 11.0, device="cuda")
    src, cu = _i64([1], "cuda"), _i32([5, 8], "cuda")
    out = ops.jagged_gather(values, src, cu, 8)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]  # rows 4..7 read 0..3 + 1
    back = ops.jagged_scatter(torch.arange(1.0, 9.0, device="cuda"), src, cu, 10)
    assert back.tolist() == [5.0, 6.0, 7.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def _cuda_matches_cpu(values, lengths, sel):
    """Gather and scatter of ``values`` on the GPU equal the CPU kernels' results."""
    src, cu, total = indices(lengths, sel, "cpu")
    cpu = verl_ops.jagged_gather(values, src, cu, total)
    gpu = verl_ops.jagged_gather(values.cuda(), src.cuda(), cu.cuda(), total, validate=False)
    assert torch.equal(gpu.cpu(), cpu)
    back = verl_ops.jagged_scatter(gpu, src.cuda(), cu.cuda(), values.shape[0], validate=False)
    assert torch.equal(back.cpu(), verl_ops.jagged_scatter(cpu, src, cu, values.shape[0]))


@pytest.mark.gpu
def test_cuda_matches_cpu_large(rng):
    lengths, sel = random_selection(rng, 3000, 2500, distinct=True)
    for feature_shape, dtype in (((), torch.int64), ((48, 8), torch.int16), ((257,), torch.bfloat16)):
        g = torch.Generator().manual_seed(seed_of(rng))
        _cuda_matches_cpu(random_data((sum(lengths), *feature_shape), dtype, g), lengths, sel)


@pytest.mark.gpu
def test_cuda_matches_cpu_many_sequences(rng):
    """9000 short output sequences of narrow rows (tiles of several rows per thread) against the
    CPU kernel."""
    lengths, sel = random_selection(rng, 9500, 9000, distinct=True)
    g = torch.Generator().manual_seed(seed_of(rng))
    _cuda_matches_cpu(random_data((sum(lengths),), torch.int64, g), lengths, sel)


def test_gather_gradient_with_repeated_spans(device, rng):
    """A span gathered twice receives the sum of both gradients (reference: autograd of a plain
    per-sequence cat)."""
    lengths, sel = random_selection(rng, 4, 7, distinct=False)
    sel[1] = sel[0]  # at least one repeat
    lengths[sel[0]] = max(lengths[sel[0]], 2)
    src, cu, total = indices(lengths, sel, device)
    x = torch.randn(sum(lengths), 3, device=device, dtype=torch.float64, requires_grad=True)
    y = torch.randn(total, 3, device=device, dtype=torch.float64)
    (verl_ops.jagged_gather(x, src, cu, total) * y).sum().backward()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    x2 = x.detach().clone().requires_grad_(True)
    ref = torch.cat([x2[starts[i] : starts[i] + lengths[i]] for i in sel]) if sel else x2[:0]
    (ref * y).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
