"""Host reads of device data in one training step of a megatron-core model on verl_ops' path.

The house rule: no host synchronisation inside an op, except the one explicit place where a layout
is built from lengths, once per micro-batch. Here the tiny DeepSeek-like ``GPTModel`` of
tests/megatron_model_lib.py (MLA + MoE + MTP, megatron-core's local specs) runs forward and
backward as verl's model engine runs it, on verl_ops' drop-ins (``preprocess_thd_engine`` for the
input ids, the rolled labels and the rolled loss mask, ``postprocess_thd_engine`` for the output)
and ``MLACoreAttention`` with the one-pass THD RoPE (``megatron_mla.install``), and every host read
of device data made by verl_ops' code is counted per micro-batch:

* on the CPU nothing synchronises, so :class:`DeviceReads` records the calls that would on CUDA:
  values read into Python (``item``, ``tolist``, ``int()``, ``bool()`` ...), copies to the host,
  blocking copies to the device, ops whose output size depends on the data (``nonzero``, boolean
  indexing, ``repeat_interleave`` without ``output_size``, ``torch.equal`` ...), each on a tensor
  that would live on the GPU (anything not made on the host: the layout op's outputs, host copies,
  tensors created without a device and what is computed from them alone), and the layout builds;
  where the CPU code path differs from the CUDA one, the run takes CUDA's (:func:`cuda_like_cpu`);
* on CUDA, the synchronisations themselves (``torch.cuda.set_sync_debug_mode("warn")``).

A read is verl_ops' when the innermost frame outside torch is in the verl_ops package: megatron-core's
own (its MoE dispatcher's, its MTP's) are not counted. The micro-batch's nested tensors share one
offsets tensor. Also here: the drop-ins' reuse of one layout per offsets tensor, and the reads they
still make where they cannot vouch for the offsets. The model tests need megatron-core; CI, which
installs it, sets VERL_OPS_REQUIRE_VERL=1, and the module then fails instead of skipping without it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_model_lib as lib  # noqa: E402
from _dist import shared_pool, skip_reason  # noqa: E402

import verl_ops  # noqa: E402

if not lib.megatron_available():
    if os.environ.get("VERL_OPS_REQUIRE_VERL") == "1":
        raise RuntimeError("VERL_OPS_REQUIRE_VERL=1 but megatron-core cannot be imported")
    _MISSING = "needs megatron-core (pip install --no-deps megatron-core==0.16.1)"
else:
    _MISSING = None

MODULE = "test_host_syncs"
# Micro-batches of the step: ragged lengths, with a length-1 sequence; each builds its own layout.
MICRO_BATCHES = ([5, 1, 17, 9], [33, 2, 12])
# What verl_ops' code may read per micro-batch: building the micro-batch's layout from its lengths.
ALLOWED_PER_MICRO_BATCH = 1

_VERL_OPS_DIR = os.path.dirname(os.path.abspath(verl_ops.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(warnings.__file__),
                  os.path.abspath(contextlib.__file__)}


def owner(frame) -> tuple[str, str]:
    """(who, where) of a call made in ``frame``'s stack: the innermost frame outside torch (and
    outside this file's bookkeeping) decides who: ``"verl_ops"``, ``"megatron"`` or ``"other"``."""
    f = frame
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path not in _SKIPPED_FILES and not path.startswith("<"):
            break
        f = f.f_back
    if f is None:
        return "other", "?"
    path = os.path.abspath(f.f_code.co_filename)
    where = f"{os.path.basename(path)}:{f.f_code.co_name}:{f.f_lineno}"
    if path.startswith(_VERL_OPS_DIR):
        return "verl_ops", where
    if f"{os.sep}megatron{os.sep}" in path:
        return "megatron", where
    return "other", where


# --------------------------------------------------------------------------------------------
# Calls that would synchronise on CUDA, recorded on the CPU.

