"""The varlen backend of mla_forward_padded (cuDNN's attention on the packed THD rows)
against a float64 reference written from docs/mla.md#semantics: V zero-padded to Dqk, softmax attention
per sequence (bottom-right causal diagonal, grouped kv heads), output trimmed to Dv; the log-sum-exp
of the scaled scores per query row (+inf for a row that sees no key).

CPU: backend="varlen" runs the exact reference; the plan-cache counters; the auto rule's Python
mirror. GPU (``gpu`` marker): outputs, log-sum-exp and q/k/v gradients within bf16 / fp16 bounds
on ragged batches (lengths 0, 1, 2, 127, 128, 129, 4096, 8192), causal and not, q / kv lengths that
differ, grouped heads, Dv != Dqk and Dv == Dqk; 64 seeded random RL-like batches (random_batch:
mixed lengths, cross attention, grouped heads, dtypes, scales, varlen and auto); the plan cache
reused within a bucket; CUDA-graph capture and replay of forward + backward; bad input; auto and
the Megatron patch on ragged batches."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA

import verl_ops
from verl_ops import _mla, mla_cache_info, mla_forward_padded

OPS = torch.ops.verl_ops
VARLEN_BUILT = mla_cache_info()["available"]
HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_varlen = pytest.mark.skipif(not (HAS_CUDA and VARLEN_BUILT), reason="needs CUDA and a build with the varlen backend")
# Relative (Frobenius) error bounds: bf16 has an 8-bit mantissa (~4e-3 per rounding), fp16 11 bits.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
EDGE_LENGTHS = [0, 1, 2, 127, 128, 129, 4096, 8192]


# --------------------------------------------------------------------------------------------
# Reference (float64, one sequence and a few heads at a time: 8192^2 scores stay small).


def reference(q, k, v, cu_q, cu_kv, causal=True, scale=None, grad_out=None):
    """out [Tq, Hq, Dv], lse [Hq, Tq] and, given grad_out, (dq, dk, dv), all float64."""
    hq, dqk = q.shape[1], q.shape[2]
    hk, dv = k.shape[1], v.shape[2]
    group = hq // hk
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    q, k, v = (t.detach().double().requires_grad_(grad_out is not None) for t in (q, k, v))
    out = q.new_zeros(q.shape[0], hq, dv)
    lse = q.new_full((hq, q.shape[0]), float("inf"))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    cu_q, cu_kv = [int(x) for x in cu_q], [int(x) for x in cu_kv]
    heads_per_step = max(1, min(hq, (1 << 26) // max(1, max(_lengths(cu_q)) * max(_lengths(cu_kv)))))
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_kv[b], cu_kv[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        for h0 in range(0, hq, heads_per_step):
            h1 = min(hq, h0 + heads_per_step)
            heads = torch.arange(h0, h1, device=q.device)
            qs = q[q0:q1, h0:h1].transpose(0, 1)  # [h, Lq, Dqk]
            ks = k[k0:k1, heads // group].transpose(0, 1)
            vs = F.pad(v[k0:k1, heads // group], (0, dqk - dv)).transpose(0, 1)  # V zero-padded to Dqk
            scores = scale * qs @ ks.transpose(1, 2)
            if causal:
                i = torch.arange(lq, device=q.device).unsqueeze(1)
                j = torch.arange(lk, device=q.device).unsqueeze(0)
                scores = scores.masked_fill(j > i + lk - lq, float("-inf"))  # bottom-right diagonal
            row_lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees no key
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            o = (p @ vs)[..., :dv].transpose(0, 1)  # trimmed back to Dv
            out[q0:q1, h0:h1] = o.detach()
            lse[h0:h1, q0:q1] = torch.where(torch.isinf(row_lse), float("inf"), row_lse).detach()
            if grad_out is not None:
                gq, gk, gv = torch.autograd.grad(o, (q, k, v), grad_out[q0:q1, h0:h1].double(), allow_unused=True)
                for acc, g in zip(grads, (gq, gk, gv)):
                    if g is not None:
                        acc += g
    return out, lse, (tuple(grads) if grad_out is not None else None)


def _lengths(cu):
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)] or [0]


def make_case(lengths, kv_lengths=None, hq=4, hk=4, dqk=192, dv=128, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_lengths = lengths if kv_lengths is None else kv_lengths
    tq, tk = sum(lengths), sum(kv_lengths)
    c = dict(
        q=torch.randn(tq, hq, dqk, generator=g).to(device, dtype),
        k=torch.randn(tk, hk, dqk, generator=g).to(device, dtype),
        v=torch.randn(tk, hk, dv, generator=g).to(device, dtype),
        cu_q=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        cu_kv=torch.tensor([0, *torch.tensor(kv_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_q=max(lengths, default=0),
        max_kv=max(kv_lengths, default=0),
    )
    if kv_lengths is lengths:
        c["cu_kv"] = c["cu_q"]  # self-attention: one offsets tensor, as Megatron passes it
    return c


def run(c, causal=True, backend="varlen", scale=None):
    q, k, v = (c[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
    out = mla_forward_padded(
        q, k, v, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"], causal=causal, softmax_scale=scale, backend=backend
    )
    return out, (q, k, v)


def rel_err(got, want):
    """Error norm relative to the reference's norm (floored at an rms of 1e-3)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-3 * max(want.numel(), 1) ** 0.5))


