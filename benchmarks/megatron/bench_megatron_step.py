"""One RL training step of a real megatron-core model: verl's THD path against verl_ops.

    python benchmarks/megatron/bench_megatron_step.py --out benchmarks/results_megatron_step.json
    python benchmarks/megatron/bench_megatron_step.py --sizes 2048 --reps 10 --no-profile
    python benchmarks/megatron/bench_megatron_step.py --tiny        # CPU smoke run (float32, hidden 64, 1 step)
    python benchmarks/megatron/bench_megatron_step.py --cpu         # both real sizes on the CPU, tiny batch, 1 step

Model: a DeepSeek-like ``GPTModel`` from megatron-core's local (non-TransformerEngine) layer specs
(tests/megatron_model_lib.py builds it): MLA with ``q_lora_rank``, ``kv_lora_rank`` 512, query/key
head dim 128 + 64 (rope) = 192, value head dim 128; 2 layers, the first dense, the second MoE
(8 experts, top-2, sigmoid router with expert bias, one shared expert, the all-to-all dispatcher,
no grouped GEMM); RMSNorm, rope, bf16, vocab 32768, attention and hidden dropout 0. Sizes:
hidden 2048 / 16 heads and hidden 4096 / 64 heads (the default), hidden 7168 / 128 heads (DeepSeek-V3's
attention, ``--sizes 7168``). One GPU: a world-1 NCCL group and
``parallel_state.initialize_model_parallel(1, 1)``.

Batch: RL-ragged, one micro-batch of ~30k tokens: 16-24 sequences, each a prompt (uniform in
[64, 512]) followed by a response (log-normal, median 900, sigma 0.9, clipped to [16, 4096]),
drawn with a fixed seed; the loss mask covers the responses, per-token advantages are random.

One step, as verl's model engine runs it (``verl/models/mcore/model_forward.py``,
``gptmodel_forward_model_engine``, and the Megatron engine's log-prob processor):
  pack      ``preprocess_thd_engine(input_ids)`` -> THD ``input_ids [1, T]`` + ``PackedSeqParams``,
            and ``preprocess_thd_engine(input_ids, need_roll=True)`` -> next-token labels
  forward   ``GPTModel(input_ids, position_ids=None, attention_mask=None, packed_seq_params)``
            -> logits ``[1, T, V]``
  log-probs ``-vocab_parallel_cross_entropy(logits, labels)`` (verl's
            ``vocab_parallel_log_probs_from_logits``); verl_ops' paths: its drop-in
            (``verl_ops.integrations.verl_logprob``, one pass over the logits)
  unpack    ``postprocess_thd_engine(log_probs)`` -> jagged ``[B, j]``
  loss      ``-sum(log_probs * advantages * response_mask) / sum(response_mask)``, backward

Paths (one model, so the same weights; between runs only the MLA core-attention modules, the
pack/unpack and log-prob functions and the megatron-core functions that ``megatron_mla.install`` replaced are
swapped — the latter found by comparing megatron-core's module and class attributes before and
after the model is built, and printed):
  verl      verl 0.9.1's own ``preprocess_thd_engine`` / ``postprocess_thd_engine`` (the installed
            verl's ``verl/models/mcore/util.py``) and Megatron's MLA THD path as verl runs it: V
            zero-padded to the query head dim (F.pad), torch's varlen FlashAttention
            (``aten::_flash_attention_forward`` / ``_flash_attention_backward``, the kernels
            TransformerEngine's flash backend would run) on q/k/v of head dim 192, the output
            trimmed back to 128 (on megatron-core >= 0.18 MultiLatentAttention pads and trims
            itself; before that verl's patch of its forward does)
  verl_fa4  verl's path as above on FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``,
            its own forward and backward) instead of torch's FlashAttention: the strongest path a
            verl user can run (an FA3-class kernel), V still padded to 192. Where flash-attn-4 is
            not importable (and on the CPU) the path is skipped with a printed note.
  verl_ops  ``verl_ops.integrations.verl.preprocess_thd_engine`` / ``postprocess_thd_engine`` and
            ``MLACoreAttention`` in every MLA slot (``megatron_mla.install(spec)``): V kept at 128,
            with whatever else ``install`` puts into megatron-core
  --te      the model from TransformerEngine's layer specs (``use_transformer_engine=True``, what
            verl builds) and, instead of verl_fa4, verl's path on TE's own ``TEDotProductAttention``
            as verl configures it: ``verl_te_flash`` (``attention_backend: flash``: whichever
            FlashAttention TE finds, FlashAttention-4 where flash-attn-4 is installed, with TE's
            causal window handed to FA4 as FA4 reads it: ``tests/megatron_model_lib.te_fa4_window_fix``;
            as shipped, TE 2.20.2 on FA4 4.0.0b36 attends to nothing) and ``verl_te_fused``
            (``fused``: cuDNN), V as megatron-core hands it (padded to 192 by MultiLatentAttention
            itself on >= 0.18, native 128 before)
Every path runs with ``verl_ops.integrations.megatron_compat.patch_megatron_core()`` applied: without
it megatron-core's MLA and MoE layers do not run without TransformerEngine.

Timing: each step is ``torch.cuda.synchronize()``-bracketed (the step has host reads of its
own: verl's packing functions read the lengths), wall clock and CUDA events around it; warm-up
3 steps, median of ``--reps`` (default 10); gradients set to None between steps (not timed).
The paths alternate in rounds, so drift in clocks hits them all (``--order blocked``: each path's
warm-up and timed steps back to back instead, as in training).

Host syncs (CUDA): one more step of each path under ``torch.cuda.set_sync_debug_mode("warn")``,
the warnings caught as they are issued and counted by the source file that made the call (the
innermost frame outside torch: verl's util.py, verl_ops' layout.py, megatron-core's MoE files ...).

Profile (``--profile``, default on, every size): torch.profiler over exactly one step of each path
(after an untraced one, between two synchronisations, so every kernel of the step and nothing else
is in the trace). GPU kernel time: the step's kernels, copies and memsets, summed; GPU busy: the
union of their intervals on the device timeline (overlapping streams count once); GPU idle: the
median step wall time minus busy (the profiler slows the host, not the kernels, so the traced
step's own wall time would overstate the idle time; it is printed beside). The GPU-side copies
of ``record_function`` ranges (user annotations) are not kernels: each spans the kernels of its
range, and summing them with the kernels (as this script once did) counted kernels two or three
times, a total above the step's wall time. Kernel time grouped by what launched it: attention
fwd / bwd (the attention op and its own
helper kernels), GEMMs, MoE routing / permute (router, dispatcher, the MoE layer's pre/post
processing), MLA rope (``apply_rotary_pos_emb``), MLA q/k concatenation (``torch.cat`` of the
no-rope and rope parts), V pad / output trim (copies inside the core attention, and
MultiLatentAttention's own pad of V on megatron-core >= 0.18, whose output-trim copy happens in a
later reshape and lands in other copies), other copies, elementwise / norm, log-prob loss, the
data path (pack / unpack), other. Backward kernels are grouped by the forward op that made
their autograd node (the profiler's sequence numbers); a kernel no op launched (FlashAttention-4's
CuTe DSL launches through the driver) goes by its name: attention, else other. Prints the paths
side by side and each path's top-10 non-GEMM kernels. Where the idle goes
(``idle_gaps.py``, from the same trace): the gaps between the device's busy intervals, the CUDA
runtime calls that overlapped them (a synchronisation, a cudaMalloc, a copy to the host), the time
before the first kernel and after the last, and for the longest gaps the op and ``bench::`` range
that launched the kernel after each. On a GPU with NVML (``gpu_clocks.py``): the SM clock, the
energy counter and the temperature sampled every 5 ms during each path's timed steps. A GPU at its
power limit lowers its clock as the step gets denser, so the same GEMMs run slower on a faster
path: the clock line says when a kernel-time difference is the clock's.

Output (at the end, after a few lines per size): the profile tables; a markdown table (size, path,
step ms median, speedup over verl and over verl_fa4, same results); per size, a markdown table
path | step (wall) | GPU kernel time | GPU idle | idle % | host syncs | attention kernels, with the
syncs by source file; and JSON to ``--out``. Before timing, each size runs every path once on the
same batch and compares per-token log-probs, loss and every parameter's gradient with verl's
(bf16 tolerance; the exit status is 1 on a mismatch or an error).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)
import verl_ops  # noqa: E402

common.use_tests_dir()
import megatron_model_lib as mml  # noqa: E402  (tests/megatron_model_lib.py: the model builder)
from common import device_line, sync  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_clocks  # noqa: E402  (the GPU's clock and power during each path's timed steps)
import idle_gaps  # noqa: E402  (where a traced step's GPU idle goes)

PATHS = ("verl", "verl_ops_cat", "verl_ops")
# The FA3-class peer: verl's path on FlashAttention-4, where flash-attn-4 is importable (CUDA).
FA4_PATH = "verl_fa4"
# Every path, in the order of the tables.
# verl_ops with Megatron's own q / k concatenation (VERL_OPS_MLA_LATENT=0): what the latent path
# (the attention reading q, kv and k_pe in place, RoPE on the way) saves.
CAT_PATH = "verl_ops_cat"
ALL_PATHS = ("verl", FA4_PATH, CAT_PATH, "verl_ops")
# --te: the model from TransformerEngine's specs (what verl builds), and verl's path with TE's own
# attention as verl configures it: attention_backend flash (whichever FlashAttention TE finds) or
# fused (cuDNN), V as megatron-core hands it.
TE_PATHS = {"verl_te_flash": "flash", "verl_te_fused": "fused"}
TE_ALL_PATHS = ("verl", *TE_PATHS, CAT_PATH, "verl_ops")

# hidden, heads, q_lora_rank, dense FFN, expert FFN, shared-expert FFN
SIZES = {
    2048: (2048, 16, 768, 5632, 1408, 1408),
    4096: (4096, 64, 1536, 11264, 2048, 2048),
    # DeepSeek-V3's attention and FFN dims (2 layers, 8 experts here): ~1.7B parameters
    7168: (7168, 128, 1536, 18432, 2048, 2048),
}


def model_size(hidden: int) -> "mml.ModelSize":
    h, heads, q_lora, ffn, moe_ffn, shared = SIZES[hidden]
    return mml.ModelSize(
        hidden=h, heads=heads, q_lora_rank=q_lora, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, ffn_hidden=ffn, moe_ffn_hidden=moe_ffn, shared_expert_hidden=shared, experts=8,
        topk=2, vocab=32768, max_seq=8192,
    )


def tiny_size() -> "mml.ModelSize":
    import dataclasses

    return dataclasses.replace(mml.SIZES["tiny"], hidden=64, max_seq=1024)


# --------------------------------------------------------------------------------------------
# verl's MLA core attention: V padded to the query head dim, varlen FlashAttention, output trimmed.


class _FlashVarlen(torch.autograd.Function):
    """Causal varlen FlashAttention on THD rows (torch's ``aten::_flash_attention_forward`` /
    ``_flash_attention_backward``, as ``torch.nn.attention.varlen`` calls them); q, k, v share
    their head dim (here 192, V zero-padded)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.meta = (max_seqlen, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        max_seqlen, scale = ctx.meta
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen, 0.0, True, rng_state,
            unused, scale=scale,
        )
        return dq, dk, dv, None, None, None


