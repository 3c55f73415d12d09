"""verl_ops' verl plugin: ``pip install verl_ops`` puts verl_ops into every verl process.

verl (>= 0.9.1) imports every setuptools entry point of the group ``verl.plugins`` while
``import verl`` runs, in the driver and in every Ray worker; verl_ops registers this module there
(pyproject.toml). ``VERL_USE_EXTERNAL_MODULES=verl_ops_plugin`` is the explicit alternative
(verl's older hook, also honoured with ``VERL_USE_EXTERNAL_PLUGINS=none``).

This module is deliberately light and outside the ``verl_ops`` package: importing it loads
neither verl_ops' compiled libraries nor megatron-core, so that nothing here can fail while verl
itself is still importing (verl would swallow the error at DEBUG level). It only arms import
hooks; the work happens in :mod:`verl_ops.integrations.plugin` when the modules it patches
finish importing:

- ``data``: verl's data-path helpers (``verl.models.mcore.util``,
  ``verl.utils.megatron.router_replay_utils``, ``verl.utils.dynamic_cp_scheduler``,
  ``verl.utils.megatron.tensor_parallel``) get the
  drop-ins of :mod:`verl_ops.integrations.verl` as soon as each of them is imported, so every verl
  module that imports them by name afterwards (``model_forward``) binds the drop-ins;
- ``mla``: every megatron-core ``GPTModel`` built afterwards (by Megatron-Bridge, vanilla mbridge
  or verl's model_initializer: all of them construct ``GPTModel``) gets
  :class:`~verl_ops.integrations.megatron_mla.MLACoreAttention` in the MLA core-attention slots of
  its layer and MTP specs, where the layer's configuration is supported.

``VERL_OPS_PLUGIN`` chooses the parts: ``all`` (default), ``data``, ``mla``, or ``off``
(also ``0``, ``none``, ``false``). verl's own ``VERL_USE_EXTERNAL_PLUGINS=none`` keeps this module
from loading at all. Nothing here raises: a part that cannot be applied leaves verl's original in
place with one warning (:class:`VerlOpsPluginWarning`) naming what and why; the same for a verl or
megatron-core release outside the range this release was checked against
(``VERL_OPS_PLUGIN_VERSION_CHECK=0`` applies the parts anyway). One INFO line per process and
part (rank 0) says what was patched and what was left alone; ``report()`` returns it all.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings

__all__ = ["ENV", "VerlOpsPluginWarning", "parts", "report"]

#: The variable that chooses the parts.
ENV = "VERL_OPS_PLUGIN"
VERSION_CHECK_ENV = "VERL_OPS_PLUGIN_VERSION_CHECK"
PARTS = ("data", "mla")
_OFF = {"off", "0", "none", "false", "no"}

# verl releases whose functions the drop-ins were compared against (0.9.x, and main's 0.10 dev).
VERL_RANGE = ((0, 9, 1), (0, 11, 0))
# megatron-core releases the MLA module was run in (0.16.1 - 0.19.2).
MEGATRON_RANGE = ((0, 16, 1), (0, 20, 0))

# verl modules that own drop-ins (verl_ops.integrations.install._OWNERS).
DATA_MODULES = (
    "verl.models.mcore.util",
    "verl.utils.megatron.router_replay_utils",
    "verl.utils.dynamic_cp_scheduler",
    "verl.utils.megatron.tensor_parallel",
)
MLA_MODULE = "megatron.core.transformer.multi_latent_attention"
GPT_MODEL_MODULE = "megatron.core.models.gpt.gpt_model"

log = logging.getLogger("verl_ops.plugin")


class VerlOpsPluginWarning(UserWarning):
    """A part of the verl plugin was left out; verl runs with its own function there."""


_state = {"parts": frozenset(), "armed": False, "report": {}, "logged": set(), "warned": set()}


def parts(value: str | None = None) -> frozenset:
    """The parts ``VERL_OPS_PLUGIN`` (or ``value``) selects: a comma list of ``data`` / ``mla``,
    ``all`` (default, empty or unset) or ``off``. An unknown name warns and is ignored."""
    raw = os.environ.get(ENV, "all") if value is None else value
    names = {p.strip().lower() for p in raw.split(",") if p.strip()}
    if not names or "all" in names:
        return frozenset(PARTS)
    if names & _OFF:
        return frozenset()
    unknown = sorted(names - set(PARTS))
    if unknown:
        warn(f"{ENV}={raw!r}: unknown part(s) {unknown} ignored (known: all, data, mla, off)")
    return frozenset(names & set(PARTS))


def report() -> dict:
    """What the plugin did in this process: per part, what it patched and what it left alone."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in _state["report"].items()}