_VALUE_READS = {"item", "tolist", "numpy", "__array__", "__int__", "__float__", "__bool__", "__index__", "__complex__",
                "__repr__", "__str__", "__format__"}
_DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique", "_unique2",
               "bincount", "equal"}
_FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
              "linspace", "eye", "scalar_tensor", "from_numpy", "asarray", "range"}
_LAYOUT_OPS = {"thd_layout_info", "thd_layout"}


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _device_arg(args, kwargs):
    """The device a ``to`` call names: a str, a torch.device, a tensor (its device), or None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device, torch.Tensor)):
            return a
    return None


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


class DeviceReads(TorchFunctionMode):
    """Records, as ``(who, kind, what, where)``, the calls that read device data on the host (they
    synchronise on CUDA) and the layout builds, while the model runs on the CPU.

    A tensor "is on the device" unless it was made on the host: by the layout op, by a copy to
    ``"cpu"`` (the string: a host copy; a ``torch.device`` or another tensor's device names where
    some tensor lives, which on CUDA is the GPU), by a factory without a device (or ``"cpu"``), or
    computed from such tensors alone. Tensors made before the mode (parameters, the batch) are on
    the device."""

    def __init__(self):
        super().__init__()
        self.host = WeakIdKeyDictionary()
        self.records = []

    def is_host(self, t) -> bool:
        return t in self.host

    def as_device(self, t) -> None:
        """``t`` is on the device from now on (a tensor that CUDA would keep there)."""
        self.host.pop(t, None)

    def _record(self, kind, what):
        who, where = owner(sys._getframe(1))
        self.records.append((who, kind, what, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in inputs if not self.is_host(t)]
        out = func(*args, **kwargs)
        host_out = bool(inputs) and not on_device
        if name in _LAYOUT_OPS:
            self._record("layout build", name)
            host_out = True
        elif name in _VALUE_READS:
            if on_device:
                self._record("value read", name)
        elif name in _DATA_SIZED or (name == "where" and len(args) + len(kwargs) == 1):
            if on_device:
                self._record("data-sized output", name)
        elif name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if kwargs.get("output_size") is None and isinstance(repeats, torch.Tensor) and on_device:
                self._record("data-sized output", name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and on_device:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if _is_bool_index(index):
                self._record("data-sized output", f"{name}[bool]")
        elif name == "cpu":
            if on_device:
                self._record("copy to host", name)
            host_out = True
        elif name in ("to", "copy_"):
            host_out = self._transfer(name, args, kwargs, on_device, host_out)
        elif not inputs and name in _FACTORIES:
            device = kwargs.get("device")
            host_out = device is None or (isinstance(device, str) and torch.device(device).type == "cpu")
            data = args[0] if args else kwargs.get("data")
            from_python = name in ("tensor", "as_tensor", "asarray") and not isinstance(data, torch.Tensor)
            if not host_out and from_python:
                self._record("blocking copy to device", name)
        moved = host_out != (not on_device)
        if name in ("to", "cpu") and isinstance(out, torch.Tensor) and out is args[0] and moved:
            # A copy between host and device on CUDA, the tensor itself on the CPU: a copy here too,
            # so that each side keeps its own tensor.
            out = out.clone()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not any(t is i for i in inputs):
                if host_out:
                    self.host[t] = True
                else:
                    self.host.pop(t, None)
        return out

    def _transfer(self, name, args, kwargs, on_device, host_out) -> bool:
        """Whether a ``to`` / ``copy_`` result is a host tensor; records the copy when it synchronises."""
        if name == "copy_":  # dst.copy_(src)
            dst, src = args[0], args[1]
            if self.is_host(dst) and not self.is_host(src):
                self._record("copy to host", name)
            elif not self.is_host(dst) and self.is_host(src) and not kwargs.get("non_blocking", False):
                self._record("blocking copy to device", name)
            return self.is_host(dst)
        device = _device_arg(args, kwargs)
        if device is None:  # a dtype change: stays where it is
            return host_out
        if isinstance(device, str) and torch.device(device).type == "cpu":
            if on_device:
                self._record("copy to host", name)
            return True
        # A torch.device or a tensor's device: on CUDA the device (a copy there when from the host).
        non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[2:])
        if host_out and not non_blocking:
            self._record("blocking copy to device", name)
        return False


@contextlib.contextmanager
def cuda_like_cpu(reads: DeviceReads):
    """Inside: the CPU run keeps the data where CUDA would. A layout's device offsets are tensors of
    their own (on CUDA copies of the host offsets; on the CPU the layout hands out its host tensors
    themselves), and ``mla_forward_padded`` does not read its offsets (its default for CUDA
    offsets; CPU offsets are checked on the host by default, which costs nothing there), and small
    host tensors go to the device without waiting (``_to_device``'s CUDA path)."""
    from verl_ops import _mla, layout as layout_module
    from verl_ops.layout import ThdLayout

    from_host = ThdLayout.__dict__["_from_host"]
    should_validate = _mla.should_validate
    to_device = layout_module._to_device

    def device_offsets(cls, *args, **kwargs):
        layout = from_host.__func__(cls, *args, **kwargs)
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            t = getattr(layout, name)
            if t is getattr(layout, f"{name}_cpu"):
                copy = t.clone()
                reads.as_device(copy)
                object.__setattr__(layout, name, copy)
        return layout

    def cuda_default(validate, t, default=None):
        if default is None:
            return should_validate(validate, t)
        return should_validate(validate, t, default=False)

    ThdLayout._from_host = classmethod(device_offsets)
    _mla.should_validate = cuda_default
    layout_module._to_device = lambda host, device: host.to(device, non_blocking=True)
    try:
        yield
    finally:
        ThdLayout._from_host = from_host
        _mla.should_validate = should_validate
        layout_module._to_device = to_device


# --------------------------------------------------------------------------------------------
# The step, on a worker process (megatron-core's process-wide state stays out of pytest's).


def _model(device):
    lib.eager_megatron_fusions()
    torch.set_num_threads(1)
    lib.init_distributed(1, device)
    cfg = lib.make_config("tiny", dtype=torch.float32, device=device)
    model = lib.build_model(cfg, "verl_ops", size="tiny", device=device, seed=3)
    lib.randomize_expert_bias(model, 4)
    return model


def _batch(lengths, seed, device):
    """The micro-batch's nested tensors share one offsets tensor on the device, as the drop-ins'
    callers that build them from one batch have it."""
    batch = lib.make_batch(lengths, lib.SIZES["tiny"].vocab, seed, device)
    offsets = batch.input_ids.offsets()
    nest = lambda t: torch.nested.nested_tensor_from_jagged(t.values(), offsets)  # noqa: E731
    return lib.Batch(batch.lengths, batch.input_ids, nest(batch.loss_mask), nest(batch.weights))


def _summary(records) -> dict:
    ours = [r for r in records if r[0] == "verl_ops"]
    return {
        "ours": [f"{kind}: {what} at {where}" for _, kind, what, where in ours],
        "megatron": sum(1 for r in records if r[0] == "megatron"),
        "other": sum(1 for r in records if r[0] == "other"),
    }


def cpu_reads(rank, world_size):
    """Per micro-batch: what verl_ops' code would read on CUDA in one forward + backward."""
    device = torch.device("cpu")
    model = _model(device)
    pack = lib.verl_ops_pack()
    out = []
    for i, lengths in enumerate(MICRO_BATCHES):
        batch = _batch(lengths, 10 + i, device)
        reads = DeviceReads()
        with cuda_like_cpu(reads), reads:
            lib.forward_backward(model, batch, pack, device=device)
        out.append(_summary(reads.records))
    return out


def cuda_syncs(rank, world_size):
    """Per micro-batch: the synchronisations of one forward + backward on CUDA, by owner."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(device)
    pack = lib.verl_ops_pack()
    lib.forward_backward(model, _batch(MICRO_BATCHES[0], 9, device), pack, device=device)  # warm-up
    torch.cuda.synchronize()
    out = []
    for i, lengths in enumerate(MICRO_BATCHES):
        batch = _batch(lengths, 10 + i, device)
        torch.cuda.synchronize()
        records = []

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                who, where = owner(sys._getframe(1))
                records.append((who, "sync", str(message).splitlines()[0][:80], where))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                lib.forward_backward(model, batch, pack, device=device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out.append(_summary(records))
    return out


# --------------------------------------------------------------------------------------------
# Tests.


def _check(per_batch):
    for lengths, got in zip(MICRO_BATCHES, per_batch):
        listing = "\n  ".join(got["ours"]) or "(none)"
        assert len(got["ours"]) <= ALLOWED_PER_MICRO_BATCH, (
            f"micro-batch {lengths}: verl_ops' code reads device data {len(got['ours'])} times in one "
            f"forward + backward (allowed: {ALLOWED_PER_MICRO_BATCH}, the layout build):\n  {listing}"
        )
        assert any(s.startswith("layout build") or s.startswith("sync") for s in got["ours"]), (
            f"micro-batch {lengths}: no layout build seen: {got}"
        )


@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_one_layout_build_per_micro_batch_cpu():
    _check(shared_pool(1, "gloo", pg_timeout_s=60.0).run(f"{MODULE}:cpu_reads", timeout_s=300.0)[0])


@pytest.mark.gpu
@pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
def test_one_sync_per_micro_batch_cuda():
    reason = skip_reason("nccl", 1)
    if reason:
        pytest.skip(reason)
    _check(shared_pool(1, "nccl", pg_timeout_s=60.0).run(f"{MODULE}:cuda_syncs", timeout_s=300.0)[0])


# The recorder itself: each kind of read is seen, host work is not.


def test_device_reads_records_what_syncs():
    x = torch.arange(6)  # made before the mode: "on the device"
    reads = DeviceReads()
    with reads:
        int(x[-1])
        x.tolist()
        x.to("cpu", torch.int64)
        x[x > 2]
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15)  # sized by the caller: no read
        torch.equal(x, x)
        host = torch.arange(4)  # no device: made on the host
        pos = (host * 2)[1:]
        int(pos.max()), pos.tolist(), torch.repeat_interleave(host, host)  # host work: no reads
        pos.to(x.device)  # a blocking copy to the device
        pos.to(x.device, non_blocking=True)
        copy = x.to("cpu")
        int(copy[0])  # a host copy: no read
    kinds = [(kind, what) for _, kind, what, _ in reads.records]
    assert kinds == [
        ("value read", "__int__"), ("value read", "tolist"), ("copy to host", "to"),
        ("data-sized output", "__getitem__[bool]"), ("data-sized output", "repeat_interleave"),
        ("data-sized output", "equal"), ("blocking copy to device", "to"), ("copy to host", "to"),
    ], kinds


# --------------------------------------------------------------------------------------------
# The drop-ins' reuse of one layout per offsets tensor (no megatron-core needed: a stand-in
# parallel_state), and what makes them read the offsets again.


@pytest.fixture
def mcore(monkeypatch):
    import verl_stubs
    from verl_ops.integrations import verl as vi

    monkeypatch.setattr(vi, "ZIGZAG_ROLL_RULE", "0.9.1")
    return verl_stubs.install_megatron_stub(monkeypatch)


def _nested(values, offsets):
    return torch.nested.nested_tensor_from_jagged(values, offsets)


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 2)])
def test_preprocess_reuses_the_layout_of_the_same_offsets(mcore, tp, cp):
    from verl_ops.integrations import verl as vi
    from verl_ops.integrations._common import host_offsets

    mcore.tp, mcore.cp, mcore.cp_rank = tp, cp, cp - 1
    offsets = torch.tensor([0, 7, 8, 20, 25])
    ids = _nested(torch.arange(25) + 100, offsets)
    mask = _nested(torch.rand(25), offsets)  # another nested tensor on the same offsets
    packed, psp, pos = vi.preprocess_thd_engine(ids)
    labels, psp_labels, _ = vi.preprocess_thd_engine(ids, need_roll=True)
    loss_mask, psp_mask, _ = vi.preprocess_thd_engine(mask, need_roll=True)
    layout = psp.verl_ops_layout
    assert psp_labels.verl_ops_layout is layout and psp_mask.verl_ops_layout is layout
    # ... row for row what a layout of its own gives (offsets of their own: nothing to reuse)
    for got, x, roll in ((packed, ids, False), (labels, ids, True), (loss_mask, mask, True)):
        want = vi.preprocess_thd_engine(_nested(x.values(), offsets.clone()), need_roll=roll)
        assert want[1].verl_ops_layout is not layout
        assert torch.equal(got, want[0])
        assert torch.equal(want[1].cu_seqlens_q_padded, psp.cu_seqlens_q_padded)
    # other rules: a layout of their own
    fp8 = vi.preprocess_thd_engine(ids, use_fp8_padding=True)[1].verl_ops_layout
    assert fp8 is not layout and fp8.fp8_padding
    assert vi.preprocess_thd_engine(ids)[1].verl_ops_layout is layout
    # the device offsets carry their host values and longest sequence
    for cu, host, longest in ((psp.cu_seqlens_q_padded, layout.cu_seqlens_padded_cpu, layout.max_seqlen),
                              (layout.cu_seqlens, layout.cu_seqlens_cpu, layout.max_seqlen_unpadded)):
        got_host, got_longest = host_offsets(cu)
        assert torch.equal(got_host, host) and got_longest == longest
        assert got_longest == int((host[1:] - host[:-1]).max())
    # offsets changed in place: a new layout, and the old tags no longer count
    offsets.add_(0)
    assert vi.preprocess_thd_engine(ids)[1].verl_ops_layout is not layout
    assert host_offsets(torch.zeros(3, dtype=torch.int32)) is None
    cu = psp.cu_seqlens_q_padded
    cu.add_(0)
    assert host_offsets(cu) is None


def test_postprocess_reads_offsets_it_cannot_vouch_for(mcore, monkeypatch):
    from verl_ops.integrations import verl as vi

    offsets = torch.tensor([0, 3, 4, 9])
    ids = _nested(torch.arange(9), offsets)
    other = _nested(torch.arange(9), torch.tensor([0, 3, 4, 9]))
    out, psp, _ = vi.preprocess_thd_engine(ids)
    reads = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if "cpu" in args or kwargs.get("device") == "cpu":  # a host copy of one of the offsets (or a view)
            reads.extend(n for n, x in (("ids", ids), ("other", other))
                         if self.data_ptr() == x.offsets().data_ptr())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    back = vi.postprocess_thd_engine(out.float(), psp, ids, 3)
    assert torch.equal(back.values(), ids.values().float())
    assert reads == []  # the preprocess call's own input: its layout knows the offsets
    # equal offsets in a tensor of their own: read and compared
    assert torch.equal(vi.postprocess_thd_engine(out.float(), psp, other, 3).values(), back.values())
    assert reads == ["other"]
    wrong = _nested(torch.arange(9), torch.tensor([0, 4, 5, 9]))
    with pytest.raises(ValueError, match="offsets do not match"):
        vi.postprocess_thd_engine(out.float(), psp, wrong, 3)
    offsets[1] = 2  # the preprocess call's own offsets, changed since: read and compared again
    with pytest.raises(ValueError, match="offsets do not match"):
        vi.postprocess_thd_engine(out.float(), psp, ids, 3)
