"""Differential fuzz: every verl drop-in against the installed verl's own function.

Each test item draws one random case from a fixed seed (``random.Random(f"{kind}-{seed}")``, so the
file is deterministic) and runs it through verl_ops' drop-in and through verl's function from the
installed ``verl/models/mcore/util.py`` (loaded with ``verl_stubs.load_verl_util`` against the real
megatron-core, as in tests/test_verl_integration.py), on every CP rank. It then requires:

* the same outputs: values in every row (padding rows included), shapes, dtypes, devices; nested
  results compared by offsets and per-sequence values; ``PackedSeqParams`` of the same class with
  every dataclass field equal (tensors by dtype and value, scalars by type and value);
* the inputs returned as themselves where verl returns them (``pre_process`` / ``post_process``
  False);
* for CP > 1 postprocessing: the same all-gather calls (count and group), each fed by a fake
  ``torch.distributed.all_gather`` from every rank's precomputed shard;
* for float32 data, the same gradients of the inputs (for a fixed weighted sum of the outputs);
* where verl raises, the same exception type and message (``str``), and the drop-in raises too.

Drawn: batch sizes 1..40; lengths log-normal (median ~150, up to 4000) mixed with edge lengths
0, 1, 2, 3, ..., 31, 32, 33, occasionally all equal or all zero; tp in {1, 2, 4}; cp in {1, 2, 4}
with every rank (and dynamic CP via ``local_cp_size``); FP8 padding; pre_process / post_process;
need_roll; ``min_local_rows`` / ``pad_to_length_bucket``; zigzag / contiguous; int64 / int32 / bool
ids, float32 / bfloat16 data with feature dims; masks right-padded, left-padded, with holes, and
non-contiguous (strided) inputs and masks; and inputs verl rejects (unknown cp_layout, bucket <= 0,
contiguous with cp > 1 on megatron-core 0.16.1, preprocess_bshd with cp > 1, masks / widths /
batch sizes that do not match, forced_max_seqlen below the longest sequence, pad_token_id None).
Gradients are compared for a third of the float32 cases (verl's own backward is slow).

The differences found are listed in ``REASONS``. The fuzz cases that hit one are told apart at
collection time by a predicate on the drawn parameters (``KNOWN``) and marked
``xfail(strict=True, raises=AssertionError)``; their mismatch must match the difference's
``PATTERNS`` entry (any other failure is an error). Each difference also has a minimal reproducer
(``test_known_*``). The file passes now, and fails (XPASS strict) when a difference is fixed.

``test_fuzz_cp_partition_mode`` re-runs packed / THD engine cases against a megatron-core whose
``PackedSeqParams`` has ``cp_partition_mode`` (``verl_stubs.install_megatron_stub``; the installed
0.16.1 has not, so there verl rejects the contiguous layout with cp > 1), with verl's util.py
executed again against that stub: the contiguous layout with cp > 1, rolled and not.

Not covered: verl's NPU branches (``is_npu_available``), CUDA devices (CPU-only machine), and
``preprocess_for_mindspeed`` (NPU only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import re
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_stubs
from test_verl_integration import real_verl  # noqa: F401  (module fixture: verl's util.py, real megatron-core)

from verl_ops.integrations import verl as vi
from verl_ops.integrations import verl_bshd as vb


# --------------------------------------------------------------------------------------------
# Drawing cases.

EDGE_LENGTHS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33]
TPS = [1, 2, 4]
CPS = [1, 2, 4]
# (dtype, trailing feature shape) of ids / labels / hidden states / logits
DATA = [
    (torch.int64, ()),
    (torch.int64, ()),
    (torch.bool, ()),
    (torch.float32, ()),
    (torch.float32, (5,)),
    (torch.bfloat16, (3,)),
    (torch.bfloat16, (2, 3)),
    (torch.int64, (2,)),
    (torch.int32, ()),
]
OUT_DATA = [(torch.float32, ()), (torch.float32, (7,)), (torch.bfloat16, (4,)), (torch.int64, ()), (torch.bool, ())]
TOKEN_CAP = 20_000  # total valid tokens of a batch (keeps the file fast)


def draw_batch_size(rng):
    return rng.choice([rng.randint(1, 4), rng.randint(1, 4), rng.randint(5, 16), rng.randint(17, 40)])


def draw_lengths(rng, B):
    lengths = []
    for _ in range(B):
        if rng.random() < 0.35:
            n = rng.choice(EDGE_LENGTHS)
        else:  # log-normal, median ~150: tens to thousands
            n = int(min(4000, max(1, round(math.exp(rng.gauss(math.log(150), 1.3))))))
        lengths.append(n)
    u = rng.random()
    if u < 0.04:
        lengths = [0] * B
    elif u < 0.10:
        lengths = [lengths[0]] * B
    total = sum(lengths)
    if total > TOKEN_CAP:
        lengths = [n * TOKEN_CAP // total if n * TOKEN_CAP // total > 0 else min(n, 1) for n in lengths]
    return lengths


def draw_parallel(rng):
    return rng.choice(TPS), rng.choice(CPS)


def rand_data(g, shape, dtype):
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(1, 151_000, shape, generator=g).to(dtype)


def draw_mask(rng, lengths, S, style):
    mask = torch.zeros(len(lengths), S, dtype=torch.bool)
    for i, n in enumerate(lengths):
        st = rng.choice(["right", "left", "holes"]) if style == "mixed" else style
        if n == 0:
            continue
        if st == "right":
            mask[i, :n] = True
        elif st == "left":
            mask[i, S - n :] = True
        else:
            mask[i, sorted(rng.sample(range(S), n))] = True
    return mask


# --------------------------------------------------------------------------------------------
# Comparing.


def _fields(psp):
    return [f.name for f in dataclasses.fields(psp)] if dataclasses.is_dataclass(psp) else None


def assert_same(ours, theirs, where="result", inputs=()):
    """ours == theirs: tensors (nested too) by dtype, shape, device and value; PackedSeqParams by
    class and fields; containers element by element; an input returned as itself by verl must be
    returned as itself by ours."""
    for k, inp in enumerate(inputs):
        if theirs is inp:
            assert ours is inp, f"{where}: verl returns input #{k} itself, ours returns another object"
            return
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: ours is {type(ours).__name__}, verl's a tensor"
        assert ours.is_nested == theirs.is_nested, f"{where}: nested {ours.is_nested} vs {theirs.is_nested}"
        if theirs.is_nested:
            assert ours.layout == theirs.layout, f"{where}: layout {ours.layout} vs {theirs.layout}"
            assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} vs {theirs.dtype}"
            assert ours.size(0) == theirs.size(0), f"{where}: {ours.size(0)} vs {theirs.size(0)} sequences"
            assert torch.equal(ours.offsets().cpu().long(), theirs.offsets().cpu().long()), (
                f"{where}: offsets {ours.offsets().tolist()} vs {theirs.offsets().tolist()}"
            )
            for i, (a, t) in enumerate(zip(ours.unbind(), theirs.unbind())):
                assert_same(a, t, f"{where}[{i}]")
            return
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} vs verl's {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {tuple(ours.shape)} vs verl's {tuple(theirs.shape)}"
        assert ours.device == theirs.device, f"{where}: device {ours.device} vs {theirs.device}"
        if not torch.equal(ours, theirs):
            diff = (ours != theirs).nonzero()
            first = tuple(diff[0].tolist())
            raise AssertionError(
                f"{where}: {diff.shape[0]} elements differ, first at {first}: ours {ours[first].tolist()} "
                f"vs verl's {theirs[first].tolist()}"
            )
        return
    if isinstance(theirs, (tuple, list)):
        assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"
        assert len(ours) == len(theirs), f"{where}: {len(ours)} vs {len(theirs)} items"
        for k, (a, t) in enumerate(zip(ours, theirs)):
            assert_same(a, t, f"{where}[{k}]", inputs)
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{where}: keys {list(ours)} vs {list(theirs)}"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{where}[{k!r}]", inputs)
        return
    names = _fields(theirs)
    if names is not None and not isinstance(theirs, type):
        assert type(ours) is type(theirs), f"{where}: {type(ours)} vs {type(theirs)}"
        for name in names:
            assert_same(getattr(ours, name), getattr(theirs, name), f"{where}.{name}")
        return
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} {ours!r} vs {type(theirs).__name__} {theirs!r}"
    assert ours == theirs, f"{where}: {ours!r} vs verl's {theirs!r}"


def call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001  (compared with verl's)
        return None, e


def _weight(t):
    return (torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape) % 7 + 1).to(t.dtype)


def _loss(result):
    """A fixed weighted sum of every float tensor of `result` that carries a gradient."""
    flat = []

    def walk(r):
        if isinstance(r, torch.Tensor):
            if r.is_nested:
                walk(r.values())
            elif r.is_floating_point() and r.requires_grad:
                flat.append((r * _weight(r)).sum())
        elif isinstance(r, (tuple, list)):
            for x in r:
                walk(x)
        elif isinstance(r, dict):
            for x in r.values():
                walk(x)

    walk(result)
    return sum(flat) if flat else None


def grads_of(result, leaves):
    loss = _loss(result)
    if loss is not None:
        loss.backward()
    return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


def compare(case, ours_fn, theirs_fn, make, what, gathers=None):
    """Run ours and verl's on fresh inputs from ``make()`` -> (args, kwargs, grad leaves); compare
    results or exceptions, gradients, and (``gathers``: a list the fake all-gather appends to) the
    collectives."""
    out = {}
    for who, fn in (("verl", theirs_fn), ("ours", ours_fn)):
        args, kwargs, leaves = make()
        if gathers is not None:
            gathers.clear()
        res, err = call(fn, *args, **kwargs)
        grads = grads_of(res, leaves) if err is None and leaves else None
        out[who] = (res, err, grads, list(gathers or []), (*args, *kwargs.values()))
    (t_res, t_err, t_grads, t_calls, _), (o_res, o_err, o_grads, o_calls, o_inputs) = out["verl"], out["ours"]
    ctx = f"{what} | case {case}"
    if t_err is not None or o_err is not None:
        assert t_err is not None, f"{ctx}: verl returns, ours raises {type(o_err).__name__}: {o_err}"
        assert o_err is not None, f"{ctx}: verl raises {type(t_err).__name__}: {t_err}; ours returns"
        assert type(o_err) is type(t_err) and str(o_err) == str(t_err), (
            f"{ctx}: ours raises {type(o_err).__name__}({str(o_err)!r}), "
            f"verl raises {type(t_err).__name__}({str(t_err)!r})"
        )
        return None
    # (the inputs of ours' call: an input that verl returns as itself must come back as itself;
    # identity is checked on ours' own inputs, mapped from verl's by position)
    theirs_inputs = out["verl"][4]
    mapped = _map_identity(t_res, theirs_inputs, o_inputs)
    assert_same(o_res, mapped, ctx, inputs=o_inputs)
    if t_grads is not None:
        for k, (a, t) in enumerate(zip(o_grads, t_grads)):
            assert_same(a, t, f"{ctx}: gradient of input {k}")
    assert [g for g in o_calls] == [g for g in t_calls], f"{ctx}: all_gather groups {o_calls} vs verl's {t_calls}"
    return o_res, t_res


def _map_identity(result, their_inputs, our_inputs):
    """verl's result with every input of verl's call replaced by the matching input of ours."""
    for t_in, o_in in zip(their_inputs, our_inputs):
        if result is t_in:
            return o_in
    if isinstance(result, tuple):
        return tuple(_map_identity(r, their_inputs, our_inputs) for r in result)
    return result


# --------------------------------------------------------------------------------------------
# The parallel state (megatron-core's parallel_state functions, patched) and fake collectives.


class Env:
    def __init__(self, util, monkeypatch, ps):
        self.util = util
        self.mp = monkeypatch
        self.cfg = verl_stubs.ParallelConfig()
        self.gathers = []
        cfg = self.cfg
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: cfg.tp)
        monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: cfg.cp)
        monkeypatch.setattr(ps, "get_context_parallel_rank", lambda: cfg.cp_rank)
        monkeypatch.setattr(ps, "get_context_parallel_group", lambda: cfg.cp_group)

        def dynamic_groups(group_size):
            if cfg.dynamic_group is None or cfg.dynamic_group.size != group_size:
                cfg.dynamic_group = verl_stubs.DynamicGroup(group_size)
            return cfg.dynamic_group

        monkeypatch.setattr(ps, "get_dynamic_data_context_parallel_groups", dynamic_groups, raising=False)

        def get_rank(group=None):
            assert isinstance(group, verl_stubs.DynamicGroup), f"get_rank of {group!r}"
            return cfg.dynamic_rank

        monkeypatch.setattr(torch.distributed, "get_rank", get_rank)
        monkeypatch.setattr(torch.distributed, "all_gather", self._no_gather)
        logger = getattr(util, "logger", None)
        if logger is not None:  # verl's "Padding tensor for context parallel alignment" warnings
            monkeypatch.setattr(logger, "disabled", True)

    @staticmethod
    def _no_gather(*a, **k):
        raise AssertionError("unexpected all_gather (no shards installed)")

    def set(self, tp=1, cp=1, rank=0):
        self.cfg.tp, self.cfg.cp, self.cfg.cp_rank = tp, cp, rank
        self.cfg.dynamic_rank = rank

    def shards(self, candidates, rank):
        """torch.distributed.all_gather: rank j's tensor comes from the candidate shard list whose
        entry `rank` is the tensor this rank contributes."""
        calls = self.gathers

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            assert not tensor.requires_grad, "all_gather of a tensor that requires grad"
            for shards in candidates:
                own = shards[rank]
                if own.shape == tensor.shape and own.dtype == tensor.dtype and torch.equal(own, tensor):
                    break
            else:
                raise AssertionError("all_gather: this rank contributes none of the precomputed shards")
            assert len(tensor_list) == len(shards)
            for dst, src in zip(tensor_list, shards):
                assert dst.shape == src.shape and dst.dtype == src.dtype
                dst.copy_(src)
            calls.append(group)

        self.mp.setattr(torch.distributed, "all_gather", all_gather)


@pytest.fixture
def env(real_verl, monkeypatch):  # noqa: F811
    from megatron.core import parallel_state

    return Env(real_verl, monkeypatch, parallel_state)


# --------------------------------------------------------------------------------------------
# Cases. Each is drawn as plain parameters first (from random.Random(f"{kind}-{seed}"), so the
# known differences below can be told apart at collection time); its tensors are built from them.


def _common(kind, seed, stub=False):
    rng = random.Random(f"{'stub-' if stub else ''}{kind}-{seed}")
    B = draw_batch_size(rng)
    p = dict(kind=kind, seed=seed, B=B, lengths=draw_lengths(rng, B))
    p["tp"], p["cp"] = draw_parallel(rng)
    p["data_seed"] = rng.randrange(2**31)
    return rng, p


def _draw_data(rng, p, choices=DATA):
    p["dtype"], p["feat"] = rng.choice(choices)


def _draw_padded(rng, p):
    p["S"] = max(p["lengths"]) + rng.choice([0, 0, 1, 3, rng.randint(0, 64)])
    p["style"] = rng.choice(["right", "right", "left", "holes", "mixed"])
    p["mask_seed"] = rng.randrange(2**31)
    _draw_data(rng, p)
    p["strided"] = rng.random() < 0.15


def _build_padded(p, g):
    """[B, S, *F] (random garbage off-mask too) and its bool mask [B, S]; with p["strided"], both
    are non-contiguous views (every other column of a wider tensor)."""
    mask = draw_mask(random.Random(p["mask_seed"]), p["lengths"], p["S"], p["style"])
    x = rand_data(g, (p["B"], p["S"], *p["feat"]), p["dtype"])
    if p.get("strided"):
        wide = rand_data(g, (p["B"], 2 * p["S"], *p["feat"]), p["dtype"])
        wide[:, ::2] = x
        wide_mask = torch.rand(p["B"], 2 * p["S"], generator=g) < 0.5
        wide_mask[:, ::2] = mask
        x, mask = wide[:, ::2], wide_mask[:, ::2]
    return x, mask


def _with_grad(p, t):
    """Gradients are compared for a third of the float32 cases (verl's backward is slow on big ones)."""
    return p["data_seed"] % 3 == 0 and t.numel() <= 200_000


def _copy(t):
    """A copy of t with t's strides (clone() of a non-contiguous view may give a contiguous one)."""
    if t.is_contiguous():
        return t.clone()
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype).copy_(t)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def draw_packed(kind, seed, stub=False):
    rng, p = _common(kind, seed, stub)
    p["fp8"] = rng.random() < 0.3
    _draw_padded(rng, p)
    if kind == "packed_pre":
        p["pre_process"] = rng.random() < 0.85
        # inputs verl rejects: a mask narrower / wider than input_ids
        p["bad"] = rng.choice(["narrow_mask", "wide_mask"]) if rng.random() < 0.06 else None
        return p
    p["post_process"] = rng.random() < 0.9
    p["psp_from"] = rng.choice(["verl", "ours"])
    if kind == "packed_post":
        p["out"] = rng.choice(OUT_DATA)
        p["bad"] = rng.choice(["seq_len", "batch_size", "rows"]) if rng.random() < 0.08 else None
    else:
        p["flat"] = rng.random() < 0.5  # entropy / log_probs given as [local] or [1, local]
    return p


