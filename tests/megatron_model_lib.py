"""A small DeepSeek-V3-like megatron-core ``GPTModel`` on verl's THD path, with verl_ops or without.

Used by tests/test_megatron_model.py (and reusable by a GPU step benchmark): it builds a real
megatron-core model from the local (non-TransformerEngine) layer specs — MLA with ``q_lora_rank``
and ``kv_lora_rank``, a rope part of the query/key head dim and a smaller value head dim, one dense
layer then one MoE layer (sigmoid router with expert bias, top-k, a shared expert), one MTP layer —
and runs it the way verl's model engine does (``verl/models/mcore/model_forward.py``,
``gptmodel_forward_model_engine``): a jagged batch packed into THD rows by
``preprocess_thd_engine`` (``input_ids [1, T]``, rolled ``labels`` and ``loss_mask`` for MTP,
``position_ids``, ``PackedSeqParams``), ``GPTModel.forward``, and the per-token output unpacked by
``postprocess_thd_engine``.

Two paths, with identical weights:

* ``"verl_ops"``: ``MLACoreAttention`` in every MLA ``core_attention`` (through
  :func:`verl_ops.integrations.megatron_mla.install`), the batch packed and unpacked by verl_ops'
  drop-ins (:mod:`verl_ops.integrations.verl`), router replay through verl_ops' drop-ins
  (:mod:`verl_ops.integrations.verl_router`).
* ``"reference"``: :class:`ReferenceMLACoreAttention` (a plain per-sequence torch attention with
  V zero-padded to the query head dim and the output trimmed back: verl's own MLA THD path), the
  batch packed and unpacked by verl's own functions (``verl/models/mcore/util.py``).

Nothing here is specific to the test framework; the functions take a device and a dtype. On a
machine without CUDA, megatron-core's ``torch.cuda.current_device()`` calls (buffers of the MoE
router, the router's move of its weight to the GPU, MTP loss logging) are pointed at the CPU
inside :func:`megatron_device` — megatron-core itself assumes a GPU there —, the MoE layer uses
the all-gather token dispatcher (the all-to-all one creates a CUDA stream when it is built), and
:func:`eager_megatron_fusions` spares each process megatron-core's ``torch.compile`` of its small
fusions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import random
import sys
from dataclasses import dataclass

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


MEGATRON_IMPORT_ERROR = None  # why megatron_available() said False (the exception), or None


def megatron_available() -> bool:
    global MEGATRON_IMPORT_ERROR
    try:
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or an error raised while megatron-core imports)
        MEGATRON_IMPORT_ERROR = f"{type(e).__name__}: {e}"
        return False
    return True


# --------------------------------------------------------------------------------------------
# Sizes.


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    ffn_hidden: int
    moe_ffn_hidden: int
    shared_expert_hidden: int
    experts: int
    topk: int
    vocab: int
    max_seq: int


SIZES = {
    # CPU tests: a few thousand parameters per matrix.
    "tiny": ModelSize(
        hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=24, qk_head_dim=48, qk_pos_emb_head_dim=16,
        v_head_dim=32, ffn_hidden=96, moe_ffn_hidden=32, shared_expert_hidden=32, experts=8, topk=2,
        vocab=256, max_seq=4096,
    ),
    # DeepSeek-V3's attention head dims (128 + 64 / 128), few heads and layers.
    "real": ModelSize(
        hidden=1024, heads=16, q_lora_rank=384, kv_lora_rank=256, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, ffn_hidden=2048, moe_ffn_hidden=512, shared_expert_hidden=512, experts=16, topk=4,
        vocab=8192, max_seq=65536,
    ),
}


# --------------------------------------------------------------------------------------------
# Process groups and devices.


@contextlib.contextmanager
def megatron_device(device):
    """Inside: megatron-core's ``torch.cuda.current_device()`` is ``device`` when that is the CPU
    (megatron-core allocates router buffers, moves router weights and logs MTP losses there); a
    no-op for CUDA devices."""
    device = torch.device(device)
    if device.type != "cpu":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: device
    try:
        yield
    finally:
        torch.cuda.current_device = original


def eager_megatron_fusions() -> None:
    """Run megatron-core's ``@jit_fuser`` functions eagerly (``torch._dynamo.config.disable``).

    megatron-core decorates its small fusions (SwiGLU, bias-dropout-add, the router's expert-bias
    update, ...) with ``torch.compile``; on a CPU every process would spend ~20 s compiling them
    for a model that runs in milliseconds. A process-wide setting: call it only in processes that
    run nothing else that wants torch.compile."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _verl_ops_patches() -> list:
    """(module, name, original) of every megatron-core module-level function that verl_ops has
    replaced (marked with megatron_mla's patch attribute, the original in ``__wrapped__``)."""
    try:
        from verl_ops.integrations import megatron_mla

        marker = getattr(megatron_mla, "_PATCHED_ATTR", "_verl_ops_mla_patched")
    except ImportError:
        marker = "_verl_ops_mla_patched"
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron."):
            continue
        for name, value in list(vars(mod).items()):
            if callable(value) and getattr(value, marker, False) and hasattr(value, "__wrapped__"):
                found.append((mod, name, value.__wrapped__))
    return found


