"""megatron_model_lib.te_fa4_window_fix: TransformerEngine's window for FlashAttention-4, on a stand-in
for TE's attention backends module (runs without TE: the wrapper's contract, not TE itself; the real
TE + FA4 run is in test_megatron_te.py and benchmarks/device/te_probe.py)."""
from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_model_lib as lib  # noqa: E402

_BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"


@pytest.fixture
def fake_te(monkeypatch):
    """A module tree that ends in TE's ``backends`` with FA4 entry points recording their kwargs."""
    parts = _BACKENDS.split(".")
    mods = {}
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
        if i > 1:
            setattr(mods[".".join(parts[: i - 1])], parts[i - 1], mods[name])
    backends = mods[_BACKENDS]
    calls = []

    def varlen(q, k, v, softmax_scale=None, causal=False, **kwargs):
        calls.append(("varlen", q, causal, kwargs))
        return "out"

    def dense(q, k, v, softmax_scale=None, causal=False, **kwargs):
        calls.append(("dense", q, causal, kwargs))
        return "out"

    backends.flash_attn_varlen_func_v4 = varlen
    backends.flash_attn_func_v4 = dense
    return backends, calls, (varlen, dense)


@pytest.mark.parametrize(
    "window, want",
    [((-1, 0), (None, 0)), ((-1, -1), (None, None)), ((128, 0), (128, 0)), ((5, -1), (5, None)), ((None, 0), (None, 0))],
)
def test_negative_sides_become_none(fake_te, window, want):
    backends, calls, _ = fake_te
    with lib.te_fa4_window_fix() as fixed:
        assert fixed is True
        # TE reads the module global at call time: the call goes through the wrapper
        out = backends.flash_attn_varlen_func_v4("q", "k", "v", softmax_scale=0.1, causal=True, window_size=window,
                                                 cu_seqlens_q="cu", max_seqlen_q=7)
    assert out == "out"
    name, q, causal, kwargs = calls[-1]
    assert (name, q, causal) == ("varlen", "q", True)
    assert kwargs == {"window_size": want, "cu_seqlens_q": "cu", "max_seqlen_q": 7}


def test_other_arguments_pass_unchanged_and_restored_on_exit(fake_te):
    backends, calls, (varlen, dense) = fake_te
    with lib.te_fa4_window_fix():
        assert backends.flash_attn_varlen_func_v4 is not varlen
        backends.flash_attn_func_v4("q2", "k", "v", causal=False)  # no window: none added
        assert calls[-1] == ("dense", "q2", False, {})
    assert backends.flash_attn_varlen_func_v4 is varlen and backends.flash_attn_func_v4 is dense


def test_restored_after_an_error(fake_te):
    backends, _, (varlen, dense) = fake_te
    with pytest.raises(RuntimeError, match="inside"):
        with lib.te_fa4_window_fix():
            raise RuntimeError("inside")
    assert backends.flash_attn_varlen_func_v4 is varlen and backends.flash_attn_func_v4 is dense


def test_without_fa4_nothing_is_wrapped(fake_te):
    backends, _, _ = fake_te
    backends.flash_attn_varlen_func_v4 = None  # TE found no FlashAttention-4
    backends.flash_attn_func_v4 = None
    with lib.te_fa4_window_fix() as fixed:
        assert fixed is False
        assert backends.flash_attn_varlen_func_v4 is None