def _causal_per_sequence(q, k, v, cu, scale):
    """CPU stand-in for the varlen flash kernel (no flash on the CPU): one causal SDPA per sequence."""
    bounds = cu.tolist()
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            parts.append(o.transpose(0, 1))
    tail = q.shape[0] - bounds[-1]
    if tail > 0:
        parts.append(q.new_zeros(tail, q.shape[1], v.shape[-1]))
    return torch.cat(parts)


class VerlFlashMLACoreAttention(mml.CoreAttentionArguments):
    """Megatron's MLA core attention on the THD path as verl runs it: V zero-padded to the
    query head dim, varlen FlashAttention, output trimmed back to the value head dim.

    Constructor and forward as Megatron's core attentions (``MLACoreAttention``'s). On
    megatron-core >= 0.18 MultiLatentAttention hands it V already padded and trims the output
    itself (it then returns ``[t, n * Dqk]``); on older releases it pads and trims here, which is
    what verl's patch of ``MultiLatentAttention.forward`` does around the core attention.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_size_per_attention_head_v = self.v_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            raise NotImplementedError("VerlFlashMLACoreAttention: THD batches only")
        if query.dim() == 4:  # [t, 1, n, d]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        dqk, dv = query.shape[-1], value.shape[-1]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dqk)
        vp = F.pad(value, (0, dqk - dv)) if dv < dqk else value
        cu = packed_seq_params.cu_seqlens_q
        out = self.attend(query, key, vp, cu, int(packed_seq_params.max_seqlen_q), float(scale))
        if dv < dqk:
            out = out[..., :dv]
        return out.reshape(out.shape[0], -1)

    @staticmethod
    def attend(q, k, v, cu, max_seqlen, scale):
        """Causal varlen attention of THD rows whose q, k, v share their head dim."""
        if q.is_cuda:
            return _FlashVarlen.apply(q, k, v, cu, max_seqlen, scale)
        return _causal_per_sequence(q, k, v, cu, scale)


@functools.lru_cache(maxsize=None)
def fa4_varlen():
    """FlashAttention-4's varlen function (``flash_attn.cute.flash_attn_varlen_func``), or None with
    the reason when flash-attn-4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (not installed, or its CUDA DSL cannot load)
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_varlen_func, None


class VerlFA4MLACoreAttention(VerlFlashMLACoreAttention):
    """verl's MLA THD path on FlashAttention-4 (the FA3-class peer a verl user can run): V
    zero-padded to the query head dim, ``flash_attn.cute.flash_attn_varlen_func`` (its own
    autograd) on q / k / v of head dim 192, output trimmed back; as verl_ops' ``backend="fa4"``
    calls it (verl_ops/_mla.py), on the offsets and longest sequence of verl's PackedSeqParams."""

    @staticmethod
    def attend(q, k, v, cu, max_seqlen, scale):
        func, why = fa4_varlen()
        if func is None:
            raise RuntimeError(f"VerlFA4MLACoreAttention: flash-attn-4 is not importable ({why})")
        out = func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                   max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------------
# The batch.


