"""verl_ops.integrations.verl_bshd (BSHD / dict-output / VLM-mask drop-ins) and verl's padding-row,
error and install contracts.

``TestRealVerl`` compares every drop-in with verl 0.9.1's own function (loaded as in
test_verl_integration.py; skipped when verl / megatron-core are not installed) on every row,
padding included. The other tests run on the megatron stub and encode the behaviour that verl's
unit tests pin (verl 0.9.1 and verl main, tests/utils/test_megatron_bshd_preprocess.py and the THD
regression tests), written here from that documented behaviour.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from test_verl_integration import make_seqs, nested, real_mpu, real_verl  # noqa: F401  (fixtures)

from verl_ops.integrations import verl as vi
from verl_ops.integrations import verl_bshd as vb

CP_RANKS = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)]
BATCHES = [[7, 1, 12, 5], [3, 2], [1], [16, 9, 0, 4]]


def by_dtype_all_gather(by_kind):
    """Fake all_gather: rank j's tensor is by_kind[kind][j], kind "mask" for bool tensors."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shards = by_kind["mask" if tensor.dtype == torch.bool else "out"]
        assert not tensor.requires_grad
        for dst, src in zip(tensor_list, shards, strict=True):
            assert dst.shape == src.shape and dst.dtype == src.dtype
            dst.copy_(src)

    return all_gather


@pytest.fixture
def mcore(monkeypatch):
    # these tests pin verl 0.9.1's rows; verl main's zigzag roll rule is tested in test_verl_integration.py
    monkeypatch.setattr(vi, "ZIGZAG_ROLL_RULE", "0.9.1")
    return verl_stubs.install_megatron_stub(monkeypatch)


# --------------------------------------------------------------------------------------------
# Against verl 0.9.1 itself.