@contextlib.contextmanager
def megatron_as_shipped():
    """Inside: megatron-core's module-level functions as megatron-core ships them — every one that
    ``megatron_mla.install()`` replaced process-wide (e.g. the THD RoPE) is put back — so that the
    reference path runs none of verl_ops' code. Yields the names put back."""
    patches = _verl_ops_patches()
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, original in patches:
        setattr(mod, name, original)
    try:
        yield [f"{mod.__name__}.{name}" for mod, name, _ in patches]
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


# TransformerEngine's attention backends, as megatron-core's ``attention_backend`` selects them
# (``LanguageModule._set_attention_backend``: process-wide environment variables).
_TE_BACKEND_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_TE_BACKENDS = {"flash": ("1", "0", "0"), "fused": ("0", "1", "0")}


def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (ImportError, or a missing / mismatched extension)
        return False
    return True


def te_flash_attention_installed() -> dict:
    """Which FlashAttention versions TransformerEngine found at import: {"2": bool, "3": bool,
    "4": bool}."""
    from transformer_engine.pytorch.attention.dot_product_attention.utils import FlashAttentionUtils as fa

    return {"2": bool(fa.is_installed), "3": bool(fa.v3_is_installed), "4": bool(getattr(fa, "v4_is_installed", False))}


def te_selected() -> dict:
    """What TransformerEngine's ``DotProductAttention`` selected for its last call: ``{"ran": whether a
    selection is recorded, "flash": backend name or None, "fused": backend name or None, "unfused":
    bool}``."""
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    chosen = dpa._attention_backends
    return {
        "ran": chosen["attention_params"] is not None,
        "flash": str(chosen["flash_attention_backend"]) if chosen["use_flash_attention"] else None,
        "fused": str(chosen["fused_attention_backend"]) if chosen["use_fused_attention"] else None,
        "unfused": bool(chosen["use_unfused_attention"]),
    }


def _fa4_window(window_size):
    """TE's window (a side of -1: unbounded) as FlashAttention-4 reads it (``None``: unbounded)."""
    if window_size is None:
        return None
    return tuple(None if (w is not None and w < 0) else w for w in window_size)