def rl_batch_lengths(seed=0, tokens=30 * 1024, prompt=(64, 512), median=900, sigma=0.9, lo=16, hi=4096,
                     n_min=16, n_max=24):
    """(prompt lengths, response lengths): prompts uniform in ``prompt``, responses log-normal
    (median, sigma) clipped to [lo, hi], drawn until the batch holds ``tokens`` (the last response
    cut to fit, the n_max-th takes what is left up to ``hi``); under n_min sequences, the longest
    response is split in two (same prompt) until there are n_min."""
    r = random.Random(seed)
    prompts, responses, total = [], [], 0
    while total < tokens and len(prompts) < n_max:
        p = r.randint(*prompt)
        resp = min(hi, max(lo, int(round(r.lognormvariate(math.log(median), sigma)))))
        if total + p + resp > tokens or len(prompts) == n_max - 1:
            resp = max(lo, min(hi, tokens - total - p))
        prompts.append(p)
        responses.append(resp)
        total += p + resp
    while len(prompts) < n_min:  # too few: split the longest sequence
        i = max(range(len(prompts)), key=lambda j: responses[j])
        half = max(lo, responses[i] // 2)
        responses[i] = half
        prompts.append(prompts[i])
        responses.append(half)
    return prompts, responses


def tiny_lengths(seed=0):
    r = random.Random(seed)
    prompts = [r.randint(2, 8) for _ in range(5)]
    responses = [r.randint(3, 40) for _ in range(5)]
    responses[2] = 1
    return prompts, responses


class Batch:
    def __init__(self, prompts, responses, vocab, device, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = [p + r for p, r in zip(prompts, responses)]
        offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
        total = int(offsets[-1])
        mask = torch.zeros(total)
        for i, p in enumerate(prompts):
            mask[offsets[i] + p : offsets[i + 1]] = 1.0
        ids = torch.randint(0, vocab, (total,), generator=g)
        adv = torch.randn(total, generator=g)
        self.prompts, self.responses, self.lengths = list(prompts), list(responses), lengths
        self.tokens = total
        dev_offsets = offsets.to(device)
        self.input_ids = torch.nested.nested_tensor_from_jagged(ids.to(device), dev_offsets)
        self.mask = mask.to(device)
        self.adv = adv.to(device)
        self.mask_sum = float(mask.sum())


# --------------------------------------------------------------------------------------------
# The step.


def load_verl_pack():
    """verl 0.9.1's own functions (``verl/models/mcore/util.py`` of the installed verl, loaded
    without verl's heavy imports: tests/verl_stubs.py)."""
    return mml.verl_pack()


_PRELOAD = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.tensor_parallel.cross_entropy",
)


_MISSING = object()


def megatron_globals():
    """{(module, class or None, name): value} over megatron-core's loaded modules and the classes
    they define: what ``megatron_mla.install`` may patch (a module function, a class method)."""
    import importlib

    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (a module this release lacks)
            pass
    out = {}
    for mname, mod in list(sys.modules.items()):
        if mod is None or not (mname == "megatron" or mname.startswith("megatron.")):
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            out[(mname, None, k)] = v
            if isinstance(v, type) and getattr(v, "__module__", None) == mname:
                for ck, cv in list(vars(v).items()):
                    out[(mname, k, ck)] = cv
    return out


def patches_between(before, after):
    """[(module, class, name, old, new)]: the megatron-core functions that verl_ops replaced
    between two :func:`megatron_globals` (a name that was not there maps to ``_MISSING``)."""
    out = []
    for key, new in after.items():
        old = before.get(key, _MISSING)
        if old is new or key[2].startswith("__"):
            continue
        fn = getattr(new, "__func__", new)  # staticmethod / classmethod
        if str(getattr(fn, "__module__", "") or "").startswith("verl_ops"):
            out.append((*key, old, new))
    return out


def _set_global(mname, cls, name, value):
    owner = sys.modules[mname]
    if cls is not None:
        owner = getattr(owner, cls)
    if value is _MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


class Step:
    """One model, every path: ``use(path)`` swaps the MLA core attentions, the pack functions
    and the megatron-core functions that ``megatron_mla.install`` patched (``patches``: the verl
    paths run megatron-core as released, plus only the fixes without which it does not run
    without TransformerEngine, applied before the snapshot)."""

    def __init__(self, model, config, device, patches=(), paths=PATHS):
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        self.model, self.config, self.device = model, config, device
        self.mlas = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
        if not self.mlas:
            raise RuntimeError("the model has no MultiLatentAttention")
        self.cores = {"verl_ops": [m.core_attention for m in self.mlas]}
        verl_pack = load_verl_pack()
        self.packs = {"verl_ops": mml.verl_ops_pack()}
        if CAT_PATH in paths:
            self.cores[CAT_PATH], self.packs[CAT_PATH] = self.cores["verl_ops"], self.packs["verl_ops"]
        for path, cls in (("verl", VerlFlashMLACoreAttention), (FA4_PATH, VerlFA4MLACoreAttention)):
            if path not in paths:
                continue
            self.cores[path] = []
            self.packs[path] = verl_pack
            for m, ours in zip(self.mlas, self.cores["verl_ops"]):
                scale = getattr(ours, "softmax_scale", None)
                if scale is None:
                    scale = getattr(m, "softmax_scale", None)
                self.cores[path].append(cls(
                    config=m.config, layer_number=getattr(ours, "layer_number", 1),
                    attn_mask_type=getattr(ours, "attn_mask_type", None),
                    attention_type=getattr(ours, "attention_type", "self"), softmax_scale=scale,
                    k_channels=getattr(ours, "k_channels", None),
                    v_channels=getattr(ours, "v_channels", None),
                ))
        te_paths = [p for p in paths if p in TE_PATHS]
        if te_paths:
            # TE's own core attention, built as MultiLatentAttention builds its own (one module per
            # layer serves both backends: the backend is chosen per call, by the environment)
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            te_cores = [TEDotProductAttention(
                config=m.config, layer_number=m.layer_number, attn_mask_type=m.attn_mask_type,
                attention_type=m.attention_type, softmax_scale=m.softmax_scale, k_channels=m.q_head_dim,
                v_channels=m.config.v_head_dim, cp_comm_type=getattr(ours, "cp_comm_type", None) or "p2p",
                pg_collection=getattr(m, "pg_collection", None),
            ) for m, ours in zip(self.mlas, self.cores["verl_ops"])]
            for path in te_paths:
                self.cores[path], self.packs[path] = te_cores, verl_pack
        self.paths = [p for p in paths if p in self.cores]
        self._te_env = None
        self.patches = list(patches)
        self.path = None
        from megatron.core import tensor_parallel

        from verl_ops.integrations.verl_logprob import vocab_parallel_log_probs_from_logits

        cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
        # verl's vocab_parallel_log_probs_from_logits is -cross_entropy; verl_ops' paths run the drop-in.
        self.log_probs = {path: (vocab_parallel_log_probs_from_logits if path in ("verl_ops", CAT_PATH)
                                 else (lambda logits, labels: -cross_entropy(logits, labels)))
                          for path in self.paths}

    def use(self, path):
        if self._te_env is not None:  # leave the previous TE path's backend
            self._te_env.__exit__(None, None, None)
            self._te_env = None
        if path in TE_PATHS:
            self._te_env = mml.te_attention(TE_PATHS[path])
            self._te_env.__enter__()
        for m, core in zip(self.mlas, self.cores[path]):
            m.core_attention = core
        for mname, cls, name, old, new in self.patches:
            _set_global(mname, cls, name, new if path in ("verl_ops", CAT_PATH) else old)
        os.environ["VERL_OPS_MLA_LATENT"] = "0" if path == CAT_PATH else "1"
        self.path = path

    def patch_names(self):
        return [f"{m}.{c + '.' if c else ''}{n}" for m, c, n, _, _ in self.patches]

    def __call__(self, batch, backward=True):
        pack = self.packs[self.path]
        with mml.megatron_device(self.device):
            with torch.profiler.record_function("bench::pack"):
                input_ids, psp, _ = pack.preprocess_thd_engine(batch.input_ids, pre_process=True)
                labels = pack.preprocess_thd_engine(batch.input_ids, pre_process=True, need_roll=True)[0]
            logits = self.model(
                input_ids=input_ids.contiguous(), position_ids=None, attention_mask=None,
                packed_seq_params=psp,
            )
            with torch.profiler.record_function("bench::logprob"):
                log_probs = self.log_probs[self.path](logits, labels.contiguous())  # [1, T]
            with torch.profiler.record_function("bench::unpack"):
                out = pack.postprocess_thd_engine(log_probs, psp, batch.input_ids, len(batch.lengths))
            with torch.profiler.record_function("bench::loss"):
                values = out.values() if out.is_nested else out
                loss = -(values * batch.adv * batch.mask).sum() / batch.mask_sum
            if backward:
                loss.backward()
        return loss.detach(), values.detach()


def time_paths(step, batches, paths, reps, warmup, device, order="alternate"):
    """Median step time per path (ms): wall clock between synchronisations, and CUDA events.
    ``order="alternate"``: the paths alternate in rounds (all warm-ups first); round r runs
    ``batches[r % len]`` on every path. ``"blocked"``: each path's warm-up and timed steps back
    to back, one path after the other (as in training, where a GPU under its power
    limit clocks each path by that path's own draw); step r still runs ``batches[r % len]``."""
    model = step.model

    def warm(path):
        step.use(path)
        for i in range(max(warmup, len(batches) if warmup else 0)):
            model.zero_grad(set_to_none=True)
            step(batches[i % len(batches)])
        sync(device)

    if order == "alternate":
        for path in paths:
            warm(path)
        schedule = [(r, path) for r in range(reps) for path in (paths if r % 2 == 0 else paths[::-1])]
    elif order == "blocked":
        schedule = [(r, path) for path in paths for r in range(reps)]
    else:
        raise ValueError(f"time_paths: order must be 'alternate' or 'blocked', got {order!r}")
    wall = {p: [] for p in paths}
    events = {p: [] for p in paths}
    # The caching allocator's device calls during the timed steps, per path: a cudaMalloc /
    # cudaFree (and a retry after freeing the cache) makes the host wait for the GPU, which the
    # sync count (set_sync_debug_mode) does not see but the GPU idle does.
    alloc = {p: {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0} for p in paths}

    def allocator_counts():
        if device.type != "cuda":
            return (0, 0, 0)
        m = torch.cuda.memory_stats(device)
        return (m.get("num_device_alloc", 0), m.get("num_device_free", 0), m.get("num_alloc_retries", 0))

    # the GPU's SM clock / energy during each path's timed steps (NVML; .ok is False on the CPU)
    clocks = gpu_clocks.ClockSampler(device).start()
    try:
        for r, path in schedule:
            if order == "blocked" and r == 0:
                warm(path)
            step.use(path)
            model.zero_grad(set_to_none=True)
            sync(device)
            if device.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            before = allocator_counts()
            t0 = time.perf_counter()
            step(batches[r % len(batches)])
            if device.type == "cuda":
                e1.record()
            sync(device)
            t1 = time.perf_counter()
            wall[path].append((t1 - t0) * 1e3)
            clocks.window(path, t0, t1)
            for key, b, a in zip(alloc[path], before, allocator_counts()):
                alloc[path][key] += a - b
            if device.type == "cuda":
                events[path].append(e0.elapsed_time(e1))
    finally:
        clocks.stop()
    clock_summary = clocks.summary() if clocks.ok else {}
    out = {}
    for p in paths:
        out[p] = {
            "clocks": ({**clock_summary[p], **clock_summary["_device"]} if p in clock_summary else None),
            "wall_ms": statistics.median(wall[p]),
            "wall_ms_all": wall[p],
            "event_ms": statistics.median(events[p]) if events[p] else None,
            # summed over the timed steps
            "allocator": alloc[p],
        }
    return out


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    nb = float(b.norm())
    return float((a - b).norm()) / nb if nb > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


def run_checked(step, batch, path):
    """(loss, per-token log-probs, {parameter: gradient}) of one step of ``path``."""
    step.use(path)
    step.model.zero_grad(set_to_none=True)
    loss, lp = step(batch)
    grads = {
        n: p.grad.detach().float().clone() for n, p in step.model.named_parameters() if p.grad is not None
    }
    step.model.zero_grad(set_to_none=True)
    return float(loss), lp.float(), grads


def check_paths(step, batch, dtype, path="verl_ops", base=None):
    """``path`` against verl's path on the same batch: per-token log-probs, the loss, and the
    gradients of every parameter (relative L2 difference; the attention parameters' and the worst
    of all). ``base``: verl's result when already run. Returns (ok, dict of differences)."""
    l0, lp0, g0 = base if base is not None else run_checked(step, batch, "verl")
    l1, lp1, g1 = run_checked(step, batch, path)
    lp_abs = float((lp1 - lp0).abs().max()) if lp0.numel() else 0.0
    lp_mean = float((lp1 - lp0).abs().mean()) if lp0.numel() else 0.0
    errs = {n: _rel_l2(g1[n], g0[n]) for n in g0 if n in g1}
    worst = max(errs, key=errs.get) if errs else None
    mla = [e for n, e in errs.items() if "self_attention" in n]
    loss_err = abs(l1 - l0) / max(abs(l0), 1e-12)
    if dtype == torch.float32:
        close = lp_abs < 1e-4 and max(errs.values(), default=0.0) < 1e-4
    else:
        # bf16: the attention kernels round differently, and a token whose router scores are near a
        # tie may pick other experts on the two paths (its expert gradients then differ): judged
        # by the mean log-prob difference and the attention parameters' gradients; the worst
        # parameter of all is reported.
        close = lp_mean < 0.02 and max(mla, default=0.0) < 0.1
    ok = set(g0) == set(g1) and math.isfinite(l0 + l1) and close
    return ok, {
        "loss_verl": l0, f"loss_{path}": l1, "loss_rel_err": loss_err, "logprob_max_abs_diff": lp_abs,
        "logprob_mean_abs_diff": lp_mean,
        "grad_rel_l2_max": errs.get(worst, 0.0), "grad_rel_l2_worst_param": worst,
        "grad_rel_l2_attention_max": max(mla, default=0.0),
    }


# --------------------------------------------------------------------------------------------
# Profile.

CATEGORIES = (
    "attention fwd", "attention bwd", "GEMM", "MoE routing / permute", "MLA rope", "MLA q/k concat",
    "V pad / output trim", "other copies", "elementwise / norm", "log-prob loss", "data path (pack / unpack)",
    "other",
)
# Ops whose own kernels are the attention (the forward / backward op, or verl_ops' op with its
# helper kernels); a kernel counts as attention when one of these is on its op stack.
_ATTN_OPS = re.compile(r"aten::_flash_attention|aten::_efficient_attention|aten::_cudnn_attention"
                       r"|aten::_scaled_dot_product|verl_ops::mla_forward|verl_ops::mla_backward|verl_ops::mla_latent|flash_attn"
                       r"|torch_attn::", re.I)
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul",
             "aten::_scaled_mm", "aten::addmv", "aten::mv", "aten::addbmm"}
