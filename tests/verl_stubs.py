"""Minimal stand-ins for the parts of megatron-core that verl's THD helpers touch.

``install_megatron_stub(monkeypatch, ...)`` puts fake ``megatron``, ``megatron.core``,
``megatron.core.parallel_state`` and ``megatron.core.packed_seq_params`` modules into
``sys.modules`` (undone by the monkeypatch) and returns a :class:`ParallelConfig` whose fields
(tp, cp, cp_rank, ...) the fake ``parallel_state`` reads on every call.

``fake_all_gather(shards, rank)`` returns a drop-in for ``torch.distributed.all_gather`` that fills
the other ranks' shards from precomputed tensors, so CP > 1 postprocessing runs in one process.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    cp_rank: int = 0
    cp_group: object = "cp-group"
    # dynamic CP: group handed out by get_dynamic_data_context_parallel_groups, and this rank in it
    dynamic_group: object = None
    dynamic_rank: int = 0


@dataclass
class PackedSeqParams:
    """megatron-core's PackedSeqParams as of core 0.16 (no cp_partition_mode)."""

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None


@dataclass
class PackedSeqParamsWithPartitionMode(PackedSeqParams):
    """Newer megatron-core: also records how CP rows were partitioned."""

    cp_partition_mode: str = "zigzag"


class DynamicGroup:
    """Sentinel process group for dynamic CP."""

    def __init__(self, size: int):
        self.size = size

    def __repr__(self):
        return f"DynamicGroup(size={self.size})"


def _parallel_state_module(cfg: ParallelConfig) -> types.ModuleType:
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.get_tensor_model_parallel_world_size = lambda: cfg.tp
    ps.get_context_parallel_world_size = lambda: cfg.cp
    ps.get_context_parallel_rank = lambda: cfg.cp_rank
    ps.get_context_parallel_group = lambda: cfg.cp_group

    def get_dynamic_data_context_parallel_groups(group_size):
        if cfg.dynamic_group is None or cfg.dynamic_group.size != group_size:
            cfg.dynamic_group = DynamicGroup(group_size)
        return cfg.dynamic_group

    ps.get_dynamic_data_context_parallel_groups = get_dynamic_data_context_parallel_groups
    return ps


