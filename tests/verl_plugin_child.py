"""Scenarios of the verl plugin, each run in a fresh process by tests/test_verl_plugin.py
(``python tests/verl_plugin_child.py SCENARIO``): the plugin acts on ``import verl``, once per
process. Each prints one line ``RESULT <json>`` last."""

from __future__ import annotations

import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Every plugin warning is recorded (the plugin warns once per message).
warnings.simplefilter("always")
_caught = []
_showwarning = warnings.showwarning


def _record(message, category, filename, lineno, file=None, line=None):
    _caught.append((category.__name__, str(message)))
    _showwarning(message, category, filename, lineno, file, line)


warnings.showwarning = _record


def plugin_warnings() -> list:
    return [m for c, m in _caught if c == "VerlOpsPluginWarning"]


def drop_in_state() -> dict:
    """For each verl module owning drop-ins (and model_forward, which imports util's by name):
    which of its functions are verl_ops' drop-ins."""
    import importlib

    from verl_ops.integrations.install import _OWNERS, _UTIL_MODULE, _all_drop_ins

    out = {}
    drop_ins = _all_drop_ins()
    for name, ours in drop_ins.items():
        owner = _OWNERS.get(name, _UTIL_MODULE)
        mod = importlib.import_module(owner)
        if hasattr(mod, name):
            out[f"{owner}.{name}"] = getattr(mod, name) is ours
    mf = importlib.import_module("verl.models.mcore.model_forward")
    for name, ours in drop_ins.items():
        if hasattr(mf, name):
            out[f"verl.models.mcore.model_forward.{name}"] = getattr(mf, name) is ours
    return out


def gpt_model_wrapped() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return bool(getattr(GPTModel.__init__, "_verl_ops_plugin_init", False))


def plugin_report() -> dict:
    mod = sys.modules.get("verl_ops_plugin")
    return mod.report() if mod is not None else {}


def scenario_state() -> dict:
    """``import verl`` and nothing else of ours: what is in place afterwards."""
    import verl  # noqa: F401

    loaded = "verl_ops_plugin" in sys.modules
    return {
        "plugin_loaded": loaded,
        "drop_ins": drop_in_state(),
        "gpt_model_wrapped": gpt_model_wrapped(),
        "report": plugin_report(),
        "warnings": plugin_warnings(),
        "warnings_all": [m for _, m in _caught],
    }


def _tiny_hf_config(size):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=2, num_attention_heads=size.heads,
        num_key_value_heads=size.heads, max_position_embeddings=size.max_seq, rope_theta=10000.0,
        architectures=["DeepseekV3ForCausalLM"],
    )


def _local_specs(*modules, core_attention=None):
    """The builders ask for TransformerEngine specs; without TransformerEngine megatron-core cannot
    make them (NameError: TENorm), so the builders' spec functions make the local ones here, with
    ``core_attention`` (a class) in every MLA slot where given."""
    import megatron_model_lib as lib
    from megatron.core.models.gpt import gpt_layer_specs as specs

    def local(fn):
        def call(*args, **kwargs):
            kwargs["use_transformer_engine"] = False
            spec = fn(*args, **kwargs)
            if core_attention is not None:
                lib.set_core_attention(spec, core_attention)
            return spec

        return call

    for mod in modules:
        for name in ("get_gpt_decoder_block_spec", "get_gpt_mtp_block_spec"):
            if hasattr(mod, name):
                setattr(mod, name, local(getattr(specs, name)))


def _mla_layers(model) -> dict:
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    out = {}
    for m in model.modules():
        if isinstance(m, MultiLatentAttention):
            name = type(m.core_attention).__name__
            out[name] = out.get(name, 0) + 1
    return out


def _step(model, seed=3):
    import random

    import megatron_model_lib as lib

    size = lib.SIZES["tiny"]
    model.zero_grad(set_to_none=True)
    batch = lib.make_batch(lib.random_lengths(random.Random(seed), hi=60), size.vocab, seed)
    res = lib.forward_backward(model, batch, lib.verl_ops_pack())
    return res.loss_per_token, lib.grads(model)


