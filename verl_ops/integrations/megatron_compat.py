"""Fixes for megatron-core as verl_ops' integrations use it: without TransformerEngine (the
local, non-TE layer specs) and with router replay.

:func:`patch_megatron_core` repairs, in the installed megatron-core, the defects that break an
MLA / MoE / MTP model built from the local spec (``get_gpt_layer_local_spec``,
``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``) on a machine where
TransformerEngine is not installed, and the one that breaks router replay under padding. Every
fix is feature-detected on the module it repairs —
never chosen by version number — and is a no-op where the defect is absent (TransformerEngine
installed, or a megatron-core that already handles its absence). It is idempotent and returns the
names of the fixes it applied in this call (see :data:`applied` for all of them).

The fixes (each one's docstring says what bites and when):

* :func:`fix_mla_have_te` — ``multi_latent_attention.HAVE_TE`` is True without TransformerEngine,
  and building an MLA layer raises ``TypeError: isinstance() arg 2 must be a type ...``.
* :func:`fix_moe_utils_te_names` — ``moe_utils.te_general_gemm`` (and the fused MoE kernels'
  names) are undefined without TransformerEngine, and every MoE router forward raises
  ``NameError: name 'te_general_gemm' is not defined``.
* :func:`fix_alltoall_replay_out_tokens` — with router replay, the all-to-all dispatcher sizes
  its permutation as ``tokens * topk``; a replayed route that names one expert twice (the zero
  routes of THD / CP / FP8 padding rows) makes the expert split sizes disagree:
  ``RuntimeError: split_with_sizes expects split_sizes to sum exactly to ...``.

Not patched, because it does not bite with verl_ops: megatron-core 0.16's own MLA local spec puts
``DotProductAttention`` in ``core_attention``, which MLA builds with ``k_channels=`` /
``v_channels=`` (``TypeError: DotProductAttention.__init__() got an unexpected keyword argument
'k_channels'``); a spec whose ``core_attention`` is
:class:`verl_ops.integrations.megatron_mla.MLACoreAttention` (``megatron_mla.install(spec)``)
never builds ``DotProductAttention`` for MLA.

megatron-core is imported inside the functions only; importing this module never needs it.
"""

from __future__ import annotations

import importlib
import sys

__all__ = [
    "applied",
    "fix_alltoall_replay_out_tokens",
    "fix_mla_have_te",
    "fix_moe_utils_te_names",
    "patch_megatron_core",
]

#: Every fix applied in this process, in order (names of the fix functions).
applied: list[str] = []

# The names moe_utils imports from megatron.core.extensions.transformer_engine inside its
# try/except ImportError; those that a module lacks are the ones its except branch never bound.
_MOE_UTILS_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def _module(name: str):
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _is_real_class(obj) -> bool:
    return isinstance(obj, type)


def fix_mla_have_te() -> bool:
    """``megatron.core.transformer.multi_latent_attention.HAVE_TE`` is True without TransformerEngine.

    What bites: megatron-core's ``extensions/transformer_engine.py`` does not fail to import when
    TransformerEngine is missing; it binds ``te = unittest.mock.MagicMock()`` and defines its
    classes on top of it (``class TELinear(te.pytorch.Linear)``). A class statement whose base is a
    MagicMock *instance* calls ``type(base)(name, bases, namespace)``, so ``TELinear`` and
    ``TEColumnParallelLinear`` are themselves MagicMock instances, not classes. The MLA module
    imports them inside ``try: ... except ImportError`` and, since nothing raises, sets its own
    ``HAVE_TE = True``. ``MultiLatentAttention.__init__`` then evaluates
    ``HAVE_TE and isinstance(self.linear_proj, TELinear) and ...``, which raises::

        TypeError: isinstance() arg 2 must be a type, a tuple of types, or a union

    for every MLA layer, with any spec (megatron-core 0.16.x; later releases read ``HAVE_TE`` from
    the extension module, where it is False).

    Fix: where the module's ``HAVE_TE`` is True but its ``TELinear`` is not a class, set
    ``HAVE_TE = False`` (the value its ``except ImportError`` branch would have set; its other uses
    — ``submodules.linear_*_proj in [TELinear]`` — compare by identity and stay False for the
    local spec's ``ColumnParallelLinear``). Returns whether it changed anything.
    """
    mla = _module("megatron.core.transformer.multi_latent_attention")
    if mla is None or not getattr(mla, "HAVE_TE", False):
        return False
    if _is_real_class(getattr(mla, "TELinear", None)):
        return False  # TransformerEngine is really there
    mla.HAVE_TE = False
    return True


def fix_moe_utils_te_names() -> bool:
    """``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is undefined without TransformerEngine.

    What bites: ``moe_utils`` imports ``te_general_gemm`` and the fused MoE kernels
    (``fused_permute``, ``fused_topk_with_score_function``, ...) inside ``try: import
    transformer_engine ... except ImportError: HAVE_TE = False`` and never binds those names in the
    ``except`` branch. ``RouterGatingLinearFunction`` (the router's gating GEMM, called by every
    ``TopKRouter.gating``, whatever ``moe_router_dtype`` is) tests ``te_general_gemm is not None``
    and raises::

        NameError: name 'te_general_gemm' is not defined

    on the first MoE forward (megatron-core 0.16.x; later releases bind the names to None). Its
    torch fallback (``torch.mm`` / ``torch.addmm`` in ``router_dtype``, and the matching backward)
    is right below that test, so binding the name to None is the whole fix. The fused kernels'
    uses are all guarded by ``not HAVE_TE or fused_x is None``, which short-circuits; they are
    bound to None too, as later releases do.

    Fix: bind each of those names the module lacks to None, only when TransformerEngine is absent
    (``moe_utils.HAVE_TE`` False). Returns whether it changed anything.
    """
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None or getattr(moe_utils, "HAVE_TE", True):
        return False
    missing = [name for name in _MOE_UTILS_TE_NAMES if not hasattr(moe_utils, name)]
    for name in missing:
        setattr(moe_utils, name, None)
    return bool(missing)