def install_megatron_stub(monkeypatch, *, cp_partition_mode: bool = True) -> ParallelConfig:
    cfg = ParallelConfig()
    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    ps = _parallel_state_module(cfg)
    psp = types.ModuleType("megatron.core.packed_seq_params")
    psp.PackedSeqParams = PackedSeqParamsWithPartitionMode if cp_partition_mode else PackedSeqParams
    megatron.core = core
    core.parallel_state = ps
    core.packed_seq_params = psp
    for name, mod in (
        ("megatron", megatron),
        ("megatron.core", core),
        ("megatron.core.parallel_state", ps),
        ("megatron.core.packed_seq_params", psp),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return cfg


def fake_all_gather(shards, rank: int, calls: list | None = None):
    """``torch.distributed.all_gather`` for one process: rank ``j``'s tensor is ``shards[j]``.

    Checks that the caller contributes exactly its own shard (``shards[rank]``) and that it is
    detached, like verl's all-gather of ``output.detach()``.
    """

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        assert len(tensor_list) == len(shards), (len(tensor_list), len(shards))
        assert not tensor.requires_grad, "all_gather must receive a detached tensor"
        assert torch.equal(tensor, shards[rank]), "this rank must contribute its own shard"
        for dst, src in zip(tensor_list, shards):
            assert dst.shape == src.shape and dst.dtype == src.dtype
            dst.copy_(src)
        if calls is not None:
            calls.append(group)

    return all_gather


def stand_in_pipeline_group(group):
    """Points ``megatron.core.parallel_state.get_pipeline_model_parallel_group`` at ``group``: on
    megatron-core's module if it is already imported, else on a bare stand-in module (importing
    megatron-core costs each rank seconds, and pp_gather reads nothing else from it)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        ps = types.ModuleType("megatron.core.parallel_state")
        sys.modules.setdefault("megatron", types.ModuleType("megatron"))
        sys.modules.setdefault("megatron.core", types.ModuleType("megatron.core"))
        sys.modules["megatron.core"].parallel_state = ps
        sys.modules["megatron.core.parallel_state"] = ps
    ps.get_pipeline_model_parallel_group = lambda: group


def _verl_root() -> str:
    """The installed verl package's directory (or that of load_verl_util's stand-in package)."""
    loaded = sys.modules.get("verl")
    if loaded is not None and getattr(loaded, "__path__", None):
        return next(iter(loaded.__path__))
    spec = importlib.util.find_spec("verl") if loaded is None else None
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("verl not installed; pip install --no-deps verl==0.9.1 megatron-core==0.16.1")
    return next(iter(spec.submodule_search_locations))


def load_verl_util(monkeypatch):
    """verl's ``verl/models/mcore/util.py`` (the installed verl), loaded on its own.

    verl/__init__.py (ray, tensordict, ...) is skipped and the two light verl modules util.py
    imports (NPU detection, an output dataclass used in annotations) are stubbed, so none of
    verl's heavy dependencies are needed; megatron-core (real or :func:`install_megatron_stub`)
    must be importable. Raises LookupError when verl or its util.py is missing.
    """
    util = sys.modules.get("verl.models.mcore.util")
    if util is not None and getattr(util, "_verl_stubs_loaded", False):
        return util
    # (Another module of that name, e.g. the real one that verl_ops.integrations.verl.install()
    # imported where verl's dependencies are installed, is bound to the megatron-core of its own
    # import time, not to the stand-in a test installs: load a copy of our own.)
    root = _verl_root()
    path = os.path.join(root, "models", "mcore", "util.py")
    if not os.path.exists(path):
        raise LookupError(f"this verl has no {path}")
    for name, sub in (("verl", ""), ("verl.models", "models"), ("verl.models.mcore", "models/mcore"), ("verl.utils", "utils")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(root, sub)] if sub else [root]
        monkeypatch.setitem(sys.modules, name, pkg)
    device = types.ModuleType("verl.utils.device")
    device.is_npu_available = False
    model = types.ModuleType("verl.utils.model")
    model.CausalLMOutputForPPO = type("CausalLMOutputForPPO", (), {})
    monkeypatch.setitem(sys.modules, "verl.utils.device", device)
    monkeypatch.setitem(sys.modules, "verl.utils.model", model)
    spec = importlib.util.spec_from_file_location("verl.models.mcore.util", path)
    util = importlib.util.module_from_spec(spec)
    util._verl_stubs_loaded = True
    monkeypatch.setitem(sys.modules, "verl.models.mcore.util", util)
    spec.loader.exec_module(util)
    return util


def install_verl_util_source(monkeypatch, root, text: str) -> None:
    """A stand-in ``verl`` package under ``root`` (a pathlib.Path) whose ``models/mcore/util.py``
    holds ``text``, in place of the verl in use (undone by the monkeypatch), and the integrations'
    cache of util.py sources emptied: the rules read from verl's source are read from ``text``."""
    from verl_ops.integrations import _common

    util = root / "verl" / "models" / "mcore" / "util.py"
    util.parent.mkdir(parents=True)
    util.write_text(text)
    pkg = types.ModuleType("verl")
    pkg.__path__ = [str(root / "verl")]
    monkeypatch.setitem(sys.modules, "verl", pkg)
    monkeypatch.delitem(sys.modules, "verl.models.mcore.util", raising=False)
    monkeypatch.setattr(_common, "_UTIL_TEXT_BY_FILE", {})


def load_verl_functions(relpath: str, names: list[str], namespace: dict | None = None) -> dict:
    """Top-level functions ``names`` of the installed verl's ``verl/<relpath>``, read from that file
    at run time and defined on their own (their module's heavy imports are not run), in a namespace
    holding ``math`` and ``torch`` (plus ``namespace``). Raises LookupError when verl, the file or a
    function is missing."""
    import ast
    import math

    path = os.path.join(_verl_root(), relpath)
    if not os.path.exists(path):
        raise LookupError(f"this verl has no {path}")
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = [n for n in names if n not in found]
    if missing:
        raise LookupError(f"{path} has no {', '.join(missing)}")
    ns = {"math": math, "torch": torch, **(namespace or {})}
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    exec(compile(module, path, "exec"), ns)  # noqa: S102  (verl's own functions, from the installed file)
    return {n: ns[n] for n in names}