def run_packed(env, p):
    """preprocess_packed_seqs on every rank; postprocess_packed_seqs and the dict output of
    random model outputs of every rank's shard shape."""
    util, g = env.util, torch.Generator().manual_seed(p["data_seed"])
    kind, tp, cp, fp8 = p["kind"], p["tp"], p["cp"], p["fp8"]
    x, mask = _build_padded(p, g)
    B, S = mask.shape
    if kind == "packed_pre":
        pre = p["pre_process"]
        grad = p["dtype"] == torch.float32 and pre and _with_grad(p, x)
        if p["bad"] == "narrow_mask":
            mask = mask[:, :-1] if S > 0 else mask
        elif p["bad"] == "wide_mask":
            mask = torch.cat([mask, torch.zeros(B, 1, dtype=torch.bool)], dim=1)
        for rank in range(cp):
            env.set(tp, cp, rank)

            def make():
                xi = _copy(x).requires_grad_(grad)
                return (xi, _copy(mask)), {"pre_process": pre, "use_fp8_padding": fp8}, [xi] if grad else []

            compare({**p, "rank": rank}, vi.preprocess_packed_seqs, util.preprocess_packed_seqs, make,
                    "preprocess_packed_seqs")
        return
    post = p["post_process"]
    env.set(tp, cp, 0)
    pre_fn = util.preprocess_packed_seqs if p["psp_from"] == "verl" else vi.preprocess_packed_seqs
    _, psp = pre_fn(x, mask, pre_process=False, use_fp8_padding=fp8)
    local = int(psp.cu_seqlens_q_padded[-1]) // cp
    if kind == "packed_post":
        odtype, ofeat = p["out"]
        rows = local + (1 if p["bad"] == "rows" else 0)
        outs = [rand_data(g, (1, rows, *ofeat), odtype) for _ in range(cp)]
        ograd = odtype == torch.float32 and _with_grad(p, outs[0])
        b_arg = B - 1 if p["bad"] == "batch_size" and B > 1 else B
        s_arg = S + 1 if p["bad"] == "seq_len" else S
        for rank in range(cp):
            env.set(tp, cp, rank)
            env.shards([outs], rank)

            def make():
                o = outs[rank].clone().requires_grad_(ograd)
                return (o, psp, _copy(mask), b_arg, s_arg), {"post_process": post}, [o] if ograd else []

            compare({**p, "rank": rank}, vi.postprocess_packed_seqs, util.postprocess_packed_seqs, make,
                    "postprocess_packed_seqs", env.gathers)
        return
    entropy = [torch.rand(local, generator=g) for _ in range(cp)]
    log_probs = [-torch.rand(local, generator=g) for _ in range(cp)]
    labels = [torch.rand(1, local, generator=g) < 0.8 for _ in range(cp)]
    masked = [lp.view(1, -1).masked_fill(~lab, 0.0) for lp, lab in zip(log_probs, labels)]
    flat = p["flat"]
    for rank in range(cp):
        env.set(tp, cp, rank)
        env.shards([[e.view(1, -1) for e in entropy], masked], rank)
        made = []

        def make():
            ns = types.SimpleNamespace(
                entropy=entropy[rank].clone() if flat else entropy[rank].view(1, -1).clone(),
                log_probs=log_probs[rank].clone() if flat else log_probs[rank].view(1, -1).clone(),
            )
            made.append(ns)
            return (labels[rank].clone(), ns, psp, _copy(mask), B, S), {"post_process": post}, []

        compare({**p, "rank": rank}, vb.postprocess_packed_seqs_for_dict_output,
                util.postprocess_packed_seqs_for_dict_output, make, "postprocess_packed_seqs_for_dict_output",
                env.gathers)
        if len(made) == 2:  # verl rewrites output.entropy / output.log_probs in place
            for name in ("entropy", "log_probs"):
                assert_same(getattr(made[1], name), getattr(made[0], name), f"output.{name} after the call | {p}")


