"""Swapping verl_ops' drop-ins into verl: :func:`install` / :func:`uninstall` and the registry
of drop-ins (which verl module owns each, verl's originals, the last report). The drop-ins live in
the modules that implement them (:mod:`~verl_ops.integrations.verl`, ``verl_bshd``, ``verl_r3``,
``verl_pp``, ``verl_dcp``), which this module imports when the registry is first read (not at
import: :mod:`verl_ops.integrations.verl` re-exports ``install`` / ``uninstall`` from here)."""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings

__all__ = ["install", "last_report", "uninstall"]

# verl's module that owns a drop-in unless _OWNERS names another.
_UTIL_MODULE = "verl.models.mcore.util"
# Module that owns each drop-in in verl (the one install() patches first); default _UTIL_MODULE.
_OWNERS: dict[str, str] = {
    "_local_padding_mask": "verl.utils.dynamic_cp_scheduler",
    "build_r3_replay_mask": "verl.utils.megatron.router_replay_utils",
    "align_r3_router_replay_data": "verl.utils.megatron.router_replay_utils",
    "pp_gather": "verl.utils.megatron.router_replay_utils",
    "reorder_and_merge_vpp_layers": "verl.utils.megatron.router_replay_utils",
    "merge_nested_router_maps": "verl.utils.megatron.router_replay_utils",
    "DynamicCPScheduler": "verl.utils.dynamic_cp_scheduler",
    "postprocess_dynamic_cp_batch": "verl.utils.dynamic_cp_scheduler",
    "vocab_parallel_log_probs_from_logits": "verl.utils.megatron.tensor_parallel",
}
# (module name, attribute) -> verl's original function, for uninstall().
_ORIGINALS: dict[tuple[str, str], object] = {}
#: What the last :func:`install` did: ``{"patched": [...], "missing": [...], "incompatible": [...]}``.
last_report: dict[str, list[str]] = {"patched": [], "missing": [], "incompatible": []}


def _all_drop_ins() -> dict:
    """Every drop-in by its name in verl: the THD ones (verl), the BSHD / dict-output / VLM-mask
    ones (verl_bshd), the R3 / router padding-mask ones (verl_r3), the pipeline-parallel
    router-map ones (verl_pp) and the dynamic CP scheduler class and output collection (verl_dcp)."""
    from . import verl, verl_bshd, verl_dcp, verl_logprob, verl_pp, verl_r3

    out = dict(verl._DROP_INS)
    out.update({name: getattr(verl_bshd, name) for name in verl_bshd.__all__})
    out.update({
        "_local_padding_mask": verl_r3.local_padding_mask,
        "build_r3_replay_mask": verl_r3.build_r3_replay_mask,
        "align_r3_router_replay_data": verl_r3.align_r3_router_replay_data,
    })
    out.update({name: getattr(verl_pp, name) for name in verl_pp.__all__})
    out["DynamicCPScheduler"] = verl_dcp.DynamicCPScheduler
    out["postprocess_dynamic_cp_batch"] = verl_dcp.postprocess_dynamic_cp_batch
    out["vocab_parallel_log_probs_from_logits"] = verl_logprob.vocab_parallel_log_probs_from_logits
    return out


def _verl_modules():
    """(name, module) of every imported ``verl`` / ``verl.*`` module (a snapshot of sys.modules)."""
    return [(n, m) for n, m in list(sys.modules.items())
            if m is not None and (n == "verl" or n.startswith("verl."))]


def _accepts(ours, theirs) -> bool:
    """verl's parameters are a prefix of ours, in order (every verl call site still binds the same)."""
    try:
        mine = list(inspect.signature(ours).parameters)
        other = list(inspect.signature(theirs).parameters)
    except (TypeError, ValueError):
        return False
    return mine[: len(other)] == other


