"""verl_ops: fused C++/CUDA ops for verl's Megatron THD data path.

Ops live under ``torch.ops.verl_ops``; this package adds typed wrappers, :class:`ThdLayout`,
autograd, and drop-ins for verl (:mod:`verl_ops.integrations.verl`).
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # noqa: F401  (registers torch.ops.verl_ops)
from ._thd import postprocess_thd, preprocess_thd
from ._jagged import jagged_gather, jagged_scatter
from .dynamic_cp import DynamicCPGroups, DynamicCPPlan, dynamic_cp_merge, dynamic_cp_split, plan_dynamic_cp
from .layout import ThdLayout

__version__ = "0.1.0"

__all__ = ["ThdLayout", "preprocess_thd", "postprocess_thd", "cuda_available", "__version__"]
__all__ += ["jagged_gather", "jagged_scatter"]
__all__ += ["DynamicCPGroups", "DynamicCPPlan", "dynamic_cp_split", "dynamic_cp_merge", "plan_dynamic_cp"]


def cuda_available() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("verl_ops::preprocess_thd", "CUDA")
