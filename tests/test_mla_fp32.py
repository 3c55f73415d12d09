"""float32 / float64 MLA attention on CUDA (docs/mla.md#cuda-reference-kernels), and context
parallelism when one rank's input is bad.

GPU (skipped without CUDA): mla_forward_padded's CUDA reference kernels against the CPU exact
reference (the op on the CPU in float64, from the same values): output, log-sum-exp and the q / k / v
gradients on ragged batches (log-normal lengths with a 0 and a 1 among them; q / kv lengths that
differ, so that some queries see no key), grouped heads, causal or not, head dims 192 / 128, 64 / 64,
24 / 16 and wider than one register tile; long sequences against a float64 torch reference on the
GPU; every backend name runs the same kernels; determinism, CUDA-graph capture, bad offsets (which
must stay inside the tensors: run this file under compute-sanitizer memcheck), opcheck;
MLACoreAttention in float32 (the module, and a real megatron-core model where megatron-core and verl
are installed); mla_cp_attention in float32 at CP = 2.

Everywhere: at CP = 2 (gloo; NCCL where 2 GPUs exist) rank 1 passes arguments that its attention
call would reject, or that disagree with rank 0's on what the collectives share, while rank 0's are
fine: both ranks raise a clear error naming the op, none hangs (the pool's timeout fails the test),
and the group is in step afterwards. The fake kernels give float32 / float64 on a (fake) CUDA device
the reference kernels' layout without a GPU.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from _dist import dist_params, dist_runner, shared_pool
from conftest import HAS_CUDA
from test_mla import ref_attention
from test_mla_cp import _assert_close, _attend, _expect_error, _full_batch, _setup, rank_rows, ragged_lengths

import verl_ops
from verl_ops import ThdLayout

OPS = torch.ops.verl_ops
OP = "mla_forward_padded"
CODES = {"auto": 0, "padded": 1, "native": 2, "varlen": 3}
# max |got - want| <= TOL * max(|want|, 1), against the float64 CPU reference from the same values.
TOL = {torch.float32: 5e-5, torch.float64: 1e-10}

gpu = pytest.mark.skipif(not (HAS_CUDA and verl_ops.cuda_available()),
                         reason="needs CUDA and verl_ops' CUDA kernels")


# --------------------------------------------------------------------------------------------
# Batches and the CPU reference.


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make_batch(lengths, kv_lengths, hq, hk, dqk, dv, seed):
    """float64 CPU q [Tq, hq, dqk], k [Tk, hk, dqk], v [Tk, hk, dv], an upstream gradient [Tq, hq, dv]
    and the offsets (one tensor for q and kv when kv_lengths is None: self-attention)."""
    g = torch.Generator().manual_seed(seed)
    kv = lengths if kv_lengths is None else kv_lengths
    tq, tk = sum(lengths), sum(kv)
    q = torch.randn(tq, hq, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hk, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hk, dv, generator=g, dtype=torch.float64)
    grad = torch.randn(tq, hq, dv, generator=g, dtype=torch.float64)
    cu_q = offsets(lengths)
    cu_kv = cu_q if kv_lengths is None else offsets(kv)
    return dict(q=q, k=k, v=v, grad=grad, cu_q=cu_q, cu_kv=cu_kv, max_q=max(lengths, default=0),
                max_kv=max(kv, default=0))


def attend(b, device, dtype, causal, scale=None, backend=0):
    """The raw op on `device` in `dtype` (inputs rounded to `dtype` first): (out, lse, dq, dk, dv)."""
    q, k, v = (b[n].to(dtype).to(device).requires_grad_(True) for n in ("q", "k", "v"))
    cu_q = b["cu_q"].to(device)
    cu_kv = cu_q if b["cu_kv"] is b["cu_q"] else b["cu_kv"].to(device)
    out, lse = OPS.mla_forward_padded(q, k, v, cu_q, cu_kv, b["max_q"], b["max_kv"], causal, scale, backend)
    out.backward(b["grad"].to(dtype).to(device))
    return out.detach(), lse, q.grad, k.grad, v.grad


def cpu_reference(b, dtype, causal, scale=None):
    """The CPU exact reference in float64 from the values rounded to `dtype`."""
    rounded = {**b, **{n: b[n].to(dtype).double() for n in ("q", "k", "v", "grad")}}
    return attend(rounded, "cpu", torch.float64, causal, scale)


def check_against(what, got, want, tol):
    """got / want: (out, lse, dq, dk, dv). +inf log-sum-exp exactly where the reference has it (rows
    without keys), the rest within tol."""
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        g, w = g.detach().cpu().double(), w.detach().cpu().double()
        assert g.shape == w.shape, (what, name, tuple(g.shape), tuple(w.shape))
        if name == "lse":
            assert torch.equal(torch.isinf(g), torch.isinf(w)), f"{what}: lse: +inf rows differ"
            finite = torch.isfinite(w)
            g, w = g[finite], w[finite]
        assert torch.isfinite(g).all(), f"{what}: {name} has non-finite values"
        _assert_close(f"{what}: {name}", g, w, tol)


# (name, lengths, kv_lengths or None, hq, hk, dqk, dv)
def _cases():
    rng = random.Random(2024)
    ragged = ragged_lengths(rng, 12, median=40.0, cap=300)  # a 0 and a 1 among them
    kv = [max(0, n + rng.randint(-30, 30)) for n in ragged]  # some queries see no key (lq > lk)
    kv[ragged.index(1)] = 0  # and a query whose sequence has no key at all
    return [
        ("mla-gqa-self", ragged, None, 8, 2, 192, 128),
        ("mla-cross", ragged, kv, 4, 4, 192, 128),
        ("64-gqa-cross", ragged, kv, 6, 3, 64, 64),
        ("64-self", ragged, None, 2, 2, 64, 64),
        ("small-dims", ragged, kv, 4, 1, 24, 16),
        ("wide-dims", ragged[:6], kv[:6], 2, 1, 320, 288),  # past one 256-column register tile
    ]


CASES = _cases()


# --------------------------------------------------------------------------------------------
# CPU: the Python rule and the fake kernels (no GPU needed).


def test_python_rule_sends_float_cuda_to_the_reference_kernels():
    from verl_ops import _mla

    sizes = (16, 16, 2, 2, 192, 128, 1)  # a uniform batch native would take in bf16
    for code in CODES.values():
        assert _mla._mla_backend(OP, code, sizes, 16, 16, True, True, True, True, reference=True) == "reference"
    assert _mla._mla_backend(OP, 1, sizes, 16, 16, True, True, False, False) == "padded"
    with pytest.raises(RuntimeError, match="backend must be 0"):
        _mla._mla_backend(OP, 7, sizes, 16, 16, True, True, False, False, reference=True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    for device, dtype, want in (("cuda", torch.float32, True), ("cuda", torch.float64, True),
                                ("cuda", torch.bfloat16, False), ("cpu", torch.float32, False)):
        with FakeTensorMode():
            q = torch.empty(4, 2, 8, device=device, dtype=dtype)
        assert _mla._reference_path(q) is want, (device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", list(CODES.values()))
def test_fake_kernels_give_the_reference_layout_without_a_gpu(dtype, backend):
    """Fake CUDA tensors (no GPU touched): contiguous out / grad_v under every backend code (the
    padded backend's [.., :Dv] view is for float16 / bfloat16), lse in float32 (float64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(10, 4, 192, device="cuda", dtype=dtype)
        k = torch.empty(10, 2, 192, device="cuda", dtype=dtype)
        v = torch.empty(10, 2, 128, device="cuda", dtype=dtype)
        cu = torch.empty(3, device="cuda", dtype=torch.int32)
        out, lse = OPS.mla_forward_padded(q, k, v, cu, cu, 5, 5, True, None, backend)
        dq, dk, dv = OPS.mla_backward_padded(out, q, k, v, out, lse, cu, cu, 5, 5, True, None, backend)
    assert out.shape == (10, 4, 128) and out.is_contiguous() and out.dtype == dtype
    assert lse.shape == (4, 10) and lse.dtype == dtype
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous() and dv.shape == (10, 2, 128)


def test_fake_kernel_rejects_other_dtypes_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(10, 2, 64, device="cuda", dtype=torch.float8_e4m3fn)
        cu = torch.empty(3, device="cuda", dtype=torch.int32)
        with pytest.raises(RuntimeError, match=f"{OP}: q must be float16, bfloat16, float32 or float64 on CUDA"):
            OPS.mla_forward_padded(q, q, q, cu, cu, 5, 5, True, None, 0)


# --------------------------------------------------------------------------------------------
# GPU: the reference kernels against the CPU exact reference.


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_float32_matches_cpu_reference(case, causal):
    name, lengths, kv_lengths, hq, hk, dqk, dv = case
    b = make_batch(lengths, kv_lengths, hq, hk, dqk, dv, seed=len(name) + 7 * causal)
    got = attend(b, "cuda", torch.float32, causal)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32 and got[0].is_contiguous()
    check_against(f"{name} causal={causal}", got, cpu_reference(b, torch.float32, causal), TOL[torch.float32])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_float64_matches_cpu_reference(causal):
    name, lengths, kv_lengths, hq, hk, dqk, dv = CASES[1]
    b = make_batch(lengths, kv_lengths, 4, 2, dqk, dv, seed=5)
    got = attend(b, "cuda", torch.float64, causal)
    assert got[1].dtype == torch.float64
    check_against(f"float64 causal={causal}", got, cpu_reference(b, torch.float64, causal), TOL[torch.float64])


@gpu
@pytest.mark.gpu
def test_cuda_softmax_scale_and_rows_without_keys():
    """softmax_scale is used; a query that sees no key (causal, lq > lk; or a sequence without
    keys) gets a zero output, +inf log-sum-exp and zero gradient, and adds nothing to dk / dv."""
    b = make_batch([5, 3, 4], [2, 0, 4], 2, 1, 64, 32, seed=11)
    got = attend(b, "cuda", torch.float32, True, scale=0.37)
    check_against("scale 0.37", got, cpu_reference(b, torch.float32, True, scale=0.37), TOL[torch.float32])
    out, lse, dq = got[0], got[1], got[2]
    blind = [0, 1, 2, 5, 6, 7]  # first sequence: queries 0-2 of 5 see no key of 2; second: no keys
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.isinf(lse[:, blind]).all() and (lse[:, blind] > 0).all()
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))
    assert torch.isfinite(lse[:, [3, 4, 8, 9, 10, 11]]).all()


