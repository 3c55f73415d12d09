"""The varlen backend's own forward and backward kernels for MLA head dims on Hopper
(csrc/cuda/mla_sm90_fwd.cu, mla_sm90_bwd.cu): Dqk 192 / Dv 128 on compute capability 9.0 in
builds for sm_90a. tests/test_mla_varlen.py checks
the backend against the float64 reference at these dims (edge lengths, fp16 / bf16, grouped heads,
cross attention, bad device offsets, CUDA graphs); here: RL-like ragged batches with many heads
against the reference (outputs and gradients), agreement with cuDNN's forward and backward
(VERL_OPS_VARLEN_FORWARD=cudnn / VERL_OPS_VARLEN_BACKWARD=cudnn, in a subprocess: the switches are
read once per process), no cuDNN plan built, and forward (+ backward) captured in a CUDA graph
without a warm-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import HAS_CUDA
from test_mla_varlen import (
    TOL,
    check_against_reference,
    lse_err,
    make_case,
    reference,
    rel_err,
    run,
    saved_by_script,
)

from verl_ops import mla_cache_info, mla_forward_padded

OPS = torch.ops.verl_ops
INFO = mla_cache_info()
HOPPER_90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_own_forward = pytest.mark.skipif(
    not (HOPPER_90 and INFO["available"] and INFO["hopper_forward"]),
    reason="needs a compute capability 9.0 GPU and a build with the varlen backend for sm_90a",
)
# The own backward runs by default (VERL_OPS_VARLEN_BACKWARD=cudnn turns it off): every reference
# check of this module goes through it; test_cuda_cudnn_backward_module_in_subprocess runs them all
# again with cuDNN's backward.
needs_own_backward = pytest.mark.skipif(
    not (HOPPER_90 and INFO["available"] and INFO["hopper_backward"]),
    reason="needs a compute capability 9.0 GPU, a build with the varlen backend for sm_90a, and "
    "VERL_OPS_VARLEN_BACKWARD not set to cudnn",
)


def rl_lengths(n, seed, median=600, sigma=0.9, lo=1, hi=4096):
    """Log-normal response lengths (what RL micro-batches look like), clipped to [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).mul(sigma).exp().mul(median).round()
    return x.clamp(lo, hi).long().tolist()


def test_cache_info_reports_the_own_kernels():
    assert isinstance(INFO["hopper_forward"], bool) and isinstance(INFO["hopper_backward"], bool)
    if not INFO["available"]:
        # no varlen backend, no kernels of it
        assert INFO["hopper_forward"] is False and INFO["hopper_backward"] is False
    assert OPS.mla_cache_info(torch.empty(0)).shape == (12,)


@pytest.mark.gpu
@needs_own_forward
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_rl_batch_many_heads_against_reference(causal):
    c = make_case(rl_lengths(12, seed=3) + [1, 2, 129], hq=16, hk=16, device="cuda", seed=41)
    check_against_reference(c, causal=causal)


@pytest.mark.gpu
@needs_own_forward
def test_cuda_long_sequence_grouped_heads_against_reference():
    c = make_case([8192, 3, 0, 2048, 127], hq=8, hk=2, device="cuda", seed=42)
    check_against_reference(c, causal=True)


@pytest.mark.gpu
@needs_own_forward
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_cross_attention_rows_without_keys(dtype):
    """Bottom-right causal cross attention with more queries than keys: the first lq - lk rows of a
    sequence see no key (zero output, +inf log-sum-exp), as do all rows of a sequence without keys."""
    c = make_case([300, 5, 130, 64], kv_lengths=[40, 0, 129, 64], hq=4, hk=4, dtype=dtype, device="cuda", seed=43)
    check_against_reference(c, causal=True)
    out, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 300, 129, True, None, 3)
    assert torch.equal(out[:260], torch.zeros_like(out[:260]))  # rows 0..259 of the first sequence
    assert torch.isinf(lse[:, :260]).all() and (lse[:, :260] > 0).all()
    assert torch.equal(out[300:305], torch.zeros_like(out[300:305]))