def _permute_needs_exact_out_tokens(moe_utils) -> bool:
    """Whether ``moe_utils.permute`` (unfused, dropless) returns ``num_out_tokens`` rows whatever
    the routing map holds: run it on a 2-token map whose first row routes to one expert only (the
    map of a replayed route naming one expert twice), asking for ``2 * 2`` rows. A permute that
    selects the map's entries returns 3 rows; one that cuts an argsort at ``num_out_tokens``
    returns 4 (the 4th a token sent to an expert it was not routed to)."""
    import torch

    tokens = torch.zeros(2, 1)
    routing_map = torch.tensor([[True, False], [True, True]])
    try:
        out = moe_utils.permute(tokens, routing_map, num_out_tokens=4)
    except Exception:
        return False
    permuted = out[0] if isinstance(out, tuple) else out
    return int(permuted.shape[0]) != int(routing_map.sum())


def fix_alltoall_replay_out_tokens() -> bool:
    """Router replay with duplicate experts in a route breaks the all-to-all dispatcher.

    What bites: ``MoEAlltoAllTokenDispatcher.preprocess`` sets ``num_out_tokens = tokens * topk``
    for dropless training, and the argsort-based ``permute`` of later megatron-core (0.19.2; 0.16.1
    selects the map's entries) returns exactly that many rows. A router replaying a route that names one expert twice sets one entry
    in the routing map for it, so the map holds fewer entries than ``tokens * topk`` and the expert
    split sizes (the map's column sums) no longer add up to the permuted rows::

        RuntimeError: split_with_sizes expects split_sizes to sum exactly to 6720 ...

    Such routes are the padding rows' (THD alignment for TP / CP / FP8): verl's
    ``set_router_replay_data``, and its drop-in, give them zeros, i.e. expert 0 ``topk`` times.
    verl patches the same method when it enables router replay
    (``router_replay_patch.apply_router_replay_patch``); this fix is for models replaying routes
    without verl's patch and is skipped where verl's is in place.

    Fix: where ``permute`` keeps ``num_out_tokens`` rows whatever the map holds (tried on a tiny
    CPU map, never chosen by version) and the dispatcher is not already patched, wrap
    ``preprocess``: with router replay on (``moe_enable_routing_replay`` or verl's
    ``enable_routing_replay``), dropless, no capacity factor and no router padding for
    quantization, ``num_out_tokens`` is the routing map's entry count, moved to the host at the
    dispatcher's own device-to-host point as megatron-core does for its dynamic-size paths.
    Returns whether it changed anything.
    """
    dispatcher_mod = _module("megatron.core.transformer.moe.token_dispatcher")
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    cls = getattr(dispatcher_mod, "MoEAlltoAllTokenDispatcher", None) if dispatcher_mod else None
    if cls is None or moe_utils is None or not hasattr(moe_utils, "permute"):
        return False
    if getattr(cls, "_verl_ops_replay_out_tokens", False) or getattr(cls, "_preprocess_patched", False):
        return False  # done here, or verl's router replay patch is in place
    if not _permute_needs_exact_out_tokens(moe_utils):
        return False
    original = cls.preprocess

    def preprocess(self, routing_map):
        result = original(self, routing_map)
        cfg = self.config
        replay = getattr(cfg, "moe_enable_routing_replay", False) or getattr(cfg, "enable_routing_replay", False)
        if (
            replay
            and not getattr(self, "drop_and_pad", False)
            and getattr(cfg, "moe_expert_capacity_factor", None) is None
            and not getattr(cfg, "moe_router_padding_for_quantization", False)
            and not getattr(cfg, "moe_router_padding_for_fp8", False)
        ):
            self.num_out_tokens = routing_map.sum()
            if hasattr(self, "_maybe_update_cuda_sync_point"):
                self._maybe_update_cuda_sync_point("before_permutation_1")
        return result

    preprocess.__wrapped__ = original
    preprocess.__doc__ = original.__doc__
    cls.preprocess = preprocess
    cls._verl_ops_replay_out_tokens = True
    return True


_FIXES = (fix_mla_have_te, fix_moe_utils_te_names, fix_alltoall_replay_out_tokens)


def patch_megatron_core() -> list[str]:
    """Apply every fix of this module that the installed megatron-core needs (see the module doc).

    Idempotent; a no-op when megatron-core is not importable or has none of the defects. Call it
    before building a model (the MLA fix must precede the construction of MLA layers). Returns
    the names of the fixes applied by this call.
    """
    if _module("megatron.core") is None:
        return []
    done = []
    for fix in _FIXES:
        if fix():
            done.append(fix.__name__)
            if fix.__name__ not in applied:
                applied.append(fix.__name__)
    return done