@gpu
@pytest.mark.gpu
def test_cuda_long_sequences_against_float64_torch():
    """Thousands of keys per query: against a float64 per-sequence torch attention on the GPU."""
    lengths = [4096, 1, 0, 1500, 37]
    b = make_batch(lengths, None, 16, 16, 192, 128, seed=3)
    got = attend(b, "cuda", torch.float32, True)
    q, k, v = (b[n].to(torch.float32).double().cuda().requires_grad_(True) for n in ("q", "k", "v"))
    want = ref_attention(q, k, v, b["cu_q"], b["cu_q"], True)
    want.backward(b["grad"].to(torch.float32).double().cuda())
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], got[2], got[3], got[4]), (want, q.grad, k.grad, v.grad)):
        _assert_close(f"long sequences: {name}", g.double().cpu(), w.detach().cpu(), TOL[torch.float32])


@gpu
@pytest.mark.gpu
def test_cuda_every_backend_name_runs_the_reference_kernels():
    """auto, padded, native, varlen (raw codes and names) and fa4 (Python API) give one result,
    bit for bit, contiguous; the same call twice gives the same bits (no atomics)."""
    name, lengths, kv_lengths, hq, hk, dqk, dv = CASES[0]
    b = make_batch(lengths, kv_lengths, hq, hk, dqk, dv, seed=1)
    first = attend(b, "cuda", torch.float32, True, backend=0)
    for code in (0, 1, 2, 3):
        again = attend(b, "cuda", torch.float32, True, backend=code)
        for x, y in zip(first, again):
            assert torch.equal(x, y), code
    q, k, v = (b[n].float().cuda() for n in ("q", "k", "v"))
    cu = b["cu_q"].cuda()
    for backend in ("auto", "padded", "native", "varlen", "fa4"):
        out = verl_ops.mla_forward_padded(q, k, v, cu, cu, b["max_q"], b["max_kv"], causal=True, backend=backend)
        assert out.is_contiguous() and torch.equal(out, first[0]), backend