@contextlib.contextmanager
def te_fa4_window_fix():
    """Inside: TransformerEngine's calls into FlashAttention-4 get an unbounded window side as
    ``None`` instead of ``-1``.

    TE 2.20.2 normalises a causal mask's window to ``(-1, 0)`` and hands it to FA4 unchanged. FA4
    with flash-attention #2490 (4.0.0b36 has it) widens a window to full attention only
    when both sides are negative, so ``(-1, 0)`` becomes the band ``[row + 1, row]``: empty. Every
    row is masked, and TE's flash attention on FA4 returns zeros and zero gradients, silently
    (TransformerEngine #3528; the fix in TE is #3532, which does what this does). FlashAttention 2
    and 3 take ``-1`` as meant. Yields whether FA4's entry points were found in TE and wrapped.
    TE's context-parallel path calls FA4's ``_flash_attn_fwd`` / ``_bwd`` with the same ``-1``
    (``window_size_left``) and is not wrapped here: TE's CP on FA4 is not run by these tests."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import backends
    except Exception:  # noqa: BLE001  (no TE: nothing to wrap)
        yield False
        return
    names = [n for n in ("flash_attn_func_v4", "flash_attn_varlen_func_v4") if getattr(backends, n, None) is not None]
    saved = {n: getattr(backends, n) for n in names}

    def wrap(func):
        @functools.wraps(func)
        def call(*args, window_size=None, **kwargs):
            if window_size is not None:
                kwargs["window_size"] = _fa4_window(window_size)
            return func(*args, **kwargs)

        return call

    for n in names:
        setattr(backends, n, wrap(saved[n]))
    try:
        yield bool(names)
    finally:
        for n, f in saved.items():
            setattr(backends, n, f)


@contextlib.contextmanager
def te_attention(backend: str, *, fa4_window_fix: bool = True):
    """Inside: TransformerEngine's ``DotProductAttention`` runs ``backend`` (``"flash"``: FlashAttention,
    whichever version TE finds; ``"fused"``: cuDNN), set the way megatron-core's
    ``attention_backend: flash / fused`` sets it (NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
    NVTE_UNFUSED_ATTN), with TE's cached backend selection dropped on entry and on exit. Models are
    built outside (with ``attention_backend`` auto, which leaves the variables at 1); a forward and
    its backward run inside. Under ``"flash"``, TE's window for FlashAttention-4 is corrected as
    ``te_fa4_window_fix`` says (``fa4_window_fix=False``: TE as shipped, which on FA4 4.0.0b36
    attends to nothing under a causal mask).

    Yields a dict that holds, on exit, what TE selected for its last attention call inside:
    ``{"ran": whether TE selected a backend inside, "flash": backend name or None, "fused": backend
    name or None, "unfused": bool, "fa4_window_fix": whether FA4's window was corrected}``."""
    if backend not in _TE_BACKENDS:
        raise ValueError(f"te_attention: backend must be one of {sorted(_TE_BACKENDS)}, got {backend!r}")
    if backend == "flash" and fa4_window_fix:
        with te_fa4_window_fix() as fixed, _te_attention(backend) as seen:
            seen["fa4_window_fix"] = fixed
            yield seen
    else:
        with _te_attention(backend) as seen:
            seen["fa4_window_fix"] = False
            yield seen


@contextlib.contextmanager
def _te_attention(backend: str):
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    def reset():
        # (the last selection's flags too: what is read on exit must come from a call inside)
        dpa._attention_backends.update(
            attention_params=None, backend_selection_requires_update=True, use_flash_attention=None,
            flash_attention_backend=None, use_fused_attention=None, fused_attention_backend=None,
            use_unfused_attention=None,
        )
        cache = getattr(dpa, "_thd_policy_backend_cache", None)
        if cache is not None:
            cache.clear()

    saved = {k: os.environ.get(k) for k in _TE_BACKEND_ENV}
    os.environ.update(zip(_TE_BACKEND_ENV, _TE_BACKENDS[backend]))
    reset()
    seen = {}
    try:
        yield seen
    finally:
        seen.update(te_selected())
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset()


def init_distributed(cp_size: int = 1, device="cpu") -> None:
    """megatron-core's model-parallel state with ``context_parallel_size=cp_size`` (TP = PP = EP = 1).

    Starts a world-1 process group first when none exists (gloo on CPU, NCCL on CUDA); with an
    existing one (e.g. two ranks for CP = 2), re-initialises megatron's groups on it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        import tempfile

        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        init_file = tempfile.NamedTemporaryFile(prefix="verl_ops_megatron_", delete=False).name
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp_size
    )


# --------------------------------------------------------------------------------------------
# The reference core attention (verl's MLA THD path).


class CoreAttentionArguments(torch.nn.Module):
    """A core attention's constructor as Megatron calls it (``MLACoreAttention``'s arguments), kept
    as attributes."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels
        self.v_channels = v_channels
        self.pg_collection = pg_collection