_CUDNN_FORWARD_SCRIPT = r"""
import sys, torch
sys.path[:0] = {path!r}
from test_mla_sm90 import rl_lengths
from test_mla_varlen import make_case, run
from verl_ops import mla_cache_info
assert not mla_cache_info()["hopper_forward"]
results = []
for causal in (True, False):
    c = make_case(rl_lengths(10, seed=5) + [1], hq=8, hk=4, device="cuda", seed=44)
    out, (q, k, v) = run(c, causal=causal)
    _, lse = torch.ops.verl_ops.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"],
                                                   c["max_kv"], causal, None, 3)
    out.backward(torch.ones_like(out))
    results.append([t.cpu() for t in (out, lse, q.grad, k.grad, v.grad)])
torch.save(results, sys.argv[1])
"""


@pytest.mark.gpu
@needs_own_forward
def test_cuda_own_forward_agrees_with_cudnn_forward(tmp_path):
    """VERL_OPS_VARLEN_FORWARD=cudnn runs cuDNN's forward plan instead: outputs within bf16
    rounding, the log-sum-exp to float32 rounding, and cuDNN's backward (which both use) gives the
    same gradients from either forward's output and log-sum-exp."""
    theirs = saved_by_script(_CUDNN_FORWARD_SCRIPT, tmp_path / "cudnn.pt", {"VERL_OPS_VARLEN_FORWARD": "cudnn"})
    for causal, want in zip((True, False), theirs):
        c = make_case(rl_lengths(10, seed=5) + [1], hq=8, hk=4, device="cuda", seed=44)
        out, (q, k, v) = run(c, causal=causal)
        _, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"],
                                        causal, None, 3)
        out.backward(torch.ones_like(out))
        assert rel_err(out, want[0]) < 4e-3
        assert lse_err(lse, want[1]) < 1e-3
        for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), want[2:]):
            assert rel_err(got, exp) < 1e-2, name


@pytest.mark.gpu
@needs_own_forward
def test_cuda_forward_builds_no_plan_and_captures_without_warm_up():
    """The forward needs no cuDNN plan: a new bucket builds nothing, and a forward is captured in
    a CUDA graph on its first call (cuDNN's forward raises there: no plan yet) and replayed on
    new data equal to an eager call."""
    c = make_case([77, 5, 300], hq=2, hk=2, device="cuda", seed=45)
    before = mla_cache_info()
    with torch.no_grad():
        out = mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 300, 300, softmax_scale=0.0713,
                                 backend="varlen")
    torch.cuda.synchronize()
    assert mla_cache_info()["builds"] == before["builds"]
    want, _, _ = reference(c["q"], c["k"], c["v"], c["cu_q"].cpu(), c["cu_kv"].cpu(), True, 0.0713)
    assert rel_err(out, want) < TOL[torch.bfloat16]

    static = {n: c[n].clone() for n in ("q", "k", "v")}
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = mla_forward_padded(static["q"], static["k"], static["v"], c["cu_q"], c["cu_kv"], 300, 300,
                                        softmax_scale=0.0419, backend="varlen")
    fresh = make_case([77, 5, 300], hq=2, hk=2, device="cuda", seed=46)
    for n in ("q", "k", "v"):
        static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = mla_forward_padded(fresh["q"], fresh["k"], fresh["v"], c["cu_q"], c["cu_kv"], 300, 300,
                                   softmax_scale=0.0419, backend="varlen")
    assert torch.equal(static_out, eager)


@pytest.mark.gpu
@needs_own_forward
def test_cuda_many_sequences_in_input_order():
    """Past 1024 sequences the schedule keeps the input order (and still counts every tile)."""
    lengths = torch.randint(0, 300, (1500,), generator=torch.Generator().manual_seed(9)).tolist()
    c = make_case(lengths, hq=2, hk=2, device="cuda", seed=47)
    check_against_reference(c, causal=True)


_CUDNN_BACKWARD_SCRIPT = r"""
import sys, torch
sys.path[:0] = {path!r}
from test_mla_sm90 import rl_lengths
from test_mla_varlen import make_case, run
from verl_ops import mla_cache_info
assert not mla_cache_info()["hopper_backward"]
results = []
for causal, kv in ((True, None), (False, None), (True, [40, 0, 129, 64, 3])):
    if kv is None:
        c = make_case(rl_lengths(10, seed=6) + [1, 0], hq=8, hk=4, device="cuda", seed=48)
    else:
        c = make_case([300, 5, 130, 64, 0], kv_lengths=kv, hq=4, hk=2, device="cuda", seed=49)
    out, (q, k, v) = run(c, causal=causal)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out.device, out.dtype)
    out.backward(g)
    results.append([t.cpu() for t in (out, q.grad, k.grad, v.grad)])
torch.save(results, sys.argv[1])
"""