@gpu
@pytest.mark.gpu
def test_cuda_bad_offsets_stay_inside_the_tensors():
    """Offsets are not checked on CUDA without validate=True (no host sync); bad ones (decreasing,
    negative, past the rows) give some result but no access outside q, k, v or the outputs
    (compute-sanitizer memcheck checks that) and no error."""
    b = make_batch([6, 9, 5], [4, 8, 7], 4, 2, 64, 32, seed=4)
    tq, tk = sum([6, 9, 5]), sum([4, 8, 7])
    for cu_q, cu_kv in (([0, 15, 3, tq + 50], [-9, 7, 2, 999]), ([5, 2, 30, tq], [0, tk + 1, 1, tk])):
        bad = {**b, "cu_q": torch.tensor(cu_q, dtype=torch.int32), "cu_kv": torch.tensor(cu_kv, dtype=torch.int32)}
        for causal in (True, False):
            out, lse, dq, dk, dv = attend(bad, "cuda", torch.float32, causal)
            torch.cuda.synchronize()
            for t in (out, dq, dk, dv):
                assert torch.isfinite(t).all()


@gpu
@pytest.mark.gpu
def test_cuda_graph_capture():
    """Forward and backward captured in a CUDA graph and replayed: the eager result, bit for bit."""
    name, lengths, kv_lengths, hq, hk, dqk, dv = CASES[1]
    b = make_batch(lengths, kv_lengths, hq, hk, dqk, dv, seed=8)
    q, k, v, grad = (b[n].float().cuda() for n in ("q", "k", "v", "grad"))
    cu_q, cu_kv = b["cu_q"].cuda(), b["cu_kv"].cuda()
    args = (cu_q, cu_kv, b["max_q"], b["max_kv"], True, None, 0)

    def step():
        out, lse = OPS.mla_forward_padded(q, k, v, *args)
        return (out, lse, *OPS.mla_backward_padded(grad, q, k, v, out, lse, *args))

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(eager, captured):
        assert torch.equal(x, y)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_opcheck(dtype):
    for causal, (name, lengths, kv_lengths, hq, hk, dqk, dv) in ((True, CASES[0]), (False, CASES[2])):
        b = make_batch(lengths[:5], None if kv_lengths is None else kv_lengths[:5], hq, hk, dqk, dv, seed=2)
        q, k, v = (b[n].to(dtype).cuda().requires_grad_(True) for n in ("q", "k", "v"))
        cu_q = b["cu_q"].cuda()
        cu_kv = cu_q if kv_lengths is None else b["cu_kv"].cuda()
        for code in (0, 1):
            args = (q, k, v, cu_q, cu_kv, b["max_q"], b["max_kv"], causal, None, code)
            torch.library.opcheck(OPS.mla_forward_padded.default, args)
            out, lse = OPS.mla_forward_padded(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
            bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_kv, b["max_q"],
                   b["max_kv"], causal, None, code)
            torch.library.opcheck(OPS.mla_backward_padded.default, bwd)