def draw_thd(kind, seed, stub=False):
    rng, p = _common(kind, seed, stub)
    kw = {"need_roll": rng.random() < 0.5, "use_fp8_padding": rng.random() < 0.25}
    p["cp_static"] = p["cp"]
    if rng.random() < 0.15:  # dynamic CP: local_cp_size decides, the static CP size is 1
        kw["local_cp_size"] = rng.choice([1, 2, 4])
        p["cp_static"], p["cp"] = 1, kw["local_cp_size"]
    if rng.random() < 0.25:
        kw["min_local_rows"] = rng.choice([1, 8, 64, 128, rng.randint(1, 600)])
    if rng.random() < 0.25:
        kw["pad_to_length_bucket"] = rng.choice([1, 2, 3, 16, 64, 128, 256, 1024, rng.randint(1, 700), 0, -8])
    # (on megatron-core 0.16.1 verl rejects contiguous with cp > 1: mostly zigzag there)
    kw["cp_layout"] = rng.choice(["zigzag", "contiguous"] if stub else ["zigzag"] * 5 + ["contiguous"])
    if rng.random() < 0.03:
        kw["cp_layout"] = "interleaved"
    p["kw"] = kw
    _draw_data(rng, p)
    p["pre_process"] = rng.random() < 0.9
    if kind == "thd_post":
        p["post_process"] = rng.random() < 0.9
        p["out"] = rng.choice(OUT_DATA)
        p["psp_from"] = rng.choice(["verl", "ours"])
        # batch_size not the batch's (verl: fewer sequences, or an IndexError)
        p["batch_size"] = p["B"] + (rng.choice([-1, 1]) if rng.random() < 0.05 and p["B"] > 1 else 0)
    return p