def lse_err(got, want):
    """Largest difference on rows that see a key; rows that see none must be +inf on both sides."""
    got, want = got.double().cpu(), want.double().cpu()
    empty = torch.isinf(want)
    assert torch.equal(torch.isinf(got) & (got > 0), empty), "rows without keys must have lse +inf"
    return float((got[~empty] - want[~empty]).abs().max()) if (~empty).any() else 0.0


def check_against_reference(c, causal=True, scale=None, tol_scale=1.0, backend="varlen"):
    dtype = c["q"].dtype
    out, (q, k, v) = run(c, causal=causal, scale=scale, backend=backend)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, dtype)
    want, want_lse, want_grads = reference(c["q"], c["k"], c["v"], c["cu_q"].cpu(), c["cu_kv"].cpu(), causal, scale, g)
    assert out.shape == want.shape and out.dtype == dtype
    # (auto's padded path returns a strided view of Dqk-wide rows; varlen's rows are contiguous)
    assert out.is_contiguous() or backend != "varlen"
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < TOL[dtype] * tol_scale
    _, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"], causal, scale, 3)
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32
    assert lse_err(lse, want_lse) < 2e-2
    out.backward(g)
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), want_grads):
        assert got.shape == exp.shape and torch.isfinite(got).all(), name
        assert rel_err(got, exp) < 2 * TOL[dtype] * tol_scale, name


# --------------------------------------------------------------------------------------------
# CPU: the reference, the cache counters, the auto rule's mirror.


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_varlen_is_the_reference(causal):
    c = make_case([3, 0, 1, 9], kv_lengths=[5, 2, 0, 9], hq=4, hk=2, dqk=24, dv=16, dtype=torch.float64, seed=1)
    out, (q, k, v) = run(c, causal=causal)
    assert out.is_contiguous()  # the varlen layout: contiguous [Tq, Hq, Dv]
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, want_lse, grads = reference(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], causal, None, g)
    assert torch.allclose(out, want, atol=1e-10)
    _, lse = OPS.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 9, 9, causal, None, 3)
    assert lse_err(lse, want_lse) < 1e-10
    out.backward(g)
    for got, exp in zip((q.grad, k.grad, v.grad), grads):
        assert torch.allclose(got, exp, atol=1e-10)


def test_cache_info_fields():
    info = mla_cache_info()
    counters = ("size", "hits", "misses", "builds", "failures", "evictions", "capacity", "failed_buckets")
    assert set(info) == {"available", "cudnn_version", "hopper_forward", "hopper_backward", *counters}
    assert all(isinstance(info[n], bool) for n in ("available", "hopper_forward", "hopper_backward"))
    assert all(isinstance(info[n], int) and info[n] >= 0 for n in counters)
    if info["available"]:
        assert verl_ops.cuda_available()
        # the cuDNN the backend loads is torch's
        assert info["cudnn_version"] == torch.backends.cudnn.version()
    else:
        assert info["cudnn_version"] == 0
    assert info["builds"] >= info["size"]
    assert info["failures"] >= info["failed_buckets"]


@pytest.mark.skipif(not VARLEN_BUILT, reason="the plan cache exists in builds with the varlen backend")
def test_cache_capacity_set_and_restored():
    previous = mla_cache_info()["capacity"]
    try:
        assert mla_cache_info(capacity=7)["capacity"] == 7
        assert mla_cache_info()["capacity"] == 7  # kept
        assert mla_cache_info(capacity=0)["capacity"] == 0  # no limit
        assert OPS.mla_cache_info(torch.empty(0), 3)[7].item() == 3  # the raw op's argument
        assert OPS.mla_cache_info(torch.empty(0))[7].item() == 3  # -1: unchanged
    finally:
        mla_cache_info(capacity=previous)
    assert mla_cache_info()["capacity"] == previous


def test_auto_cudnn_floor_mirror(monkeypatch):
    """The fake kernels' auto rule takes varlen only with cuDNN >= 9.7.0, as prepare_mla does."""
    monkeypatch.setattr(_mla, "_VARLEN_DEVICES", {0: True})
    dev = torch.device("cuda", 0)
    # (built, cuDNN version, own kernels), as the probe reads it on the first CUDA question
    monkeypatch.setattr(_mla, "_VARLEN_STATE", (True, 90700, False))
    assert _mla._varlen_auto(dev)
    monkeypatch.setattr(_mla, "_VARLEN_STATE", (True, 90699, False))
    assert not _mla._varlen_auto(dev)
    monkeypatch.setattr(_mla, "_VARLEN_STATE", (True, 0, False))
    assert not _mla._varlen_auto(dev)
    monkeypatch.setattr(_mla, "_VARLEN_STATE", (False, 90700, True))  # a build without the backend
    assert not _mla._varlen_auto(dev)