# --------------------------------------------------------------------------------------------
# GPU: MLACoreAttention in float32.


def _core_attention(cp_comm_type="p2p"):
    from verl_ops.integrations.megatron_mla import MLACoreAttention

    config = SimpleNamespace(attention_dropout=0.0, kv_channels=192, softmax_type="vanilla", window_size=None)
    return MLACoreAttention(config, 1, "causal", "self", cp_comm_type=cp_comm_type)


@gpu
@pytest.mark.gpu
def test_cuda_core_attention_float32():
    """MLACoreAttention on THD rows in float32 (no CP): [t, n * Dv] out and q / k / v gradients
    equal the CPU exact reference's."""
    lengths = ragged_lengths(random.Random(9), 8, median=60.0, cap=400)
    layout = ThdLayout.from_lengths(lengths, tp_size=2)  # padded rows after each sequence's tokens
    heads, dqk, dv = 4, 192, 128
    q, k, v, grad = _full_batch(17, layout.total_padded, heads, dqk, dv, torch.float32)
    cu = layout.cu_seqlens_padded_cpu
    want = _attend(q.double(), k.double(), v.double(), grad.double(), cu, layout.max_seqlen, None)
    psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens_cpu.cuda(),
                          cu_seqlens_kv=layout.cu_seqlens_cpu.cuda(),
                          cu_seqlens_q_padded=cu.cuda(), cu_seqlens_kv_padded=cu.cuda(),
                          max_seqlen_q=layout.max_seqlen, max_seqlen_kv=layout.max_seqlen)
    qc, kc, vc = (x.cuda().requires_grad_(True) for x in (q, k, v))
    out = _core_attention()(qc, kc, vc, None, packed_seq_params=psp)
    assert out.dtype == torch.float32 and tuple(out.shape) == (layout.total_padded, heads * dv)
    out.backward(grad.cuda().reshape(out.shape))
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out.detach().reshape(-1, heads, dv), qc.grad, kc.grad, vc.grad),
                            want):
        _assert_close(f"MLACoreAttention float32: {name}", got.double().cpu(), w, TOL[torch.float32])


