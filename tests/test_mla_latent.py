"""mla_latent_forward / _backward and mla_latent_attention (docs/mla.md#latent-parts), and Megatron's
MLA layers handing MLACoreAttention q, kv and k_pe unconcatenated (docs/megatron.md#mla-q-and-k-without-concatenation).

The reference is the concatenation the op replaces: q = [q | q_pe], k = [k | k_pe in every head],
attention by mla_forward_padded, gradients through torch.cat / expand."""

from __future__ import annotations

import math
import os

import pytest
import torch

import verl_ops
from verl_ops import _mla_latent as L

ops = torch.ops.verl_ops
CUDA = torch.cuda.is_available()


def _sm90() -> bool:
    return CUDA and torch.cuda.get_device_capability() == (9, 0)


def _parts(lengths, heads, dtype, device, *, shared=True, megatron_views=True, seed=0):
    """q, q_pe, k, k_pe, v as Megatron's MLA makes them: views into the up-projections' outputs
    q [T, H * 192] and kv [T, H * 256], k_pe a [T, 1, 64] view into the down-projection's
    [T, 512 + 64] (or contiguous tensors)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(dtype).to(device)

    if megatron_views:
        q_full = r(t, heads * 192).view(t, heads, 192)
        kv_full = r(t, heads * 256).view(t, heads, 256)
        kv_down = r(t, 512 + 64)
        k_pe = kv_down[:, 512:].unsqueeze(1) if shared else r(t, heads, 64)
        parts = (q_full[..., :128], q_full[..., 128:], kv_full[..., :128], k_pe, kv_full[..., 128:])
    else:
        parts = (r(t, heads, 128), r(t, heads, 64), r(t, heads, 128), r(t, 1 if shared else heads, 64),
                 r(t, heads, 128))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return parts, cu, max(lengths) if lengths else 0


def _reference(parts, cu, max_len, grad_out):
    q, q_pe, k, k_pe, v = (p.detach().float().requires_grad_() for p in parts)
    hk = k.shape[1]
    qf = torch.cat([q, q_pe], -1)
    kf = torch.cat([k, k_pe.expand(k.shape[0], hk, 64)], -1)
    out = verl_ops.mla_forward_padded(qf, kf, v, cu.cpu(), cu.cpu(), max_len, max_len, causal=True)
    out.backward(grad_out.float())
    return out.detach(), [x.grad for x in (q, q_pe, k, k_pe, v)]


def _latent(parts, cu, max_len, grad_out):
    leaves = [p.detach().clone().requires_grad_() for p in parts]
    out, lse = ops.mla_latent_forward(*leaves, cu, cu, max_len, max_len, True, None)
    out.backward(grad_out)
    return out.detach(), lse.detach(), [x.grad for x in leaves]


LENGTHS = [[1], [5, 0, 37, 1], [130, 7, 64, 300, 2]]


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("shared", [True, False])
def test_cpu_equals_concatenated(lengths, shared):
    parts, cu, m = _parts(lengths, 3, torch.float32, "cpu", shared=shared)
    g = torch.randn(sum(lengths), 3, 128)
    ref_out, ref_grads = _reference(parts, cu, m, g)
    out, lse, grads = _latent(parts, cu, m, g)
    assert lse.shape == (3, sum(lengths))
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("q", "q_pe", "k", "k_pe", "v"), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_fake_kernels_match_cpu_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    parts, cu, m = _parts([4, 9], 2, torch.float32, "cpu")
    out, lse = ops.mla_latent_forward(*parts, cu, cu, m, m)
    grads = ops.mla_latent_backward(torch.ones_like(out), *parts, out, lse, cu, cu, m, m)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fparts = [mode.from_tensor(p) for p in parts]
        fcu = mode.from_tensor(cu)
        fout, flse = ops.mla_latent_forward(*fparts, fcu, fcu, m, m)
        fgrads = ops.mla_latent_backward(mode.from_tensor(torch.ones_like(out)), *fparts, fout, flse, fcu, fcu, m, m)
    for a, b in zip((out, lse, *grads), (fout, flse, *fgrads)):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


@pytest.mark.parametrize("bad", ["q_cols", "k_pe_heads", "v_rows", "dtype"])
def test_bad_shapes_name_the_argument(bad):
    parts, cu, m = _parts([4, 9], 2, torch.float32, "cpu", megatron_views=False)
    q, q_pe, k, k_pe, v = parts
    if bad == "q_cols":
        q, name = torch.zeros(13, 2, 96), "q"
    elif bad == "k_pe_heads":
        k_pe, name = torch.zeros(13, 3, 64), "k_pe"
    elif bad == "v_rows":
        v, name = torch.zeros(12, 2, 128), "v"
    else:
        q_pe, name = q_pe.double(), "q_pe"
    with pytest.raises((ValueError, RuntimeError), match=rf"mla_latent_forward: {name}\b"):
        ops.mla_latent_forward(q, q_pe, k, k_pe, v, cu, cu, m, m)


def _rope_plans(lengths, device, dtype):
    t = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    freqs = torch.arange(max(lengths) + 1).float()[:, None] * torch.linspace(0.01, 1.0, 64)[None, :]
    cos, sin = freqs.cos().to(dtype).to(device), freqs.sin().to(dtype).to(device)
    assert pos.numel() == t
    return L.RopePlan(cos, sin, pos, True), L.RopePlan(cos, sin, pos, True)


def _attention_grads(fn, q, kv, k_pe):
    leaves = [x.detach().clone().requires_grad_() for x in (q, kv, k_pe)]
    out = fn(*leaves)
    out.float().square().sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mla_latent_attention_equals_megatron_concatenation(device, monkeypatch):
    """mla_latent_attention (the latent path; on the CPU with VERL_OPS_MLA_LATENT_CPU=1) against
    q / k concatenated as Megatron does and mla_forward_padded, gradients through autograd."""
    if device == "cuda" and not _sm90():
        pytest.skip("needs an SM90 GPU")
    monkeypatch.setenv("VERL_OPS_MLA_LATENT_CPU", "1")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [40, 1, 17, 130]
    t, h = sum(lengths), 4
    g = torch.Generator().manual_seed(3)
    q = torch.randn(t, h, 192, generator=g).to(dtype).to(device)
    kv = torch.randn(t, h, 256, generator=g).to(dtype).to(device)
    k_pe = torch.randn(t, 1, 64, generator=g).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    rq, rk = _rope_plans(lengths, device, dtype)
    m = max(lengths)
    scale = 1 / math.sqrt(192)

    def latent(q, kv, k_pe):
        return L.mla_latent_attention(q, kv, k_pe, rq, rk, cu, cu, m, m, softmax_scale=scale)

    def concatenated(q, kv, k_pe):
        query = torch.cat([q[..., :128], rq.apply(q[..., 128:])], -1)
        k_r = rk.apply(k_pe)
        key = torch.cat([kv[..., :128], k_r.expand(t, h, 64)], -1)
        return verl_ops.mla_forward_padded(query, key, kv[..., 128:].contiguous(), cu, cu, m, m,
                                           causal=True, softmax_scale=scale)

    calls = []
    real = L._LatentAttention.apply
    monkeypatch.setattr(L._LatentAttention, "apply", lambda *a: calls.append(1) or real(*a))
    out, grads = _attention_grads(latent, q, kv, k_pe)
    assert calls, "the latent path did not run"
    ref, ref_grads = _attention_grads(concatenated, q, kv, k_pe)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("q", "kv", "k_pe"), grads, ref_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda msg, name=name: f"grad of {name}: {msg}")


# --------------------------------------------------------------------------------------------
# CUDA: the SM90 kernels on the parts.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", LENGTHS + [[2048, 1, 900, 3000]])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("views", [True, False])
def test_cuda_sm90_equals_dense_kernels(dtype, lengths, shared, views):
    """The parts through their own tensor maps give what the same SM90 kernels give on the
    concatenated, contiguous operands (mla_forward_padded's varlen backend): bit for bit forward and
    for the gradients of k and v (each CTA's own registers); dq is summed over key blocks with
    atomic adds in either case, so its rounding follows their order (within a few ulp), and k_pe's
    gradient is summed over the heads outside the kernel."""
    if not _sm90():
        pytest.skip("needs an SM90 GPU")
    h = 4
    parts, cu, m = _parts(lengths, h, dtype, "cuda", shared=shared, megatron_views=views)
    t = sum(lengths)
    g = (torch.randn(t, h, 128, generator=torch.Generator().manual_seed(9)) * 0.5).to(dtype).cuda()
    out, lse, grads = _latent(parts, cu, m, g)
    q, q_pe, k, k_pe, v = (p.detach().clone().requires_grad_() for p in parts)
    qf = torch.cat([q, q_pe], -1)
    kf = torch.cat([k, k_pe.expand(t, h, 64)], -1)
    ref, ref_lse = ops.mla_forward_padded(qf, kf, v, cu, cu, m, m, True, None, 3)  # varlen: the SM90 kernels
    ref.backward(g)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    assert torch.equal(lse, ref_lse)
    for name, a, b in zip(("k", "v"), (grads[2], grads[4]), (k.grad, v.grad)):
        assert torch.equal(a, b), f"grad of {name}: {(a.float() - b.float()).abs().max()}"
    for name, a, b in zip(("q", "q_pe"), grads[:2], (q.grad, q_pe.grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-4,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    torch.testing.assert_close(grads[3].float(), k_pe.grad.float(), rtol=1e-2, atol=1e-2)
    ref32, ref32_grads = _reference([p.cpu() for p in parts], cu.cpu(), m, g.cpu())
    torch.testing.assert_close(out.float().cpu(), ref32, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_cross_attention_rows_without_keys():
    """Own q and kv offsets (bottom-right causal): a query row that sees no key gets zeros and
    +inf, as mla_forward_padded."""
    if not _sm90():
        pytest.skip("needs an SM90 GPU")
    h, dt = 2, torch.bfloat16
    g = torch.Generator().manual_seed(1)
    lq, lk = [5, 3, 0], [2, 3, 4]
    tq, tk = sum(lq), sum(lk)
    q, q_pe = (torch.randn(tq, h, d, generator=g).to(dt).cuda() for d in (128, 64))
    k, v = (torch.randn(tk, h, 128, generator=g).to(dt).cuda() for _ in range(2))
    k_pe = torch.randn(tk, 1, 64, generator=g).to(dt).cuda()
    cu_q = torch.tensor([0, 5, 8, 8], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 2, 5, 9], dtype=torch.int32, device="cuda")
    out, lse = ops.mla_latent_forward(q, q_pe, k, k_pe, v, cu_q, cu_k, 5, 4)
    ref, ref_lse = ops.mla_forward_padded(torch.cat([q, q_pe], -1), torch.cat([k, k_pe.expand(tk, h, 64)], -1), v,
                                          cu_q, cu_k, 5, 4, True, None, 3)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.isinf(lse[:, :3]).all() and (out[:3] == 0).all()  # rows 0-2 of sequence 0 see no key


# --------------------------------------------------------------------------------------------
# Megatron: the layers hand MLACoreAttention the parts.

def _megatron():
    import megatron_model_lib as lib

    if not lib.megatron_available():
        pytest.skip("megatron-core is not installed")
    return lib


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_megatron_layers_run_the_latent_path(device, monkeypatch):
    """A DeepSeek-like model (MLA 128 + 64 / 128, MoE, MTP) on MLACoreAttention: with the latent
    capture every MLA layer (2 decoder + 1 MTP) runs mla_latent_attention, and the step's loss and
    every gradient equal those of Megatron's own q / k concatenation (VERL_OPS_MLA_LATENT=0)."""
    import dataclasses

    lib = _megatron()
    if device == "cuda" and not _sm90():
        pytest.skip("needs an SM90 GPU")
    from verl_ops.integrations import megatron_mla

    import torch.distributed as dist
    from megatron.core import parallel_state

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    size = dataclasses.replace(lib.SIZES["tiny"], heads=2, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    created = not dist.is_initialized()
    lib.init_distributed(1, device)
    try:
        # megatron-core's @jit_fuser functions eagerly, as every Megatron test here runs them (this
        # process runs other torch.compile tests: the setting is undone on exit)
        with torch._dynamo.config.patch(disable=True):
            _compare_latent_and_concatenated(lib, megatron_mla, size, dtype, device, monkeypatch)
    finally:  # (later tests of this process expect no process group of ours)
        parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _compare_latent_and_concatenated(lib, megatron_mla, size, dtype, device, monkeypatch):
    config = lib.make_config(size, dtype=dtype, device=device)
    model = lib.build_model(config, "verl_ops", size=size, device=device)
    batch = lib.make_batch([37, 1, 90, 12], size.vocab, seed=4, device=device)
    pack = lib.verl_ops_pack()

    def step():
        model.zero_grad(set_to_none=True)
        r = lib.forward_backward(model, batch, pack, device=device)
        return r.loss_per_token, lib.grads(model)

    calls = []
    real = megatron_mla.LatentQKV.__init__

    def counting(self, *a):
        calls.append(1)
        real(self, *a)

    monkeypatch.setattr(megatron_mla.LatentQKV, "__init__", counting)
    monkeypatch.setenv("VERL_OPS_MLA_LATENT", "0")
    ref_loss, ref_grads = step()
    assert not calls
    monkeypatch.setenv("VERL_OPS_MLA_LATENT", "1")
    monkeypatch.setenv("VERL_OPS_MLA_LATENT_CPU", "1")
    loss, grads = step()
    assert len(calls) == 3, f"{len(calls)} MLA layers took the latent path, expected 3 (2 decoder + MTP)"
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
def test_cuda_backward_takes_unaligned_out_and_grad_out():
    """out / grad_out that are views 8 bytes into a buffer (not 16-byte aligned) give the backward
    of the aligned tensors (the kernels read them as 16-byte vectors and through a tensor map: the
    op copies them first)."""
    if not _sm90():
        pytest.skip("needs an SM90 GPU")
    parts, cu, m = _parts([30, 7, 64], 2, torch.bfloat16, "cuda")
    out, lse = ops.mla_latent_forward(*parts, cu, cu, m, m)
    g = torch.randn_like(out)
    ref = ops.mla_latent_backward(g, *parts, out, lse, cu, cu, m, m)

    def unaligned(t):
        buf = torch.empty(t.numel() + 4, dtype=t.dtype, device=t.device)
        view = buf[4:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16 != 0
        return view

    got = ops.mla_latent_backward(unaligned(g), *parts, unaligned(out), lse, cu, cu, m, m)
    for name, a, b in zip(("grad_q", "grad_kv", "grad_k_pe"), got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-4, msg=lambda msg, name=name: f"{name}: {msg}")