def test_varlen_state_probed_once_outside_fake_mode(monkeypatch):
    """The varlen backend's state is read on the first question about a CUDA device (not at
    import), through the real op even when the first question comes from a fake kernel under
    FakeTensorMode, and then kept."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(_mla, "_VARLEN_STATE", None)
    with FakeTensorMode():
        state = _mla._varlen_state()
    want = OPS.mla_cache_info(torch.empty(0)).tolist()
    assert state == (bool(want[0]), want[9], bool(want[10]) and bool(want[11]))
    assert _mla._VARLEN_STATE == state
    assert not _mla._varlen_auto(torch.device("cpu"))


@pytest.mark.parametrize(
    "lengths, kv_lengths, heads, dims, varlen_auto, varlen_uniform, want",
    [
        ([100, 3000, 7], None, (16, 16), (192, 128), True, False, "varlen"),  # ragged: varlen
        ([100, 3000, 7], None, (16, 16), (192, 128), False, False, "padded"),  # no varlen (build, device)
        ([1024] * 16, None, (16, 16), (192, 128), True, False, "native"),  # uniform: the native rule
        ([512] * 4, None, (16, 16), (192, 128), True, False, "padded"),  # uniform below the native rule
        # uniform where varlen runs the own SM90 kernels: varlen, above and below the native rule
        ([1024] * 16, None, (16, 16), (192, 128), True, True, "varlen"),
        ([512] * 4, None, (16, 16), (192, 128), True, True, "varlen"),
        ([1024] * 16, None, (16, 16), (192, 128), False, True, "native"),  # not without varlen_auto
        ([1024] * 16, None, (16, 16), (128, 128), True, True, "padded"),  # other head dims: as before
        ([2, 2], [3, 3], (4, 4), (192, 128), True, True, "varlen"),  # uniform cross attention
        ([5, 9], [9, 5], (8, 2), (128, 128), True, False, "varlen"),  # cross attention, grouped heads
        ([5, 9], None, (4, 4), (96, 64), True, True, "padded"),  # head dims not in the table
        ([1, 1, 0], None, (4, 4), (192, 128), True, True, "padded"),  # single tokens: padded
        ([1, 1], None, (4, 4), (192, 128), True, True, "padded"),  # uniform single tokens: padded
    ],
)
def test_auto_rule_mirror(lengths, kv_lengths, heads, dims, varlen_auto, varlen_uniform, want):
    """_mla._mla_backend mirrors resolve_mla_backend: auto sends batches that are not uniform to
    varlen where varlen_auto holds (Hopper, a build with the backend) and the head dims are in the
    table, and uniform 192 / 128 batches too where varlen runs the own SM90 kernels."""
    kv_lengths = lengths if kv_lengths is None else kv_lengths
    sizes = (sum(lengths), sum(kv_lengths), heads[0], heads[1], dims[0], dims[1], len(lengths))
    got = _mla._mla_backend("op", 0, sizes, max(lengths), max(kv_lengths), True, kv_lengths is lengths,
                             varlen_auto, varlen_uniform)
    assert got == want
    assert _mla._mla_backend("op", 3, sizes, max(lengths), max(kv_lengths), True, False, False) == "varlen"


def test_cpu_auto_never_varlen():
    """On the CPU auto keeps the padded layout for a ragged 192/128 batch (varlen is CUDA-only)."""
    c = make_case([5, 30, 2], hq=2, hk=2, dtype=torch.float32, seed=2)
    out, _ = run(c, backend="auto")
    assert out.stride() == (2 * 192, 192, 1)


def test_bad_input_cpu():
    c = make_case([3, 4], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"mla_forward_padded: cu_seqlens_q\[-1\]=7 must equal the number of rows 6"):
        mla_forward_padded(c["q"][:6], c["k"], c["v"], c["cu_q"], c["cu_kv"], 4, 4, backend="varlen", validate=True)
    with pytest.raises(ValueError, match="mla_forward_padded: a sequence has 4 tokens, more than max_seqlen_q=3"):
        mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 3, 4, backend="varlen", validate=True)


# --------------------------------------------------------------------------------------------
# GPU.

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@gpu
@pytest.mark.gpu
def test_cuda_varlen_missing_from_build_is_a_clear_error():
    if VARLEN_BUILT:
        pytest.skip("this build has the varlen backend")
    c = make_case([3, 4], device="cuda")
    with pytest.raises(RuntimeError, match="mla_forward_padded: backend='varlen' is not in this build.*nvidia-cudnn-frontend"):
        run(c)


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=["192-128", "128-128"])
def test_cuda_edge_lengths(causal, dims):
    """Lengths 0, 1, 2, 127, 128, 129, 4096, 8192 in one batch, 16 heads, bf16."""
    c = make_case(EDGE_LENGTHS, hq=16, hk=16, dqk=dims[0], dv=dims[1], device="cuda", seed=10)
    check_against_reference(c, causal=causal)


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [(3, 3), (8, 2)], ids=["h3", "gqa8-2"])
def test_cuda_small_ragged(dtype, causal, heads):
    lengths = [129, 0, 1, 2, 127, 128, 700, 1, 64]
    c = make_case(lengths, hq=heads[0], hk=heads[1], dtype=dtype, device="cuda", seed=11)
    check_against_reference(c, causal=causal, scale=0.07)


def random_batch(seed):
    """A seeded ragged batch as RL makes them, small enough for the float64 reference: 1-10
    sequences, lengths log-normal (median 120, clipped to 700) with 0 and 1-3 mixed in, in 3 of 20
    cases one sequence of 1500-3000 (many key tiles per query tile, the rings wrap); in 4 of 10
    cases kv lengths of their own (cross attention, bottom-right causal diagonal: rows that see no
    key, keys no row sees); grouped heads; bf16 or fp16; causal in 7 of 10; the default scale or
    another. Returns (make_case kwargs, causal, scale, backend)."""
    rng = random.Random(seed)

    def length():
        r = rng.random()
        if r < 0.1:
            return 0
        if r < 0.2:
            return rng.randint(1, 3)
        return min(700, max(1, int(rng.lognormvariate(math.log(120), 1.0))))

    batch = rng.randint(1, 10)
    lengths = [length() for _ in range(batch)]
    kv_lengths = [length() for _ in range(batch)] if rng.random() < 0.4 else None
    if rng.random() < 0.15:
        i = rng.randrange(batch)
        lengths[i] = rng.randint(1500, 3000)
        if kv_lengths is not None:
            kv_lengths[i] = rng.randint(1500, 3000)
    hq, hk = rng.choice([(1, 1), (2, 2), (4, 1), (6, 3), (8, 8), (16, 4)])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    kwargs = dict(lengths=lengths, kv_lengths=kv_lengths, hq=hq, hk=hk, dtype=dtype, seed=1000 + seed)
    return kwargs, rng.random() < 0.7, rng.choice([None, None, 0.05]), rng.choice(["varlen", "varlen", "auto"])


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("seed", range(64))
def test_cuda_random_ragged_batches(seed):
    """Seeded random batches (random_batch) against the reference: outputs, lse and q / k / v
    gradients, through varlen or auto. On compute capability 9.0 these are the own SM90 kernels
    (192 / 128); elsewhere cuDNN's."""
    kwargs, causal, scale, backend = random_batch(seed)
    c = make_case(device="cuda", **kwargs)
    check_against_reference(c, causal=causal, scale=scale, backend=backend)


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 64)], ids=["192-128", "64-64"])
def test_cuda_cross_attention(causal, dims):
    """q and kv lengths that differ (bottom-right causal diagonal): queries that see no key
    (lq > lk, or lk == 0) get zero rows and an infinite lse; keys that no query sees (lq == 0) get
    zero gradients."""
    lq = [5, 300, 0, 64, 1, 7, 129, 2]
    lk = [2, 100, 40, 0, 129, 7, 1, 300]
    c = make_case(lq, kv_lengths=lk, hq=8, hk=4, dqk=dims[0], dv=dims[1], device="cuda", seed=12)
    check_against_reference(c, causal=causal)


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_plan_cache_reused_within_a_bucket():
    """Batches of one bucket (batch size and max_seqlen rounded up to powers of two, token totals
    in quarter octaves) build no new graph; a longer batch builds the forward and backward of its
    bucket once."""

    def step(lengths):
        c = make_case(lengths, hq=4, hk=4, device="cuda", seed=sum(lengths))
        out, (q, k, v) = run(c, scale=0.061)  # a scale of its own: buckets no other test builds
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()

    # Forward and backward have a plan each, except where they run the own SM90 kernels at these
    # head dims (192 / 128, compute capability 9.0), which need none (tests/test_mla_sm90.py).
    hopper = torch.cuda.get_device_capability() == (9, 0)
    info = mla_cache_info()
    plans = sum(not (info[n] and hopper) for n in ("hopper_forward", "hopper_backward"))
    step([700, 300, 5, 900, 129])  # bucket: 8 sequences, max_seqlen 1024, ~2k tokens
    before = mla_cache_info()
    step([900, 129, 700, 5, 300])
    step([1000, 10, 600, 400, 20, 3])
    after = mla_cache_info()
    assert after["builds"] == before["builds"], (before, after)
    assert after["hits"] >= before["hits"] + 2 * plans
    step([3000, 5, 12])  # max_seqlen 4096: a new bucket
    assert mla_cache_info()["builds"] == after["builds"] + plans


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_new_threads_reuse_handles_and_plans():
    """A thread gives its cuDNN handle back when it exits and the next thread takes it, with the
    plans built on it: a program that keeps starting threads builds a bucket's graphs once."""
    import threading

    c = make_case([300, 17, 129], hq=2, hk=2, dqk=64, dv=64, device="cuda", seed=21)
    errors = []

    def work():
        try:
            out, _ = run(c, scale=0.0517)  # a scale of its own: buckets no other test builds
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def in_new_thread():
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert not errors, errors

    in_new_thread()
    first = mla_cache_info()
    for _ in range(3):
        in_new_thread()
    after = mla_cache_info()
    assert after["builds"] == first["builds"], (first, after)
    assert after["hits"] >= first["hits"] + 6  # forward and backward of each thread


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_plan_cache_capacity_evicts_least_recently_used():
    previous = mla_cache_info()["capacity"]
    # three forward-only buckets (max_seqlen 64, 256, 1024) with a scale of their own
    cases = [make_case(lengths, hq=2, hk=2, dqk=64, dv=64, device="cuda", seed=30 + i)
             for i, lengths in enumerate(([40, 3], [200, 7], [900, 1]))]

    def forward(c):
        with torch.no_grad():
            mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"],
                               softmax_scale=0.0371, backend="varlen")
        torch.cuda.synchronize()

    try:
        start = mla_cache_info(capacity=1)
        for c in cases:
            forward(c)
        mid = mla_cache_info()
        assert mid["builds"] == start["builds"] + 3
        assert mid["evictions"] >= start["evictions"] + 2
        forward(cases[2])  # the most recently used plan stays
        assert mla_cache_info()["builds"] == mid["builds"]
        forward(cases[0])  # the least recently used one went: built again
        assert mla_cache_info()["builds"] == mid["builds"] + 1
        out, _ = run(cases[1], scale=0.0371)  # an evicted plan's bucket still computes right
        want, _, _ = reference(cases[1]["q"], cases[1]["k"], cases[1]["v"], cases[1]["cu_q"], cases[1]["cu_kv"], True, 0.0371)
        assert rel_err(out.detach(), want) < TOL[torch.bfloat16]
    finally:
        mla_cache_info(capacity=previous)
    assert mla_cache_info()["capacity"] == previous