# megatron-core's model in float32 on CUDA (tests/test_megatron_model.py's tasks, which hold the
# tolerances of the dtypes they were written for): verl_ops' path against the plain reference.
MEGATRON_FP32_TOL = {"metric": "max", "loss": 1e-4, "grad": 1e-4, "param": 1e-4}


def _megatron_missing():
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core (pip install --no-deps megatron-core==0.16.1)"
    if importlib.util.find_spec("verl") is None:
        return "needs verl for its THD functions (pip install --no-deps verl==0.9.1)"
    return None


def megatron_task(rank, world, name, *args):
    """tests/test_megatron_model.py's rank task `name`, with float32 on CUDA among its tolerances."""
    import test_megatron_model as tm

    tm.TOLERANCES.setdefault(("cuda", "float32"), MEGATRON_FP32_TOL)
    return getattr(tm, name)(rank, world, *args)


@gpu
@pytest.mark.gpu
def test_cuda_megatron_model_float32():
    """A float32 (params_dtype=torch.float32) megatron-core model with MLACoreAttention trains on
    the GPU: 3 SGD steps, per-token loss and every gradient equal the reference path's."""
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    import test_megatron_model as tm

    tol = MEGATRON_FP32_TOL
    reports = shared_pool(2, "gloo", pg_timeout_s=60.0).run(
        "test_mla_fp32:megatron_task", "steps_task", "cuda", "float32", "tiny", 11, 3, timeout_s=400.0)
    for rank, rep in enumerate(reports):
        assert rep["attention"]["verl_ops"] == ["MLACoreAttention"] * 3, rep["attention"]
        for step, e in enumerate(rep["steps"]):
            what = f"{rep['megatron_core']} float32 rank {rank} step {step} lengths {e['lengths']}"
            assert e["loss_finite"], what
            assert e["loss_err"] <= tol["loss"], f"{what}: loss error {e['loss_err']:.3g}"
            tm._check_grads(what, e["grads"], tol["grad"], tol["metric"])
        bad = {n: v for n, v in rep["param_errors"].items() if not v <= tol["param"]}
        assert not bad, f"rank {rank}: parameters after 3 steps differ: {bad}"


@gpu
@pytest.mark.gpu
def test_cuda_megatron_model_float32_cp2_nccl():
    """The float32 model with context_parallel_size=2 over NCCL (MLACoreAttention's ring on the
    reference kernels) equals the single-process model: loss and gradients, 2 SGD steps."""
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    if torch.cuda.device_count() < 2:
        pytest.skip(f"CP = 2 over NCCL needs 2 GPUs, found {torch.cuda.device_count()}")
    import test_megatron_model as tm

    tol = MEGATRON_FP32_TOL
    reports = shared_pool(2, "nccl", pg_timeout_s=60.0).run(
        "test_mla_fp32:megatron_task", "cp_task", "cuda", "float32", "tiny", 5, 2, None, timeout_s=400.0)
    for rank, rep in enumerate(reports):
        assert rep["attention"] == ["MLACoreAttention"] * 3, rep["attention"]
        for step, e in enumerate(rep["steps"]):
            what = f"{rep['megatron_core']} float32 cp=2 rank {rank} step {step}"
            assert e["routes_equal"], f"{what}: {e['routes_mismatch']}"
            assert e["loss_finite"] and e["loss_err"] <= tol["loss"], f"{what}: loss error {e['loss_err']:.3g}"
            tm._check_grads(what, e["grads"], tol["grad"], tol["metric"])


