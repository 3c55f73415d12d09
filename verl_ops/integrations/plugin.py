"""What the verl plugin (:mod:`verl_ops_plugin`) does once verl's and megatron-core's modules load.

- :func:`patch_data_path`: the drop-ins into a verl module that owns some of them, right after it
  finished importing (:func:`verl_ops.integrations.install.install` limited to that owner), so the
  verl modules imported after it bind the drop-ins by name.
- :func:`patch_gpt_model`: megatron-core's ``GPTModel.__init__`` puts
  :class:`~verl_ops.integrations.megatron_mla.MLACoreAttention` into the MLA core-attention slots of
  the layer and MTP specs it is given (a copy of them), for the layers whose configuration the module
  supports (:func:`~verl_ops.integrations.megatron_mla.unsupported_reason`); every builder verl
  uses (Megatron-Bridge's providers, vanilla mbridge, verl's model_initializer) constructs
  ``GPTModel``, TransformerEngine specs included. The first build also applies
  :func:`~verl_ops.integrations.megatron_mla.install` (megatron-core fixes, the native-V bypass of
  megatron-core >= 0.18, the one-pass THD RoPE).
- Where verl's own MLA patch (``verl.models.mcore.patch.apply_patch``, megatron-core < 0.16.2)
  replaces ``MultiLatentAttention.forward`` to zero-pad V to the query head dim, the MLA layers that
  run ``MLACoreAttention`` call megatron-core's own forward instead (which hands V as it is), so the
  module gets the native V. verl may apply that patch before or after the model is built; the
  choice is made per call.

Every failure leaves megatron-core's / verl's original in place, with one warning.
"""

from __future__ import annotations

import copy
import inspect
import types

import verl_ops_plugin as _plugin

_INIT_ATTR = "_verl_ops_plugin_init"
# megatron-core's own MultiLatentAttention.forward, remembered before verl can replace it.
_megatron_mla_forward = None


def _names(entries) -> str:
    return ", ".join(entries) if entries else "none"


def patch_data_path(owner: str) -> dict:
    """Put the drop-ins owned by verl module ``owner`` in place (it has finished importing), and in
    every verl module already imported that bound verl's originals by name. Returns this call's
    ``install`` report."""
    from .install import install

    result = install(report=True, owners={owner})
    left = [f"{n} (not in this verl)" for n in result["missing"]]
    left += [f"{n} (other parameters)" for n in result["incompatible"]]
    rep = _plugin._state["report"].setdefault("data", {"patched": [], "left alone": []})
    rep["patched"] += result["patched"]
    rep["left alone"] += left
    short = sorted({p.rsplit(".", 1)[1] for p in result["patched"]})
    _plugin.info_once(
        f"data:{owner}",
        f"verl {_plugin._verl_version()}: {owner}: {len(short)} drop-ins in place ({_names(short)}), "
        f"{len(result['patched'])} bindings in {len({p.rsplit('.', 1)[0] for p in result['patched']})} "
        f"modules; left alone: {_names(left)}. verl's other data-path modules get theirs when imported.",
    )
    return result


def _is_megatron_forward(fn) -> bool:
    return getattr(fn, "__module__", "").startswith("megatron.")


def _is_verl_value_pad(fn) -> bool:
    """verl's ``apply_patch`` forward for megatron-core < 0.16.2 (pads V to the query head dim)."""
    return getattr(fn, "__module__", "") == "verl.models.mcore.patch"


def remember_mla_forward(mla_module) -> None:
    """Keep megatron-core's own ``MultiLatentAttention.forward`` (before verl may replace it)."""
    global _megatron_mla_forward
    fn = getattr(getattr(mla_module, "MultiLatentAttention", None), "forward", None)
    if fn is not None and _is_megatron_forward(fn):
        _megatron_mla_forward = fn


def _mla_forward(self, *args, **kwargs):
    """The forward of an MLA layer that runs MLACoreAttention: the class's, except where that is
    verl's V-padding patch (then megatron-core's own, which hands the module V as it is)."""
    cls_forward = type(self).forward
    if _megatron_mla_forward is not None and _is_verl_value_pad(cls_forward):
        return _megatron_mla_forward(self, *args, **kwargs)
    return cls_forward(self, *args, **kwargs)


def _megatron_version() -> str:
    try:
        import megatron.core as mc

        return str(getattr(mc, "__version__", None) or "unknown")
    except Exception:  # noqa: BLE001
        return "unknown"


