"""mla_forward_padded (docs/mla.md#semantics) against a float64 reference written from the contract:
pad V to Dqk, attend per sequence, trim. CPU: values, gradients, gradcheck, output layout per
backend, grouped-query heads, unequal q/kv lengths, opcheck, torch.compile, bad input. GPU: every
backend against the same reference with bf16 / fp16 tolerances, lengths 1..4096."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA

import verl_ops
from verl_ops import mla_forward_padded

OPS = torch.ops.verl_ops
DIMS = [(192, 128), (128, 128), (64, 64)]


# --------------------------------------------------------------------------------------------
# Reference (float64, one sequence at a time).


def ref_attention(q, k, v, cu_q, cu_kv, causal=True, scale=None):
    """out [Tq, Hq, Dv]: V zero-padded to Dqk, softmax attention per sequence (FlashAttention's
    bottom-right causal diagonal, grouped kv heads), output trimmed back to Dv. Rows that see no
    key are zero."""
    q, k, v = q.double(), k.double(), v.double()
    hq, dqk = q.shape[1], q.shape[2]
    hk, dv = k.shape[1], v.shape[2]
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    v_pad = F.pad(v, (0, dqk - dv))
    outs = []
    cu_q, cu_kv = [int(x) for x in cu_q], [int(x) for x in cu_kv]
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)  # [Hq, Lq, D]
        ks = k[cu_kv[b] : cu_kv[b + 1]].repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        vs = v_pad[cu_kv[b] : cu_kv[b + 1]].repeat_interleave(hq // hk, dim=1).transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        scores = scale * qs @ ks.transpose(1, 2)
        if causal:
            i = torch.arange(lq, device=q.device).unsqueeze(1)
            j = torch.arange(lk, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(j > i + lk - lq, float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: all -inf -> 0
        outs.append((p @ vs).transpose(0, 1)[..., :dv])
    return torch.cat(outs) if outs else q.new_zeros(0, hq, dv)


def make_case(lengths, hq=2, hk=2, dqk=64, dv=64, dtype=torch.float32, device="cpu", seed=0, kv_lengths=None):
    g = torch.Generator().manual_seed(seed)
    kv_lengths = lengths if kv_lengths is None else kv_lengths
    tq, tk = sum(lengths), sum(kv_lengths)
    q = torch.randn(tq, hq, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hk, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hk, dv, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
    cu_kv = torch.tensor([0] + list(torch.tensor(kv_lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int32)
    return dict(
        q=q.to(device, dtype),
        k=k.to(device, dtype),
        v=v.to(device, dtype),
        cu_q=cu_q.to(device),
        cu_kv=cu_kv.to(device),
        max_q=max(lengths, default=0),
        max_kv=max(kv_lengths, default=0),
    )


def run(c, causal=True, backend="auto", scale=None, grad=False):
    q, k, v = (c[n].detach().clone().requires_grad_(grad) for n in ("q", "k", "v"))
    out = mla_forward_padded(
        q, k, v, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"], causal=causal, softmax_scale=scale, backend=backend
    )
    return out, (q, k, v)


def ref_grads(c, grad_out, causal=True, scale=None):
    """float64 reference output and gradients, computed on the data's device."""
    q, k, v = (c[n].detach().double().requires_grad_(True) for n in ("q", "k", "v"))
    out = ref_attention(q, k, v, c["cu_q"].cpu(), c["cu_kv"].cpu(), causal, scale)
    out.backward(grad_out.double().to(q.device))
    return out.detach(), (q.grad, k.grad, v.grad)