# --------------------------------------------------------------------------------------------
# Context parallel at 2 ranks (gloo on the CPU, NCCL on 2 GPUs).


@pytest.fixture(params=dist_params(("gloo", "nccl"), (2,)))
def dist_run(request):
    run = dist_runner(request, "test_mla_fp32")
    if run.backend == "nccl" and not verl_ops.cuda_available():
        pytest.skip("verl_ops was built without its CUDA kernels")
    return run


def _shard(world, rank, device, dtype=torch.float32, heads=2, dqk=64, dv=32, lengths=(5, 9, 0, 12)):
    """This rank's zigzag rows of a batch built the same on every rank, and the offsets."""
    layout = ThdLayout.from_lengths(list(lengths), cp_size=world, cp_layout="zigzag")
    q, k, v, _ = _full_batch(3, layout.total_padded, heads, dqk, dv, dtype)
    rows = rank_rows(layout.cu_seqlens_padded_cpu.tolist(), world, rank, "zigzag")
    return q[rows].to(device), k[rows].to(device), v[rows].to(device), layout.cu_seqlens_padded_cpu, layout.max_seqlen


def _bad_inputs(q, k, v, device):
    """(name, rank 1's change, pattern of rank 1's error, pattern of rank 0's error) of arguments
    rank 1's attention call rejects or the collectives cannot take, rank 0's arguments being fine."""
    other = "another rank of the CP group got bad arguments"
    as_int = {"q": q.to(torch.int32), "k": k.to(torch.int32), "v": v.to(torch.int32)}
    cases = [
        ("integer q / k / v", as_int, "must be floating point", other),
        ("float16 q with float32 k / v", {"q": q.half()}, "dtype", other),
        ("Dv > Dqk", {"v": torch.ones(v.shape[0], v.shape[1], q.shape[2] + 8, dtype=v.dtype, device=device)},
         "head dims", other),
        ("q heads not a multiple of kv heads", {"q": torch.ones(q.shape[0], 3, q.shape[2], dtype=q.dtype, device=device)},
         "heads", other),
        ("a row short", {"q": q[1:], "k": k[1:], "v": v[1:]}, "rows", other),
        ("non-finite softmax_scale", {"softmax_scale": math.nan}, "softmax_scale", other),
        ("unknown cp_layout", {"cp_layout": "ring"}, "cp_layout", other),
        ("offsets not a tensor", {"cu": [0, 4]}, "cu_seqlens_padded must be a tensor", other),
        # valid on its own, but not the dtype the other rank gathers: both ranks say so
        ("float64 on one rank, float32 on the other", {"q": q.double(), "k": k.double(), "v": v.double()},
         "disagree on dtype", "disagree on dtype"),
        ("other head dims on one rank",
         {n: torch.ones(t.shape[0], t.shape[1], t.shape[2] + 4, dtype=t.dtype, device=device)
          for n, t in (("q", q), ("k", k))}, "disagree on Dqk", "disagree on Dqk"),
    ]
    if device.type == "cuda":
        cases.append(("CPU tensors under NCCL", {"q": q.cpu(), "k": k.cpu(), "v": v.cpu()}, "needs CUDA tensors", other))
    return cases


