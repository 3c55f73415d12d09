"""Fixes for megatron-core without TransformerEngine (the local, non-TE layer specs).

:func:`patch_megatron_core` repairs, in the installed megatron-core, the defects that break an
MLA / MoE / MTP model built from the local spec (``get_gpt_layer_local_spec``,
``get_gpt_decoder_block_spec(..., use_transformer_engine=False)``) on a machine where
TransformerEngine is not installed. Every fix is feature-detected on the module it repairs —
never chosen by version number — and is a no-op where the defect is absent (TransformerEngine
installed, or a megatron-core that already handles its absence). It is idempotent and returns the
names of the fixes it applied in this call (see :data:`applied` for all of them).

The fixes (each one's docstring says what bites and when):

* :func:`fix_mla_have_te` — ``multi_latent_attention.HAVE_TE`` is True without TransformerEngine,
  and building an MLA layer raises ``TypeError: isinstance() arg 2 must be a type ...``.
* :func:`fix_moe_utils_te_names` — ``moe_utils.te_general_gemm`` (and the fused MoE kernels'
  names) are undefined without TransformerEngine, and every MoE router forward raises
  ``NameError: name 'te_general_gemm' is not defined``.

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

__all__ = ["applied", "fix_mla_have_te", "fix_moe_utils_te_names", "patch_megatron_core"]

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


_FIXES = (fix_mla_have_te, fix_moe_utils_te_names)


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