class ReferenceMLACoreAttention(CoreAttentionArguments):
    """Causal attention for MLA, built like Megatron's core attention (same constructor and forward
    signatures as ``MLACoreAttention``), computed plainly.

    THD (``packed_seq_params.qkv_format == "thd"``): ``query, key [t, n, Dqk]``, ``value [t, n, Dv]``
    -> ``[t, n * Dv]``. Sequence ``i`` occupies rows ``[cu_seqlens_q_padded[i], ...[i + 1])`` of
    which the first ``cu_seqlens_q[i + 1] - cu_seqlens_q[i]`` are its tokens; each sequence is
    attended on its own: V zero-padded to ``Dqk``, causal softmax in float32, the output trimmed back
    to ``Dv`` (verl's patch of Megatron's MLA on the THD path). Rows past a sequence's tokens are 0.
    BSHD: ``[s, b, n, D]`` -> ``[s, b, n * Dv]``, causal over ``s``. One CP rank only.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name = getattr(self.attn_mask_type, "name", str(self.attn_mask_type))
        if "causal" not in name:
            raise ValueError(f"ReferenceMLACoreAttention: causal masks only, got {self.attn_mask_type}")
        cp = getattr(self.pg_collection, "cp", None) if self.pg_collection is not None else None
        if cp is not None and cp.size() > 1:
            raise ValueError("ReferenceMLACoreAttention: one context-parallel rank only")

    @staticmethod
    def _attend(q, k, v, scale):
        """q, k [L, n, Dqk], v [L, n, Dqk] -> [L, n, Dqk]; causal, softmax in float32."""
        s = torch.einsum("qnd,knd->nqk", q.float(), k.float()) * scale
        L = q.shape[0]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        return torch.einsum("nqk,knd->qnd", p, v.float()).to(q.dtype)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if attention_bias is not None:
            raise ValueError("ReferenceMLACoreAttention: no attention bias")
        dqk, dv = query.shape[-1], value.shape[-1]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dqk)
        v_pad = torch.nn.functional.pad(value, (0, dqk - dv)) if dv < dqk else value
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if not thd:  # [s, b, n, D]
            out = torch.stack(
                [self._attend(query[:, b], key[:, b], v_pad[:, b], scale) for b in range(query.shape[1])], dim=1
            )
            out = out[..., :dv]
            return out.reshape(out.shape[0], out.shape[1], -1)
        rows = packed_seq_params.cu_seqlens_q_padded
        if rows is None:
            rows = packed_seq_params.cu_seqlens_q
        rows = rows.tolist()
        lengths = packed_seq_params.cu_seqlens_q.diff().tolist()
        parts = []
        for i, n in enumerate(lengths):
            a, b = rows[i], rows[i + 1]
            if n > 0:
                parts.append(self._attend(query[a : a + n], key[a : a + n], v_pad[a : a + n], scale)[..., :dv])
            if b - a > n:
                parts.append(query.new_zeros(b - a - n, query.shape[1], dv))
        tail = query.shape[0] - rows[-1]
        if tail > 0:
            parts.append(query.new_zeros(tail, query.shape[1], dv))
        out = torch.cat(parts) if parts else query.new_zeros(0, query.shape[1], dv)
        return out.reshape(out.shape[0], -1)


# --------------------------------------------------------------------------------------------
# Specs and the model.


def _walk_mla_submodules(obj, seen=None):
    """Every MLA self-attention submodules object reachable from a spec (ModuleSpec, block /
    MTP submodules, lists), each once."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, MLASelfAttentionSubmodules):
        yield obj
        return
    if isinstance(obj, ModuleSpec):
        yield from _walk_mla_submodules(obj.submodules, seen)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk_mla_submodules(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk_mla_submodules(getattr(obj, f.name), seen)


def set_core_attention(spec, cls) -> int:
    """Put ``cls`` in the ``core_attention`` of every MLA self-attention reachable from ``spec``;
    returns how many were set."""
    count = 0
    for sub in _walk_mla_submodules(spec):
        object.__setattr__(sub, "core_attention", cls)  # (frozen dataclasses too)
        count += 1
    return count


def make_config(
    size: ModelSize | str = "tiny",
    *,
    dtype=torch.float32,
    device="cpu",
    cp_size: int = 1,
    mtp: bool = True,
    routing_replay: bool = True,
    dispatcher: str | None = None,
    qk_layernorm: bool = False,
):
    """The model's ``MLATransformerConfig``: 2 layers (dense, then MoE), MLA with rope, sigmoid
    top-k router with expert bias and a shared expert, ``mtp_num_layers=1`` when ``mtp``;
    ``qk_layernorm``: RMSNorm on MLA's compressed q and kv (DeepSeek-V3's q_a / kv_a layernorms;
    in TransformerEngine's specs fused into the up-projections)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    size = SIZES[size] if isinstance(size, str) else size
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    kwargs = dict(
        num_layers=2,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        ffn_hidden_size=size.ffn_hidden,
        multi_latent_attention=True,
        qk_layernorm=qk_layernorm,
        q_lora_rank=size.q_lora_rank,
        kv_lora_rank=size.kv_lora_rank,
        qk_head_dim=size.qk_head_dim,
        qk_pos_emb_head_dim=size.qk_pos_emb_head_dim,
        v_head_dim=size.v_head_dim,
        rope_type="rope",
        rotary_base=10000,
        normalization="RMSNorm",
        num_moe_experts=size.experts,
        moe_layer_freq=[0, 1],
        moe_router_topk=size.topk,
        moe_ffn_hidden_size=size.moe_ffn_hidden,
        moe_shared_expert_intermediate_size=size.shared_expert_hidden,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=routing_replay,
        # (the all-to-all dispatcher creates a CUDA stream in its constructor)
        moe_token_dispatcher_type=dispatcher or ("alltoall" if torch.device(device).type == "cuda" else "allgather"),
        moe_grouped_gemm=False,
        mtp_num_layers=1 if mtp else None,
        mtp_loss_scaling_factor=0.3,
        # A per-token (unnormalised) MTP loss: its gradient is then a sum over tokens, the same
        # whether the tokens sit on one rank or are split over CP ranks.
        calculate_per_token_loss=True,
        context_parallel_size=cp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=torch.device(device).type == "cpu",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        init_method_std=0.02,
    )
    missing = sorted(k for k in kwargs if k not in fields and k not in _OPTIONAL_CONFIG)
    if missing:
        raise ValueError(f"make_config: this megatron-core's MLATransformerConfig has no {missing}")
    return MLATransformerConfig(**{k: v for k, v in kwargs.items() if k in fields})


# Kernel-fusion switches: a megatron-core without them computes the same model.
_OPTIONAL_CONFIG = {"moe_router_fusion", "moe_permute_fusion", "persist_layer_norm", "bias_activation_fusion",
                    "masked_softmax_fusion", "apply_rope_fusion", "gradient_accumulation_fusion"}


def build_specs(config, core_attention: str, *, te: bool = False):
    """(decoder block spec, MTP block spec) from megatron-core's layer specs with the chosen MLA
    core attention: ``"verl_ops"`` (``MLACoreAttention`` via ``megatron_mla.install``),
    ``"verl_ops_padded"`` (the same module on ``mla_forward_padded``'s padded backend: torch's
    FlashAttention kernels on V zero-padded to the query head dim, the kernels verl's own path runs:
    the accepted bf16 numerics the GPU tests measure against), ``"reference"``
    (:class:`ReferenceMLACoreAttention`) or, with ``te``, ``"te"`` (the spec's own
    ``TEDotProductAttention``).

    ``te``: TransformerEngine's specs (``use_transformer_engine=True``, what verl builds) instead of
    the local ones."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    from verl_ops.integrations import megatron_mla

    backends = {"verl_ops": "auto", "verl_ops_padded": "padded"}
    if core_attention not in backends and core_attention != "reference" and not (te and core_attention == "te"):
        allowed = "'verl_ops', 'verl_ops_padded', 'reference'" + (" or 'te'" if te else "")
        raise ValueError(f"core_attention must be {allowed}, got {core_attention!r}")

    def put(spec):
        if core_attention == "te":
            return spec
        if core_attention == "reference":
            set_core_attention(spec, ReferenceMLACoreAttention)
            return spec
        return megatron_mla.install(spec, backend=backends[core_attention])

    block = put(get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm"))
    mtp = None
    if config.mtp_num_layers:
        mtp = put(get_gpt_mtp_block_spec(config, block, use_transformer_engine=te))
    return block, mtp


def build_model(config, core_attention: str, *, size: ModelSize | str = "tiny", device="cpu", seed=0, te=False):
    """``GPTModel`` on ``device`` with the chosen core attention and specs (see :func:`build_specs`);
    megatron-core is patched for running without TransformerEngine first (a no-op where it is
    there)."""
    from megatron.core.models.gpt import GPTModel

    from verl_ops.integrations.megatron_compat import patch_megatron_core

    patch_megatron_core()
    size = SIZES[size] if isinstance(size, str) else size
    block, mtp = build_specs(config, core_attention, te=te)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)  # (GPU initialisation forks its RNG tracker)
    with megatron_device(device):
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=size.vocab,
            max_sequence_length=size.max_seq,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            mtp_block_spec=mtp,
        )
    return model.to(device)


