"""verl_ops: fused C++/CUDA ops for verl's Megatron THD data path.

Ops live under ``torch.ops.verl_ops``; this package adds typed wrappers, :class:`ThdLayout`,
autograd, and drop-ins for verl (:mod:`verl_ops.integrations.verl`).
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _library  # noqa: F401  (loads _C, and _C_layers under torch >= 2.10)
# Each op family's module registers its ops' fake (Meta) kernels and autograd on import:
# layout (thd_layout, thd_layout_info), _thd, _jagged, _mla, dynamic_cp, router.
from ._jagged import jagged_gather, jagged_scatter
from ._log_probs import vocab_parallel_log_probs
from ._mla import mla_cache_info, mla_forward_padded
from ._mla_cp import mla_cp_attention
from ._mla_latent import mla_latent_attention
from ._rope import mla_rope
from ._thd import postprocess_thd, preprocess_thd
from .dynamic_cp import DynamicCPGroups, DynamicCPPlan, dynamic_cp_merge, dynamic_cp_split, plan_dynamic_cp
from .layout import ThdLayout
from .router import merge_router_topk, scatter_router_topk

__version__ = "0.1.0"

__all__ = [
    "ThdLayout",
    "preprocess_thd",
    "postprocess_thd",
    "jagged_gather",
    "jagged_scatter",
    "DynamicCPGroups",
    "DynamicCPPlan",
    "plan_dynamic_cp",
    "dynamic_cp_split",
    "dynamic_cp_merge",
    "merge_router_topk",
    "scatter_router_topk",
    "mla_forward_padded",
    "mla_cache_info",
    "mla_cp_attention",
    "mla_latent_attention",
    "mla_rope",
    "vocab_parallel_log_probs",
    "cuda_available",
    "__version__",
]


def cuda_available() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("verl_ops::preprocess_thd", "CUDA")