def rel_err(got, want):
    """Error norm relative to the reference's norm, floored at an rms of 1e-3: a reference that is
    exactly zero (e.g. dq when every query sees a single key) is met by rounding noise."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-3 * max(want.numel(), 1) ** 0.5))


# --------------------------------------------------------------------------------------------
# CPU semantics.


@pytest.mark.parametrize("dims", DIMS, ids=[f"{a}-{b}" for a, b in DIMS])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_backward_match_reference(rng, dims, causal):
    dqk, dv = dims
    lengths = [1, rng.randint(2, 9), 0, rng.randint(10, 33), 1, rng.randint(1, 20)]
    c = make_case(lengths, hq=2, hk=2, dqk=dqk, dv=dv, seed=rng.randrange(2**31))
    out, (q, k, v) = run(c, causal=causal, grad=True)
    assert out.shape == (sum(lengths), 2, dv) and out.dtype == torch.float32
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, grads = ref_grads(c, g, causal)
    assert rel_err(out, want) < 1e-5
    out.backward(g.float())
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), grads):
        assert got.shape == exp.shape, name
        assert rel_err(got, exp) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_cpu(rng, dtype):
    c = make_case([7, 1, 20], dqk=192, dv=128, dtype=dtype, seed=rng.randrange(2**31))
    out, _ = run(c)
    assert out.dtype == dtype
    want = ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"])
    assert rel_err(out, want) < (2e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
def test_gradcheck_float64(causal, gqa):
    c = make_case([3, 1, 4], hq=4 if gqa else 2, hk=2, dqk=8, dv=6, dtype=torch.float64, seed=3)
    q, k, v = (c[n].clone().requires_grad_(True) for n in ("q", "k", "v"))

    def f(q, k, v):
        return mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 4, 4, causal=causal, softmax_scale=0.7)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_unequal_lengths_bottom_right():
    # kv longer than q in one sequence, shorter in another (queries without keys -> zero rows).
    c = make_case([2, 5], kv_lengths=[5, 2], hq=2, hk=1, dqk=8, dv=4, dtype=torch.float64, seed=5)
    q, k, v = (c[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    out = mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 5, 5)
    want = ref_attention(q, k, v, c["cu_q"], c["cu_kv"])
    assert torch.allclose(out, want, atol=1e-12)
    # FlashAttention's example: seqlen_q=5, seqlen_k=2 -> the first 3 query rows see no key.
    assert torch.equal(out[2:5], torch.zeros_like(out[2:5]))
    assert not torch.equal(out[5:7], torch.zeros_like(out[5:7]))
    assert torch.autograd.gradcheck(lambda q, k, v: mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 5, 5), (q, k, v))


def test_causal_row_sees_its_prefix_only():
    # Changing a later key/value must not change an earlier query's output (causal), and must
    # change it without the mask.
    c = make_case([6], dqk=16, dv=8, seed=11)
    base, _ = run(c)
    c2 = dict(c, k=c["k"].clone(), v=c["v"].clone())
    c2["k"][4:] += 1.0
    c2["v"][4:] += 1.0
    moved, _ = run(c2)
    assert torch.equal(base[:4], moved[:4])
    assert not torch.allclose(base[4:], moved[4:])
    assert not torch.allclose(run(c, causal=False)[0][:4], run(c2, causal=False)[0][:4])


def test_output_layout_per_backend():
    c = make_case([4, 4, 4], hq=3, hk=3, dqk=24, dv=16, seed=2)
    padded, _ = run(c, backend="padded")
    assert padded.shape == (12, 3, 16) and padded.stride() == (3 * 24, 24, 1)
    auto, _ = run(c, backend="auto")
    assert auto.stride() == padded.stride()  # auto: the padded path at small shapes
    native, _ = run(c, backend="native")
    assert native.is_contiguous()
    assert torch.equal(native, padded)
    same = make_case([4, 4], dqk=16, dv=16, seed=2)
    assert run(same, backend="padded")[0].is_contiguous()


@pytest.mark.parametrize(
    "batch, seqlen, heads, dims, native",
    [
        (16, 1024, 16, (192, 128), True),  # measured: native 1.8x forward+backward (H200)
        (4, 4096, 16, (192, 128), True),
        (2, 1024, 16, (192, 128), False),  # measured: host-bound, padded wins
        (16, 512, 16, (192, 128), False),
        (16, 1024, 16, (128, 128), False),  # not measured: stays on FlashAttention
    ],
)
def test_auto_backend_table(batch, seqlen, heads, dims, native):
    """auto picks the backend from shapes alone (Meta tensors: no compute, and no varlen there, so
    the table without the varlen rules), as the table says."""
    dqk, dv = dims
    t = batch * seqlen
    q = torch.empty(t, heads, dqk, device="meta", dtype=torch.bfloat16)
    v = torch.empty(t, heads, dv, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(batch + 1, device="meta", dtype=torch.int32)
    out, _ = OPS.mla_forward_padded(q, q, v, cu, cu, seqlen, seqlen, True, None, 0)
    assert out.is_contiguous() == (native or dqk == dv)


def test_grad_v_is_view_of_padded_rows():
    c = make_case([3, 5], hq=2, hk=2, dqk=24, dv=16, seed=4)
    out, (q, k, v) = run(c, backend="padded", grad=True)
    lse = torch.zeros(2, 8)
    args = (torch.ones_like(out), c["q"], c["k"], c["v"], out.detach(), lse, c["cu_q"], c["cu_kv"], 5, 5)
    _, _, dv = OPS.mla_backward_padded(*args, True, None, 1)
    assert dv.shape == (8, 2, 16) and dv.stride() == (2 * 24, 24, 1)
    _, _, dv_auto = OPS.mla_backward_padded(*args, True, None, 0)
    assert dv_auto.stride() == dv.stride()  # auto is padded at this size
    u = make_case([4, 4], hq=2, hk=2, dqk=24, dv=16, seed=4)
    out_u, _ = run(u, backend="native")
    args_u = (torch.ones_like(out_u), u["q"], u["k"], u["v"], out_u.detach(), torch.zeros(2, 8), u["cu_q"], u["cu_kv"], 4, 4)
    _, _, dv_native = OPS.mla_backward_padded(*args_u, True, None, 2)
    assert dv_native.shape == (8, 2, 16) and dv_native.is_contiguous()


def test_native_backend_ragged_self_attention():
    """Ragged batches go native for causal self-attention sharing one offsets tensor (CPU: the
    exact reference in the native layout)."""
    c = make_case([4, 3, 7], hq=2, hk=2, dqk=24, dv=16, seed=1)
    c["cu_kv"] = c["cu_q"]
    out, _ = run(c, backend="native")
    assert out.is_contiguous()
    assert rel_err(out, ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_q"])) < 1e-5
    with pytest.raises(RuntimeError, match="needs a uniform batch"):
        run(c, backend="native", causal=False)
    c["cu_kv"] = c["cu_q"].clone()  # equal values, but not one tensor: not known without a read
    with pytest.raises(RuntimeError, match="needs a uniform batch"):
        run(c, backend="native")


@pytest.mark.parametrize(
    "lengths, native",
    [([1024] * 31 + [800], True), ([2048] * 15 + [1024], True), ([2048] * 4 + [200] * 4, False)],
)
def test_auto_backend_ragged(lengths, native):
    """auto goes native for ragged causal self-attention when the batch is at least 3/4 full."""
    t, s = sum(lengths), max(lengths)
    q = torch.empty(t, 16, 192, device="meta", dtype=torch.bfloat16)
    v = torch.empty(t, 16, 128, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(len(lengths) + 1, device="meta", dtype=torch.int32)
    out, _ = OPS.mla_forward_padded(q, q, v, cu, cu, s, s, True, None, 0)
    assert out.is_contiguous() == native
    out, _ = OPS.mla_forward_padded(q, q, v, cu, cu.clone(), s, s, True, None, 0)
    assert not out.is_contiguous()  # separate offsets tensors: padded


# (lengths, kv_lengths or None for one offsets tensor, heads, (Dqk, Dv), causal); the large ones on
# CUDA only (the CPU kernels are the float64 reference: too slow at the auto table's sizes).
_AUTO_AGREE_SMALL = [
    ([5, 30, 2], None, 2, (192, 128), True),
    ([4, 4], None, 2, (192, 128), True),
    ([4, 4], None, 2, (192, 128), False),
    ([1, 1, 0], None, 2, (192, 128), True),
    ([5, 9], [9, 5], 2, (24, 16), True),
    ([7, 3], None, 2, (24, 16), True),
]
_AUTO_AGREE_LARGE = [
    ([1024] * 16, None, 16, (192, 128), True),
    ([1024] * 16, None, 16, (192, 128), False),
    ([512] * 4, None, 16, (192, 128), True),
    ([1024] * 31 + [800], None, 16, (192, 128), True),
    ([2048] * 4 + [200] * 4, None, 16, (192, 128), True),
    ([100, 3000, 7], None, 16, (192, 128), True),
    ([1024] * 16, None, 16, (128, 128), True),
]


_NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.parametrize(
    "device, dtype, case, backend",
    [("cpu", torch.float32, c, 0) for c in _AUTO_AGREE_SMALL]
    + [pytest.param("cuda", torch.bfloat16, c, 0, marks=_NEEDS_CUDA)
       for c in _AUTO_AGREE_SMALL + _AUTO_AGREE_LARGE]
    # float32 / float64 on CUDA: the reference kernels under every backend code (contiguous
    # outputs), where the same shapes in bf16 take padded (a view) or native.
    + [pytest.param("cuda", dt, c, b, marks=_NEEDS_CUDA)
       for dt in (torch.float32, torch.float64) for c in _AUTO_AGREE_SMALL[:4] for b in (0, 1, 2, 3)]
    + [pytest.param("cuda", torch.float32, c, 0, marks=_NEEDS_CUDA) for c in _AUTO_AGREE_LARGE[:2]],
)
def test_auto_rule_python_copy_agrees_with_the_op(device, dtype, case, backend):
    """backend="auto" is decided twice: by the op (resolve_mla_backend in csrc/ops/mla_ops.cpp) and
    by its one Python copy (verl_ops._mla._mla_backend / _backend_flags), which the fake kernels
    use to give the output the layout the op will give it. The two agree: the real op's output and
    gradient layouts equal the fake kernels' for the same inputs on this device and dtype (for
    float32 / float64 on CUDA, under every backend code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lengths, kv_lengths, heads, (dqk, dv), causal = case
    c = make_case(lengths, hq=heads, hk=heads, dqk=dqk, dv=dv, dtype=dtype, device=device, seed=3,
                  kv_lengths=kv_lengths)
    cu_kv = c["cu_q"] if kv_lengths is None else c["cu_kv"]
    args = (c["cu_q"], cu_kv, c["max_q"], c["max_kv"], causal, None, backend)
    out, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], *args)
    grads = OPS.mla_backward_padded(torch.ones_like(out), c["q"], c["k"], c["v"], out, lse, *args)
    with FakeTensorMode() as mode:
        fq, fk, fv, fcu_q, fcu_kv = (mode.from_tensor(t) for t in (c["q"], c["k"], c["v"], c["cu_q"], cu_kv))
        fargs = (fcu_q, fcu_kv) + args[2:]
        fout, flse = OPS.mla_forward_padded(fq, fk, fv, *fargs)
        fgrads = OPS.mla_backward_padded(torch.ones_like(fout), fq, fk, fv, fout, flse, *fargs)
    assert (fout.shape, fout.stride()) == (out.shape, out.stride())
    assert (flse.shape, flse.dtype) == (lse.shape, lse.dtype)
    assert [(g.shape, g.stride()) for g in fgrads] == [(g.shape, g.stride()) for g in grads]