def _same_step(model, reference) -> dict:
    import torch

    import megatron_model_lib as lib

    lib.copy_weights(model, reference)
    loss_a, grads_a = _step(model)
    loss_b, grads_b = _step(reference)
    grads_equal = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in ((grads_a[k], grads_b.get(k)) for k in grads_a)
    )
    return {"loss_equal": bool(torch.equal(loss_a, loss_b)), "grads_equal": grads_equal, "tokens": int(loss_a.numel())}


def scenario_builders() -> dict:
    """verl's model_initializer (DeepseekV3Model) and vanilla mbridge build real models after a
    bare ``import verl``: every MLA layer (MTP included) runs MLACoreAttention, and one training
    step equals that of the model built with ``megatron_mla.install(spec)`` explicitly."""
    import verl  # noqa: F401

    import megatron_model_lib as lib

    lib.init_distributed(1)
    size = lib.SIZES["tiny"]
    out = {"wrapped": gpt_model_wrapped()}
    reference = lib.build_model(lib.make_config("tiny"), "verl_ops")
    out["reference_layers"] = _mla_layers(reference)

    from verl.models.mcore import model_initializer

    _local_specs(model_initializer)
    config = lib.make_config("tiny")
    lib.eager_megatron_fusions()
    with lib.megatron_device("cpu"):
        model = model_initializer.DeepseekV3Model(config, _tiny_hf_config(size)).initialize(freeze_moe_router=False)
    out["model_initializer"] = {"layers": _mla_layers(model), **_same_step(model, reference)}

    try:
        import mbridge.core.llm_bridge as mb_llm
        import mbridge.models.deepseek_v3 as mb_dsv3
    except ImportError as e:
        out["mbridge"] = {"skipped": f"{type(e).__name__}: {e}"}
    else:
        from megatron.core.models.gpt.gpt_model import GPTModel

        _local_specs(mb_llm, mb_dsv3)
        seen = {}
        config2 = lib.make_config("tiny")

        def provider_model():
            # mbridge's DeepSeek-V3 provider, with the test model's config in place of the one
            # mbridge converts from an HF checkpoint's config (so that the weights map one to one).
            bridge = mb_dsv3.DeepseekV3Bridge.__new__(mb_dsv3.DeepseekV3Bridge)
            bridge.config = config2
            bridge.hf_config = _tiny_hf_config(size)
            bridge.has_vp_stage = False
            bridge._get_gptmodel_args = lambda: {
                "vocab_size": size.vocab, "max_sequence_length": size.max_seq,
                "position_embedding_type": "rope", "rotary_base": 10000,
            }
            return bridge._model_provider([])(True, True)

        with lib.megatron_device("cpu"):
            model2 = provider_model()
        seen["layers"] = _mla_layers(model2)
        seen.update(_same_step(model2, reference))
        seen["is_gpt_model"] = isinstance(model2, GPTModel)
        out["mbridge"] = seen
    out["report"] = plugin_report()
    out["warnings"] = plugin_warnings()
    return out