class TestRealVerl:
    @pytest.mark.parametrize("feat", ["ids", "hidden", "topk"])
    @pytest.mark.parametrize("fp8", [False, True])
    @pytest.mark.parametrize("roll", [False, True])
    def test_preprocess_bshd_engine(self, real_verl, real_mpu, feat, fp8, roll):
        for b, lengths in enumerate(BATCHES):
            x = nested(make_seqs(lengths, feat, seed=b))
            for tp in (1, 2):
                for cp, rank in CP_RANKS:
                    real_mpu.tp, real_mpu.cp, real_mpu.cp_rank = tp, cp, rank
                    for forced in (None, max(lengths) + 3):
                        kw = {"need_roll": roll, "use_fp8_padding": fp8, "forced_max_seqlen": forced}
                        theirs = real_verl.preprocess_bshd_engine(x, **kw)
                        ours = vb.preprocess_bshd_engine(x, **kw)
                        for a, t in zip(ours, theirs, strict=True):
                            assert a.dtype == t.dtype and a.shape == t.shape
                            assert torch.equal(a, t), (lengths, tp, cp, rank, forced)

    @pytest.mark.parametrize("cp", [1, 2, 4])
    def test_postprocess_bshd_engine(self, real_verl, real_mpu, monkeypatch, cp):
        for b, lengths in enumerate(BATCHES):
            x = nested(make_seqs(lengths, "hidden", seed=b))
            real_mpu.tp, real_mpu.cp = 2, cp
            outs, masks = [], []
            for rank in range(cp):
                real_mpu.cp_rank = rank
                xb, mask, _ = real_verl.preprocess_bshd_engine(x)
                outs.append(xb * 3 + rank)
                masks.append(mask)
            monkeypatch.setattr(torch.distributed, "all_gather", by_dtype_all_gather({"out": outs, "mask": masks}))
            for rank in range(cp):
                real_mpu.cp_rank = rank
                results = []
                for fn in (real_verl.postprocess_bshd_engine, vb.postprocess_bshd_engine):
                    out = outs[rank].clone().requires_grad_(True)
                    res = fn(out, masks[rank])
                    sum((r * (k + 1.5)).sum() for k, r in enumerate(res.unbind())).backward()
                    results.append(([r.detach() for r in res.unbind()], out.grad))
                (theirs, their_grad), (ours, our_grad) = results
                assert len(ours) == len(theirs)
                for a, t in zip(ours, theirs):
                    assert torch.equal(a, t)
                assert torch.equal(our_grad, their_grad)

    def test_postprocess_bshd_engine_shape_assertion(self, real_verl, real_mpu):
        out, mask = torch.zeros(2, 4, 3), torch.ones(2, 6, dtype=torch.bool)
        for fn in (real_verl.postprocess_bshd_engine, vb.postprocess_bshd_engine):
            with pytest.raises(AssertionError, match="output.shape"):
                fn(out, mask)
        assert vb.postprocess_bshd_engine(out, mask, post_process=False) is out

    @pytest.mark.parametrize("sp", [False, True])
    @pytest.mark.parametrize("feat", ["ids", "hidden"])
    def test_preprocess_postprocess_bshd(self, real_verl, real_mpu, sp, feat):
        B, S = 4, 11
        g = torch.Generator().manual_seed(3)
        counts = [7, 2, 11, 5]
        x = torch.stack([torch.cat(make_seqs([S], feat, seed=i)) for i in range(B)])
        mask = torch.zeros(B, S, dtype=torch.bool)
        for i, n in enumerate(counts):
            mask[i, S - n :] = True  # left padding
        mask[1, 3] = True  # and one hole-y row
        mask[1, S - 2] = False
        position_ids = torch.randint(0, 50, (B, S), generator=g)
        real_mpu.tp, real_mpu.cp, real_mpu.cp_rank = 3, 1, 0
        for pre in (False, True):
            theirs = real_verl.preprocess_bshd(x, mask, position_ids, sequence_parallel=sp, pre_process=pre)
            ours = vb.preprocess_bshd(x, mask, position_ids, sequence_parallel=sp, pre_process=pre)
            for a, t in zip(ours, theirs, strict=True):
                assert a.dtype == t.dtype and torch.equal(a, t)
        new_x, new_mask, _ = ours  # pre_process=True
        result = (new_x * 2).to(torch.float32).requires_grad_(True)
        grads = []
        for fn in (real_verl.postprocess_bshd, vb.postprocess_bshd):
            r = result.detach().clone().requires_grad_(True)
            out = fn(r, new_mask, mask, S)
            (out * torch.arange(out.numel()).view(out.shape)).sum().backward()
            grads.append((out.detach(), r.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
        assert vb.postprocess_bshd(result, new_mask, mask, S, post_process=False) is result
        real_mpu.cp = 2
        for fn in (real_verl.preprocess_bshd, vb.preprocess_bshd):
            with pytest.raises(AssertionError, match="Context parallel size without seq_pack is not supported"):
                fn(x, mask, position_ids)

    @pytest.mark.parametrize("cp", [1, 2])
    def test_postprocess_packed_seqs_for_dict_output(self, real_verl, real_mpu, monkeypatch, cp):
        lengths = [5, 1, 9]
        B, S = 3, 12
        mask = torch.zeros(B, S, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, 1 : 1 + n] = True
        x = torch.randint(1, 100, (B, S))
        real_mpu.tp, real_mpu.cp = 1, cp
        shards = {"entropy": [], "log_probs": [], "labels": []}
        for rank in range(cp):
            real_mpu.cp_rank = rank
            packed, psp = real_verl.preprocess_packed_seqs(x, mask)
            n = packed.shape[1]
            shards["entropy"].append(torch.rand(1, n, generator=torch.Generator().manual_seed(rank)))
            shards["log_probs"].append(-torch.rand(1, n, generator=torch.Generator().manual_seed(9 + rank)))
            shards["labels"].append(packed % 3 != 0)
        for rank in range(cp):
            real_mpu.cp_rank = rank
            _, psp = real_verl.preprocess_packed_seqs(x, mask)
            results = []
            for fn in (real_verl.postprocess_packed_seqs_for_dict_output, vb.postprocess_packed_seqs_for_dict_output):
                out = types.SimpleNamespace(
                    entropy=shards["entropy"][rank].view(-1).clone(), log_probs=shards["log_probs"][rank].view(-1).clone()
                )
                masked_lp = [lp.masked_fill(~lab, 0.0) for lp, lab in zip(shards["log_probs"], shards["labels"])]
                gathered = {"entropy": shards["entropy"], "log_probs": masked_lp}
                calls = iter(["entropy", "log_probs"])

                def all_gather(tensor_list, tensor, group=None, async_op=False):
                    for dst, src in zip(tensor_list, gathered[next(calls)]):
                        dst.copy_(src)

                monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
                res = fn(shards["labels"][rank], out, psp, mask, B, S)
                results.append((res, out))
            (theirs, their_out), (ours, our_out) = results
            assert set(ours) == set(theirs) == {"entropy", "log_probs"}
            for k in ours:
                assert torch.equal(ours[k], theirs[k]), k
                assert torch.equal(getattr(our_out, k), getattr(their_out, k)), k

    @pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 4)])
    def test_build_vlm_attn_mask_thd_main_rule(self, real_mpu, monkeypatch, tp, cp):
        """verl main 1dda039b's build_vlm_attn_mask_thd: ids padded to the longest length (no TP / CP
        alignment), prefix mask."""
        monkeypatch.setattr(vb, "VLM_THD_ALIGN_RULE", "main")
        real_mpu.tp, real_mpu.cp, real_mpu.cp_rank = tp, cp, 0
        seqs = make_seqs([5, 1, 7], "ids")  # 7: every alignment above 1 would change the width
        for pad in (0, 7):
            ids, mask = vb.build_vlm_attn_mask_thd(nested(seqs), pad)
            want = torch.full((3, 7), pad, dtype=seqs[0].dtype)
            want_mask = torch.zeros(3, 7, dtype=torch.bool)
            for i, s in enumerate(seqs):
                want[i, : len(s)] = s
                want_mask[i, : len(s)] = True
            assert ids.dtype == want.dtype and torch.equal(ids, want)
            assert mask.dtype == torch.bool and torch.equal(mask, want_mask)

    @pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 4)])
    def test_build_vlm_attn_masks(self, real_verl, real_mpu, tp, cp):
        x = nested(make_seqs([5, 1, 8], "ids"))
        real_mpu.tp, real_mpu.cp, real_mpu.cp_rank = tp, cp, 0
        for pad in (0, 7):
            for a, t in zip(vb.build_vlm_attn_mask_thd(x, pad), real_verl.build_vlm_attn_mask_thd(x, pad), strict=True):
                assert a.dtype == t.dtype and torch.equal(a, t)
            for forced in (None, 11):
                ours = vb.build_vlm_attn_mask_bshd(x, 3, pad, forced_max_seqlen=forced)
                theirs = real_verl.build_vlm_attn_mask_bshd(x, 3, pad, forced_max_seqlen=forced)
                for a, t in zip(ours, theirs, strict=True):
                    assert a.dtype == t.dtype and torch.equal(a, t)

    @pytest.mark.parametrize("fn", ["preprocess_thd_engine", "postprocess_thd_engine"])
    def test_unknown_cp_layout_error_is_verls(self, real_verl, real_mpu, fn):
        x = nested([torch.tensor([10, 11])])
        real_mpu.cp = 2
        args = (x,) if fn == "preprocess_thd_engine" else (torch.empty(1, 1), None, x, 1, False)
        for f in (getattr(real_verl, fn), getattr(vi, fn)):
            with pytest.raises(ValueError, match="^Unsupported context parallel layout: interleaved$"):
                f(*args, cp_layout="interleaved")