def run_thd(env, p):
    util, g = env.util, torch.Generator().manual_seed(p["data_seed"])
    kw, tp, cp, cp_static = dict(p["kw"]), p["tp"], p["cp"], p["cp_static"]
    values = rand_data(g, (sum(p["lengths"]), *p["feat"]), p["dtype"])
    offsets = _offsets(p["lengths"])

    def nested(grad=False):
        v = values.clone().requires_grad_(grad)
        return torch.nested.nested_tensor_from_jagged(v, offsets.clone()), v

    def set_rank(rank):
        env.set(tp, cp_static, rank if "local_cp_size" not in kw else 0)
        env.cfg.dynamic_rank = rank

    if p["kind"] == "thd_pre":
        pre = p["pre_process"]
        grad = p["dtype"] == torch.float32 and pre and _with_grad(p, values)
        for rank in range(cp):
            set_rank(rank)

            def make():
                x, v = nested(grad)
                return (x,), {"pre_process": pre, **kw}, [v] if grad else []

            compare({**p, "rank": rank}, vi.preprocess_thd_engine, util.preprocess_thd_engine, make,
                    "preprocess_thd_engine")
        return
    # postprocess_thd_engine: the packed_seq_params of this case's preprocess (verl's or ours).
    # Where the preprocess raises (thd_pre compares that), verl's of the nearest case it accepts:
    # no bucket <= 0, and the zigzag twin of a cp_layout its preprocess rejects (the postprocess
    # still gets the cp_layout drawn: verl checks it first, and zigzag offsets are valid
    # contiguous ones).
    if kw.get("pad_to_length_bucket") is not None and kw["pad_to_length_bucket"] <= 0:
        del kw["pad_to_length_bucket"]
    pre_kw = {k: v for k, v in kw.items() if k != "need_roll"}
    set_rank(0)
    fns = [vi.preprocess_thd_engine, util.preprocess_thd_engine]
    if p["psp_from"] == "verl":
        fns.reverse()
    psp = None
    for fn, a_kw in [(f, pre_kw) for f in fns] + [(util.preprocess_thd_engine, {**pre_kw, "cp_layout": "zigzag"})]:
        try:
            _, psp, _ = fn(nested()[0], pre_process=False, **a_kw)
            break
        except (ValueError, RuntimeError):
            continue
    assert psp is not None, p
    odtype, ofeat = p["out"]
    local = int(psp.cu_seqlens_q_padded[-1]) // cp
    outs = [rand_data(g, (1, local, *ofeat), odtype) for _ in range(cp)]
    ograd = odtype == torch.float32 and _with_grad(p, outs[0])
    post_kw = {k: v for k, v in kw.items() if k in ("local_cp_size", "cp_layout")}
    post = p["post_process"]
    case = {**p, "psp": f"{'verl' if fn is util.preprocess_thd_engine else 'ours'}, {a_kw['cp_layout']}"}
    for rank in range(cp):
        set_rank(rank)
        env.shards([outs], rank)

        def make():
            o = outs[rank].clone().requires_grad_(ograd)
            return (o, psp, nested()[0], p["batch_size"]), {"post_process": post, **post_kw}, [o] if ograd else []

        compare({**case, "rank": rank}, vi.postprocess_thd_engine, util.postprocess_thd_engine, make,
                "postprocess_thd_engine", env.gathers)


def draw_bshd_engine(kind, seed, stub=False):
    rng, p = _common(kind, seed, stub)
    p["fp8"] = rng.random() < 0.25
    p["need_roll"] = rng.random() < 0.5
    u, longest = rng.random(), max(p["lengths"])
    p["forced"] = None
    if u < 0.22:
        p["forced"] = longest + rng.choice([0, 1, 3, 17, rng.randint(0, 300)])
    elif u < 0.3 and longest > 0:  # below the longest length: verl rejects it or truncates
        p["forced"] = rng.randint(0, longest - 1)
    if kind == "bshd_engine_pre":
        _draw_data(rng, p)
        p["pre_process"] = rng.random() < 0.8
        return p
    _draw_data(rng, p, OUT_DATA[:4])  # (model outputs; bool ones could pass for the masks in all_gather)
    p["post_process"] = rng.random() < 0.9
    p["masks"] = rng.choice(["engine", "engine", "engine", "random", "narrow", "odd"])
    if p["forced"] is not None and p["forced"] < longest:
        p["forced"] = None
    return p