def test_native_backend_needs_uniform_batch():
    c = make_case([4, 3], seed=1)
    with pytest.raises(RuntimeError, match="mla_forward_padded: backend='native' needs a uniform batch"):
        run(c, backend="native")
    # Ragged batches under "auto" take the padded path.
    out, _ = run(c, backend="auto")
    assert rel_err(out, ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"])) < 1e-5
    gqa = make_case([4, 4], hq=4, hk=2, seed=1)
    with pytest.raises(RuntimeError, match="needs as many k/v heads as q heads"):
        run(gqa, backend="native")
    cross = make_case([2, 2], kv_lengths=[3, 3], seed=1)
    with pytest.raises(RuntimeError, match="max_seqlen_q == max_seqlen_kv"):
        run(cross, backend="native")
    assert run(cross, backend="native", causal=False)[0].shape == (4, 2, 64)


def test_softmax_scale_and_lse():
    c = make_case([5, 2], dqk=16, dv=8, seed=9)
    out, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 5, 5, False, 0.3, 0)
    assert rel_err(out, ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], False, 0.3)) < 1e-5
    # softmax_lse [Hq, Tq]: log-sum-exp of the scaled scores of each query row.
    s0 = 0.3 * c["q"][:5, 1].double() @ c["k"][:5, 1].double().T
    assert torch.allclose(lse[1, :5].double(), torch.logsumexp(s0, dim=-1), atol=1e-5)
    assert lse.shape == (2, 7) and lse.dtype == torch.float32