def scenario_engine_forward() -> dict:
    """verl's own Megatron engine forward, with the verl plugin on or off (VERL_OPS_PLUGIN): a
    DeepSeek-V3-like model (MLA + MoE) from vanilla mbridge's DeepSeek-V3 provider after a bare
    ``import verl``, run through verl's ``get_mcore_engine_forward_fn(hf_config)``
    (``gptmodel_forward_model_engine``) on a jagged batch, THD, with the engine's log-prob processor
    (temperature, entropy, ``vocab_parallel_log_probs_from_logits`` as verl's engine binds it) and a
    policy-gradient loss, backward.

    - On the CPU (default): the tiny model in float32, megatron-core's local specs; every MLA core
      attention is a plain torch attention on V padded (the stand-in for TransformerEngine's:
      megatron-core's local one takes no THD batch), which the plugin replaces by MLACoreAttention;
      megatron-core's fixes for running without TransformerEngine in both runs.
    - VERL_OPS_ENGINE_DEVICE=cuda: the "real" model (DeepSeek-V3's head dims) in bf16 on the GPU,
      from TransformerEngine's specs as mbridge builds them where TE imports (the plugin off: TE's
      own attention; on: MLACoreAttention), else as on the CPU. Then also the median time of
      VERL_OPS_ENGINE_REPS (default 10) more steps, after 3 untimed ones.

    The routers record their routes, or, with VERL_OPS_ENGINE_REPLAY=FILE (an earlier run's output),
    replay that run's. Saves log-probs, entropy, routes and every gradient to VERL_OPS_ENGINE_OUT
    (torch.save)."""
    import functools
    import random
    import statistics
    import time

    import torch

    import verl  # noqa: F401

    import megatron_model_lib as lib

    cuda = os.environ.get("VERL_OPS_ENGINE_DEVICE") == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    te = cuda and lib.transformer_engine_available()
    if cuda:
        torch.cuda.set_device(device)
    lib.init_distributed(1, device)
    lib.eager_megatron_fusions()
    # (megatron-core's fixes for running without TransformerEngine; with the plugin on they are in
    # place already, and where TE is there they find nothing to fix)
    from verl_ops.integrations.megatron_compat import patch_megatron_core

    patch_megatron_core()
    size = lib.SIZES["real" if cuda else "tiny"]
    dtype = torch.bfloat16 if cuda else torch.float32
    import mbridge.core.llm_bridge as mb_llm
    import mbridge.models.deepseek_v3 as mb_dsv3
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if not cuda:
        # (on the CPU of a machine that has TE: megatron-core's router GEMM would take TE's, CUDA only)
        from megatron.core.transformer.moe import moe_utils

        if getattr(moe_utils, "te_general_gemm", None) is not None:
            moe_utils.te_general_gemm = None
    if not te:
        _local_specs(mb_llm, mb_dsv3, core_attention=lib.ReferenceMLACoreAttention)
    # (MTP off, as verl's engine configures it unless model.mtp.enable: mtp_num_layers None)
    config = lib.make_config(size, dtype=dtype, device=device.type, mtp=False)
    hf_config = _tiny_hf_config(size)
    bridge = mb_dsv3.DeepseekV3Bridge.__new__(mb_dsv3.DeepseekV3Bridge)
    bridge.config, bridge.hf_config, bridge.has_vp_stage = config, hf_config, False
    bridge._get_gptmodel_args = lambda: {
        "vocab_size": size.vocab, "max_sequence_length": size.max_seq,
        "position_embedding_type": "rope", "rotary_base": 10000,
    }
    torch.manual_seed(0)
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    with lib.megatron_device(device):
        model = bridge._model_provider([])(True, True).to(device)
    lib.randomize_expert_bias(model, 1)

    # The engine's log-prob processor (MegatronEngineWithLMHead._lm_head_logits_processor without
    # sum_pi_squared / distillation), with the functions as verl's engine module binds them: after
    # ``import verl`` (and so after the plugin), from verl.utils.megatron.tensor_parallel.
    from verl.utils.megatron import tensor_parallel as verl_tp

    log_probs_fn, entropy_fn = verl_tp.vocab_parallel_log_probs_from_logits, verl_tp.vocab_parallel_entropy

    def processor(logits, label, temperature):
        temperature[temperature <= 0] = 1e-8
        logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))
        logits_bak = logits.clone()
        return {"entropy": entropy_fn(logits), "log_probs": log_probs_fn(logits_bak, label)}

    import verl.utils.torch_functional as verl_F
    from verl.models.mcore import get_mcore_engine_forward_fn

    rng = random.Random(5)
    if cuda:
        lengths = lib.random_lengths(rng, 4, 8, lo=16, hi=2048, mu=6.0, sigma=1.0, with_long=True)
    else:
        lengths = lib.random_lengths(rng, 4, 7, hi=80, with_long=True)
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(1, size.vocab, (n,), generator=g).to(device) for n in lengths]
    input_ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    loss_mask = torch.nested.as_nested_tensor(
        [(torch.rand(n, generator=g) < 0.8).float().to(device) for n in lengths], layout=torch.jagged)
    adv = torch.randn(sum(lengths), generator=g).to(device)
    temperature = verl_F.expand_as_nested(torch.full((len(lengths),), 0.7, device=device), input_ids)
    routers = lib.routers(model)
    replay = os.environ.get("VERL_OPS_ENGINE_REPLAY")
    targets = torch.load(replay)["routes"] if replay else None
    forward_fn = get_mcore_engine_forward_fn(hf_config)

    def step(record: bool):
        for i, r in enumerate(routers):
            r.clear_indices()
            if targets is not None:
                r.set_target_indices(targets[i].to(device))
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif record:
                r.set_router_replay_action(RouterReplayAction.RECORD)
        model.zero_grad(set_to_none=True)
        with lib.megatron_device(device):
            out = forward_fn(
                model, input_ids, {}, logits_processor=functools.partial(processor),
                logits_processor_args={"label": input_ids.clone(), "temperature": temperature.clone(),
                                       "loss_mask": loss_mask, "response_attention_mask": None},
                vision_model=False, pad_token_id=0, data_format="thd", mtp_enable_train=False,
            )
            lp, ent = out["log_probs"], out["entropy"]
            lp_v = lp.values() if lp.is_nested else lp
            loss = -(lp_v * adv * loss_mask.values()).sum() / loss_mask.values().sum()
            loss.backward()
        routes = [r.get_recorded_indices().detach().clone() for r in routers] if record and targets is None else None
        for r in routers:
            r.clear_indices()
            r.clear_router_replay_action()
        return lp, ent, lp_v, routes

    selected = None
    lp, ent, lp_v, routes = step(record=True)
    if te:
        selected = lib.te_selected()
    path = os.environ["VERL_OPS_ENGINE_OUT"]
    torch.save({
        "log_probs": lp_v.detach().float().cpu(), "entropy": (ent.values() if ent.is_nested else ent).detach().float().cpu(),
        "routes": [r.cpu() for r in routes] if routes is not None else [t.cpu() for t in targets],
        "grads": {k: (v.cpu() if v is not None else None) for k, v in lib.grads(model).items()},
    }, path)
    step_ms = None
    if cuda:
        times = []
        for i in range(3 + int(os.environ.get("VERL_OPS_ENGINE_REPS", "10"))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(record=False)
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        step_ms = statistics.median(times)
    return {
        "device": str(device),
        "te": te,
        "te_selected": selected,
        "layers": _mla_layers(model),
        "lengths": lengths,
        "nested": [bool(lp.is_nested), bool(ent.is_nested)],
        "log_probs_fn": f"{log_probs_fn.__module__}.{log_probs_fn.__name__}",
        "param_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "step_ms": step_ms,
        "drop_ins": drop_in_state(),
        "report": plugin_report(),
        "warnings": plugin_warnings(),
    }


def scenario_verl_value_pad() -> dict:
    """verl's own MLA patch (megatron-core < 0.16.2: ``MultiLatentAttention.forward`` zero-pads V),
    applied after the model is built as verl's bridge path does: the MLACoreAttention layers still
    get the native V, and the step is unchanged."""
    import verl  # noqa: F401

    import megatron_model_lib as lib
    from verl_ops.integrations.megatron_mla import MLACoreAttention

    lib.init_distributed(1)
    config = lib.make_config("tiny")
    model = lib.build_model(config, "verl_ops")
    reference = lib.build_model(lib.make_config("tiny"), "verl_ops")
    before = _same_step(model, reference)

    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from verl.models.mcore.patch import apply_patch

    apply_patch()
    patched = getattr(MultiLatentAttention.forward, "__module__", "")
    v_dims = []
    original = MLACoreAttention.forward

    def spy(self, query, key, value, *args, **kwargs):
        v_dims.append(int(value.shape[-1]))
        return original(self, query, key, value, *args, **kwargs)

    MLACoreAttention.forward = spy
    try:
        after = _same_step(model, reference)
        dims_with_plugin = sorted(set(v_dims))
        # The control: the layers' own forward (the class's: verl's patch) pads V.
        v_dims.clear()
        for m in model.modules():
            if isinstance(m, MultiLatentAttention) and "forward" in vars(m):
                del m.forward
        without = _same_step(model, reference)
        dims_without = sorted(set(v_dims))
    finally:
        MLACoreAttention.forward = original
    return {
        "class_forward": patched,
        "before": before,
        "after": after,
        "without_plugin_dispatch": without,
        "v_dims": dims_with_plugin,
        "v_dims_verl_forward": dims_without,
        "qk_head_dim": config.qk_head_dim + config.qk_pos_emb_head_dim,
        "v_head_dim": config.v_head_dim,
        "warnings": plugin_warnings(),
    }


def _core_attention_slots(spec) -> list:
    """The core-attention entry of every MLA self-attention submodules object reachable from
    ``spec`` (found by their fields, so that this works without megatron-core's MLA module)."""
    import dataclasses

    out, seen = [], set()

    def walk(obj):
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
            return
        if not dataclasses.is_dataclass(obj):
            return
        if hasattr(obj, "core_attention") and hasattr(obj, "linear_kv_down_proj"):
            out.append(obj.core_attention)
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name, None))

    walk(spec)
    return out


