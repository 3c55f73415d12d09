"""The Megatron MLA integration (verl_ops.integrations.megatron_mla) against stand-ins for
megatron-core: when the THD path is taken (verl's rules: THD, not DSA, configs without
``experimental_attention_variant`` allowed), what it computes, and the version gate."""

from __future__ import annotations

import enum
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from test_mla import make_case, ref_attention
from verl_stubs import PackedSeqParams, install_megatron_stub

from verl_ops.integrations import megatron_mla as mm


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4


class FakeCoreAttention(torch.nn.Module):
    """Records its calls; returns a constant so a call that reached it is recognisable."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.softmax_scale = 0.125
        self.attn_mask_type = AttnMaskType.causal

    def forward(self, query, key, value, attention_mask, packed_seq_params=None, attn_mask_type=None, **kwargs):
        self.calls.append(dict(value_dim=value.shape[-1], kwargs=kwargs))
        return torch.full((query.shape[0], query.shape[1] * value.shape[-1]), 7.0)


def _install(monkeypatch, version):
    cfg = install_megatron_stub(monkeypatch)
    core = sys.modules["megatron.core"]
    monkeypatch.setattr(core, "__version__", version, raising=False)
    transformer = types.ModuleType("megatron.core.transformer")
    mla_mod = types.ModuleType("megatron.core.transformer.multi_latent_attention")

    class MultiLatentAttention(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.core_attention = FakeCoreAttention()

        def forward(self, query, key, value, packed_seq_params=None, **extra):
            out = self.core_attention(
                query, key, value, None, packed_seq_params=packed_seq_params, attn_mask_type=AttnMaskType.causal, **extra
            )
            return out.reshape(out.size(0), 1, -1)

    mla_mod.MultiLatentAttention = MultiLatentAttention
    transformer.multi_latent_attention = mla_mod
    core.transformer = transformer
    monkeypatch.setitem(sys.modules, "megatron.core.transformer", transformer)
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.multi_latent_attention", mla_mod)
    return cfg, MultiLatentAttention


def _thd_params(c):
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=c["cu_q"],
        cu_seqlens_kv=c["cu_kv"],
        cu_seqlens_q_padded=c["cu_q"],
        cu_seqlens_kv_padded=c["cu_kv"],
        max_seqlen_q=c["max_q"],
        max_seqlen_kv=c["max_kv"],
    )


def test_version_gate():
    assert mm.needs_forward_patch("0.16.1")
    assert mm.needs_forward_patch("0.13.0rc0")
    assert mm.needs_forward_patch("0.12.2")
    assert not mm.needs_forward_patch("0.16.2")
    assert not mm.needs_forward_patch("0.17.0rc1")
    assert not mm.needs_forward_patch("1.0.0")


def test_thd_path_decision(monkeypatch):
    cfg, _ = _install(monkeypatch, "0.16.1")
    c = make_case([3, 5], dqk=24, dv=16)
    psp = _thd_params(c)
    q, v = c["q"], c["v"]
    no_attr = SimpleNamespace()  # a config without experimental_attention_variant must not crash
    assert mm.use_mla_thd_path(no_attr, psp, q, v, AttnMaskType.causal)
    assert mm.use_mla_thd_path(SimpleNamespace(experimental_attention_variant=None), psp, q, v, AttnMaskType.padding_causal)
    assert not mm.use_mla_thd_path(SimpleNamespace(experimental_attention_variant="dsa"), psp, q, v, AttnMaskType.causal)
    assert not mm.use_mla_thd_path(no_attr, None, q, v, AttnMaskType.causal)
    assert not mm.use_mla_thd_path(no_attr, PackedSeqParams(qkv_format="sbhd"), q, v, AttnMaskType.causal)
    assert not mm.use_mla_thd_path(no_attr, psp, q, v, AttnMaskType.padding)
    assert not mm.use_mla_thd_path(SimpleNamespace(attention_dropout=0.1), psp, q, v, AttnMaskType.causal, training=True)
    assert mm.use_mla_thd_path(SimpleNamespace(attention_dropout=0.1), psp, q, v, AttnMaskType.causal, training=False)
    other = PackedSeqParams(**{**psp.__dict__, "cu_seqlens_q_padded": c["cu_q"].clone()})
    assert not mm.use_mla_thd_path(no_attr, other, q, v, AttnMaskType.causal)
    cfg.cp = 2
    assert not mm.use_mla_thd_path(no_attr, psp, q, v, AttnMaskType.causal)


def test_patch_routes_thd_mla_to_the_op(monkeypatch):
    _, MLA = _install(monkeypatch, "0.16.1")
    monkeypatch.setattr(MLA, "forward", MLA.forward)  # undone after the test
    assert mm.apply_patch() is True
    assert mm.apply_patch() is True  # idempotent
    c = make_case([3, 1, 6], hq=2, hk=2, dqk=24, dv=16, seed=3)
    module = MLA(SimpleNamespace())  # no experimental_attention_variant attribute
    out = module(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert module.core_attention.calls == []  # Megatron's core attention was not used
    want = ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], True, 0.125)
    assert out.shape == (10, 1, 2 * 16)
    assert torch.allclose(out.double(), want.reshape(10, 1, -1), atol=1e-5)
    # Gradients reach q, k and v through the op.
    q = c["q"].clone().requires_grad_(True)
    module(q, c["k"], c["v"], packed_seq_params=_thd_params(c)).sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_patch_leaves_dsa_and_bshd_alone(monkeypatch):
    _, MLA = _install(monkeypatch, "0.16.1")
    monkeypatch.setattr(MLA, "forward", MLA.forward)
    mm.apply_patch()
    c = make_case([3, 4], dqk=24, dv=16)
    dsa = MLA(SimpleNamespace(experimental_attention_variant="dsa"))
    out = dsa(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c), x="hidden")
    assert len(dsa.core_attention.calls) == 1
    assert dsa.core_attention.calls[0]["value_dim"] == 16  # DSA: V is not padded
    assert dsa.core_attention.calls[0]["kwargs"] == {"x": "hidden"}
    assert torch.equal(out, torch.full((7, 1, 32), 7.0))
    plain = MLA(SimpleNamespace())
    plain(c["q"], c["k"], c["v"], packed_seq_params=None)
    assert len(plain.core_attention.calls) == 1


def test_fallback_pads_v_like_verl(monkeypatch):
    """Calls the op does not take (here another attention variant) reach Megatron's core attention
    with V zero-padded to the query head dim and the output trimmed back, as verl's patch does."""
    _, MLA = _install(monkeypatch, "0.16.1")
    monkeypatch.setattr(MLA, "forward", MLA.forward)
    mm.apply_patch()
    c = make_case([3, 4], dqk=24, dv=16)
    other = MLA(SimpleNamespace(experimental_attention_variant="dsv4_hybrid"))
    out = other(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert len(other.core_attention.calls) == 1
    assert other.core_attention.calls[0]["value_dim"] == 24  # padded to Dqk
    assert torch.equal(out, torch.full((7, 1, 2 * 16), 7.0))  # trimmed back to Dv per head


def test_patch_applies_where_mla_does_not_pad_v(monkeypatch):
    """0.16.2-0.17.x neither pad V nor fix it: the gate is the feature, not the version."""
    _, MLA = _install(monkeypatch, "0.17.0")
    monkeypatch.setattr(MLA, "forward", MLA.forward)
    assert not mm.mla_pads_value_itself()
    assert mm.apply_patch() is True
    c = make_case([3, 4], dqk=24, dv=16)
    module = MLA(SimpleNamespace())
    module(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert module.core_attention.calls == []


def _install_padding_mla(monkeypatch, version="0.19.2"):
    """A stand-in for megatron-core >= 0.18, whose MultiLatentAttention pads V to the query head
    dim itself through module functions before calling its core attention."""
    cfg, MLA = _install(monkeypatch, version)
    mod = sys.modules["megatron.core.transformer.multi_latent_attention"]

    def _prepare_mla_core_attention_value(parallel_attention, query, value, packed_seq_params):
        dv = value.shape[-1]
        need = packed_seq_params is not None and packed_seq_params.qkv_format == "thd" and query.shape[-1] != dv
        if need:
            value = torch.nn.functional.pad(value, [0, query.shape[-1] - dv])
        return value, need, dv, value.shape[-1]

    def _trim_mla_core_attention_output(out, need, dv, padded):
        if need:
            out = out.reshape(*out.shape[:-1], -1, padded)[..., :dv]
        return out

    class PaddingMLA(MLA):
        def forward(self, query, key, value, packed_seq_params=None, **extra):
            value, need, dv, padded = mod._prepare_mla_core_attention_value(self, query, value, packed_seq_params)
            out = self.core_attention(
                query, key, value, None, packed_seq_params=packed_seq_params, attn_mask_type=AttnMaskType.causal, **extra
            )
            out = mod._trim_mla_core_attention_output(out, need, dv, padded)
            return out.reshape(out.shape[0], 1, -1)

    monkeypatch.setattr(mod, "_prepare_mla_core_attention_value", _prepare_mla_core_attention_value, raising=False)
    monkeypatch.setattr(mod, "_trim_mla_core_attention_output", _trim_mla_core_attention_output, raising=False)
    monkeypatch.setattr(mod, "MultiLatentAttention", PaddingMLA)
    return cfg, PaddingMLA


def test_patch_skips_megatrons_own_v_pad(monkeypatch):
    """Where MultiLatentAttention pads V itself, the patched core attention gets V native (no pad,
    no trim); a core attention that is not patched keeps Megatron's pad."""
    _, MLA = _install_padding_mla(monkeypatch)
    monkeypatch.setattr(MLA, "forward", MLA.forward)
    assert mm.mla_pads_value_itself()
    plain = MLA(SimpleNamespace(experimental_attention_variant=None))
    c = make_case([3, 1, 6], hq=2, hk=2, dqk=24, dv=16, seed=5)
    plain(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert plain.core_attention.calls[0]["value_dim"] == 24  # Megatron's pad, untouched before the patch
    assert mm.apply_patch() is True
    module = MLA(SimpleNamespace(experimental_attention_variant=None))
    out = module(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert module.core_attention.calls == []
    want = ref_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_kv"], True, 0.125)
    assert out.shape == (10, 1, 2 * 16)
    assert torch.allclose(out.double(), want.reshape(10, 1, -1), atol=1e-5)
    # A call the op does not take (another variant) reaches Megatron's attention padded once.
    other = MLA(SimpleNamespace(experimental_attention_variant="dsv4_hybrid"))
    out = other(c["q"], c["k"], c["v"], packed_seq_params=_thd_params(c))
    assert [call["value_dim"] for call in other.core_attention.calls] == [24]
    assert torch.equal(out, torch.full((10, 1, 2 * 16), 7.0))


def test_module_imports_without_megatron():
    """In a fresh process where megatron cannot be imported (reloading the module here would leave
    this process's copy changed for the tests after this one)."""
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "import verl_ops.integrations.megatron_mla as mm\n"
        "assert mm.needs_forward_patch('0.15.0')\n"
        "try:\n"
        "    mm.apply_patch()\n"
        "except ImportError:\n"
        "    print('ImportError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ImportError", r.stderr[-2000:]