def warn(message: str) -> None:
    """One warning per distinct message (every rank: a left-out part matters on each)."""
    if message in _state["warned"]:
        return
    _state["warned"].add(message)
    try:  # (under ``-W error`` a warning raises: never into verl's import)
        warnings.warn(f"verl_ops plugin: {message}", VerlOpsPluginWarning, stacklevel=2)
    except Exception:  # noqa: BLE001
        pass


def _rank_zero() -> bool:
    rank = os.environ.get("RANK")
    if rank is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank() == 0
        except Exception:  # noqa: BLE001
            return True
        return True
    return rank.strip() in ("", "0")


LOG_LEVEL_ENV = "VERL_OPS_LOG_LEVEL"


def _apply_log_level() -> None:
    """The logger's level from ``VERL_OPS_LOG_LEVEL`` (a level name such as ``DEBUG``, or a number;
    default ``INFO``), unless the logger already has one. An unknown value: INFO, one warning."""
    if log.level != logging.NOTSET:
        return
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip() or "INFO"
    try:
        level = int(raw)
    except ValueError:
        level = logging.getLevelName(raw.upper())  # the number for a known name, else a string
    if not isinstance(level, int):
        warn(f"{LOG_LEVEL_ENV}={raw!r} is not a logging level (a name such as DEBUG, or a number); using INFO")
        level = logging.INFO
    log.setLevel(level)


def info_once(part: str, message: str) -> None:
    """The INFO line of ``part`` for this process (rank 0 only; later ones at DEBUG). Never raises."""
    try:
        _apply_log_level()
        if part in _state["logged"] or not _rank_zero():
            log.debug("verl_ops plugin: %s", message)
            return
        _state["logged"].add(part)
        if not log.handlers and not logging.getLogger().handlers:
            # No logging set up (verl sets a basic config; a bare process has none): INFO would only
            # reach Python's last-resort handler, which drops it.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            log.addHandler(handler)
        log.info("verl_ops plugin: %s", message)
    except Exception:  # noqa: BLE001  (a log line must not break verl's model build)
        pass


def version_tuple(v) -> tuple:
    out = []
    for part in str(v).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple((out + [0, 0, 0])[:3])


def version_ok(what: str, version, bounds) -> bool:
    """True where ``version`` is in ``bounds`` ([low, high)) or the check is turned off; else a
    warning naming the release and what is left alone."""
    if os.environ.get(VERSION_CHECK_ENV, "1").strip().lower() in _OFF:
        return True
    low, high = bounds
    v = version_tuple(version)
    if v and low <= v < high:
        return True
    fmt = lambda t: ".".join(map(str, t))  # noqa: E731
    warn(
        f"{what} {version} is outside the releases this verl_ops release was checked against "
        f"(>= {fmt(low)}, < {fmt(high)}); its part is left alone (verl runs unchanged there). "
        f"{VERSION_CHECK_ENV}=0 applies it anyway."
    )
    return False