def install(*, strict: bool = False, report: bool = False, owners=None):
    """Swap the drop-ins into verl.

    Replaces the THD functions (``preprocess_packed_seqs``, ``postprocess_packed_seqs``,
    ``preprocess_thd_engine``, ``postprocess_thd_engine``) and the BSHD / dict-output / VLM-mask
    ones of :mod:`verl_ops.integrations.verl_bshd` (``preprocess_bshd_engine``,
    ``postprocess_bshd_engine``, ``preprocess_bshd``, ``postprocess_bshd``,
    ``postprocess_packed_seqs_for_dict_output``, ``build_vlm_attn_mask_thd``,
    ``build_vlm_attn_mask_bshd``) and the R3 / router padding-mask ones of
    :mod:`verl_ops.integrations.verl_r3` (``_local_padding_mask`` in
    ``verl.utils.dynamic_cp_scheduler``; ``build_r3_replay_mask``, ``align_r3_router_replay_data`` in
    ``verl.utils.megatron.router_replay_utils``), the pipeline-parallel router-map ones of
    :mod:`verl_ops.integrations.verl_pp` and the dynamic CP ones of
    :mod:`verl_ops.integrations.verl_dcp` (``DynamicCPScheduler``, ``postprocess_dynamic_cp_batch``)
    and the log-prob one of :mod:`verl_ops.integrations.verl_logprob`
    (``vocab_parallel_log_probs_from_logits`` in ``verl.utils.megatron.tensor_parallel``)
    in the verl module that owns them (``verl.models.mcore.util`` unless named)
    and in every already-imported ``verl.*`` module that imported them by name (e.g.
    ``verl.models.mcore.model_forward``); modules imported later pick the drop-ins up from the
    owner. A function this verl does not have is reported as missing; one whose verl parameters
    are not a prefix of ours (a newer/forked verl with parameters the drop-in lacks) is left
    alone, reported as incompatible, with a warning.

    Returns the patched names as ``"module.attribute"`` (newly patched by this call), or with
    ``report=True`` the dict ``{"patched": [...], "missing": [...], "incompatible": [...]}`` (also
    kept in :data:`last_report`). When verl (or megatron-core, which verl's module imports) is not
    importable, nothing is patched — or ``ImportError`` is raised if ``strict=True``. Undo with
    :func:`uninstall`.

    ``owners`` (a collection of verl module names) limits the call to the drop-ins those modules
    own, and imports nothing: an owner that is not imported is skipped. The verl plugin
    (:mod:`verl_ops.integrations.plugin`) calls it as each owner finishes executing its code.
    """
    drop_ins = _all_drop_ins()
    result = {"patched": [], "missing": [], "incompatible": []}
    originals = {}
    for name, ours in drop_ins.items():
        owner = _OWNERS.get(name, _UTIL_MODULE)
        if owners is not None:
            if owner not in owners:
                continue
            if owner not in sys.modules:
                continue
        try:
            mod = importlib.import_module(owner)
        except Exception:  # noqa: BLE001  (ImportError, or any error raised while verl's module imports)
            if strict:
                raise
            result["missing"].append(f"{owner}.{name}")
            continue
        current = getattr(mod, name, None)
        if current is None:
            result["missing"].append(f"{owner}.{name}")
            continue
        theirs = _ORIGINALS.get((owner, name), current)
        if theirs is ours:
            continue
        if not _accepts(ours, theirs):
            warnings.warn(
                f"verl_ops.integrations.verl.install: {owner}.{name} has parameters the drop-in "
                f"does not support ({inspect.signature(theirs)}); leaving verl's version in place",
                stacklevel=2,
            )
            result["incompatible"].append(f"{owner}.{name}")
            continue
        originals[name] = theirs
    for mod_name, mod in _verl_modules():
        for name, theirs in originals.items():
            if getattr(mod, name, None) is theirs:
                _ORIGINALS.setdefault((mod_name, name), theirs)
                setattr(mod, name, drop_ins[name])
                result["patched"].append(f"{mod_name}.{name}")
    result = {k: sorted(v) for k, v in result.items()}
    last_report.clear()
    last_report.update(result)
    return result if report else result["patched"]


def uninstall() -> list[str]:
    """Undo :func:`install` (and the verl plugin's data part): put verl's original functions back
    in every imported ``verl.*`` module that holds a drop-in, including modules imported after
    :func:`install` that bound a drop-in from its owner, and drop the plugin's hooks for owners not
    imported yet. Returns the restored names as ``"module.attribute"``."""
    drop_ins = _all_drop_ins()
    originals = {name: theirs for (_, name), theirs in _ORIGINALS.items()}
    restored = []
    for mod_name, mod in _verl_modules():
        for name, theirs in originals.items():
            if getattr(mod, name, None) is drop_ins[name]:
                setattr(mod, name, theirs)
                restored.append(f"{mod_name}.{name}")
    _ORIGINALS.clear()
    plugin = sys.modules.get("verl_ops_plugin")
    if plugin is not None and hasattr(plugin, "disarm_data"):
        plugin.disarm_data()
    return sorted(restored)