@pytest.mark.gpu
@needs_own_backward
def test_cuda_own_backward_agrees_with_cudnn_backward(tmp_path):
    """VERL_OPS_VARLEN_BACKWARD=cudnn runs cuDNN's backward plan on the same forward: gradients
    within bf16 rounding on an RL-like batch (causal and not, grouped heads, a sequence of length
    0) and on bottom-right cross attention with rows and sequences that see no key."""
    theirs = saved_by_script(_CUDNN_BACKWARD_SCRIPT, tmp_path / "cudnn_bwd.pt", {"VERL_OPS_VARLEN_BACKWARD": "cudnn"})
    cases = ((True, None), (False, None), (True, [40, 0, 129, 64, 3]))
    for (causal, kv), want in zip(cases, theirs):
        if kv is None:
            c = make_case(rl_lengths(10, seed=6) + [1, 0], hq=8, hk=4, device="cuda", seed=48)
        else:
            c = make_case([300, 5, 130, 64, 0], kv_lengths=kv, hq=4, hk=2, device="cuda", seed=49)
        out, (q, k, v) = run(c, causal=causal)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out.device, out.dtype)
        out.backward(g)
        assert torch.equal(out.cpu(), want[0])  # the same forward
        for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), want[1:]):
            assert torch.isfinite(got).all(), name
            assert rel_err(got, exp) < 1e-2, (name, causal, kv)


@pytest.mark.gpu
@needs_own_forward
@needs_own_backward
def test_cuda_forward_backward_build_no_plan_and_capture_without_warm_up():
    """Forward and backward need no cuDNN plan: a new bucket builds nothing, and both are captured
    in a CUDA graph on their first call and replayed on new data equal to eager calls."""
    lengths, scale = [77, 5, 0, 300, 129], 0.0667  # a scale of its own: a bucket no other test uses
    c = make_case(lengths, hq=4, hk=2, device="cuda", seed=50)
    static = {n: c[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    grad = torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16)
    builds = mla_cache_info()["builds"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = mla_forward_padded(static["q"], static["k"], static["v"], c["cu_q"], c["cu_kv"], 300, 300,
                                        softmax_scale=scale, backend="varlen")
        static_out.backward(grad)
    assert mla_cache_info()["builds"] == builds
    fresh = make_case(lengths, hq=4, hk=2, device="cuda", seed=51)
    for n in ("q", "k", "v"):
        static[n].data.copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    out, (q, k, v) = run(fresh, scale=scale)
    out.backward(grad)
    assert torch.equal(static_out, out)
    for n, t in zip("qkv", (q, k, v)):
        assert torch.isfinite(static[n].grad).all(), n
        assert rel_err(static[n].grad, t.grad) < 1e-2, n  # dq adds partial sums in any order
    assert mla_cache_info()["builds"] == builds


@pytest.mark.gpu
@needs_own_forward
@needs_own_backward
def test_cuda_cudnn_backward_module_in_subprocess():
    """This module again with VERL_OPS_VARLEN_BACKWARD=cudnn: the reference checks (RL batches causal
    and not, long sequences with grouped heads, fp16 / bf16 cross attention with rows that see no
    key, 1500 sequences) through cuDNN's backward plan on the own forward, which users who turn the
    own backward off get."""
    env = dict(os.environ, VERL_OPS_VARLEN_BACKWARD="cudnn", COLUMNS="1000")  # skip reasons unwrapped
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-m", "pytest", os.path.join(here, "test_mla_sm90.py"), "-q", "-m", "gpu",
                           "-p", "no:cacheprovider", "-k", "not module_in_subprocess", "-rs"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=here)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    last = done.stdout.strip().splitlines()[-1]
    assert " passed" in last, tail
    # The switch took effect there: the tests that need the own backward are skipped for it.
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("VERL_OPS_VARLEN_BACKWARD" in line for line in skips), tail