def run_bshd_engine(env, p):
    util, g = env.util, torch.Generator().manual_seed(p["data_seed"])
    tp, cp = p["tp"], p["cp"]
    values = rand_data(g, (sum(p["lengths"]), *p["feat"]), p["dtype"])
    offsets = _offsets(p["lengths"])

    def nested():
        return torch.nested.nested_tensor_from_jagged(values.clone(), offsets.clone())

    kw = {"use_fp8_padding": p["fp8"], "forced_max_seqlen": p["forced"]}
    if p["kind"] == "bshd_engine_pre":
        for rank in range(cp):
            env.set(tp, cp, rank)
            compare({**p, "rank": rank}, vb.preprocess_bshd_engine, util.preprocess_bshd_engine,
                    lambda: ((nested(),), {"pre_process": p["pre_process"], "need_roll": p["need_roll"], **kw}, []),
                    "preprocess_bshd_engine")
        return
    B = p["B"]
    masks = []
    for rank in range(cp):
        env.set(tp, cp, rank)
        masks.append(util.preprocess_bshd_engine(nested(), **kw)[1])
    local = masks[0].shape[1]
    if p["masks"] == "random":  # any mask: verl keeps the positions it marks, in order
        masks = [torch.rand(m.shape, generator=g) < 0.6 for m in masks]
    outs = [rand_data(g, (B, local, *p["feat"]), p["dtype"]) for _ in range(cp)]
    if p["masks"] == "narrow":  # verl's shape assertion
        masks = [m[:, : max(local - 1, 0)] for m in masks]
    elif p["masks"] == "odd" and local > 1:  # an odd local width (cp > 1: verl's assertion)
        outs, masks = [o[:, 1:] for o in outs], [m[:, 1:] for m in masks]
    ograd = p["dtype"] == torch.float32 and _with_grad(p, outs[0])
    for rank in range(cp):
        env.set(tp, cp, rank)
        env.shards([outs, masks], rank)

        def make():
            o = outs[rank].clone().requires_grad_(ograd)
            return (o, masks[rank].clone()), {"post_process": p["post_process"]}, [o] if ograd else []

        compare({**p, "rank": rank}, vb.postprocess_bshd_engine, util.postprocess_bshd_engine, make,
                "postprocess_bshd_engine", env.gathers)


def draw_bshd(kind, seed, stub=False):
    rng, p = _common(kind, seed, stub)
    p["cp"] = 1 if rng.random() < 0.9 else rng.choice([2, 4])  # verl: cp == 1 only (asserted)
    _draw_padded(rng, p)
    p["sp"] = rng.random() < 0.5
    p["pre_process"] = rng.random() < 0.85
    if kind == "bshd_pre":
        p["bad"] = "mask_3d" if rng.random() < 0.03 else None
    else:
        p["out"] = rng.choice(OUT_DATA)
        p["post_process"] = rng.random() < 0.9
        # an original mask that does not match the packed one: another count in one row
        # (verl: a shape error, or a broadcast of one value) or one column too few
        p["bad"] = rng.choice(["counts", "width"]) if rng.random() < 0.06 else None
    return p


def run_bshd(env, p):
    """preprocess_bshd / postprocess_bshd (left-padding removal)."""
    util, g = env.util, torch.Generator().manual_seed(p["data_seed"])
    x, mask = _build_padded(p, g)
    B, S = mask.shape
    position_ids = torch.randint(0, 4096, (B, S), generator=g)
    sp, pre = p["sp"], p["pre_process"]
    env.set(p["tp"], p["cp"], 0)
    if p["kind"] == "bshd_pre":
        grad = p["dtype"] == torch.float32 and pre and _with_grad(p, x)
        if p["bad"] == "mask_3d":
            mask = mask.unsqueeze(-1)

        def make():
            xi = _copy(x).requires_grad_(grad)
            return (xi, _copy(mask), position_ids.clone()), {"sequence_parallel": sp, "pre_process": pre}, (
                [xi] if grad else []
            )

        compare(p, vb.preprocess_bshd, util.preprocess_bshd, make, "preprocess_bshd")
        return
    env.set(p["tp"], 1, 0)
    _, new_mask, _ = util.preprocess_bshd(x, mask, position_ids, sequence_parallel=sp)
    odtype, ofeat = p["out"]
    result = rand_data(g, (B, new_mask.shape[1], *ofeat), odtype)
    ograd = odtype == torch.float32 and _with_grad(p, result)

    orig, seq_len = _copy(mask), S
    if p["bad"] == "counts" and S > 0:
        row = int(torch.randint(0, B, (1,), generator=g))
        if orig[row].all():
            orig[row, 0] = False
        else:
            orig[row, int((~orig[row]).nonzero()[0])] = True
    elif p["bad"] == "width":
        seq_len = S + 1

    def make():
        r = result.clone().requires_grad_(ograd)
        return (r, new_mask.clone(), _copy(orig), seq_len), {"post_process": p["post_process"]}, [r] if ograd else []

    compare(p, vb.postprocess_bshd, util.postprocess_bshd, make, "postprocess_bshd")


def draw_vlm(kind, seed, stub=False):
    rng, p = _common(kind, seed, stub)
    p["rank"] = rng.randrange(p["cp"])
    p["pad"] = rng.choice([0, 0, 151643, -100, 2]) if rng.random() < 0.95 else None
    if kind == "vlm_bshd":
        longest = max(p["lengths"])
        u = rng.random()
        p["forced"] = None if u < 0.6 else longest + rng.choice([0, 1, 5, rng.randint(0, 200)])
        if u > 0.95 and longest > 0:
            p["forced"] = rng.randint(0, longest - 1)
        p["batch_size"] = p["B"] + (rng.choice([-1, 1]) if rng.random() < 0.05 and p["B"] > 1 else 0)
    return p


def run_vlm(env, p):
    g = torch.Generator().manual_seed(p["data_seed"])
    values = rand_data(g, (sum(p["lengths"]),), torch.int64)
    offsets = _offsets(p["lengths"])
    env.set(p["tp"], p["cp"], p["rank"])

    def nested():
        return torch.nested.nested_tensor_from_jagged(values.clone(), offsets.clone())

    if p["kind"] == "vlm_thd":
        compare(p, vb.build_vlm_attn_mask_thd, env.util.build_vlm_attn_mask_thd,
                lambda: ((nested(), p["pad"]), {}, []), "build_vlm_attn_mask_thd")
        return
    compare(p, vb.build_vlm_attn_mask_bshd, env.util.build_vlm_attn_mask_bshd,
            lambda: ((nested(), p["batch_size"], p["pad"]), {"forced_max_seqlen": p["forced"]}, []),
            "build_vlm_attn_mask_bshd")