def _recorded_build(config, before_build=None):
    """GPTModel built by the plugin's wrapper around a stand-in for megatron-core's own
    ``__init__`` that keeps its arguments (no modules are built): the specs as the plugin hands them."""
    import torch

    import megatron_model_lib as lib
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    import inspect

    seen = {}
    real = GPTModel.__init__.__wrapped__
    signature = inspect.signature(real)

    def keep(self, *args, **kwargs):
        torch.nn.Module.__init__(self)
        seen.update(signature.bind(self, *args, **kwargs).arguments)

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    if before_build is not None:
        before_build()
    GPTModel.__init__.__wrapped__ = keep
    try:
        GPTModel(config=config, transformer_layer_spec=block, vocab_size=lib.SIZES["tiny"].vocab,
                 max_sequence_length=64, mtp_block_spec=mtp)
    finally:
        GPTModel.__init__.__wrapped__ = real
    slots = _core_attention_slots(seen["transformer_layer_spec"]) + _core_attention_slots(seen["mtp_block_spec"])
    given = _core_attention_slots(block)
    return {
        "slots": sorted({getattr(s, "__name__", type(s).__name__) for s in slots}),
        "callers_spec_unchanged": all(s is not None and getattr(s, "__name__", "") != "MLACoreAttention" for s in given),
    }