def patch_gpt_model(gpt_model_module) -> bool:
    """Wrap ``GPTModel.__init__`` of megatron-core (see the module docstring). Idempotent."""
    version = _megatron_version()
    if not _plugin.version_ok("megatron-core", version, _plugin.MEGATRON_RANGE):
        _plugin._state["report"]["mla"] = {"left alone": [f"megatron-core {version} (version)"]}
        return False
    cls = getattr(gpt_model_module, "GPTModel", None)
    if cls is None:
        _plugin.warn(f"megatron-core {version} has no GPTModel in {gpt_model_module.__name__}; MLA left alone")
        return False
    original = cls.__init__
    if getattr(original, _INIT_ATTR, False):
        return True
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        args, kwargs, spec_report = _with_mla_specs(signature, self, args, kwargs)
        __init__.__wrapped__(self, *args, **kwargs)  # megatron-core's (read per call: tests swap it)
        if spec_report is not None:
            _report_model(self, spec_report, version)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    setattr(__init__, _INIT_ATTR, True)
    cls.__init__ = __init__
    return True


def _prepare_megatron() -> str | None:
    """megatron_mla.install() (fixes, native-V bypass, one-pass RoPE) once; why not, or None."""
    state = _plugin._state
    if "mla_prepared" in state:
        return state["mla_prepared"]
    try:
        from megatron.core.transformer import multi_latent_attention as mla_module
    except Exception as e:  # noqa: BLE001
        state["mla_prepared"] = f"megatron-core {_megatron_version()} has no MLA ({type(e).__name__}: {e})"
        return state["mla_prepared"]
    if _megatron_mla_forward is None:
        remember_mla_forward(mla_module)
    try:
        from .megatron_mla import install

        install()
    except Exception as e:  # noqa: BLE001  (once: not retried for every later model)
        state["mla_prepared"] = (f"megatron_mla.install() failed ({type(e).__name__}: {e}; the fixes it applied "
                                 "before that stay)")
        return state["mla_prepared"]
    state["mla_prepared"] = None
    return None


def _with_mla_specs(signature, model, args, kwargs):
    """GPTModel's arguments with MLACoreAttention in copies of its layer / MTP specs, and the spec
    report; the arguments unchanged (report None) where the model has no MLA or anything fails."""
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return args, kwargs, None  # GPTModel reports its own argument errors
    config = bound.arguments.get("config")
    if config is None or not getattr(config, "multi_latent_attention", False):
        return args, kwargs, None
    try:
        why = _prepare_megatron()
        if why is not None:
            _plugin.warn(f"{why}; MLA layers keep their attention")
            return args, kwargs, None
        from .megatron_mla import place_in_spec

        total = {"placed": 0, "kept": {}, "replaced": {}}
        for name in ("transformer_layer_spec", "mtp_block_spec"):
            spec = bound.arguments.get(name)
            if spec is None:
                continue
            try:
                spec = copy.deepcopy(spec)  # the caller's spec object stays as it was
            except Exception as e:  # noqa: BLE001  (never edit the caller's object instead)
                _plugin.warn(f"GPTModel's {name} could not be copied ({type(e).__name__}: {e}); "
                             "its MLA layers keep their attention")
                continue
            rep = place_in_spec(spec, config)
            bound.arguments[name] = spec
            total["placed"] += rep["placed"]
            for key in ("kept", "replaced"):
                for k, n in rep[key].items():
                    total[key][k] = total[key].get(k, 0) + n
        return bound.args[1:], bound.kwargs, total
    except Exception as e:  # noqa: BLE001
        _plugin.warn(f"MLACoreAttention could not be put into the model's specs ({type(e).__name__}: {e}); "
                     "MLA layers keep their attention")
        return args, kwargs, None


def _report_model(model, spec_report: dict, version: str) -> None:
    """Count the built model's MLA layers by core attention, route the ones that run
    MLACoreAttention past verl's V pad, and log the placement."""
    try:
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        from .megatron_mla import MLACoreAttention

        total = ours = 0
        kept_classes: dict[str, int] = {}
        for m in model.modules():
            if not isinstance(m, MultiLatentAttention):
                continue
            total += 1
            core = getattr(m, "core_attention", None)
            if isinstance(core, MLACoreAttention):
                ours += 1
                m.forward = types.MethodType(_mla_forward, m)
            else:
                name = type(core).__name__
                kept_classes[name] = kept_classes.get(name, 0) + 1
    except Exception as e:  # noqa: BLE001
        _plugin.warn(f"could not inspect the built model ({type(e).__name__}: {e})")
        return
    kept = [f"{n} ({r})" for r, n in sorted(spec_report["kept"].items())]
    rep = _plugin._state["report"].setdefault("mla", {"models": []})
    entry = {
        "mla_layers": total,
        "mla_core_attention": ours,
        "replaced": dict(spec_report["replaced"]),
        "kept": dict(spec_report["kept"]),
        "kept_classes": kept_classes,
    }
    rep.setdefault("models", []).append(entry)
    replaced = _names([f"{k} x{n}" for k, n in sorted(spec_report["replaced"].items())])
    _plugin.info_once(
        "mla",
        f"megatron-core {version}: MLACoreAttention in {ours} of {total} MLA layers of "
        f"{type(model).__name__} (MTP included; spec slots replaced: {replaced}); "
        f"kept their attention: {_names(kept) if kept or not kept_classes else _names(sorted(kept_classes))}",
    )