def _loaded(name: str):
    mod = sys.modules.get(name)
    if mod is None or getattr(getattr(mod, "__spec__", None), "_initializing", False):
        return None
    return mod


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the hooks of the module (each one guarded)."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            # Tools that read the loader (inspect.getsource, importlib.reload) see the real one.
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        _run_hooks(self._name, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the modules that have hooks; every other import is untouched."""

    def __init__(self):
        self.hooks: dict[str, list] = {}
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001  (let the normal import report it)
            return None
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_finder = _Finder()


def _run_hooks(name: str, module) -> None:
    for hook in _finder.hooks.pop(name, []):
        try:
            hook(module)
        except Exception as e:  # noqa: BLE001  (never break the import of verl's module)
            warn(f"patching {name} failed ({type(e).__name__}: {e}); left alone")


def when_imported(name: str, hook) -> None:
    """``hook(module)`` once ``name`` has finished importing: now if it has, else right after."""
    mod = _loaded(name)
    if mod is not None:
        try:
            hook(mod)
        except Exception as e:  # noqa: BLE001
            warn(f"patching {name} failed ({type(e).__name__}: {e}); left alone")
        return
    _finder.hooks.setdefault(name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def disarm_data() -> list:
    """Drop the data part's hooks not yet run (owners verl has not imported yet), so that a later
    import of one leaves verl's functions alone; :func:`verl_ops.integrations.verl.uninstall` calls
    it. Returns the module names whose hook was dropped."""
    dropped = []
    for name in DATA_MODULES:
        hooks = _finder.hooks.get(name)
        if hooks and _data_hook in hooks:
            hooks[:] = [h for h in hooks if h is not _data_hook]
            if not hooks:
                del _finder.hooks[name]
            dropped.append(name)
    _state["report"].setdefault("data", {})["undone"] = "uninstall(): verl's functions restored"
    return dropped


def _actions():
    """verl_ops.integrations.plugin, imported on first use; None (after one warning) where
    verl_ops itself cannot be imported."""
    if "actions" not in _state:
        try:
            from verl_ops.integrations import plugin

            _state["actions"] = plugin
        except Exception as e:  # noqa: BLE001
            _state["actions"] = None
            warn(f"verl_ops could not be imported ({type(e).__name__}: {e}); verl runs unchanged")
    return _state["actions"]


def _data_hook(module) -> None:
    actions = _actions()
    if actions is not None:
        actions.patch_data_path(module.__name__)


def _mla_module_hook(module) -> None:
    actions = _actions()
    if actions is not None:
        actions.remember_mla_forward(module)


def _gpt_model_hook(module) -> None:
    actions = _actions()
    if actions is not None:
        actions.patch_gpt_model(module)


def _verl_version():
    verl = sys.modules.get("verl")
    version = getattr(verl, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("verl")
        except Exception:  # noqa: BLE001
            version = "unknown"
    return version


def arm() -> frozenset:
    """Arm the hooks of the parts ``VERL_OPS_PLUGIN`` selects (idempotent). Returns the parts."""
    if _state["armed"]:
        return _state["parts"]
    chosen = parts()
    _state["armed"] = True
    _state["parts"] = chosen
    if not chosen:
        _state["report"]["off"] = f"{ENV}={os.environ.get(ENV)!r}"
        log.debug("verl_ops plugin: off (%s)", _state["report"]["off"])
        return chosen
    try:
        _apply_log_level()  # (every rank: the DEBUG lines follow the variable too)
    except Exception:  # noqa: BLE001  (a log level never keeps the parts from arming)
        pass
    if "data" in chosen:
        if version_ok("verl", _verl_version(), VERL_RANGE):
            for name in DATA_MODULES:
                when_imported(name, _data_hook)
        else:
            _state["report"]["data"] = {"left alone": [f"verl {_verl_version()} (version)"]}
    if "mla" in chosen:
        # megatron-core's version is read when its GPT model module loads (not imported here).
        when_imported(MLA_MODULE, _mla_module_hook)
        when_imported(GPT_MODEL_MODULE, _gpt_model_hook)
    return chosen


try:
    arm()
except Exception as _e:  # noqa: BLE001  (a plugin must never break ``import verl``)
    warn(f"could not be armed ({type(_e).__name__}: {_e}); verl runs unchanged")
