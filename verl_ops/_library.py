"""Loads the compiled libraries: verl_ops._C (every op, stable ABI of torch 2.9) and, under
torch >= 2.10, verl_ops._C_layers (router_topk_record_layers: a list argument, which needs the
stable ABI of torch 2.10). Without the second, router record stacks its layers into one tensor.

Every op of the namespace takes dense (strided) tensors only. :func:`guard_dense_arguments` gives
each op (the compiled ones here, the Python-defined ones where they are defined) the kernels that
reject a nested tensor or a None in a tensor argument with a message naming the op and the
argument (verl_ops._validate.DenseArguments); :func:`register_autograd` registers an op's Autograd
kernel with the same check of a None first.
"""

from __future__ import annotations

import glob
import os
import re

import torch

from . import _C  # noqa: F401  (registers torch.ops.verl_ops)
from ._validate import DenseArguments, _JaggedNT


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


# --------------------------------------------------------------------------------------------
# Dense tensor arguments. Where each bad argument first meets a kernel of the op:
#
# - A nested tensor (jagged or strided) in any tensor argument: the op's
#   CompositeImplicitAutogradNestedTensor kernel. It fills the AutogradNestedTensor slot (ahead of
#   an Autograd kernel) and the NestedTensor backends (no kernel of ours there), so every call with
#   a nested tensor reaches it, recording gradients or not. Below the Autograd keys (inference
#   mode) the jagged NestedTensor's __torch_dispatch__ sends an op it has no rule for to that same
#   kernel; a torch_dispatch rule for the class (torch.library.register_torch_dispatch, torch >= 2.5)
#   raises the error first, whatever the class does.
# - A None where no tensor argument is defined (every one None, or an empty list): no dispatch key
#   at all, so the dispatcher runs the op's kernel for the Undefined key, which is its
#   CompositeExplicitAutogradNonFunctional kernel (the "default backend kernel" of every backend
#   without a kernel of its own: a dense tensor there gets a NotImplementedError naming the device).
#   Unlike a CompositeExplicitAutograd kernel it leaves the nested kernel above in place.
# - A None beside defined tensors: the op's Autograd kernel runs first (unless autograd is
#   disabled below it, as under inference mode) and tests its Tensor arguments: every Autograd
#   kernel registered through register_autograd does, and _thd's hand-written ones.
#
# A dense call on a device with a kernel pays nothing for the first two (kernels it never reaches)
# and one `is None` test per Tensor argument for the third. A Python-defined op's own kernels test a
# None themselves (DenseArguments.checked / check_none), on every path.

_guard_lib = torch.library.Library("verl_ops", "FRAGMENT")
_register_torch_dispatch = getattr(torch.library, "register_torch_dispatch", None)


def guard_dense_arguments(name: str) -> DenseArguments:
    """Register the nested-tensor and no-tensor errors of op ``verl_ops::<name>`` (see above)."""
    dense = DenseArguments.of(f"verl_ops::{name}")

    def reject(*args, **kwargs):
        raise dense.reject(args, kwargs)

    _guard_lib.impl(name, reject, "CompositeImplicitAutogradNestedTensor")
    _guard_lib.impl(name, reject, "CompositeExplicitAutogradNonFunctional")
    if _register_torch_dispatch is not None and _JaggedNT:

        def jagged_rule(cls, func, types, args, kwargs):
            raise dense.reject(args, kwargs)

        _register_torch_dispatch(f"verl_ops::{name}", _JaggedNT, jagged_rule, lib=_guard_lib)
    return dense


def namespace_ops() -> list:
    """The name of every op registered in the verl_ops namespace so far."""
    return sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("verl_ops::")})


for _name in namespace_ops():  # the compiled ops; the Python-defined ones guard themselves
    guard_dense_arguments(_name)


def redispatcher(op):
    """``op``'s redispatch by keyset: the operator handle's own (what OpOverload.redispatch calls,
    less one Python frame and one argument tuple), or OpOverload.redispatch where it has none."""
    handle = getattr(op, "_handle", None)
    return getattr(handle, "redispatch_boxed", None) or op.redispatch


def _checks_none_first(dense: DenseArguments, kernel):
    """An Autograd kernel (``kernel(keyset, *args, **kwargs)``) that first rejects a None in a Tensor
    argument of ``dense.op``."""
    required = dense.required

    def checked_kernel(keyset, *args, **kwargs):
        for i in required:
            if args[i] is None:
                raise dense.error(args, kwargs)
        return kernel(keyset, *args, **kwargs)

    return checked_kernel


class _CheckedAutogradLibrary(torch.library.Library):
    """A verl_ops fragment whose Autograd kernels reject a None in a Tensor argument first. Handed to
    torch.library.register_autograd as its ``lib``: the generated kernel is registered through it."""

    def __init__(self):
        super().__init__("verl_ops", "FRAGMENT")

    def impl(self, op_name, fn, dispatch_key="", *args, **kwargs):
        if dispatch_key == "Autograd" and kwargs.get("with_keyset"):
            name = op_name if isinstance(op_name, str) else op_name._schema.name
            fn = _checks_none_first(DenseArguments.of(f"verl_ops::{name.split('::')[-1]}"), fn)
        return super().impl(op_name, fn, dispatch_key, *args, **kwargs)


_autograd_lib = _CheckedAutogradLibrary()
_after_autograd = torch._C._after_autograd_keyset


def register_autograd(qualname: str, backward=None, *, setup_context=None) -> None:
    """torch.library.register_autograd(qualname, backward, setup_context=...), its kernel testing a
    None in a Tensor argument first. Without ``backward`` (an op with no derivative) the Autograd
    kernel runs the same test and then the op below the Autograd keys: its outputs never require
    grad. Wrappers that need no gradient call such an op below Autograd themselves (call_op), so
    only a raw call pays for the Python kernel."""
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_autograd_lib)
        return
    ns, name = qualname.split("::")
    redispatch = redispatcher(getattr(getattr(torch.ops, ns), name).default)

    def below_autograd(keyset, *args, **kwargs):
        return redispatch(keyset & _after_autograd, *args, **kwargs)

    _autograd_lib.impl(name, below_autograd, "Autograd", with_keyset=True)