# kind: (draw, run, number of seeds)
KINDS = {
    "packed_pre": (draw_packed, run_packed, 150),
    "packed_post": (draw_packed, run_packed, 110),
    "dict_out": (draw_packed, run_packed, 40),
    "thd_pre": (draw_thd, run_thd, 240),
    "thd_post": (draw_thd, run_thd, 120),
    "bshd_engine_pre": (draw_bshd_engine, run_bshd_engine, 140),
    "bshd_engine_post": (draw_bshd_engine, run_bshd_engine, 90),
    "bshd_pre": (draw_bshd, run_bshd, 90),
    "bshd_post": (draw_bshd, run_bshd, 70),
    "vlm_thd": (draw_vlm, run_vlm, 40),
    "vlm_bshd": (draw_vlm, run_vlm, 50),
}
STUB_KINDS = {"packed_pre": 30, "thd_pre": 120, "thd_post": 80}


# --------------------------------------------------------------------------------------------
# Known differences from verl 0.9.1: (predicate on a drawn case, reason). A case they match is
# xfail(strict=True); each has a minimal reproducer in a test_known_* test below.

def verl_thd_padded(lengths, tp, cp, kw):
    """Padded lengths per verl 0.9.1's preprocess_thd_engine rules (to tell known cases apart)."""
    layout = kw.get("cp_layout", "zigzag")
    align = tp * cp * (2 if layout == "zigzag" and cp > 1 else 1)
    fp8 = kw.get("use_fp8_padding", False)
    if fp8:
        align, total_align = math.lcm(16, align), align * 128
    padded = [n + (-n) % align for n in lengths]
    if fp8:
        padded[-1] += (-sum(padded)) % total_align
    mlr = kw.get("min_local_rows")
    if mlr is not None and sum(padded) < cp * mlr:
        padded[-1] += cp * mlr - sum(padded)
    bucket = kw.get("pad_to_length_bucket")
    if bucket is not None and bucket > 0:
        total = math.lcm(bucket, cp)
        if fp8:
            total = math.lcm(total, total_align)
        padded[-1] += (-sum(padded)) % total
    return padded