def saved_by_script(script, dest, env, **fields):
    """What ``script`` saves to ``dest`` (its argument), run in a fresh process with the environment
    variables ``env`` added; the script is formatted with ``path`` (this folder, for sys.path) and
    ``fields``."""
    import os
    import subprocess
    import sys

    code = script.format(path=[os.path.dirname(os.path.abspath(__file__))], **fields)
    done = subprocess.run([sys.executable, "-c", code, str(dest)], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return torch.load(dest)


_FAILED_BUILD_SCRIPT = r"""
import torch, verl_ops
from verl_ops import mla_cache_info, mla_forward_padded
q = torch.randn(14, 2, 64, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 5, 14], dtype=torch.int32, device="cuda")
def call():
    try:
        mla_forward_padded(q, q, q, cu, cu, 9, 9, causal=True, backend="varlen")
        torch.cuda.synchronize()
        return None
    except RuntimeError as e:
        return str(e)
first = call(); after_first = mla_cache_info()
second = call(); after_second = mla_cache_info()
print(repr((first, second, after_first, after_second)))
"""


_ORDER_SCRIPT = """
import sys, torch
sys.path[:0] = {path!r}
from test_mla_varlen import make_case, run
c = make_case({lengths!r}, hq=4, hk=2, device="cuda", seed=21)
out, (q, k, v) = run(c, causal=True)
_, lse = torch.ops.verl_ops.mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"],
                                               True, None, 3)
out.backward(torch.ones_like(out))
torch.save([t.cpu() for t in (out, lse, q.grad, k.grad, v.grad)], sys.argv[1])
"""


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_sequence_order_does_not_change_results(tmp_path):
    """The backend hands cuDNN the sequences largest first (VERL_OPS_VARLEN_ORDER, default
    largest_first); in input order (=input) the outputs and the log-sum-exp are the same bit for
    bit and the gradients the same up to the accumulation order of dq."""
    lengths = [3, 900, 0, 1, 257, 64, 900, 128, 2, 511]
    results = [
        saved_by_script(_ORDER_SCRIPT, tmp_path / f"{order}.pt", {"VERL_OPS_VARLEN_ORDER": order}, lengths=lengths)
        for order in ("input", "largest_first")
    ]
    (out_a, lse_a, *grads_a), (out_b, lse_b, *grads_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    for name, a, b in zip("qkv", grads_a, grads_b):
        assert rel_err(a, b) < 1e-2, name


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_many_sequences_keep_input_order():
    """Past 1024 sequences the backend keeps the input order (the largest-first ranking is one
    thread per sequence against all others); results still match the reference."""
    rng = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 24, (1100,), generator=rng).tolist()
    c = make_case(lengths, hq=2, hk=2, device="cuda", seed=22)
    check_against_reference(c, causal=True)


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_failed_build_is_remembered():
    """A bucket cuDNN refuses to build raises at once on its later calls, with the same error, without
    building again. VERL_OPS_CUDNN_SDPA_IMPL=unified (a documented override, read once per process)
    forces the unified forward engine, which cuDNN before 9.21 refuses for causal masks; with a
    cuDNN that builds it, the second call must be a plain cache hit instead."""
    import ast
    import os
    import subprocess
    import sys

    env = dict(os.environ, VERL_OPS_CUDNN_SDPA_IMPL="unified")
    done = subprocess.run([sys.executable, "-c", _FAILED_BUILD_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    first, second, a1, a2 = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    if first is None:  # this cuDNN builds it: the second call reuses the plan
        assert second is None
        assert a2["builds"] == a1["builds"] == 1 and a2["hits"] == a1["hits"] + 1
        return
    assert first.startswith("mla_forward_padded: cuDNN"), first
    assert a1["failures"] == 1 and a1["failed_buckets"] == 1 and a1["builds"] == 0
    assert second == first + " (remembered from an earlier call of this shape bucket)"
    assert a2["failures"] == 1 and a2["builds"] == 0 and a2["misses"] == a1["misses"] + 1


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_graph_capture_and_replay():
    """Forward + backward captured in a CUDA graph after an eager warm-up (which builds the plans),
    replayed on new data: equal to eager calls on that data."""
    lengths = [1, 300, 0, 129, 64]
    c = make_case(lengths, hq=4, hk=4, device="cuda", seed=13)
    static = {n: c[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    grad = torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        for t in static.values():
            t.grad = None
        out = mla_forward_padded(static["q"], static["k"], static["v"], c["cu_q"], c["cu_kv"], 300, 300, backend="varlen")
        out.backward(grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    builds = mla_cache_info()["builds"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fwd_bwd()
    assert mla_cache_info()["builds"] == builds
    fresh = make_case(lengths, hq=4, hk=4, device="cuda", seed=14)
    for n in ("q", "k", "v"):
        static[n].data.copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    out, (q, k, v) = run(fresh)
    out.backward(grad)
    assert torch.equal(static_out, out)
    for n, t in zip("qkv", (q, k, v)):
        assert rel_err(static[n].grad, t.grad) < 1e-2, n  # dq accumulation order may differ


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_capture_without_plan_is_a_clear_error():
    c = make_case([33, 77, 5], hq=2, hk=2, dqk=64, dv=64, device="cuda", seed=15)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="mla_forward_padded: backend='varlen' has no cuDNN plan yet"):
        with torch.cuda.graph(graph):
            mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 77, 77, softmax_scale=0.0123, backend="varlen")


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_bad_input():
    c = make_case([3, 4, 9], device="cuda")
    with pytest.raises(ValueError, match=r"mla_forward_padded: cu_seqlens_kv\[-1\]=16 must equal the number of rows 15"):
        mla_forward_padded(c["q"], c["k"][:15], c["v"][:15], c["cu_q"], c["cu_q"].clone(), 9, 9, backend="varlen",
                           validate=True)
    with pytest.raises(ValueError, match="mla_forward_padded: a sequence has 9 tokens, more than max_seqlen_q=8"):
        mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], 8, 9, backend="varlen", validate=True)
    odd = make_case([3, 4], dqk=20, dv=12, device="cuda")
    with pytest.raises(RuntimeError, match="mla_forward_padded: backend='varlen' .*multiples of 8"):
        run(odd)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [1, 3], ids=["padded", "varlen"])
@pytest.mark.parametrize("bad", ["past_end", "negative", "huge", "decreasing"])
def test_cuda_bad_device_offsets_stay_in_bounds(backend, bad):
    """The raw op reads device offsets without a host check (the Python API checks them only with
    validate=True): offsets past the rows, negative, huge or decreasing give unspecified values,
    but no kernel reads or writes outside q, k, v or the outputs (compute-sanitizer memcheck runs
    the MLA GPU tests), and the CUDA context stays usable: a valid call afterwards gives what it
    gave before."""
    if backend == 3 and not VARLEN_BUILT:
        pytest.skip("needs a build with the varlen backend")
    c = make_case([100, 37, 200], device="cuda")
    T = 337
    offsets = {
        "past_end": [0, 100, 137, T + 5000],
        "negative": [-5000, 100, 137, T],
        "huge": [0, 2**31 - 1, 2**31 - 1, 2**31 - 1],
        "decreasing": [0, 300, 137, T],
    }[bad]
    q, k, v = c["q"], c["k"], c["v"]
    good = [OPS.mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 200, 200, causal, None, backend)[0].clone()
            for causal in (True, False)]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    for causal in (True, False):
        out, lse = OPS.mla_forward_padded(q, k, v, cu, cu, 200, 200, causal, None, backend)
        grads = OPS.mla_backward_padded(torch.ones_like(out), q, k, v, out, lse, cu, cu, 200, 200, causal, None,
                                        backend)
        assert out.shape == (T, 4, 128) and [tuple(g.shape) for g in grads] == [(T, 4, 192), (T, 4, 192), (T, 4, 128)]
    torch.cuda.synchronize()
    for causal, want in zip((True, False), good):
        assert torch.equal(OPS.mla_forward_padded(q, k, v, c["cu_q"], c["cu_kv"], 200, 200, causal, None, backend)[0],
                           want)


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.skipif(not HOPPER, reason="auto picks varlen on Hopper only")
def test_cuda_auto_and_megatron_route_ragged_batches_to_varlen(monkeypatch):
    """Ragged batches run varlen, through auto and through the Megatron patch (without
    FlashAttention-4; where it is installed, auto leaves ragged batches on varlen when that runs the
    own SM90 kernels, checked at the end)."""
    from types import SimpleNamespace

    from verl_ops.integrations.megatron_mla import mla_thd_core_attention

    has_fa4 = _mla._fa4_importable()
    monkeypatch.setattr(_mla, "_FA4_IMPORTABLE", False)
    c = make_case([1500, 64, 3000, 700], hq=16, hk=16, device="cuda", seed=16)
    # Where the forward runs the own SM90 kernel (192 / 128 on compute capability 9.0) it uses no
    # cuDNN plan, so the plan counters move only without it; the output is varlen's either way.
    counted = not (mla_cache_info()["hopper_forward"] and torch.cuda.get_device_capability() == (9, 0))
    want, _ = run(c, backend="varlen")
    before = mla_cache_info()
    out, _ = run(c, backend="auto")
    assert out.is_contiguous()  # varlen's layout (padded would be a view of [T, H, 192] rows)
    assert torch.equal(out, want)
    after = mla_cache_info()
    assert not counted or after["hits"] + after["misses"] > before["hits"] + before["misses"]
    psp = SimpleNamespace(cu_seqlens_q=c["cu_q"], cu_seqlens_kv=c["cu_q"], max_seqlen_q=c["max_q"],
                          max_seqlen_kv=c["max_q"])
    flat = mla_thd_core_attention(c["q"], c["k"], c["v"], psp)
    assert torch.equal(flat, out.reshape(out.shape[0], -1))
    assert not counted or mla_cache_info()["hits"] > after["hits"]
    if has_fa4:
        # This batch is ragged: FlashAttention-4 only where varlen lacks the own SM90 kernels.
        monkeypatch.setattr(_mla, "_FA4_IMPORTABLE", True)
        flat = mla_thd_core_attention(c["q"], c["k"], c["v"], psp)
        want = out
        if not _mla._own_kernels_take_ragged(c["q"].device):
            want = mla_forward_padded(c["q"], c["k"], c["v"], c["cu_q"], c["cu_q"], c["max_q"], c["max_q"], backend="fa4")
        assert torch.equal(flat, want.reshape(want.shape[0], -1))


@gpu
@pytest.mark.gpu
@needs_varlen
def test_cuda_opcheck_and_compile():
    c = make_case([5, 0, 70, 1], kv_lengths=[9, 3, 70, 0], hq=4, hk=2, device="cuda", seed=17)
    args = (c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"], True, None, 3)
    torch.library.opcheck(OPS.mla_forward_padded.default, args)
    out, lse = OPS.mla_forward_padded(*args)
    bwd = (torch.randn_like(out), c["q"], c["k"], c["v"], out, lse, c["cu_q"], c["cu_kv"], c["max_q"], c["max_kv"],
           True, None, 3)
    torch.library.opcheck(OPS.mla_backward_padded.default, bwd)

    def f(q, k, v, cu_q, cu_kv):
        return mla_forward_padded(q, k, v, cu_q, cu_kv, 70, 70, backend="varlen")

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"]), out)


# --------------------------------------------------------------------------------------------
# backend="fa4": FlashAttention-4's varlen kernels where flash-attn-4 is installed (optional).


def _fa4_importable() -> bool:
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception:  # noqa: BLE001  (not installed, or its dependencies are missing)
        return False
    return True


HAS_FA4 = HAS_CUDA and _fa4_importable()


def test_fa4_backend_needs_cuda():
    c = make_case([3, 5], hq=2, hk=2, dqk=24, dv=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="mla_forward_padded: backend='fa4' runs on CUDA tensors only"):
        run(c, backend="fa4")


@gpu
@pytest.mark.gpu
def test_cuda_fa4_gets_offsets_clamped_into_the_rows(monkeypatch):
    """FlashAttention-4 reads the offsets unchecked: backend="fa4" hands it offsets clamped into
    the rows and non-decreasing (valid ones unchanged). FlashAttention-4 itself is replaced by a
    recorder, so this runs whether it is installed or not."""

    seen = []

    def recorder(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
        seen.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist()))
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])

    monkeypatch.setattr(_mla, "_fa4_varlen_func", lambda op: recorder)
    c = make_case([3, 4, 9], kv_lengths=[3, 4, 10], device="cuda")  # 16 query rows, 17 key rows
    bad_q = torch.tensor([-7, 3, 2, 40], dtype=torch.int32, device="cuda")
    bad_kv = torch.tensor([0, 50, 2, 17], dtype=torch.int32, device="cuda")
    for cu_q, cu_kv in ((bad_q, bad_q), (bad_q, bad_kv), (c["cu_q"], c["cu_kv"])):
        _mla._fa4_forward("mla_forward_padded", c["q"], c["k"], c["v"], cu_q, cu_kv, 9, 10, True, None)
    assert seen == [
        ([0, 3, 3, 16], [0, 3, 3, 17]),
        ([0, 3, 3, 16], [0, 17, 17, 17]),
        ([0, 3, 7, 16], [0, 3, 7, 17]),
    ]


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(HAS_FA4, reason="flash-attn-4 is installed here")
def test_cuda_fa4_missing_is_a_clear_error():
    c = make_case([3, 5], hq=2, hk=2, device="cuda")
    with pytest.raises(ImportError, match="mla_forward_padded: backend='fa4' needs FlashAttention-4.*flash-attn-4"):
        run(c, backend="fa4")


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FA4, reason="needs flash-attn-4")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_fa4_matches_the_reference(causal):
    """Output and q/k/v gradients of backend="fa4" on a ragged 192/128 batch, bf16."""
    c = make_case([129, 1, 2, 127, 700, 64], hq=8, hk=8, device="cuda", seed=13)
    out, (q, k, v) = run(c, causal=causal, backend="fa4")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    want, _, want_grads = reference(c["q"], c["k"], c["v"], c["cu_q"].cpu(), c["cu_kv"].cpu(), causal, None, g)
    assert out.shape == want.shape and rel_err(out, want) < TOL[torch.bfloat16]
    out.backward(g)
    for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), want_grads):
        assert rel_err(got, exp) < 2 * TOL[torch.bfloat16], name