# --------------------------------------------------------------------------------------------
# verl's documented behaviour (its unit tests), on the megatron stub.


def test_bshd_engine_pads_rows_to_tp(mcore):
    mcore.tp, mcore.cp = 4, 1
    x, mask, pos = vb.preprocess_bshd_engine(nested([torch.tensor([11, 12, 13]), torch.tensor([21, 22])]))
    assert x.tolist() == [[11, 12, 13, 0], [21, 22, 0, 0]]
    assert mask.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]] and pos.dtype == torch.long


def test_bshd_engine_keeps_dense_trailing_dims(mcore, device):
    mcore.tp, mcore.cp = 4, 1
    topk = 64
    rows = [
        torch.arange(3 * topk, dtype=torch.float32, device=device).reshape(3, topk),
        torch.arange(2 * topk, dtype=torch.float32, device=device).reshape(2, topk) + 1000,
    ]
    x, mask, pos = vb.preprocess_bshd_engine(nested(rows))
    assert x.shape == (2, 4, topk) and x.device.type == mask.device.type == device
    assert torch.equal(x[0, :3], rows[0]) and torch.equal(x[1, :2], rows[1])
    assert not x[0, 3].any() and not x[1, 2:].any()
    assert pos.shape == (2, 4)


def test_bshd_engine_roundtrip_cp(mcore, monkeypatch):
    rows = make_seqs([7, 1, 12, 5], "hidden")
    x = nested(rows)
    mcore.tp, mcore.cp = 1, 2
    outs, masks = [], []
    for rank in range(2):
        mcore.cp_rank = rank
        xb, mask, _ = vb.preprocess_bshd_engine(x)
        outs.append(xb)
        masks.append(mask)
    monkeypatch.setattr(torch.distributed, "all_gather", by_dtype_all_gather({"out": outs, "mask": masks}))
    for rank in range(2):
        mcore.cp_rank = rank
        back = vb.postprocess_bshd_engine(outs[rank], masks[rank])
        for a, t in zip(back.unbind(), rows, strict=True):
            assert torch.equal(a, t)


