"""Loads the compiled libraries: verl_ops._C (every op, stable ABI of torch 2.9) and, under
torch >= 2.10, verl_ops._C_layers (router_topk_record_layers: a list argument, which needs the
stable ABI of torch 2.10). Without the second, router record stacks its layers into one tensor."""

from __future__ import annotations

import glob
import os
import re

import torch

from . import _C  # noqa: F401  (registers torch.ops.verl_ops)


def _torch_at_least(major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def _load_layers() -> bool:
    if not _torch_at_least(2, 10):
        return False
    libs = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_C_layers*.so")))
    if not libs:
        return False
    torch.ops.load_library(libs[0])
    return True


HAS_LAYERS = _load_layers()


_BelowAutograd = torch._C._AutoDispatchBelowAutograd


def call_op(op, grad_input: torch.Tensor, *args):
    """``op(*args)``, skipping the Autograd dispatch key when ``grad_input`` (the op's one
    differentiable input) needs no gradient or grad mode is off.

    The autograd formulas are registered from Python (torch.library.register_autograd); that
    Autograd kernel runs on every call, recording or not, and costs several times the rest of the
    call on the host (the dispatcher, the argument checks and the launch; see
    benchmarks/RESULTS.md). Below the Autograd key the op runs the same kernel. Inside
    torch.compile tracing the op is called plainly, so the graph is the same either way.
    """
    if torch.compiler.is_compiling() or (grad_input.requires_grad and torch.is_grad_enabled()):
        return op(*args)
    with _BelowAutograd():
        return op(*args)