def test_cache_info_under_another_default_device():
    """The probe tensor is an explicit CPU tensor: a default device set by the user (meta here;
    cuda likewise) does not change what mla_cache_info reports."""
    want = mla_cache_info()["available"]
    with torch.device("meta"):
        assert mla_cache_info()["available"] == want


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FA4, reason="needs flash-attn-4")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_auto_takes_fa4_on_uniform_self_attention(monkeypatch, causal):
    """Where flash-attn-4 is installed, auto runs it for bf16 192/128 self-attention (one offsets
    tensor) on uniform batches of sequences longer than 1024, and the result is the reference's.
    Ragged batches (the edge-case lengths, 0 and 1 included) and uniform ones of shorter sequences
    stay on varlen where it runs the own SM90 kernels (they measured at or ahead of
    FlashAttention-4 there), else they take FlashAttention-4 too. With two offsets tensors auto
    never takes it."""

    calls = []
    real = _mla._fa4_forward
    monkeypatch.setattr(_mla, "_fa4_forward", lambda *a: calls.append(1) or real(*a))
    g_cpu = torch.Generator().manual_seed(3)
    for lengths, long_uniform in (([1152, 1152], True), ([256, 256, 256], False),
                                  ([3, 0, 1, 2, 127, 128, 129, 0, 1000], False)):
        c = make_case(lengths, hq=8, hk=8, device="cuda", seed=21)
        c["cu_kv"] = c["cu_q"]
        before = len(calls)
        out, (q, k, v) = run(c, causal=causal, backend="auto")
        takes = long_uniform or not _mla._own_kernels_take_ragged(c["q"].device)
        assert len(calls) == before + int(takes), (lengths, calls)
        if not takes:
            want_varlen, _ = run(c, causal=causal, backend="varlen")
            assert torch.equal(out, want_varlen)
        g = torch.randn(out.shape, generator=g_cpu).to(out.device, out.dtype)
        want, _, want_grads = reference(c["q"], c["k"], c["v"], c["cu_q"].cpu(), c["cu_q"].cpu(), causal, None, g)
        assert out.shape == want.shape and rel_err(out, want) < TOL[torch.bfloat16]
        out.backward(g)
        for name, got, exp in zip("qkv", (q.grad, k.grad, v.grad), want_grads):
            assert torch.isfinite(got).all() and rel_err(got, exp) < 2 * TOL[torch.bfloat16], name
        n = len(calls)
        c["cu_kv"] = c["cu_q"].clone()
        run(c, causal=causal, backend="auto")
        assert len(calls) == n