_GEMM_KERNEL = re.compile(r"gemm|nvjet|cublas|splitKreduce|xmma", re.I)
_COPY_OPS = {
    "aten::" + n for n in (
        "copy_", "cat", "clone", "contiguous", "constant_pad_nd", "pad", "_to_copy", "to", "stack",
        "slice_scatter", "select_scatter", "index_put_", "_index_put_impl_", "index", "index_select",
        "gather", "scatter", "scatter_", "scatter_add_", "new_zeros", "zeros", "zero_", "fill_", "roll",
        "repeat", "expand_copy", "narrow_copy", "masked_scatter_", "index_add_", "_unsafe_index",
    )
}
_COPY_KERNEL = re.compile(r"copy|CatArray|Memcpy|Memset|fill|index|scatter|gather", re.I)
_ELEMENTWISE_KERNEL = re.compile(
    r"elementwise|vectorized|reduce|norm|softmax|unrolled|pointwise|activation|silu|sigmoid|where|compare",
    re.I,
)
_LABELS = ("bench::pack", "bench::unpack", "bench::logprob", "bench::loss", "bench::moe_route", "bench::rope",
           "bench::mla_qkv", "bench::core_attention", "bench::v_pad")


# MoELayer's and its token dispatcher's steps other than the experts' own compute (whichever exist).
_MOE_LAYER_STEPS = ("route", "preprocess", "dispatch", "combine", "postprocess", "router_and_preprocess")
_DISPATCHER_STEPS = (
    "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess", "token_combine",
    "combine_postprocess", "token_permutation", "token_unpermutation",
)