def test_empty_inputs():
    c = make_case([0, 0], seed=0)
    out, (q, k, v) = run(c, grad=True)
    assert out.shape == (0, 2, 64)
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    none = make_case([], seed=0)
    assert run(none)[0].shape == (0, 2, 64)


def test_many_random_batches_cpu(rng):
    for _ in range(6):
        n = rng.randint(1, 5)
        lengths = [rng.choice([1, 2, rng.randint(1, 24)]) for _ in range(n)]
        hk = rng.choice([1, 2])
        c = make_case(lengths, hq=hk * rng.choice([1, 2]), hk=hk, dqk=32, dv=rng.choice([16, 32]), seed=rng.randrange(2**31))
        causal = rng.random() < 0.5
        out, _ = run(c, causal=causal)
        assert rel_err(out, ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], causal)) < 1e-5


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def _op_cases(device="cpu", dtype=torch.float32):
    out = []
    for lengths, hq, hk, dqk, dv, backend in [
        ([3, 1, 4], 2, 2, 24, 16, "padded"),
        ([4, 4], 2, 2, 24, 16, "native"),
        ([2, 5], 4, 2, 16, 16, "auto"),
    ]:
        c = make_case(lengths, hq=hq, hk=hk, dqk=dqk, dv=dv, dtype=dtype, device=device, seed=7)
        out.append((c, backend))
    return out