@gpu
@pytest.mark.gpu
@needs_varlen
@pytest.mark.skipif(not HOPPER, reason="auto's FlashAttention-4 rule is for Hopper")
def test_cuda_auto_fa4_rule_uniform_vs_ragged(monkeypatch):
    """auto's FlashAttention-4 rule without flash-attn-4 itself (its call replaced by a recorder):
    uniform bf16 192/128 self-attention batches of sequences longer than 1024 take it; ragged ones
    and uniform ones of shorter sequences stay on varlen wherever varlen runs the own SM90 kernels
    (the default build on Hopper), else they take it too."""

    calls = []

    def fake_fa4(op, q, k, v, cu_q, cu_kv, max_q, max_kv, causal, scale):
        calls.append(tuple(q.shape))
        return mla_forward_padded(q, k, v, cu_q, cu_kv, max_q, max_kv, causal=causal, softmax_scale=scale,
                                  backend="varlen")

    monkeypatch.setattr(_mla, "_FA4_IMPORTABLE", True)
    monkeypatch.setattr(_mla, "_fa4_forward", fake_fa4)
    info = mla_cache_info()
    own = info["hopper_forward"] and info["hopper_backward"] and info["cudnn_version"] >= 90700
    assert _mla._own_kernels_take_ragged(torch.device("cuda")) == own
    uni = make_case([1025, 1025], hq=4, hk=4, device="cuda", seed=22)
    run(uni, backend="auto")
    assert calls == [(2050, 4, 192)]
    rag = make_case([3, 0, 1, 2, 127, 128, 129, 0, 1000], hq=4, hk=4, device="cuda", seed=23)
    out, _ = run(rag, backend="auto")
    assert len(calls) == (1 if own else 2)
    want, _ = run(rag, backend="varlen")
    assert torch.equal(out, want)
    # max_seqlen above the longest length: not uniform either (B * max_seqlen > T).
    uni["max_q"] = uni["max_kv"] = 1100
    run(uni, backend="auto")
    assert len(calls) == (1 if own else 3)
    # uniform, sequences of 1024: the own kernels where they run (auto's op-level rule sends
    # uniform 192 / 128 batches to varlen there), else FlashAttention-4.
    short = make_case([1024, 1024], hq=4, hk=4, device="cuda", seed=24)
    out, _ = run(short, backend="auto")
    assert len(calls) == (1 if own else 4)
    if own:
        # the layout changes with the rule: padded (a strided view of Dqk-wide rows) before, varlen
        # (contiguous) now; the fake kernel agrees
        assert out.is_contiguous()
        assert torch.equal(out, run(short, backend="varlen")[0])
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(short[n]) for n in ("q", "k", "v"))
            fcu = mode.from_tensor(short["cu_q"])
            fout, _ = OPS.mla_forward_padded(fq, fk, fv, fcu, fcu, 1024, 1024, True, None, 0)
        assert fout.stride() == out.stride()


def test_auto_does_not_take_fa4_off_cuda(monkeypatch):

    monkeypatch.setattr(_mla, "_FA4_IMPORTABLE", True)
    c = make_case([3, 5], hq=2, hk=2, dtype=torch.bfloat16)
    c["cu_kv"] = c["cu_q"]
    assert not _mla._auto_takes_fa4(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], c["max_q"])
    out, _ = run(c, backend="auto")  # the CPU reference, not FlashAttention-4
    assert out.shape == (8, 2, 128)
