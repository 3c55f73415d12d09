"""verl_ops: fused C++/CUDA ops for verl's Megatron THD data path.

Ops live under ``torch.ops.verl_ops``; this package adds typed wrappers, :class:`ThdLayout`,
autograd, and drop-ins for verl (:mod:`verl_ops.integrations.verl`).
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # noqa: F401  (registers torch.ops.verl_ops)
from ._thd import postprocess_thd, preprocess_thd
from .layout import ThdLayout
from .router import merge_router_topk, scatter_router_topk

__version__ = "0.1.0"

__all__ = ["ThdLayout", "preprocess_thd", "postprocess_thd", "cuda_available", "__version__"]
__all__ += ["merge_router_topk", "scatter_router_topk"]


def cuda_available() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("verl_ops::preprocess_thd", "CUDA")
