"""An import-only stand-in for Ray (``.vb/stubs/ray``, made by benchmarks/device/prepare_vb.sh).

verl 0.9.1 imports Ray at module level in two modules of the chain ``import verl`` and its engine
forward run (tests/test_verl_plugin.py, ``-k engine_forward``):

- ``verl/protocol.py``: ``import ray``; ``ray.ObjectRef`` in the annotations of
  ``DataProtoFuture`` (``futures: list[ray.ObjectRef]``, ``concat(data: list[ray.ObjectRef])``),
  evaluated when the class is defined; ``ray.get`` / ``isinstance(x, ray.ObjectRef)`` only when
  a ``DataProtoFuture`` is used, which a single-process engine forward never does.
- ``verl/single_controller/base/worker.py``: ``import ray``; ``ray.util.get_node_ip_address()`` and
  ``ray.get_runtime_context()`` only inside ``Worker`` methods (a Ray worker's setup).

Nothing else of that chain (transformers, tensordict, mbridge, megatron-core) imports Ray.
transformers' ``is_ray_available()`` stays False: this package has no distribution metadata.

So this module provides the names, and every call that would need a Ray cluster raises.
"""

__version__ = "0.0.0+verl_ops.stub"
_IS_STUB = True


class _NoRay(RuntimeError):
    pass


def _no_ray(what):
    def fail(*args, **kwargs):
        raise _NoRay(f"ray.{what}: this is an import-only stand-in for Ray (.vb/stubs), no Ray here")

    fail.__name__ = what.rsplit(".", 1)[-1]
    return fail


class ObjectRef:
    """Only for annotations and isinstance checks: no instance ever exists."""

    def __init__(self, *args, **kwargs):
        raise _NoRay("ray.ObjectRef: this is an import-only stand-in for Ray (.vb/stubs)")


class ObjectRefGenerator(ObjectRef):
    pass


def is_initialized() -> bool:
    return False


def remote(*args, **kwargs):
    """``@ray.remote`` / ``@ray.remote(...)``: the class or function unchanged (defining a remote
    class at import time works; calling ``.remote()`` on it does not)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


method = remote  # ``@ray.method(...)``: the same pass-through

# every call that would need a Ray cluster
for _name in ("init", "shutdown", "get", "put", "wait", "kill", "get_actor", "get_runtime_context", "get_gpu_ids",
              "nodes", "available_resources", "cluster_resources"):
    globals()[_name] = _no_ray(_name)
del _name

from . import util  # noqa: E402  (ray.util, as ``import ray`` makes it an attribute)