def scenario_unsupported() -> dict:
    """A configuration the module does not run (attention dropout): the layers keep their core
    attention and the report says why; a supported one gets the module."""
    import verl  # noqa: F401

    import megatron_model_lib as lib

    lib.init_distributed(1)
    ok = _recorded_build(lib.make_config("tiny"))
    config = lib.make_config("tiny")
    config.attention_dropout = 0.1
    kept = _recorded_build(config)
    return {"supported": ok, "dropout": kept, "report": plugin_report(), "warnings": plugin_warnings()}


def scenario_megatron_version() -> dict:
    """A megatron-core release outside the checked range: the MLA part is left alone, with a warning."""
    import megatron.core

    megatron.core.__version__ = os.environ.get("FAKE_MEGATRON_VERSION", "0.12.0")
    import verl  # noqa: F401

    return {"gpt_model_wrapped": gpt_model_wrapped(), "drop_ins": drop_in_state(),
            "report": plugin_report(), "warnings": plugin_warnings()}


def scenario_no_mla() -> dict:
    """A megatron-core without MLA (its multi_latent_attention module cannot be imported): models
    build with their own attention, with a warning."""
    import importlib

    import verl  # noqa: F401

    import megatron_model_lib as lib

    lib.init_distributed(1)
    config = lib.make_config("tiny")
    importlib.import_module("megatron.core.models.gpt.gpt_model")

    def remove_mla():
        import megatron.core.transformer as transformer

        sys.modules["megatron.core.transformer.multi_latent_attention"] = None
        if hasattr(transformer, "multi_latent_attention"):
            delattr(transformer, "multi_latent_attention")

    try:
        res = _recorded_build(config, remove_mla)
    except Exception as e:  # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}"}
    return {"build": res, "warnings": plugin_warnings()}


def scenario_broken_ops() -> dict:
    """verl_ops' compiled library cannot load (a wheel for another CUDA, say): ``import verl`` and
    verl's modules still import, with verl's own functions and a warning."""
    sys.modules["verl_ops._C"] = None
    import verl  # noqa: F401
    import verl.models.mcore.model_forward as mf

    return {"model_forward_module": mf.preprocess_packed_seqs.__module__, "warnings": plugin_warnings()}