def test_thd_engine_min_local_rows_padding_positions_are_zero(mcore):
    mcore.tp, mcore.cp = 1, 1
    ids, psp, pos = vi.preprocess_thd_engine(nested([torch.arange(100)]), min_local_rows=128)
    assert ids.shape == (1, 128) and psp.cu_seqlens_q_padded.tolist() == [0, 128]
    assert torch.equal(ids[0, :100], torch.arange(100)) and not ids[0, 100:].any()
    assert torch.equal(pos[0, :100], torch.arange(100)) and not pos[0, 100:].any()


def test_thd_engine_dynamic_cp_one_token(mcore, monkeypatch):
    mcore.tp = 1
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    topk = 64
    packed, psp, pos = vi.preprocess_thd_engine(
        nested([torch.arange(topk, dtype=torch.float32).reshape(1, topk)]), local_cp_size=2
    )
    assert packed.shape == (1, 2, topk) and not packed.any()
    assert pos.tolist() == [[1, 0]]
    assert psp.local_cp_size == 2


@pytest.mark.parametrize("rank,ids,positions", [(0, [10, 11, 12, 13, 14], [0, 1, 2, 3, 4]), (1, [0, 20, 21, 22, 0], [0, 0, 1, 2, 0])])
def test_thd_engine_contiguous_global_intervals(mcore, rank, ids, positions):
    mcore.tp, mcore.cp, mcore.cp_rank = 1, 2, rank
    x = nested([torch.tensor([10, 11, 12, 13, 14]), torch.tensor([20, 21, 22])])
    out, psp, pos = vi.preprocess_thd_engine(x, cp_layout="contiguous")
    assert psp.cu_seqlens_q_padded.tolist() == [0, 6, 10]
    assert out[0].tolist() == ids and pos[0].tolist() == positions


def test_thd_engine_contiguous_roll_per_sequence(mcore):
    mcore.tp, mcore.cp, mcore.cp_rank = 1, 2, 0
    x = nested([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])])
    out, _, _ = vi.preprocess_thd_engine(x, need_roll=True, cp_layout="contiguous")
    assert out[0].tolist() == [2, 3, 4, 1]


def test_thd_engine_zigzag_roll_padding_rows(mcore):
    """cp=2, labels 1..7 (padded to 8), rank 0. verl 0.9.1: [2, 3, 0, 1] (position 6 reads the
    zero at position 7, position 7 wraps to token 0). verl main 1dda039b's test expects
    [2, 3, 1, 1]: the drop-in follows the verl in use (docs/layout.md#roll-under-verl-main); both rules are
    tested in test_verl_integration.py."""
    mcore.tp, mcore.cp = 1, 2
    x = nested([torch.arange(1, 8)])
    got = []
    for rank in range(2):
        mcore.cp_rank = rank
        out, _, pos = vi.preprocess_thd_engine(x, need_roll=True)
        got.append((out[0].tolist(), pos[0].tolist()))
    assert got == [([2, 3, 0, 1], [1, 1, 0, 0]), ([4, 5, 6, 7], [3, 3, 5, 5])]


