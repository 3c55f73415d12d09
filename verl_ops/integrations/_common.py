"""Helpers shared by the verl drop-in modules (verl, verl_bshd, verl_pp, verl_r3, verl_router,
verl_dcp) and by :mod:`verl_ops.integrations.install`: lazy megatron-core access, the attribute
that carries a micro-batch's layout, mask coercion, and reading the in-use verl's source to tell
its releases apart. Nothing here imports a drop-in module, so the drop-in modules import from
here and never from each other's internals."""

from __future__ import annotations

import importlib
import os
import sys

import torch

from .._validate import cache_version

#: Attribute of ``PackedSeqParams`` that carries the :class:`~verl_ops.ThdLayout` of its micro-batch.
LAYOUT_ATTR = "verl_ops_layout"

# Attribute of a layout's device offsets tensor: (its version, its host copy, its longest sequence).
# megatron-core hands its consumers (RoPE, core attention) the offsets tensors of PackedSeqParams,
# not the PackedSeqParams; the tag lets them read the layout's host values instead of the device.
_HOST_OFFSETS_ATTR = "_verl_ops_host_offsets"


def remember_host_offsets(layout) -> None:
    """Tag ``layout.cu_seqlens`` and ``layout.cu_seqlens_padded`` with their host copies and longest
    sequences (for :func:`host_offsets`)."""
    for device, host, longest in (
        (layout.cu_seqlens, layout.cu_seqlens_cpu, layout.max_seqlen_unpadded),
        (layout.cu_seqlens_padded, layout.cu_seqlens_padded_cpu, layout.max_seqlen),
    ):
        version = cache_version(device)
        if version is None:  # an inference tensor: nothing remembered on it, read when needed
            continue
        try:
            # (a CPU layout's offsets are its host copies: no tag pointing at itself)
            setattr(device, _HOST_OFFSETS_ATTR, (version, None if host is device else host, longest))
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: read when needed
            pass


def host_offsets(cu: torch.Tensor):
    """``(host copy, longest sequence)`` of offsets ``cu`` that a drop-in's layout made (and nothing
    changed in place since), without reading the device; ``None`` for any other tensor."""
    tag = getattr(cu, _HOST_OFFSETS_ATTR, None)
    if tag is None or tag[0] != cache_version(cu):
        return None
    return (cu if tag[1] is None else tag[1]), tag[2]


# --------------------------------------------------------------------------------------------
# Lazy megatron-core access (megatron-core is optional: importing an integration never needs it).


def _megatron(module: str, name: str, needed_by: str, what: str | None = None):
    """``from <module> import <name>`` of megatron-core, from ``sys.modules`` when already imported
    (skipping the import statement's ~7 µs); an ImportError that says what needs it otherwise."""
    found = getattr(sys.modules.get(module), name, None)
    if found is not None:
        return found
    try:
        found = getattr(importlib.import_module(module), name, None)
        if found is None:
            found = importlib.import_module(f"{module}.{name}")
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            f"{needed_by} needs megatron-core ({what or module}); install it with `pip install megatron-core`"
        ) from e
    return found


def _mpu():
    """``megatron.core.parallel_state``: parallel sizes, ranks and groups, where verl reads them."""
    return _megatron("megatron.core", "parallel_state", "verl_ops.integrations", "megatron.core.parallel_state")


# --------------------------------------------------------------------------------------------
# Masks.


def _bool_mask(op: str, attention_mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """A [B, S] mask as bool (0/1 integers accepted, as verl's masks)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_nested:
        raise ValueError(f"{op}: {name} must be a [B, S] tensor, got a nested tensor")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = (
            tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        )
        raise ValueError(f"{op}: {name} must be a [B, S] tensor, got {shape}")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


# --------------------------------------------------------------------------------------------
# Which verl: rules that differ between verl 0.9.1 and verl main are read from the in-use verl's
# ``verl/models/mcore/util.py`` (each drop-in module keeps its own override setting).

_UTIL_TEXT_BY_FILE: dict[str, str] = {}  # verl util.py path -> its text, read once


def _verl_util_file() -> str | None:
    mod = sys.modules.get("verl.models.mcore.util")
    path = getattr(mod, "__file__", None)
    if path:
        return path
    verl = sys.modules.get("verl")
    roots = list(getattr(verl, "__path__", None) or [])
    if not roots:
        try:
            import importlib.util

            spec = importlib.util.find_spec("verl")  # finds the package without importing it
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "models", "mcore", "util.py")
        if os.path.isfile(path):
            return path
    return None


def _verl_util_function(name: str) -> str:
    """The source of function `name` in the in-use verl's ``verl/models/mcore/util.py`` (up to the
    next top-level ``def``), or "" where there is no verl, no such file or no such function."""
    path = _verl_util_file()
    if path is None:
        return ""
    text = _UTIL_TEXT_BY_FILE.get(path)
    if text is None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""
        _UTIL_TEXT_BY_FILE[path] = text
    start = text.find(f"def {name}(")
    if start < 0:
        return ""
    end = text.find("\ndef ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _verl_rule(override_name: str, override: str | None, function: str, is_main) -> str:
    """``"0.9.1"`` or ``"main"``: ``override`` (the module setting named ``override_name``) when set,
    else ``"main"`` where the in-use verl's util.py has ``function`` and ``is_main(its source)``,
    ``"0.9.1"`` otherwise (also when no verl is found)."""
    if override is not None:
        if override not in ("0.9.1", "main"):
            raise ValueError(f"{override_name} must be '0.9.1', 'main' or None, got {override!r}")
        return override
    body = _verl_util_function(function)
    return "main" if body and is_main(body) else "0.9.1"