def scenario_log_level() -> dict:
    """``import verl`` with VERL_OPS_LOG_LEVEL as set by the test: the logger's level, the warnings,
    and whether the drop-ins went in (a bad level must cost nothing but a warning)."""
    import logging

    import verl  # noqa: F401

    state = drop_in_state()  # imports the owners: the data part runs and logs its INFO line
    return {"level": logging.getLogger("verl_ops.plugin").level, "drop_ins": state,
            "warnings": plugin_warnings()}


def scenario_warnings_as_errors() -> dict:
    """The plugin's warnings turned into errors (as ``-W error`` or pytest's filterwarnings=error do)
    while it has one to give (VERL_OPS_LOG_LEVEL is not a level): importing verl's modules must
    still work."""
    warnings.filterwarnings("error", message="verl_ops plugin")
    import verl  # noqa: F401
    import verl.models.mcore.model_forward  # noqa: F401

    warnings.simplefilter("always")
    return {"drop_ins": drop_in_state()}


def scenario_uninstall() -> dict:
    """The plugin's data part, a verl module imported afterwards (model_forward binds the drop-ins
    by name), then ``uninstall()``: no verl module keeps a drop-in, and an owner imported only after
    ``uninstall()`` keeps verl's functions (the plugin's pending hooks are dropped)."""
    import verl  # noqa: F401
    import verl.models.mcore.model_forward  # noqa: F401

    from verl_ops.integrations import verl as vi
    from verl_ops.integrations.install import _all_drop_ins

    late = "verl.utils.dynamic_cp_scheduler"
    late_imported_before = late in sys.modules
    drop_ins = _all_drop_ins()
    before = sorted(f"{m}.{n}" for m, mod in list(sys.modules.items()) if m.startswith("verl.") and mod
                    for n, f in drop_ins.items() if getattr(mod, n, None) is f)
    restored = vi.uninstall()
    import importlib

    importlib.import_module(late)
    after = sorted(f"{m}.{n}" for m, mod in list(sys.modules.items()) if m.startswith("verl.") and mod
                   for n, f in drop_ins.items() if getattr(mod, n, None) is f)
    restored_modules = sorted({getattr(getattr(sys.modules[r.rsplit(".", 1)[0]], r.rsplit(".", 1)[1]),
                                       "__module__", "?") for r in restored})
    return {"before": before, "restored": restored, "after": after, "restored_modules": restored_modules,
            "report_data_undone": "undone" in plugin_report().get("data", {}),
            "late_imported_before": late_imported_before, "warnings": plugin_warnings()}


def scenario_spec_copy_fails() -> dict:
    """A GPTModel spec that cannot be deep-copied: the plugin leaves it alone (one warning) instead of
    putting MLACoreAttention into the caller's own object; a spec that can be copied still gets it."""
    import inspect
    import types

    import verl  # noqa: F401
    from verl_ops.integrations import megatron_mla, plugin

    placed = []
    plugin._prepare_megatron = lambda: None
    megatron_mla.place_in_spec = lambda spec, config: (placed.append(spec) or
                                                      {"placed": 1, "kept": {}, "replaced": {}})

    class NoCopy:
        def __deepcopy__(self, memo):
            raise TypeError("no copies of this spec")

    def gpt_init(self, config, transformer_layer_spec, mtp_block_spec=None):
        pass

    layer, mtp = NoCopy(), {"a": 1}
    config = types.SimpleNamespace(multi_latent_attention=True)
    args, kwargs, report = plugin._with_mla_specs(inspect.signature(gpt_init), object(), (config, layer),
                                                  {"mtp_block_spec": mtp})
    return {"caller_spec_placed": any(p is layer for p in placed), "mtp_copy_placed": len(placed) == 1
            and placed[0] == mtp and placed[0] is not mtp, "layer_arg_kept": args[1] is layer,
            "report_placed": (report or {}).get("placed"), "warnings": plugin_warnings()}


if __name__ == "__main__":
    result = globals()[f"scenario_{sys.argv[1]}"]()
    sys.stdout.flush()
    print("RESULT " + json.dumps(result, default=str))