def verl_bshd_width(p):
    """verl 0.9.1's padded width (before the CP split) of preprocess_bshd_engine."""
    tp, cp, B = p["tp"], p["cp"], p["B"]
    width = p["forced"] if p["forced"] is not None else max(p["lengths"])
    align = tp * cp * 2 if cp > 1 else tp
    width += (-width) % align
    if p["fp8"]:
        total = 128 * tp * cp
        step = math.lcm(total // math.gcd(B, total), align)
        width = -(-width // step) * step
    return width


def _thd(p, kinds):
    return p["kind"] in kinds and p["kw"]["cp_layout"] != "interleaved"


def _bucket_bad(p):
    return p["kw"].get("pad_to_length_bucket") is not None and p["kw"]["pad_to_length_bucket"] <= 0


def _unrepresentable(p):
    kw = p["kw"]
    if kw["cp_layout"] != "zigzag" or p["cp"] == 1:
        return False
    return any(n % (2 * p["cp"]) for n in verl_thd_padded(p["lengths"], p["tp"], p["cp"], kw))


# Known differences from verl 0.9.1, by name. Those the fuzz draws have a predicate on the drawn
# case (KNOWN): a case it matches is xfail(strict=True). Every one has a minimal reproducer in the
# test_known_* tests at the end of the file, xfail(strict=True) too.
REASONS = {
    "zigzag_unrepresentable": (
        "zigzag, cp > 1, min_local_rows / pad_to_length_bucket making the last padded length no "
        "multiple of 2*cp: ours raises RuntimeError('thd_layout_info: ...') in preprocess_thd_engine "
        "where verl returns rows, and ValueError in postprocess_thd_engine where verl raises a "
        "RuntimeError (docs/layout.md#invariants: a documented decision)"
    ),
    "empty_batch_roll": (
        "preprocess_thd_engine(need_roll=True), zigzag, cp > 1, every sequence empty: verl raises "
        "IndexError('index -1 is out of bounds for dimension 0 with size 0'), ours returns empty rows"
    ),
    "thd_post_batch_size": (
        "postprocess_thd_engine with batch_size != the nested batch's: ours raises ValueError, verl "
        "unpacks the first batch_size sequences (fewer) or raises IndexError('list index out of "
        "range') (more)"
    ),
    "thd_post_layout_mismatch": (
        "postprocess_thd_engine(cp_layout='contiguous') with the packed_seq_params of ours' zigzag "
        "preprocess: ours raises ValueError('... were built for ... cp_layout='zigzag' ...'), verl "
        "unpacks them as contiguous"
    ),
    "packed_post_validation": (
        "postprocess_packed_seqs with an output of more rows than the layout, batch_size below the "
        "mask's rows or seq_len above its columns: ours raises ValueError, verl returns (rows, "
        "batch_size) or raises IndexError (seq_len)"
    ),
    "packed_pre_mask_width": (
        "preprocess_packed_seqs with a mask narrower / wider than input_ids: ours "
        "ValueError('preprocess_thd: padded x must be ...'), verl IndexError('The shape of the mask "
        "... does not match ...')"
    ),
    "bshd_forced_short": (
        "preprocess_bshd_engine(forced_max_seqlen) whose aligned width is below the longest sequence: "
        "ours raises ValueError('ThdLayout.from_padded_offsets: ...'); verl raises RuntimeError (cp "
        "== 1) or truncates (cp > 1)"
    ),
    "bshd_post_mask_mismatch": (
        "postprocess_bshd with an original mask of other row counts or of another width than "
        "origin_seqlen: ours raises RuntimeError('postprocess_bshd: ...'); verl raises torch's "
        "RuntimeError / IndexError (or broadcasts)"
    ),
    "int_masks": (
        "0/1 integer attention masks: ours reads them as bool; verl indexes with them (integer "
        "indices), so it raises a shape RuntimeError or returns other rows "
        "(preprocess/postprocess_packed_seqs, preprocess/postprocess_bshd)"
    ),
}

# What the mismatch message of each known difference says (a known case that fails otherwise is an
# error, not an expected failure).
PATTERNS = {
    "zigzag_unrepresentable": r"zigzag with cp_size=\d+ needs every padded length to be a multiple of",
    "empty_batch_roll": r"verl raises IndexError: index -1 is out of bounds for dimension 0 with size 0; ours returns",
    "thd_post_batch_size": r"ours raises ValueError.{0,3}postprocess_thd_engine: input_ids has \d+ sequences but",
    "thd_post_layout_mismatch": r"postprocess_thd_engine: packed_seq_params were built for cp_size=",
    "packed_post_validation": r"postprocess_packed_seqs: (output has \d+ rows but|attention_mask has shape)",
    "packed_pre_mask_width": r"ours raises ValueError\('preprocess_thd: padded x must be .*verl raises IndexError",
    "bshd_forced_short": r"ours raises ValueError.*ThdLayout\.from_padded_offsets: cu_seqlens_padded does not fit",
    "bshd_post_mask_mismatch": r"ours raises RuntimeError\('postprocess_bshd: ",
    "int_masks": r"verl raises RuntimeError: .*; ours returns|elements differ",
}


def expect_known(names, fn, /, *args, **kwargs):
    """fn(*args); where `names` (known differences) apply, an AssertionError must be one of theirs."""
    try:
        return fn(*args, **kwargs)
    except AssertionError as e:
        if names and not any(re.search(PATTERNS[n], str(e), re.S) for n in names):
            raise RuntimeError(f"case of known difference {names} fails otherwise: {e}") from e
        raise


KNOWN = [
    ("zigzag_unrepresentable",
     lambda p, stub: (_thd(p, ["thd_pre"]) and not _bucket_bad(p) and _unrepresentable(p))
     or (_thd(p, ["thd_post"]) and p["post_process"] and _unrepresentable(p) and p["batch_size"] == p["B"])),
    ("empty_batch_roll",
     lambda p, stub: _thd(p, ["thd_pre"]) and p["kw"]["need_roll"] and p["pre_process"] and p["cp"] > 1
     and p["kw"]["cp_layout"] == "zigzag" and not _bucket_bad(p)
     and sum(verl_thd_padded(p["lengths"], p["tp"], p["cp"], p["kw"])) == 0),
    ("thd_post_batch_size", lambda p, stub: _thd(p, ["thd_post"]) and p["post_process"] and p["batch_size"] != p["B"]),
    ("packed_post_validation",
     lambda p, stub: p["kind"] == "packed_post" and p["post_process"]
     and (p["bad"] in ("rows", "seq_len") or (p["bad"] == "batch_size" and p["B"] > 1))),
    ("packed_pre_mask_width",
     lambda p, stub: p["kind"] == "packed_pre" and p["pre_process"]
     and (p["bad"] == "wide_mask" or (p["bad"] == "narrow_mask" and p["S"] > 0))),
    ("bshd_forced_short",
     lambda p, stub: p["kind"] == "bshd_engine_pre" and p["forced"] is not None
     and verl_bshd_width(p) < max(p["lengths"])),
    ("bshd_post_mask_mismatch",
     lambda p, stub: p["kind"] == "bshd_post" and p["post_process"]
     and (p["bad"] == "width" or (p["bad"] == "counts" and p["S"] > 0))),
]


def known_names(p, stub) -> list:
    return [name for name, applies in KNOWN if applies(p, stub)]


def known_difference(p, stub) -> str | None:
    return " | ".join(f"{name}: {REASONS[name]}" for name in known_names(p, stub)) or None


def _params(kinds, stub=False):
    out = []
    for kind, n in kinds.items():
        draw = KINDS[kind][0]
        for seed in range(n):
            reason = known_difference(draw(kind, seed, stub), stub)
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
            out.append(pytest.param(kind, seed, id=f"{kind}-{seed}", marks=marks))
    return out


@pytest.mark.parametrize("kind,seed", _params({k: v[2] for k, v in KINDS.items()}))
def test_fuzz(env, kind, seed):
    draw, run, _ = KINDS[kind]
    p = draw(kind, seed)
    expect_known(known_names(p, False), run, env, p)


# --------------------------------------------------------------------------------------------
# A megatron-core whose PackedSeqParams has cp_partition_mode (verl_stubs), verl's util.py executed
# against it: the contiguous CP layout with cp > 1, and cp_partition_mode in every PackedSeqParams.

_UTIL_CODE = {}


@pytest.fixture
def stub_env(real_verl, monkeypatch):  # noqa: F811
    verl_stubs.install_megatron_stub(monkeypatch, cp_partition_mode=True)
    path = real_verl.__file__
    if path not in _UTIL_CODE:
        with open(path) as f:
            _UTIL_CODE[path] = compile(f.read(), path, "exec")
    util = types.ModuleType("verl_fuzz_util_on_stub_megatron")
    util.__file__ = path
    exec(_UTIL_CODE[path], util.__dict__)  # noqa: S102  (the installed verl's util.py)
    assert util._PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE
    return Env(util, monkeypatch, sys.modules["megatron.core.parallel_state"])


@pytest.mark.parametrize("kind,seed", _params(STUB_KINDS, stub=True))
def test_fuzz_cp_partition_mode(stub_env, kind, seed):
    draw, run, _ = KINDS[kind]
    p = draw(kind, seed, stub=True)
    expect_known(known_names(p, True), run, stub_env, p)


# --------------------------------------------------------------------------------------------
# Minimal reproducers of the known differences (each fails now: xfail(strict=True)).


def known(name):
    """xfail(strict=True) for known difference `name`; the test's mismatch must be that one."""

    def mark(test):
        @functools.wraps(test)
        def wrapper(*args, **kwargs):
            return expect_known([name], test, *args, **kwargs)

        return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"{name}: {REASONS[name]}")(wrapper)

    return mark


def _nt(lengths, dtype=torch.int64):
    """Jagged nested batch whose tokens are 1, 2, 3, ... (in batch order)."""
    values = torch.arange(1, sum(lengths) + 1).to(dtype)
    return torch.nested.nested_tensor_from_jagged(values, _offsets(lengths))


def _same_call(env, what, ours, theirs, args, kwargs=None, **case):
    """compare() of one call on fresh copies of args (tensors cloned, nested rebuilt)."""

    def fresh(a):
        if isinstance(a, torch.Tensor):
            if a.is_nested:
                return torch.nested.nested_tensor_from_jagged(a.values().clone(), a.offsets().clone())
            return a.clone()
        return a

    compare(case, ours, theirs, lambda: (tuple(fresh(a) for a in args), dict(kwargs or {}), []), what)


# Were differences (fixed): ours said "megatron-core version" / "Upgrade megatron-core" where verl
# says "Megatron-core"; for pad_to_length_bucket <= 0 ours raised the layout's own ValueError (and,
# for contiguous cp > 1 without cp_partition_mode, that error first) where verl raises
# ValueError('pad_to_length_bucket must be a positive integer') first.
def test_contiguous_cp_message(env):
    env.set(tp=1, cp=2, rank=0)
    _same_call(env, "preprocess_thd_engine", vi.preprocess_thd_engine, env.util.preprocess_thd_engine,
               (_nt([1]),), {"cp_layout": "contiguous"})


@pytest.mark.parametrize("bucket,cp_layout,cp", [(0, "zigzag", 1), (-1, "zigzag", 1), (0, "contiguous", 2)])
def test_bucket_message(env, bucket, cp_layout, cp):
    env.set(tp=1, cp=cp, rank=0)
    _same_call(env, "preprocess_thd_engine", vi.preprocess_thd_engine, env.util.preprocess_thd_engine,
               (_nt([1]),), {"pad_to_length_bucket": bucket, "cp_layout": cp_layout})


@known("zigzag_unrepresentable")
@pytest.mark.parametrize("kw", [{"min_local_rows": 3}, {"pad_to_length_bucket": 3}], ids=["min_local_rows", "bucket"])
@pytest.mark.parametrize("rank", [0, 1])
def test_known_zigzag_unrepresentable_preprocess(env, kw, rank):
    # one token, tp 1, cp 2: verl pads the sequence to 6 rows (3 per rank); rank 0 gets [1, 0, 0]
    env.set(tp=1, cp=2, rank=rank)
    _same_call(env, "preprocess_thd_engine", vi.preprocess_thd_engine, env.util.preprocess_thd_engine,
               (_nt([1]),), kw)


@known("zigzag_unrepresentable")
def test_known_zigzag_unrepresentable_postprocess(env):
    env.set(tp=1, cp=2, rank=0)
    x = _nt([1])
    _, psp, _ = env.util.preprocess_thd_engine(x, pre_process=False, min_local_rows=3)  # cu_seqlens_padded [0, 6]
    outs = [torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[4.0, 5.0, 6.0]])]
    env.shards([outs], 0)
    # verl: RuntimeError (expanded size 1 vs 2); ours: ValueError (zigzag needs multiples of 4)
    _same_call(env, "postprocess_thd_engine", vi.postprocess_thd_engine, env.util.postprocess_thd_engine,
               (outs[0], psp, x, 1))