def check_one_rank_rejects(rank, world, backend):
    """For each bad argument of _bad_inputs on rank 1 (rank 0's fine), with the all-gather and the
    ring: both ranks raise an error naming the op (rank 1 its own, rank 0 that another rank's
    arguments are bad), neither waits; then a valid call gives the full attention's rows."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    q, k, v, cu, max_seqlen = _shard(world, rank, device)
    for name, change, own, others in _bad_inputs(q, k, v, device):
        for comm in ("all_gather", "p2p"):
            args = dict(q=q, k=k, v=v, cu=cu, cp_layout="zigzag", softmax_scale=None)
            if rank == 1:
                args.update(change)

            def call(a=args, comm=comm):
                return verl_ops.mla_cp_attention(a["q"], a["k"], a["v"], a["cu"], max_seqlen, cp_group=group,
                                                 cp_layout=a["cp_layout"], softmax_scale=a["softmax_scale"],
                                                 cp_comm_type=comm)

            msg = _expect_error(own if rank == 1 else others, call)
            assert "mla_cp_attention" in msg, (name, comm, msg)
    check_float32_matches(rank, world, backend)  # the group is in step: a valid call's result
    return True


def check_float32_matches(rank, world, backend):
    """float32 mla_cp_attention (all-gather and ring, zigzag; all-gather, contiguous) and
    MLACoreAttention at CP = 2: out and q / k / v gradients equal the CPU exact reference's rows."""
    dist, device = _setup(rank, backend)
    group = dist.group.WORLD
    rng = random.Random(77)  # the same batch on every rank
    if device.type == "cpu":
        lengths, heads, dqk, dv = ragged_lengths(rng, 6), 2, 24, 16
    else:
        lengths, heads, dqk, dv = ragged_lengths(rng, 10, median=120.0, cap=600), 4, 192, 128
    for cp_layout, comm in (("zigzag", "all_gather"), ("zigzag", "p2p"), ("contiguous", "all_gather")):
        layout = ThdLayout.from_lengths(lengths, cp_size=world, cp_layout=cp_layout)
        cu = layout.cu_seqlens_padded_cpu
        rows = rank_rows(cu.tolist(), world, rank, cp_layout)
        q, k, v, grad = _full_batch(rng.randrange(2**31), layout.total_padded, heads, dqk, dv, torch.float32)
        want = [w[rows] for w in _attend(q.double(), k.double(), v.double(), grad.double(), cu, layout.max_seqlen, None)]
        ql, kl, vl = (x[rows].to(device).requires_grad_(True) for x in (q, k, v))
        out = verl_ops.mla_cp_attention(ql, kl, vl, cu, layout.max_seqlen, cp_group=group, cp_layout=cp_layout,
                                        cp_comm_type=comm)
        assert out.dtype == torch.float32 and out.device == ql.device
        out.backward(grad[rows].to(device))
        what = f"float32 {cp_layout} {comm} rank {rank}"
        for name, got, w in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad), want):
            _assert_close(f"{what}: {name}", got.double().cpu(), w, TOL[torch.float32])
        if cp_layout == "zigzag":  # the Megatron module on the same rows, its group from packed_seq_params
            psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens_cpu.to(device),
                                  cu_seqlens_kv=layout.cu_seqlens_cpu.to(device), cu_seqlens_q_padded=cu.to(device),
                                  cu_seqlens_kv_padded=cu.to(device), max_seqlen_q=layout.max_seqlen,
                                  max_seqlen_kv=layout.max_seqlen, local_cp_size=world, cp_group=group)
            core = _core_attention(comm)
            core.k_channels = dqk
            ql, kl, vl = (x[rows].to(device).requires_grad_(True) for x in (q, k, v))
            out = core(ql, kl, vl, None, packed_seq_params=psp)
            out.backward(grad[rows].to(device).reshape(out.shape))
            for name, got, w in zip(("out", "dq", "dk", "dv"),
                                    (out.detach().reshape(-1, heads, dv), ql.grad, kl.grad, vl.grad), want):
                _assert_close(f"MLACoreAttention {what}: {name}", got.double().cpu(), w, TOL[torch.float32])
    return True


def test_one_rank_rejects_its_input_and_no_rank_waits(dist_run):
    dist_run("check_one_rank_rejects", timeout_s=120.0)


def test_float32_under_cp(dist_run):
    dist_run("check_float32_matches", timeout_s=240.0)