@contextlib.contextmanager
def profile_labels(step):
    """record_function ranges around the parts of the model that the profile groups by (undone on
    exit): MLA's rope and q/k/v construction, the core attentions, MoE routing / dispatch."""
    from megatron.core.transformer import multi_latent_attention as mla_mod
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    undo = []

    def wrap(owner, name, label):
        original = vars(owner).get(name)  # None: a method of the class, shadowed below
        bound = getattr(owner, name, None)
        if bound is None:
            return

        @functools.wraps(bound)
        def wrapper(*a, **k):
            with torch.profiler.record_function(label):
                return bound(*a, **k)

        setattr(owner, name, wrapper)
        if original is None:  # instance attribute shadowing a method
            undo.append(lambda: delattr(owner, name))
        else:
            undo.append(lambda: setattr(owner, name, original))

    wrap(mla_mod, "apply_rotary_pos_emb", "bench::rope")
    wrap(mla_mod, "_prepare_mla_core_attention_value", "bench::v_pad")
    for m in step.mlas:
        wrap(m, "get_query_key_value_tensors", "bench::mla_qkv")
    cores = [c for cs in step.cores.values() for c in cs]
    for c in cores:
        wrap(c, "forward", "bench::core_attention")
    for mod in step.model.modules():
        if isinstance(mod, TopKRouter):
            wrap(mod, "forward", "bench::moe_route")
        elif isinstance(mod, MoELayer):
            for name in _MOE_LAYER_STEPS:
                wrap(mod, name, "bench::moe_route")
            disp = getattr(mod, "token_dispatcher", None)
            if disp is not None:
                for name in _DISPATCHER_STEPS:
                    wrap(disp, name, "bench::moe_route")
    try:
        yield
    finally:
        for f in reversed(undo):
            f()


def _chain(evt):
    names = []
    e = evt
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


def device_activities(prof):
    """The GPU's own work in a trace, as ``[(start_us, end_us, name)]``: kernels, memcpys and
    memsets. Left out: the GPU-side copies of ``record_function`` ranges (Kineto's
    gpu_user_annotation events, ``is_user_annotation``), which span the kernels launched inside
    the range on the device timeline; summed with the kernels, they count those kernels twice
    (and a range inside another three times), which is how the table used to add up to more than
    the step."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or _is_annotation(e):
            continue
        out.append((e.time_range.start, e.time_range.end, e.name))
    return out


def _is_annotation(e) -> bool:
    return (bool(getattr(e, "is_user_annotation", False)) or e.name in _LABELS
            or e.name.startswith("ProfilerStep"))


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end, ...)`` intervals: the time the device had work, each
    instant counted once however many kernels ran in it (streams overlap)."""
    busy, end = 0.0, None
    for s, e, *_ in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


_ATTN_KERNEL = re.compile(r"flash|fmha|mla_sm90|attention", re.I)


def classify_profile(prof):
    """{category: us}, [(kernel name, category, us)], total device us, attributed us, busy us.

    Each device activity counts once: through the op that launched it (its CPU event's kernels,
    annotation ranges left out), or, where no op is linked (a kernel launched through the driver,
    as FlashAttention-4's CuTe DSL does), by its own name: attention kernels by theirs, the rest
    as 'other'."""
    from torch.autograd import DeviceType

    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    activities = device_activities(prof)
    annotations = set(_LABELS) | {e.name for e in events if e.device_type != DeviceType.CPU and _is_annotation(e)}
    # Forward ops (and custom autograd functions) by sequence number -> the innermost label they
    # ran under; backward nodes carry the same sequence number.
    seq_label = {}
    seq_op = {}
    for e in cpu:
        if e.sequence_nr is None or e.sequence_nr < 0 or e.name.startswith("autograd::engine"):
            continue
        if "Backward" in e.name or "backward" in e.name:
            continue
        chain = _chain(e)
        if any(n.startswith("autograd::engine::evaluate_function") for n in chain):
            continue  # an op of the backward pass
        label = next((n for n in chain if n in _LABELS), None)
        key = (e.fwd_thread if e.fwd_thread else e.thread, e.sequence_nr)
        if label is not None and key not in seq_label:
            seq_label[key] = label
        seq_op.setdefault(key, e.name)

    cat_us = collections.Counter()
    per_kernel = collections.Counter()  # (kernel name, category) -> us
    linked = collections.Counter()  # kernel name -> us attributed through an op
    attributed = 0.0
    for e in cpu:
        kernels = [k for k in (getattr(e, "kernels", None) or []) if k.name not in annotations]
        if not kernels:
            continue
        # kernels of this op only (children's kernels are listed on the children)
        chain = _chain(e)
        backward = any(n.startswith("autograd::engine::evaluate_function") for n in chain)
        label = next((n for n in chain if n in _LABELS), None)
        fwd_op = None
        if backward:
            for a in _iter_parents(e):
                if a.name.startswith("autograd::engine::evaluate_function") or "Backward" in a.name:
                    key = (a.fwd_thread if a.fwd_thread else a.thread, a.sequence_nr)
                    if a.sequence_nr is not None and a.sequence_nr >= 0 and key in seq_label:
                        label = seq_label[key]
                        fwd_op = seq_op.get(key)
                        break
                    if a.sequence_nr is not None and a.sequence_nr >= 0 and key in seq_op:
                        fwd_op = seq_op[key]
        for k in kernels:
            us = float(k.duration)
            cat = _category(k.name, e.name, chain, label, backward, fwd_op)
            cat_us[cat] += us
            per_kernel[(k.name, cat)] += us
            linked[k.name] += us
            attributed += us
    by_name = collections.Counter()
    for s, e, name in activities:
        by_name[name] += e - s
    total = float(sum(by_name.values()))
    for name, us in by_name.items():
        rest = us - linked.get(name, 0.0)
        if rest <= 1e-3:
            continue
        if _ATTN_KERNEL.search(name):
            cat = "attention bwd" if re.search(r"bwd|backward|dq|dkv", name, re.I) else "attention fwd"
        else:
            cat = "other"
        cat_us[cat] += rest
        per_kernel[(name, cat)] += rest
    top = [(n, c, us) for (n, c), us in per_kernel.most_common()]
    return dict(cat_us), top, total, attributed, busy_us(activities)