@known("empty_batch_roll")
@pytest.mark.parametrize("lengths", [[0], [0, 0]])
def test_known_empty_batch_roll(env, lengths):
    env.set(tp=1, cp=2, rank=0)
    _same_call(env, "preprocess_thd_engine", vi.preprocess_thd_engine, env.util.preprocess_thd_engine,
               (_nt(lengths),), {"need_roll": True})


@known("thd_post_batch_size")
@pytest.mark.parametrize("batch_size", [1, 3])
def test_known_thd_post_batch_size(env, batch_size):
    env.set(tp=1, cp=1, rank=0)
    x = _nt([1, 1])
    _, psp, _ = env.util.preprocess_thd_engine(x, pre_process=False)
    _same_call(env, "postprocess_thd_engine", vi.postprocess_thd_engine, env.util.postprocess_thd_engine,
               (torch.tensor([[1.0, 2.0]]), psp, x, batch_size))


@known("thd_post_layout_mismatch")
def test_known_thd_post_layout_mismatch(env):
    env.set(tp=1, cp=2, rank=0)
    x = _nt([2])
    _, psp, _ = vi.preprocess_thd_engine(x, pre_process=False)  # zigzag, cu_seqlens_padded [0, 4]
    outs = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])]
    env.shards([outs], 0)
    _same_call(env, "postprocess_thd_engine", vi.postprocess_thd_engine, env.util.postprocess_thd_engine,
               (outs[0], psp, x, 1), {"cp_layout": "contiguous"})


@known("packed_post_validation")
@pytest.mark.parametrize("bad", ["rows", "batch_size", "seq_len"])
def test_known_packed_post_validation(env, bad):
    env.set(tp=1, cp=1, rank=0)
    if bad == "rows":  # verl: [[1., 2.]] (the extra row ignored)
        mask, out, B, S = torch.tensor([[True, True]]), torch.tensor([[1.0, 2.0, 3.0]]), 1, 2
    elif bad == "batch_size":  # verl: [[1.]] (the second row dropped)
        mask, out, B, S = torch.tensor([[True], [True]]), torch.tensor([[1.0, 2.0]]), 1, 1
    else:  # verl: IndexError (mask [1] vs [2])
        mask, out, B, S = torch.tensor([[True]]), torch.tensor([[1.0]]), 1, 2
    _, psp = env.util.preprocess_packed_seqs(torch.zeros(mask.shape, dtype=torch.int64), mask)
    _same_call(env, "postprocess_packed_seqs", vi.postprocess_packed_seqs, env.util.postprocess_packed_seqs,
               (out, psp, mask, B, S))


@known("packed_pre_mask_width")
@pytest.mark.parametrize("mask", [[[True]], [[True, True, False]]], ids=["narrow", "wide"])
def test_known_packed_pre_mask_width(env, mask):
    env.set(tp=1, cp=1, rank=0)
    _same_call(env, "preprocess_packed_seqs", vi.preprocess_packed_seqs, env.util.preprocess_packed_seqs,
               (torch.tensor([[5, 6]]), torch.tensor(mask)))


@known("bshd_forced_short")
@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (2, 1)])
def test_known_bshd_forced_short(env, cp, rank):
    # one 5-token sequence, forced_max_seqlen=3: verl cp 1 RuntimeError;
    # cp 2 (width 4): rank 0 [[1, 4]], rank 1 [[2, 3]] (token 5 dropped)
    env.set(tp=1, cp=cp, rank=rank)
    _same_call(env, "preprocess_bshd_engine", vb.preprocess_bshd_engine, env.util.preprocess_bshd_engine,
               (_nt([5]),), {"forced_max_seqlen": 3})


@known("bshd_post_mask_mismatch")
@pytest.mark.parametrize(
    "orig,seq_len", [([[True, False, False]], 3), ([[True, True, False]], 4)], ids=["counts", "width"]
)
def test_known_bshd_post_mask_mismatch(env, orig, seq_len):
    env.set(tp=1, cp=1, rank=0)
    _same_call(env, "postprocess_bshd", vb.postprocess_bshd, env.util.postprocess_bshd,
               (torch.tensor([[1.0, 2.0]]), torch.tensor([[True, True]]), torch.tensor(orig), seq_len))


@known("int_masks")
@pytest.mark.parametrize("fn,cp", [("preprocess_packed_seqs", 1), ("preprocess_packed_seqs", 2),
                                   ("postprocess_packed_seqs", 1), ("preprocess_bshd", 1), ("postprocess_bshd", 1)])
def test_known_int_masks(env, fn, cp):
    env.set(tp=1, cp=cp, rank=0)
    x, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]])  # int64 0/1
    mod = vi if fn in ("preprocess_packed_seqs", "postprocess_packed_seqs") else vb
    if fn == "preprocess_packed_seqs":  # verl: cp 1 RuntimeError (3 rows into 2), cp 2 rank 0 [[5, 0]] (ours [[6, 0]])
        args = (x, mask)
    elif fn == "postprocess_packed_seqs":
        _, psp = env.util.preprocess_packed_seqs(x, mask.bool())
        args = (torch.tensor([[1.0, 2.0]]), psp, mask, 1, 3)
    elif fn == "preprocess_bshd":
        args = (x, mask, torch.tensor([[0, 1, 2]]))
    else:
        args = (torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 1]]), mask, 3)
    _same_call(env, fn, getattr(mod, fn), getattr(env.util, fn), args)