def _fwd_args(c, causal, backend, grad):
    return (
        c["q"].clone().requires_grad_(grad),
        c["k"].clone().requires_grad_(grad),
        c["v"].clone().requires_grad_(grad),
        c["cu_q"],
        c["cu_kv"],
        c["max_q"],
        c["max_kv"],
        causal,
        None,
        ("auto", "padded", "native").index(backend) if isinstance(backend, str) else backend,
    )


def test_opcheck_forward_cpu():
    for c, backend in _op_cases():
        for causal in (True, False):
            torch.library.opcheck(OPS.mla_forward_padded.default, _fwd_args(c, causal, backend, True))


def test_opcheck_backward_cpu():
    for c, backend in _op_cases():
        out, lse = OPS.mla_forward_padded(*_fwd_args(c, True, backend, False))
        args = (torch.randn_like(out), c["q"], c["k"], c["v"], out, lse, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"])
        torch.library.opcheck(OPS.mla_backward_padded.default, (*args, True, None, _fwd_args(c, True, backend, False)[-1]))


def _compile_check(device, dtype, backend, tol):
    torch._dynamo.reset()

    def f(q, k, v, cu, max_seqlen):
        return mla_forward_padded(q, k, v, cu, cu, max_seqlen, max_seqlen, backend=backend).float().square().sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    # Two batches of different sizes and sequence counts through one compiled graph.
    batches = ([4, 4], [3, 3, 3]) if backend == "native" else ([3, 5, 2], [6, 1, 1, 2])
    for lengths in batches:
        c = make_case(lengths, dqk=24, dv=16, dtype=dtype, device=device, seed=len(lengths))
        q1, k1, v1 = (c[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        q2, k2, v2 = (c[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        got = cf(q1, k1, v1, c["cu_q"], c["max_q"])
        want = f(q2, k2, v2, c["cu_q"], c["max_q"])
        assert torch.allclose(got, want, rtol=tol, atol=tol)
        got.backward()
        want.backward()
        for a, b in ((q1, q2), (k1, k2), (v1, v2)):
            assert torch.allclose(a.grad, b.grad, rtol=tol, atol=tol)


def test_compile_fullgraph_dynamic_cpu():
    _compile_check("cpu", torch.float32, "auto", 1e-5)


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument.


def _raw(c, **over):
    a = dict(q=c["q"], k=c["k"], v=c["v"], cu_q=c["cu_q"], cu_kv=c["cu_kv"], max_q=c["max_q"], max_kv=c["max_kv"])
    a.update(over)
    return OPS.mla_forward_padded(a["q"], a["k"], a["v"], a["cu_q"], a["cu_kv"], a["max_q"], a["max_kv"])


BAD_RAW = [
    ("dv_gt_dqk", dict(v=torch.randn(7, 2, 80)), r"Dv=80\) must be <= the q/k head dim \(Dqk=64"),
    ("heads_not_multiple", dict(q=torch.randn(7, 3, 64)), r"q heads \(3\) must be a multiple of the number of k/v heads \(2\)"),
    ("k_v_heads", dict(v=torch.randn(7, 1, 64)), "k and v must have the same number of heads"),
    ("k_v_rows", dict(v=torch.randn(6, 2, 64)), "k and v must have the same number of rows"),
    ("k_head_dim", dict(k=torch.randn(7, 2, 32)), "k must have q's head dim"),
    ("q_rank", dict(q=torch.randn(7, 128)), "q must be 3-D"),
    ("dtype_mix", dict(k=torch.randn(7, 2, 64, dtype=torch.float64)), "q, k and v must have one dtype"),
    ("int_q", dict(q=torch.ones(7, 2, 64, dtype=torch.int32)), "q must be floating point"),
    ("cu_int64", dict(cu_q=torch.tensor([0, 3, 7])), "cu_seqlens_q must be int32"),
    ("cu_2d", dict(cu_kv=torch.tensor([[0, 3, 7]], dtype=torch.int32)), "cu_seqlens_kv must be 1-D"),
    ("cu_len_mismatch", dict(cu_kv=torch.tensor([0, 7], dtype=torch.int32)), "cu_seqlens_kv must have as many entries"),
    ("cu_end_not_T", dict(cu_q=torch.tensor([0, 3, 6], dtype=torch.int32)), r"cu_seqlens_q\[-1\]=6 must equal the number of rows 7"),
    ("cu_kv_end_not_T", dict(cu_kv=torch.tensor([0, 4, 8], dtype=torch.int32)), r"cu_seqlens_kv\[-1\]=8 must equal"),
    ("cu_not_zero", dict(cu_q=torch.tensor([1, 3, 7], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    ("cu_decreasing", dict(cu_q=torch.tensor([0, 4, 3, 7], dtype=torch.int32), cu_kv=torch.tensor([0, 3, 4, 7], dtype=torch.int32)), "cu_seqlens_q must be non-decreasing"),
    ("max_too_small", dict(max_q=3), "more than max_seqlen_q=3"),
    ("max_negative", dict(max_kv=-1), r"max_seqlen_kv must be in \[0, 2147483647\], got -1"),
    ("max_huge", dict(max_q=2**31), r"max_seqlen_q must be in \[0, 2147483647\], got 2147483648"),
    ("cu_on_meta", dict(cu_q=torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")), "cu_seqlens_q is on meta"),
    ("v_on_meta", dict(v=torch.randn(7, 2, 64, device="meta")), "q, k and v must be on one device"),
]


@pytest.mark.parametrize("over,pattern", [b[1:] for b in BAD_RAW], ids=[b[0] for b in BAD_RAW])
def test_bad_input_raw_op(over, pattern):
    c = make_case([3, 4], seed=0)
    with pytest.raises(RuntimeError, match="mla_forward_padded: .*" + pattern if not pattern.startswith("mla") else pattern):
        _raw(c, **over)


def test_fake_kernel_rejects_the_dtypes_the_op_rejects():
    """The fake (Meta) kernel checks q's dtype per device as the op does: a float8 batch on the CPU
    fails under FakeTensorMode (torch.compile's tracing) with the op's message, not at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = make_case([3, 4], seed=0)
    q8 = c["q"].to(torch.float8_e4m3fn)
    k8, v8 = c["k"].to(torch.float8_e4m3fn), c["v"].to(torch.float8_e4m3fn)
    pattern = "mla_forward_padded: q must be float16, bfloat16, float32 or float64 on the CPU"
    with pytest.raises(RuntimeError, match=pattern):
        OPS.mla_forward_padded(q8, k8, v8, c["cu_q"], c["cu_kv"], 4, 4, True, None, 0)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (q8, k8, v8, c["cu_q"], c["cu_kv"])]
        with pytest.raises(RuntimeError, match=pattern):
            OPS.mla_forward_padded(*args, 4, 4, True, None, 0)
        ok = [mode.from_tensor(t) for t in (c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"])]
        out, _ = OPS.mla_forward_padded(*ok, 4, 4, True, None, 0)
        assert out.shape == (7, 2, 64)


def test_bad_input_backend_and_scale():
    c = make_case([3, 4], seed=0)
    with pytest.raises(RuntimeError, match=r"mla_forward_padded: backend must be 0 \(auto\), 1 \(padded\), 2 \(native\) or 3 \(varlen\), got 7"):
        OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 4, 4, True, None, 7)
    with pytest.raises(ValueError, match="mla_forward_padded: backend must be one of"):
        run(c, backend="fast")
    with pytest.raises(RuntimeError, match="mla_forward_padded: softmax_scale must be finite"):
        run(c, scale=float("nan"))


def test_bad_input_python_wrapper():
    c = make_case([3, 4], seed=0)
    q, k, v = c["q"], c["k"], c["v"]
    with pytest.raises(ValueError, match=r"mla_forward_padded: cu_seqlens_q\[-1\]=6 must equal the number of rows 7"):
        mla_forward_padded(q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32), c["cu_kv"], 4, 4)
    with pytest.raises(ValueError, match="mla_forward_padded: cu_seqlens_q / cu_seqlens_kv must be int32"):
        mla_forward_padded(q, k, v, c["cu_q"].long(), c["cu_kv"], 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv must have the same length"):
        mla_forward_padded(q, k, v, c["cu_q"], torch.tensor([0, 7], dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="a sequence has 4 tokens, more than max_seqlen_kv=3"):
        mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 4, 3)
    with pytest.raises(TypeError, match="mla_forward_padded: q must be a tensor"):
        mla_forward_padded([1.0], k, v, c["cu_q"], c["cu_kv"], 4, 4)


def test_bad_input_backward_op():
    c = make_case([3, 4], dqk=24, dv=16, seed=0)
    out, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 4, 4)
    base = dict(g=torch.randn(7, 2, 16), out=out, lse=lse)
    cases = [
        (dict(g=torch.randn(7, 2, 24)), "mla_backward_padded: grad_out must be \\[Tq, Hq, Dv\\]"),
        (dict(out=torch.randn(6, 2, 16)), "mla_backward_padded: out must be \\[Tq, Hq, Dv\\]"),
        (dict(lse=torch.zeros(2, 7, dtype=torch.float64)), "mla_backward_padded: softmax_lse must be a 2-D"),
        (dict(lse=torch.zeros(2, 6)), "mla_backward_padded: softmax_lse must be \\[Hq, Tq\\]"),
    ]
    for over, pattern in cases:
        a = dict(base, **over)
        with pytest.raises(RuntimeError, match=pattern):
            OPS.mla_backward_padded(a["g"], c["q"], c["k"], c["v"], a["out"], a["lse"], c["cu_q"], c["cu_kv"], 4, 4)


# --------------------------------------------------------------------------------------------
# GPU: every backend against the float64 reference, bf16 / fp16 tolerances.

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# Relative (Frobenius) error bounds: bf16 has an 8-bit mantissa (~4e-3 per rounding), fp16 11 bits.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _gpu_lengths(rng, uniform):
    if uniform:
        s = rng.choice([1, 64, 1000, 4096])
        return [s] * rng.choice([1, 2, 3])
    return [1, 4096, rng.randint(2, 300), 1, rng.randint(1000, 3000), 17]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dims", DIMS, ids=[f"{a}-{b}" for a, b in DIMS])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["padded", "native", "auto"])
def test_cuda_backends_match_reference(rng, dtype, dims, causal, backend):
    dqk, dv = dims
    lengths = _gpu_lengths(rng, uniform=backend == "native")
    c = make_case(lengths, hq=4, hk=4, dqk=dqk, dv=dv, dtype=dtype, device="cuda", seed=rng.randrange(2**31))
    out, (q, k, v) = run(c, causal=causal, backend=backend, grad=True)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want, grads = ref_grads(c, g, causal)
    assert out.shape == want.shape and out.dtype == dtype
    assert rel_err(out, want) < TOL[dtype], backend
    out.backward(g.to("cuda", dtype))
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), grads):
        assert got.shape == exp.shape, name
        assert rel_err(got, exp) < 2 * TOL[dtype], (backend, name)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 64)], ids=["192-128", "64-64"])
@pytest.mark.parametrize("lengths", [[1, 4096, 77, 1, 2500, 17, 0, 1024], [300, 301, 299]], ids=["wide", "close"])
def test_cuda_native_ragged_self_attention(dtype, dims, lengths):
    """Ragged causal self-attention on the native backend (right-padded dense copies)."""
    dqk, dv = dims
    c = make_case(lengths, hq=4, hk=4, dqk=dqk, dv=dv, dtype=dtype, device="cuda", seed=sum(lengths))
    c["cu_kv"] = c["cu_q"]
    out, (q, k, v) = run(c, backend="native", grad=True)
    assert out.is_contiguous()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want, grads = ref_grads(c, g)
    assert rel_err(out, want) < TOL[dtype]
    out.backward(g.to("cuda", dtype))
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), grads):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, exp) < 2 * TOL[dtype], name


@gpu
@pytest.mark.gpu
def test_cuda_auto_uniform_where_measured():
    """At the auto table's native threshold (16 x 1024 tokens x 16 heads, 192/128) auto runs varlen
    where that runs verl_ops' own SM90 kernels (Hopper builds with the varlen backend: measured
    faster than native on uniform batches), else native; contiguous output either way, and the
    reference's result, forward and backward."""
    from verl_ops import _mla

    c = make_case([1024] * 16, hq=16, hk=16, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda", seed=11)
    out, (q, k, v) = run(c, backend="auto", grad=True)
    assert out.is_contiguous()
    chosen = "varlen" if _mla._auto_flags(out.device)[1] else "native"
    assert torch.equal(out, run(c, backend=chosen)[0]), chosen
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want, grads = ref_grads(c, g)
    assert rel_err(out, want) < TOL[torch.bfloat16]
    out.backward(g.to("cuda", torch.bfloat16))
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), grads):
        assert rel_err(got, exp) < 2 * TOL[torch.bfloat16], name


@gpu
@pytest.mark.gpu
def test_cuda_fake_kernel_rejects_float8():
    """On CUDA the op takes float16, bfloat16, float32 and float64 (the last two on its reference
    kernels, tests/test_mla_fp32.py); the fake kernel rejects the others at trace time too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = make_case([3, 4], dtype=torch.float8_e4m3fn, device="cuda", seed=0)
    pattern = "mla_forward_padded: q must be float16, bfloat16, float32 or float64 on CUDA"
    with pytest.raises(RuntimeError, match=pattern):
        OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 4, 4, True, None, 0)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(c[n]) for n in ("q", "k", "v", "cu_q", "cu_kv")]
        with pytest.raises(RuntimeError, match=pattern):
            OPS.mla_forward_padded(*args, 4, 4, True, None, 0)


@gpu
@pytest.mark.gpu
def test_cuda_gqa_and_unequal_lengths_padded():
    c = make_case([2, 300, 64], kv_lengths=[50, 300, 10], hq=8, hk=2, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda", seed=3)
    out, (q, k, v) = run(c, backend="padded", grad=True)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want, grads = ref_grads(c, g)
    assert rel_err(out, want) < TOL[torch.bfloat16]
    out.backward(g.to("cuda", torch.bfloat16))
    for got, exp in zip((q.grad, k.grad, v.grad), grads):
        assert rel_err(got, exp) < 2 * TOL[torch.bfloat16]


@gpu
@pytest.mark.gpu
def test_cuda_layouts_and_cpu_agreement():
    c = make_case([5, 9, 1], hq=4, hk=4, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda", seed=4)
    out, _ = run(c, backend="padded")
    assert out.stride() == (4 * 192, 192, 1)
    cpu = make_case([5, 9, 1], hq=4, hk=4, dqk=192, dv=128, dtype=torch.bfloat16, seed=4)
    assert rel_err(out, run(cpu, backend="padded")[0]) < TOL[torch.bfloat16]
    u = make_case([8, 8], hq=4, hk=4, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda", seed=4)
    assert run(u, backend="native")[0].is_contiguous()


@gpu
@pytest.mark.gpu
def test_cuda_backward_with_copied_out():
    """The padded backward rebuilds the padded output when `out` is no longer the forward's view."""
    c = make_case([7, 33], hq=2, hk=2, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda", seed=6)
    out, lse = OPS.mla_forward_padded(*_fwd_args(c, True, "padded", False))
    g = torch.randn_like(out)
    args = (c["q"], c["k"], c["v"])
    tail = (lse, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"], True, None, 1)
    a = OPS.mla_backward_padded(g, *args, out, *tail)
    b = OPS.mla_backward_padded(g, *args, out.contiguous(), *tail)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@gpu
@pytest.mark.gpu
def test_cuda_empty_and_opcheck():
    c = make_case([0, 0], dqk=192, dv=128, dtype=torch.bfloat16, device="cuda")
    out, (q, k, v) = run(c, grad=True)
    out.sum().backward()
    assert out.shape == (0, 2, 128) and v.grad.shape == v.shape
    for c, backend in _op_cases("cuda", torch.bfloat16):
        torch.library.opcheck(OPS.mla_forward_padded.default, _fwd_args(c, True, backend, True))
        out, lse = OPS.mla_forward_padded(*_fwd_args(c, True, backend, False))
        args = (torch.randn_like(out), c["q"], c["k"], c["v"], out, lse, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"])
        torch.library.opcheck(OPS.mla_backward_padded.default, (*args, True, None, _fwd_args(c, True, backend, False)[-1]))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["padded", "native"])
def test_cuda_compile(backend):
    _compile_check("cuda", torch.bfloat16, backend, 2e-2)


def test_cuda_kernels_registered_when_built():
    has = torch._C._dispatch_has_kernel_for_dispatch_key("verl_ops::mla_forward_padded", "CUDA")
    assert has == verl_ops.cuda_available()