def _iter_parents(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def _category(kernel, op, chain, label, backward, fwd_op):
    """The category of one kernel: ``op`` launched it, ``chain`` is the op stack (innermost first),
    ``label`` the innermost ``bench::`` range (for backward kernels: that of the forward op whose
    autograd node runs them), ``fwd_op`` that forward op's name."""
    # The latent path's RoPE and its backward's assembly (the rope columns of dq turned back in
    # place, k_pe's gradient summed over the heads) run inside the core attention: MLA rope.
    if op == "verl_ops::mla_rope" or (any("_LatentAttention" in n for n in chain)
                                      and not any(_ATTN_OPS.search(n) for n in chain)):
        return "MLA rope"
    # (by the kernel's name too: FlashAttention-4's kernels run under no op of their own, only the
    # core attention's range and, backward, its autograd node)
    if any(_ATTN_OPS.search(n) for n in chain) or _ATTN_KERNEL.search(kernel):
        return "attention bwd" if backward else "attention fwd"
    if op in _GEMM_OPS or (_GEMM_KERNEL.search(kernel) and not _COPY_KERNEL.search(kernel)):
        return "GEMM"
    if label in ("bench::pack", "bench::unpack"):
        return "data path (pack / unpack)"
    if label == "bench::moe_route":
        return "MoE routing / permute"
    if label == "bench::rope":
        return "MLA rope"
    copy = op in _COPY_OPS or bool(_COPY_KERNEL.search(kernel)) or fwd_op in _COPY_OPS
    if label == "bench::mla_qkv" and (op == "aten::cat" or fwd_op == "aten::cat" or "CatArray" in kernel):
        return "MLA q/k concat"
    if label in ("bench::core_attention", "bench::v_pad") and copy:
        return "V pad / output trim"
    if label in ("bench::logprob", "bench::loss"):
        return "log-prob loss"
    if copy:
        return "other copies"
    if _ELEMENTWISE_KERNEL.search(kernel):
        return "elementwise / norm"
    return "other"


def profile_path(step, batch, path):
    """torch.profiler over exactly one step of ``path`` (after one untraced step), between two
    synchronisations, so that every kernel of the step and nothing else is in the trace: the
    step's GPU kernel time by category, its total, and the time the GPU was busy (the union of
    the kernels' intervals)."""
    from torch.profiler import ProfilerActivity, profile

    step.use(path)
    step.model.zero_grad(set_to_none=True)
    step(batch)
    step.model.zero_grad(set_to_none=True)
    sync(step.device)
    with profile_labels(step):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step(batch)
            sync(step.device)
            wall_ms = (time.perf_counter() - t0) * 1e3
    cats, top, total, attributed, busy = classify_profile(prof)
    ms = 1e-3
    try:  # (the table stands without it)
        idle = idle_gaps.from_profiler(prof, skip=set(_LABELS))
    except Exception as e:  # noqa: BLE001
        idle = {"error": f"{type(e).__name__}: {e}"}
    return {
        "idle": idle,
        "categories_ms": {c: cats.get(c, 0.0) * ms for c in CATEGORIES},
        "kernel_ms_total": total * ms,
        "kernel_ms_attributed": attributed * ms,
        "busy_ms": busy * ms,
        "profiled_step_wall_ms": wall_ms,
        "attention_ms": (cats.get("attention fwd", 0.0) + cats.get("attention bwd", 0.0)) * ms,
        "top_kernels": [{"kernel": n, "category": c, "ms": us * ms} for n, c, us in top[:40]],
    }


def print_profile(size_label, profiles, times=None):
    """The category table (every path side by side, with each path's time over verl_ops') and one
    table of each path's top-10 non-GEMM kernels."""
    print(f"\n### GPU kernel time of one step, {size_label} (ms; torch.profiler over one step)\n")
    paths = list(profiles)
    others = [p for p in paths if p != "verl_ops"] if "verl_ops" in paths else []
    print("| category | " + " | ".join(paths) + "".join(f" | {p} / verl_ops" for p in others) + " |")
    print("|---|" + "---:|" * (len(paths) + len(others)))

    def ratios(vals):
        ours = vals.get("verl_ops", 0.0)
        return "".join(f" | {vals[p] / ours:.2f}" if ours > 1e-3 else " | -" for p in others)

    for c in CATEGORIES:
        vals = {p: profiles[p]["categories_ms"][c] for p in paths}
        print(f"| {c} | " + " | ".join(f"{vals[p]:.2f}" for p in paths) + ratios(vals) + " |")
    tot = {p: profiles[p]["kernel_ms_total"] for p in paths}
    print("| **total kernel time** | " + " | ".join(f"**{tot[p]:.2f}**" for p in paths) + ratios(tot) + " |")
    busy = {p: profiles[p]["busy_ms"] for p in paths}
    print("| GPU busy (union of the kernels' intervals) | " + " | ".join(f"{busy[p]:.2f}" for p in paths)
          + ratios(busy) + " |")
    for p in paths:
        pr = profiles[p]
        line = (f"{p}: {pr['kernel_ms_attributed']:.2f} of {pr['kernel_ms_total']:.2f} ms of kernel time "
                f"traced to the op that launched it (the rest by kernel name: attention, else 'other'); "
                f"the traced step took {pr['profiled_step_wall_ms']:.1f} ms")
        if times and p in times:
            step_ms = times[p]["wall_ms"]
            line += f"; the GPU is busy {100 * pr['busy_ms'] / step_ms:.0f}% of the {step_ms:.1f} ms step"
        print(line)
    print(f"\n### Top-10 non-GEMM kernels per path, {size_label}\n")
    print("| path | ms | category | kernel |")
    print("|---|---:|---|---|")
    for p in paths:
        rows = [k for k in profiles[p]["top_kernels"] if k["category"] != "GEMM"][:10]
        for k in rows:
            name = k["kernel"]
            name = name if len(name) <= 100 else name[:97] + "..."
            print(f"| {p} | {k['ms']:.3f} | {k['category']} | `{name}` |")


# --------------------------------------------------------------------------------------------
# Host synchronisations.


def _source_name(path: str) -> str:
    """A source file as a reader finds it: from its package folder (megatron/..., verl/...,
    verl_ops/..., torch/...), else relative to the checkout, else its name."""
    path = os.path.abspath(path)
    for package in ("verl_ops", "benchmarks", "tests", "megatron", "verl", "torch"):
        i = path.rfind(os.sep + package + os.sep)
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIP_FILES = {os.path.abspath(warnings.__file__), os.path.abspath(contextlib.__file__)}


def _issuer(frame) -> str:
    """The source file of the innermost frame outside torch (and the warnings machinery): where
    the call that synchronised was made."""
    f = frame
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        inside = path.startswith(_TORCH_DIR) or path in _SKIP_FILES or f.f_code.co_filename.startswith("<")
        if not inside:
            return _source_name(path)
        f = f.f_back
    return "?"


def count_syncs(step, batch, path):
    """{source file: n}: the host synchronisations of one step of ``path`` (CUDA only), each where
    the innermost frame outside torch made the call (torch.cuda.set_sync_debug_mode("warn"), the
    warnings caught as they are issued)."""
    step.use(path)
    step.model.zero_grad(set_to_none=True)
    step(batch)  # (first-call work, e.g. a plan built once, is not a step's)
    step.model.zero_grad(set_to_none=True)
    sync(step.device)
    counts = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counts[_issuer(sys._getframe(1))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync(step.device)
    return dict(counts.most_common())


# --------------------------------------------------------------------------------------------


def megatron_core_version():
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001
        import megatron.core as mc

        return getattr(mc, "__version__", "?")


def verl_version():
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001
        return "?"


PATCHES = []  # (module, class, name, megatron's, verl_ops') of the last model built


def run_size(label, size, args, device, dtype, results):
    config = mml.make_config(size, dtype=dtype, device=device.type, mtp=False, routing_replay=False)
    for name, value in (("attention_dropout", 0.0), ("hidden_dropout", 0.0)):
        setattr(config, name, value)
    t0 = time.perf_counter()
    for mname, cls, name, old, _ in PATCHES:  # megatron-core as released, so install() patches it again
        _set_global(mname, cls, name, old)
    before = megatron_globals()
    model = mml.build_model(config, "verl_ops", size=size, device=device, seed=args.seed, te=args.te)
    patches = patches_between(before, megatron_globals()) or list(PATCHES)
    PATCHES[:] = patches
    model.train()
    step = Step(model, config, device, patches, paths=args.paths)
    if args.smoke:
        prompts, responses = tiny_lengths(args.seed)
    else:
        prompts, responses = rl_batch_lengths(args.seed, tokens=args.tokens)
    batch = Batch(prompts, responses, size.vocab, device, args.seed)
    batches = [batch]
    for k in range(1, args.batches):  # more RL-ragged batches, seeds seed+1, ...
        pk, rk = rl_batch_lengths(args.seed + k, tokens=args.tokens)
        batches.append(Batch(pk, rk, size.vocab, device, args.seed + k))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n## {label}: {n_params / 1e6:.1f} M parameters "
          f"(built in {time.perf_counter() - t0:.1f} s); batch {len(batch.lengths)} sequences, "
          f"{batch.tokens} tokens (longest {max(batch.lengths)})")
    print(f"lengths (prompt+response): {' '.join(f'{p}+{r}' for p, r in zip(prompts, responses))}")
    if len(batches) > 1:
        print(f"timed over {len(batches)} batches (seeds {args.seed}..{args.seed + len(batches) - 1}): "
              f"{', '.join(f'{len(x.lengths)} seq / longest {max(x.lengths)}' for x in batches)}")
    patched = ", ".join(step.patch_names()) or "none"
    print(f"megatron-core functions that verl_ops replaces (swapped per path, verl_ops only): {patched}")
    entry = {"patched": step.patch_names(), "label": label, "hidden": size.hidden, "heads": size.heads,
             "params": n_params, "timed_batches": [x.lengths for x in batches],
             "lengths": batch.lengths, "prompts": prompts, "responses": responses, "tokens": batch.tokens}
    try:
        base = run_checked(step, batch, "verl")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        entry["error"] = f"verl: {type(e).__name__}: {e}"
        results.append(entry)
        print(f"check failed: {entry['error']}")
        return None
    paths, entry["checks"] = ["verl"], {}
    for path in step.paths:
        if path == "verl":
            continue
        try:
            ok, errs = check_paths(step, batch, dtype, path, base)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            if path == "verl_ops":
                entry["error"] = f"{path}: {type(e).__name__}: {e}"
                results.append(entry)
                print(f"check failed: {entry['error']}")
                return None
            # (a peer that does not run here leaves the others' numbers standing)
            entry.setdefault("path_errors", {})[path] = f"{type(e).__name__}: {e}"
            print(f"note: path {path} left out, it failed: {type(e).__name__}: {e}")
            continue
        paths.append(path)
        entry["checks"][path] = {"ok": ok, **errs}
        print(f"check, {path} against verl: per-token log-probs |diff| max "
              f"{errs['logprob_max_abs_diff']:.2e} mean {errs['logprob_mean_abs_diff']:.2e}, "
              f"loss rel. diff {errs['loss_rel_err']:.2e}, gradients rel. L2 diff: attention params max "
              f"{errs['grad_rel_l2_attention_max']:.2e}, all params max {errs['grad_rel_l2_max']:.2e} "
              f"({errs['grad_rel_l2_worst_param']}) -> {'OK' if ok else 'MISMATCH'}")
    entry["check"] = entry["checks"]["verl_ops"]
    entry["paths"] = paths
    try:
        times = time_paths(step, batches, paths, args.reps, args.warmup, device, args.order)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        entry["error"] = f"{type(e).__name__}: {e}"
        results.append(entry)
        print(f"timing failed: {entry['error']}")
        return None
    entry["times"] = times
    if device.type == "cuda":
        entry["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    results.append(entry)
    if device.type == "cuda":
        try:
            entry["syncs"] = {p: count_syncs(step, batch, p) for p in paths}
        except Exception as e:  # noqa: BLE001  (the timings stand without it)
            traceback.print_exc()
            entry["syncs_error"] = f"{type(e).__name__}: {e}"
            print(f"sync count failed: {entry['syncs_error']}")
    if args.profile:  # (on the CPU it exercises the code: no kernels)
        try:
            entry["profile"] = {p: profile_path(step, batch, p) for p in paths}
        except Exception as e:  # noqa: BLE001  (the timings stand without it)
            traceback.print_exc()
            entry["profile_error"] = f"{type(e).__name__}: {e}"
            print(f"profile failed: {entry['profile_error']}")
    del step, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def print_step_tables(results, smoke):
    """The step-time table (speedups, same results) and, per size, where the step's time goes:
    wall, GPU kernel time, GPU idle, host syncs, attention kernels."""
    print("\n## Step time\n")
    print("| size | path | step ms (median) | GPU events ms | speedup vs verl | speedup vs verl_fa4 "
          "(--te: vs verl_te_flash) | same results |")
    print("|---|---|---:|---:|---:|---:|---|")
    for e in results:
        if "times" not in e:
            print(f"| {e['label']} | (error) | {e.get('error', '')} | | | | |")
            continue
        base = e["times"]["verl"]["wall_ms"]
        peer = e["times"].get(FA4_PATH, e["times"].get("verl_te_flash", {})).get("wall_ms")
        for p in e["paths"]:
            t = e["times"][p]
            ev = f"{t['event_ms']:.1f}" if t["event_ms"] is not None else "-"
            speedup = "-" if smoke else f"{base / t['wall_ms']:.2f}x"
            vs_peer = "-" if smoke or peer is None else f"{peer / t['wall_ms']:.2f}x"
            same = "" if p == "verl" else ("OK" if e["checks"][p]["ok"] else "MISMATCH")
            print(f"| {e['label']} ({e['tokens']} tok) | {p} | {t['wall_ms']:.1f} | {ev} | {speedup} "
                  f"| {vs_peer} | {same} |")
    for e in results:
        if "times" not in e:
            continue
        print(f"\n## Where the step's time goes, {e['label']} ({e['tokens']} tokens)\n")
        print("| path | step (wall) | GPU kernel time | GPU idle | idle % | host syncs | attention kernels |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        profiles, syncs = e.get("profile", {}), e.get("syncs", {})
        for p in e["paths"]:
            wall = e["times"][p]["wall_ms"]
            pr = profiles.get(p) if not smoke else None
            if pr is not None:
                idle = wall - pr["busy_ms"]
                gpu = (f"{pr['kernel_ms_total']:.1f} ms", f"{idle:.1f} ms", f"{100 * idle / wall:.1f}%",
                       f"{pr['attention_ms']:.1f} ms")
            else:
                gpu = ("-", "-", "-", "-")
            n_syncs = str(sum(syncs[p].values())) if p in syncs else "-"
            print(f"| {p} | {wall:.1f} ms | {gpu[0]} | {gpu[1]} | {gpu[2]} | {n_syncs} | {gpu[3]} |")
        for p in e["paths"]:
            if syncs.get(p):
                print(f"- host syncs of one {p} step, by source file: "
                      + ", ".join(f"{f} {n}" for f, n in syncs[p].items()))
        reps = len(e["times"][e["paths"][0]].get("wall_ms_all", [])) or 1
        for p in e["paths"]:
            a = e["times"][p].get("allocator")
            if a and any(a.values()):
                print(f"- caching allocator, {p}, per timed step: {a['device_allocs'] / reps:.1f} cudaMalloc, "
                      f"{a['device_frees'] / reps:.1f} cudaFree, {a['alloc_retries'] / reps:.1f} retries "
                      "(each a wait for the GPU)")
        clock = {p: e["times"][p].get("clocks") for p in e["paths"]}
        if any(c and c.get("samples") for c in clock.values()):
            top = next((c.get("sm_mhz_max") for c in clock.values() if c and c.get("sm_mhz_max")), None)
            print("- GPU during the timed steps (NVML, sampled every 5 ms"
                  + (f"; SM clock at most {top} MHz" if top else "")
                  + "; mean SM clock, lowest, mean power and energy per step from the energy counter, "
                  "temperature): " + "; ".join(
                      f"{p} {c['sm_mhz']:.0f} MHz (min {c['sm_mhz_min']}), "
                      + (f"{c['power_w']:.0f} W" if c.get("power_w") is not None else "- W")
                      + (f", {c['energy_j']:.0f} J" if c.get("energy_j") is not None else "")
                      + (f", {c['temp_c']:.0f} C" if c.get("temp_c") is not None else "")
                      for p, c in clock.items() if c and c.get("samples")))
        for p in e["paths"]:
            idle = (profiles.get(p) or {}).get("idle") if not smoke else None
            if idle and "error" in idle:
                print(f"- GPU idle of {p}: not analysed ({idle['error']})")
            elif idle:
                print("\n".join(idle_gaps.describe(p, idle)))
    print("\nstep (wall): median wall clock between synchronisations. GPU kernel time: the kernels, copies "
          "and memsets of one traced step (torch.profiler over exactly that step), summed. GPU idle: step "
          "(wall) minus the time the GPU was busy in the traced step (the union of those intervals: "
          "overlapping streams count once). host syncs: torch.cuda.set_sync_debug_mode('warn') over one "
          "step, each counted at the source file that made the call (outside torch). attention kernels: "
          "the attention fwd + bwd kernel time of the traced step. GPU idle of one traced step: the gaps "
          "between the device's busy intervals in that step, the host's CUDA calls that overlapped them, and "
          "the op (and bench:: range) that launched the kernel after each (benchmarks/megatron/idle_gaps.py).")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: float32, hidden 64, tiny batch, 1 step")
    ap.add_argument("--cpu", action="store_true",
                    help="the --sizes models on the CPU in float32 with --tiny's batch, 1 step "
                         "(a check of the configurations, not a timing)")
    ap.add_argument("--sizes", default="2048,4096", help="hidden sizes (2048: 16 heads, 4096: 64 heads, 7168: 128 heads)")
    ap.add_argument("--tokens", type=int, default=30 * 1024, help="tokens of the RL-ragged micro-batch")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per path (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per path first")
    ap.add_argument("--order", choices=("alternate", "blocked"), default="alternate",
                    help="alternate: the paths take turns, one step each per round (drift in clocks hits "
                         "them all); blocked: each path's warm-up and timed steps back to back, as in "
                         "training (under the GPU's power limit each path runs at its own clock)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the batch and the weights")
    ap.add_argument("--batches", type=int, default=1,
                    help="time over this many RL-ragged batches (seeds seed, seed+1, ...; round r runs batch "
                         "r mod N on both paths) instead of one: new lengths every step, as in training")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.profiler over one step of each path at every size: kernel time by category, "
                         "GPU busy and idle (default: on, off with --tiny; on the CPU it only exercises the "
                         "code: no kernels)")
    ap.add_argument("--te", action="store_true",
                    help="the model from TransformerEngine's layer specs, and verl's path on TE's own attention "
                         "(verl_te_flash, verl_te_fused) instead of verl_fa4 (needs transformer_engine)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.smoke = args.tiny or args.cpu
    if args.smoke:  # one step each: a check that it runs, not a timing
        args.reps, args.warmup, args.batches = 1, 0, 1
    if args.profile is None:
        args.profile = not args.smoke

    warnings.filterwarnings("ignore")
    smoke = args.tiny or args.cpu
    if smoke:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --tiny for the CPU smoke run)")
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        torch.cuda.set_device(device)
    t_start = time.perf_counter()
    mml.init_distributed(1, device=device.type)
    if device.type == "cuda":  # megatron-core's GPU weight init draws from its RNG tracker
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    from verl_ops.integrations.megatron_compat import patch_megatron_core

    patch_megatron_core()
    print(f"# One RL training step of a megatron-core MLA + MoE model: verl's path vs verl_ops\n")
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"device: {device_line(device)}; torch {torch.__version__}; "
          f"megatron-core {megatron_core_version()}; verl {verl_version()}; "
          f"verl_ops {getattr(verl_ops, '__version__', '?')}; commit {common.commit()}; {now:%Y-%m-%d %H:%M} UTC")
    print(f"command: python {common.command()}")
    print("verl path: verl's preprocess/postprocess_thd_engine + V padded to 192, aten varlen FlashAttention "
          "fwd/bwd, output trimmed"
          + (" (CPU: per-sequence SDPA stands in for the flash kernel)" if smoke else ""))
    print("verl_ops path: verl_ops.integrations.verl drop-ins + MLACoreAttention (install(spec)), "
          "V at its native 128")
    fa4, why = fa4_varlen()
    if smoke:
        why = "a CPU run (FlashAttention-4 runs on CUDA)"
    if args.te:  # (TE's flash backend runs FlashAttention-4 where TE finds it)
        if not mml.transformer_engine_available():
            sys.exit("--te: transformer_engine.pytorch does not import here (benchmarks/device/te_setup.sh)")
        import transformer_engine

        args.paths = list(TE_ALL_PATHS)
        print(f"TransformerEngine {transformer_engine.__version__}: the model from its layer specs; "
              f"verl_te_flash / verl_te_fused: verl's pack/unpack and log-probs, TE's TEDotProductAttention with "
              f"NVTE_FLASH_ATTN / NVTE_FUSED_ATTN as attention_backend flash / fused sets them (FlashAttention "
              f"found by TE: {mml.te_flash_attention_installed()}; on FlashAttention-4 TE's causal window (-1, 0) "
              f"is handed over as (None, 0), TransformerEngine #3528), V as megatron-core hands it")
    elif fa4 is None or smoke:
        args.paths = [p for p in ALL_PATHS if p != FA4_PATH]
        print(f"{FA4_PATH} path: skipped, {why}")
    else:
        args.paths = list(ALL_PATHS)
        print(f"{FA4_PATH} path: verl's preprocess/postprocess_thd_engine + V padded to 192, "
              "FlashAttention-4 (flash_attn.cute.flash_attn_varlen_func) fwd/bwd, output trimmed")

    results = []
    sizes = [tiny_size()] if args.tiny else [model_size(h) for h in args.sizes]
    sizes = [(f"{'tiny, ' if args.tiny else ''}hidden {z.hidden} / {z.heads} heads", z) for z in sizes]
    for label, size in sizes:
        run_size(label, size, args, device, dtype, results)

    for e in results:
        if "profile" in e:
            print_profile(e["label"], e["profile"], e.get("times"))
    print_step_tables(results, smoke)
    if smoke:
        print("\n(smoke run on the CPU: one step each, no warm-up; the times say nothing about the GPU)")
    print(f"\nspeedup = the other path's step time / this path's; wall clock between synchronisations, "
          f"median of {args.reps} (warm-up {args.warmup}; {args.order} order); total run "
          f"{time.perf_counter() - t_start:.0f} s")
    if args.out:
        meta = {
            "device": device_line(device), "torch": torch.__version__, "commit": common.commit(),
            "megatron_core": megatron_core_version(), "verl": verl_version(), "tiny": args.tiny,
            "cpu": args.cpu, "reps": args.reps, "warmup": args.warmup, "order": args.order,
            "seed": args.seed, "dtype": str(dtype), "tokens": args.tokens,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
        print(f"wrote {args.out}")
    bad = [e for e in results if "times" not in e or not all(c["ok"] for c in e.get("checks", {}).values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