def routers(model) -> list:
    """The model's ``RouterReplay`` objects in forward order (decoder MoE layers, then MTP)."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    if any(r is None for r in out):
        raise ValueError("routers: the model was built without moe_enable_routing_replay")
    return out


def randomize_expert_bias(model, seed: int) -> None:
    """Non-zero expert biases (the router selects experts by score + bias), reproducible."""
    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, TopKRouter) and getattr(m, "expert_bias", None) is not None:
            m.expert_bias.copy_(torch.rand(m.expert_bias.shape, generator=g) * 0.2)


# --------------------------------------------------------------------------------------------
# Batches.


@dataclass
class Batch:
    """One ragged micro-batch (RL-like): token ids, a loss mask (prompt 0, response 1) and
    per-token weights (advantages), all jagged nested on ``device``.

    The model's output at position ``p`` is the loss of token ``p + 1`` (verl's rolled labels);
    ``has_next`` (bool, flat) marks the positions that have a next token (all but each sequence's
    last, whose rolled label is verl's wrap-around filler) and ``next_mask`` (flat) is the loss
    mask of that next token (0 where there is none)."""

    lengths: list
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    weights: torch.Tensor

    @property
    def has_next(self) -> torch.Tensor:
        offsets = self.input_ids.offsets()
        last = offsets[1:] - 1
        keep = torch.ones(int(offsets[-1]), dtype=torch.bool, device=offsets.device)
        keep[last[self.input_ids.offsets().diff() > 0]] = False
        return keep

    @property
    def next_mask(self) -> torch.Tensor:
        mask = self.loss_mask.values()
        out = torch.zeros_like(mask)
        out[:-1] = mask[1:]
        return out * self.has_next.to(mask.dtype)

    def to(self, device):
        nest = lambda t: torch.nested.nested_tensor_from_jagged(t.values().to(device), t.offsets().to(device))  # noqa: E731
        return Batch(self.lengths, nest(self.input_ids), nest(self.loss_mask), nest(self.weights))


def random_lengths(
    rng: random.Random, n_min=3, n_max=8, lo=5, hi=200, mu=3.5, sigma=0.9, with_one=True, with_long=False
):
    """``n_min``-``n_max`` log-normal lengths clipped to [lo, hi]; one of them 1 when ``with_one``
    and another in [hi / 2, hi] when ``with_long``."""
    n = rng.randint(max(n_min, int(with_one) + int(with_long)), n_max)
    lengths = [min(hi, max(lo, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    slots = rng.sample(range(n), int(with_one) + int(with_long))
    if with_one:
        lengths[slots.pop()] = 1
    if with_long:
        lengths[slots.pop()] = rng.randint(hi // 2, hi)
    return lengths


def make_batch(lengths, vocab: int, seed: int, device="cpu", *, cp_invariant_mtp: int | None = None) -> Batch:
    """Random token ids; loss mask 0 on each sequence's prompt (its first third, token 0 always),
    1 on its response; weights uniform in [-0.5, 1.5).

    ``cp_invariant_mtp=cp``: also 0 at position ``j * c + 1`` of every sequence, for each of the
    ``2 * cp`` zigzag chunks of length ``c`` that CP ``cp`` cuts it into (internal zeros, like tool
    outputs in a response). Megatron's MTP loss rolls the loss mask over CP ranks, and newer
    megatron-core (0.19.2; not 0.16.1) rescales each rank's per-token MTP loss by that rank's own
    mask count before / after the roll; with these zeros no mask value crosses a chunk boundary,
    every rank's ratio is 1, and the MTP gradients of a CP run equal those of one process (on
    0.16.1 they do with any mask)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    total = int(offsets[-1])
    ids = torch.randint(0, vocab, (total,), generator=g)
    mask = torch.zeros(total, dtype=torch.float32)
    for i, n in enumerate(lengths):
        prompt = max(1, n // 3) if n > 1 else 1  # token 0 is always prompt (loss 0)
        mask[offsets[i] + prompt : offsets[i + 1]] = 1.0
        if cp_invariant_mtp is not None and cp_invariant_mtp > 1:
            cp = cp_invariant_mtp
            c = -(-n // (2 * cp))  # chunk length: the length padded to a multiple of 2 * cp, / (2 * cp)
            for j in range(2 * cp):
                if j * c + 1 < n:
                    mask[offsets[i] + j * c + 1] = 0.0
    weights = torch.rand(total, generator=g) * 2 - 0.5
    nest = lambda t: torch.nested.nested_tensor_from_jagged(t.to(device), offsets.to(device))  # noqa: E731
    return Batch(list(lengths), nest(ids), nest(mask), nest(weights))


# --------------------------------------------------------------------------------------------
# Packing functions: verl_ops' drop-ins or verl's own.


@dataclass
class PackFns:
    name: str
    preprocess_thd_engine: object
    postprocess_thd_engine: object


def verl_ops_pack() -> PackFns:
    from verl_ops.integrations import verl as vi

    return PackFns("verl_ops", vi.preprocess_thd_engine, vi.postprocess_thd_engine)


class _Setter:
    """``monkeypatch``'s ``setitem`` without undo: for processes that keep verl's util loaded."""

    @staticmethod
    def setitem(mapping, key, value):
        mapping[key] = value


def _logger_warning_once() -> None:
    """verl 0.9.1's ``preprocess_thd_engine`` calls ``logger.warning_once`` on a plain
    ``logging.Logger`` (when a sequence is shorter than its CP-padded length). That method exists only
    once transformers is imported, which adds it to ``logging.Logger``; every verl worker imports
    transformers. Here it is imported where installed, and otherwise the same one-time warning is
    added, so that verl's function runs as it does in verl."""
    import functools
    import logging

    if hasattr(logging.Logger, "warning_once"):
        return
    try:
        import transformers.utils.logging  # noqa: F401  (adds Logger.warning_once)
    except Exception:  # noqa: BLE001  (not installed: the GPU machine)
        pass
    if not hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)


def verl_pack(monkeypatch=None) -> PackFns:
    """verl's own ``preprocess_thd_engine`` / ``postprocess_thd_engine`` (the installed verl's
    ``verl/models/mcore/util.py``, loaded without verl's heavy imports; see tests/verl_stubs.py).
    Raises LookupError when verl is not installed."""
    import verl_stubs

    _logger_warning_once()

    util = verl_stubs.load_verl_util(monkeypatch if monkeypatch is not None else _Setter())
    return PackFns("verl", util.preprocess_thd_engine, util.postprocess_thd_engine)


# --------------------------------------------------------------------------------------------
# One forward / backward.


def clear_mtp_tracker() -> None:
    """Empty megatron-core's process-wide MTP loss tracker: it keeps its tensors on the device of
    the first step that logged to it, so a process that runs CPU steps and then GPU steps must
    start each step afresh."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


@dataclass
class StepResult:
    loss_per_token: torch.Tensor  # float32, cross entropy of the next token at every position that has one
    objective: float
    recorded: list | None  # per router: recorded top-k [T_local, K] (RECORD) or None
    packed_seq_params: object


def forward_backward(
    model, batch: Batch, pack: PackFns, *, replay=None, device="cpu", backward=True, as_shipped=False
) -> StepResult:
    """verl's model-engine forward of ``batch`` (THD, MTP on), then backward of
    ``sum(weights * next_mask * loss)`` over every position (+ the MTP loss Megatron attaches).

    ``replay``: None (the routers route), ``"record"`` (RECORD: the routers' top-k is returned in
    ``recorded``) or a list of per-router ``[T_local, K]`` targets (REPLAY_FORWARD).
    ``as_shipped``: forward and backward inside :func:`megatron_as_shipped` (the reference path)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    clear_mtp_tracker()
    rs = routers(model) if replay is not None else []
    for r in rs:
        r.clear_indices()
        r.clear_router_replay_action()
    if replay == "record":
        for r in rs:
            r.set_router_replay_action(RouterReplayAction.RECORD)
    elif replay is not None:
        if len(replay) != len(rs):
            raise ValueError(f"forward_backward: {len(replay)} replay targets for {len(rs)} routers")
        for r, target in zip(rs, replay):
            r.set_target_indices(target.to(device))
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    with megatron_device(device), (megatron_as_shipped() if as_shipped else contextlib.nullcontext()):
        input_ids, psp, position_ids = pack.preprocess_thd_engine(batch.input_ids, pre_process=True)
        labels = pack.preprocess_thd_engine(batch.input_ids, pre_process=True, need_roll=True)[0]
        loss_mask = pack.preprocess_thd_engine(batch.loss_mask, pre_process=True, need_roll=True)[0]
        loss = model(
            input_ids=input_ids.contiguous(),
            position_ids=position_ids,
            attention_mask=None,
            labels=labels.contiguous(),
            loss_mask=loss_mask.contiguous(),
            packed_seq_params=psp,
        )  # [1, T_local]: cross entropy of each row's label
        per_token = pack.postprocess_thd_engine(loss, psp, batch.input_ids, len(batch.lengths))
        values = per_token.values() if per_token.is_nested else per_token
        objective = (values * batch.weights.values() * batch.next_mask).sum()
        if backward:
            objective.backward()
        values = values[batch.has_next]
    recorded = [r.get_recorded_indices().detach().clone() for r in rs] if replay == "record" else None
    for r in rs:
        r.clear_indices()
        r.clear_router_replay_action()
    return StepResult(values.detach().float().clone(), float(objective.detach()), recorded, psp)


def grads(model) -> dict:
    """name -> gradient (float32 copy) of every parameter that requires one; a parameter without a
    gradient maps to None."""
    return {
        n: (p.grad.detach().float().clone() if p.grad is not None else None)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def snapshot(model) -> dict:
    """A copy of ``model``'s state dict (tensors cloned) for :func:`copy_weights`."""
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in model.state_dict().items()}


def copy_weights(dst, src) -> None:
    """``dst``'s parameters and buffers := ``src``'s (a model or a :func:`snapshot`; expert biases
    included)."""
    state = src if isinstance(src, dict) else src.state_dict()
    missing, unexpected = dst.load_state_dict(state, strict=False)
    # (TransformerEngine's modules keep an "_extra_state" entry, FP8 metadata; a core attention of
    # another kind in the same slot has none: neither side's counts)
    real_missing = [k for k in missing if not k.endswith("_extra_state")]
    real_unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if real_missing or real_unexpected:
        raise ValueError(f"copy_weights: missing {real_missing}, unexpected {real_unexpected}")


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    if scale == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / scale


def rel_err(a: torch.Tensor, b: torch.Tensor, metric: str = "norm") -> float:
    """``a``'s error against ``b``: ``"norm"``, ||a - b|| / ||b||, or ``"max"`` (:func:`max_rel_err`)."""
    if metric == "max":
        return max_rel_err(a, b)
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return 0.0 if num == 0.0 else (num / den if den > 0 else float("inf"))


def grad_report(ours: dict, ref: dict, metric: str = "norm") -> dict:
    """Per-parameter errors of ``ours`` against ``ref`` (name -> :func:`rel_err`), the reference's
    norms, the names that have a gradient on one side only and those without one in ``ref``."""
    one_sided = sorted(n for n in set(ours) | set(ref) if (ours.get(n) is None) != (ref.get(n) is None))
    errors = {n: rel_err(ours[n], ref[n], metric) for n in ref if ref[n] is not None and ours.get(n) is not None}
    norms = {n: float(ref[n].double().norm()) for n in errors}
    return {"errors": errors, "norms": norms, "one_sided": one_sided,
            "no_grad": sorted(n for n in ref if ref[n] is None)}


def mla_core_attention_types(model) -> list:
    """The class name of every MLA layer's core attention, in module order."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return [type(m.core_attention).__name__ for m in model.modules() if isinstance(m, MultiLatentAttention)]


def routes_values(routes) -> torch.Tensor:
    """A route tensor's rows (a jagged nested one's values) on the CPU."""
    return (routes.values() if routes.is_nested else routes).cpu()


def route_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(tokens whose top-k sets agree in every layer, tokens) of two [T, L, K] route tensors."""
    sa, sb = a.long().sort(dim=-1).values, b.long().sort(dim=-1).values
    same = (sa == sb).all(dim=-1).all(dim=-1)
    return int(same.sum()), int(same.numel())


def broadcast_singles(singles) -> None:
    """Rank 0's single-process results on every rank, in place: ``singles`` is a list of (routes, a
    jagged nested route tensor; per-token loss; name -> gradient or None). On GPUs a single
    process's backward is not bitwise deterministic (atomics in the MoE's unpermute and the
    embedding), so each rank's own run may differ slightly; a CP run is checked against rank 0's."""
    import torch.distributed as dist

    for routes, loss, grads in singles:
        dist.broadcast(routes.values().view(torch.uint8), src=0)
        dist.broadcast(loss, src=0)
        for name in sorted(grads):
            if grads[name] is not None:
                dist.broadcast(grads[name], src=0)