def test_unknown_cp_layout_message(mcore):
    mcore.cp = 2
    x = nested([torch.tensor([10, 11])])
    with pytest.raises(ValueError, match="^Unsupported context parallel layout: interleaved$"):
        vi.preprocess_thd_engine(x, cp_layout="interleaved")
    # checked before post_process, as verl does
    with pytest.raises(ValueError, match="^Unsupported context parallel layout: interleaved$"):
        vi.postprocess_thd_engine(
            torch.empty(1, 1), packed_seq_params=None, input_ids=torch.empty(1), batch_size=1,
            post_process=False, cp_layout="interleaved",
        )


def test_install_reports_missing(monkeypatch):
    """A verl whose util module lacks some functions: those are reported, the rest patched."""
    util = types.ModuleType("verl.models.mcore.util")

    def preprocess_bshd_engine(input_ids, pre_process=True, need_roll=False, use_fp8_padding=False):
        raise AssertionError("not patched")

    def build_vlm_attn_mask_thd(input_ids, pad_token_id=None, extra_new_arg=None):
        raise AssertionError("verl's")

    util.preprocess_bshd_engine = preprocess_bshd_engine
    util.build_vlm_attn_mask_thd = build_vlm_attn_mask_thd
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)  # (a real verl module imported earlier is not this verl)
    for name in ("verl", "verl.models", "verl.models.mcore"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.models.mcore.util", util)
    try:
        with pytest.warns(UserWarning, match="build_vlm_attn_mask_thd"):
            rep = vi.install(report=True)
        assert rep["patched"] == ["verl.models.mcore.util.preprocess_bshd_engine"]
        assert rep["incompatible"] == ["verl.models.mcore.util.build_vlm_attn_mask_thd"]
        assert "verl.models.mcore.util.postprocess_bshd_engine" in rep["missing"]
        assert "verl.models.mcore.util.preprocess_thd_engine" in rep["missing"]
        assert util.preprocess_bshd_engine is vb.preprocess_bshd_engine
        assert util.build_vlm_attn_mask_thd is build_vlm_attn_mask_thd
    finally:
        restored = vi.uninstall()
    assert restored == ["verl.models.mcore.util.preprocess_bshd_engine"]
    assert util.preprocess_bshd_engine is preprocess_bshd_engine


@pytest.mark.parametrize("aligns,rule", [(True, "0.9.1"), (False, "main")])
def test_vlm_thd_align_rule_read_from_verl_source(tmp_path, monkeypatch, aligns, rule):
    """The rule follows the verl in use: its util.py's build_vlm_attn_mask_thd aligns to TP / CP
    (0.9.1, names align_size) or pads to the longest length only (main)."""
    body = ("    align_size = tp_size * cp_size * 2 if cp_size > 1 else tp_size\n" if aligns else "")
    verl_stubs.install_verl_util_source(
        monkeypatch, tmp_path,
        "def preprocess_thd_engine(input_ids):\n    pass\n\n\n"
        f"def build_vlm_attn_mask_thd(input_ids, pad_token_id=None):\n{body}"
        "    input_ids_with_pad = input_ids.to_padded_tensor(pad_token_id)\n\n\n"
        "def build_vlm_attn_mask_bshd(input_ids, batch_size, pad_token_id=None):\n"
        "    align_size = 2\n")
    monkeypatch.setattr(vb, "VLM_THD_ALIGN_RULE", None)
    assert vb.vlm_thd_align_rule() == rule
    monkeypatch.setattr(vb, "VLM_THD_ALIGN_RULE", "1.0")
    with pytest.raises(ValueError, match="VLM_THD_ALIGN_RULE"):
        vb.vlm_thd_align_rule()
