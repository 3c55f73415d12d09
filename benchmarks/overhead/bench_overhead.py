"""Host cost per call of the THD ops, layer by layer, beside the kernel's own device time.

    python benchmarks/overhead/bench_overhead.py [--out results_overhead.md]

Eager mode, inputs already on the device, validate=False where the API has it. "host" is the
mean time per call over chunks of 16 back-to-back calls, with a device synchronisation between
chunks outside the timed span (so the launch queue never fills and a long kernel cannot leak into
the figure): Python, dispatcher, checks, allocation, launch. "device" is the kernel's time from
CUDA events (verl_ops.timing.device_time). Layers:

  raw op (Autograd key)   torch.ops.verl_ops.preprocess_thd.default(...) as called from Python;
                          the Python-registered autograd kernel runs even when nothing records
  raw op below Autograd   the same under torch._C._AutoDispatchBelowAutograd (the C++ op:
                          dispatcher, argument checks, allocation, launch)
  API (before)            verl_ops.preprocess_thd(values, layout, 0, validate=False) calling the op
                          through the Autograd key, as before the fast path
  API                     the same call as it is now (below the Autograd key when no gradient
                          is needed)
  API, nested input       the same from a jagged nested tensor
  verl drop-in            verl_ops.integrations.verl.preprocess_thd_engine(nested) end to end,
                          layout built from the nested tensor's device offsets (megatron stubbed;
                          its one host read waits for the work queued before it: in this
                          back-to-back loop, the previous call's kernel)
  ..., idle stream        the same, each call timed alone after a synchronisation: the call's
                          own cost, its host read waiting only for its own transfer
  aten floor              torch.ops.aten.index_select.default(values, 0, index) from Python: an
                          aten op with one output allocation and one launch, for scale

"call -> launch" columns (CUDA): the time from the Python call to the moment its first kernel
launch enters the CUDA runtime, taken by benchmarks/overhead/launch_clock.c (compiled here with the
system C compiler and preloaded: the script re-executes itself with LD_PRELOAD). It excludes
what a call costs after its launch (returning the outputs to Python, freeing the last call's).
--no-launch-clock skips them.

Batches: 256 sequences of token ids (int64) and 1024 sequences of fp32 [.., 1] values, log-normal
lengths (sigma 1, median 256), cp=1 and cp=4 zigzag (rank 0).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: common.py
import common  # noqa: E402  (puts the checkout on the path when verl_ops is not installed)

common.use_tests_dir()
import verl_ops  # noqa: E402
from common import device_time, lognormal_lengths, sync  # noqa: E402
from verl_ops import _thd  # noqa: E402


def _chunked(fn, device, n, warmup, chunk, time_chunk):
    """The loop shared by host_time and launch_time: ``warmup`` calls, then chunks of ``chunk``
    back-to-back calls, each timed by ``time_chunk(fn, chunk) -> (seconds, calls counted)``, with a
    device synchronisation between chunks outside the timed span. Returns (seconds, counted, calls)."""
    for _ in range(warmup):
        fn()
    sync(device)
    total, counted, done = 0.0, 0, 0
    while done < n:
        seconds, k = time_chunk(fn, chunk)
        total += seconds
        counted += k
        sync(device)
        done += chunk
    return total, counted, done


def host_time(fn, device, n=2000, warmup=50, chunk=16):
    """Mean host time per call: chunks of ``chunk`` back-to-back calls, timed, with a device
    synchronisation between chunks outside the timed span. The launch queue never fills, so a
    kernel longer than the host cost does not leak into the figure (a plain back-to-back loop
    measures max(host, device) once the queue is full)."""

    def whole_chunk(fn, chunk):
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        return time.perf_counter() - t0, chunk

    total, _, done = _chunked(fn, device, n, warmup, chunk, whole_chunk)
    return total / done


_CLOCK_ENV = "VERL_OPS_LAUNCH_CLOCK"


def preload_launch_clock():
    """Re-executes this script with benchmarks/overhead/launch_clock.c compiled and preloaded (once)."""
    if os.environ.get(_CLOCK_ENV):
        return
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        print("launch clock: no C compiler; call -> launch columns skipped", file=sys.stderr)
        return
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_clock.c")
    lib = os.path.join(tempfile.mkdtemp(prefix="verl_ops_clock_"), "launch_clock.so")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src, "-ldl"], check=True)
    env = dict(os.environ)
    env[_CLOCK_ENV] = lib
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD")) if x)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def launch_clock():
    """The preloaded clock's take() (ns of the first launch since the last take, 0 if none), or None."""
    lib = os.environ.get(_CLOCK_ENV)
    if not lib:
        return None
    take = ctypes.CDLL(lib).verl_ops_launch_clock_take
    take.restype = ctypes.c_int64
    take.argtypes = []
    return take


def launch_time(fn, device, take, n=2000, warmup=50, chunk=16):
    """Mean time from the Python call to its first kernel launch entering the runtime (chunks of
    ``chunk`` calls, synchronised between chunks as host_time). nan if a call launched nothing."""
    clock = time.perf_counter_ns

    def call_to_launch(fn, chunk):
        take()  # forget launches before this chunk (warm-up, the previous chunk's last call)
        total, counted = 0, 0
        for _ in range(chunk):
            t0 = clock()
            fn()
            t1 = take()
            if t1:
                total += t1 - t0
                counted += 1
        return total * 1e-9, counted

    total, counted, done = _chunked(fn, device, n, warmup, chunk, call_to_launch)
    return total / counted if counted == done else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-launch-clock", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not args.no_launch_clock:
        preload_launch_clock()
    take = launch_clock() if device.type == "cuda" else None

    import pytest
    import verl_stubs

    from verl_ops.integrations import verl as vi

    mp = pytest.MonkeyPatch()
    cfg = verl_stubs.install_megatron_stub(mp)

    op = torch.ops.verl_ops.preprocess_thd.default
    through_autograd = lambda o, g, *a: o(*a)  # noqa: E731  (the API before the fast path)
    name = common.gpu_name(device)
    lines = [
        f"### Host cost per call ({name}, torch {torch.__version__})",
        "",
        "| batch | cp | raw op (Autograd key) | raw op below Autograd | API (before) | API | API, nested input "
        "| verl drop-in e2e | verl drop-in e2e, idle stream | aten floor | kernel device time "
        "| call -> launch: raw op (Autograd key) | raw op below Autograd | API | aten floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for label, B, feat, dtype in (("256 seqs ids int64", 256, (), torch.int64), ("1024 seqs fp32 [.,1]", 1024, (1,), torch.float32)):
        lengths = lognormal_lengths(B, 256, seed=B)
        T = sum(lengths)
        values = (torch.randint(0, 32000, (T, *feat)) if dtype == torch.int64 else torch.randn(T, *feat)).to(device, dtype)
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device)
        nested = torch.nested.nested_tensor_from_jagged(values, offsets)
        for cp in (1, 4):
            layout = verl_ops.ThdLayout.from_lengths(lengths, cp_size=cp, device=device)
            cu, cup = layout.cu_seqlens, layout.cu_seqlens_padded
            raw_args = (values, cu, cup, layout.local_rows, cp, 0, layout.cp_layout_code, False, None)

            def below():
                with torch._C._AutoDispatchBelowAutograd():
                    return op(*raw_args)

            t_raw = host_time(lambda: op(*raw_args), device, args.n)
            t_below = host_time(below, device, args.n)
            with pytest.MonkeyPatch.context() as before:
                before.setattr(_thd, "call_op", through_autograd)
                t_before = host_time(lambda: verl_ops.preprocess_thd(values, layout, 0, validate=False), device, args.n)
            t_api = host_time(lambda: verl_ops.preprocess_thd(values, layout, 0, validate=False), device, args.n)
            t_nested = host_time(lambda: verl_ops.preprocess_thd(nested, layout, 0, validate=False), device, args.n)
            cfg.cp, cfg.cp_rank = cp, 0
            t_dropin = host_time(lambda: vi.preprocess_thd_engine(nested), device, max(64, args.n // 10))
            t_dropin_idle = host_time(lambda: vi.preprocess_thd_engine(nested), device, max(64, args.n // 10), chunk=1)
            index = torch.arange(0, T, 2, device=device)
            t_aten = host_time(lambda: torch.ops.aten.index_select.default(values, 0, index), device, args.n)
            t_dev = device_time(lambda i: op(*raw_args), device, 50) if device.type == "cuda" else float("nan")
            nan = float("nan")
            l_raw = launch_time(lambda: op(*raw_args), device, take, args.n) if take else nan
            l_below = launch_time(below, device, take, args.n) if take else nan
            l_api = launch_time(lambda: verl_ops.preprocess_thd(values, layout, 0, validate=False), device, take,
                                args.n) if take else nan
            l_aten = launch_time(lambda: torch.ops.aten.index_select.default(values, 0, index), device, take,
                                 args.n) if take else nan
            us = lambda t: f"{t * 1e6:.1f} µs"  # noqa: E731
            row = (f"| {label} | {cp} | {us(t_raw)} | {us(t_below)} | {us(t_before)} | {us(t_api)} | {us(t_nested)} "
                   f"| {us(t_dropin)} | {us(t_dropin_idle)} | {us(t_aten)} | {us(t_dev)} "
                   f"| {us(l_raw)} | {us(l_below)} | {us(l_api)} | {us(l_aten)} |")
            lines.append(row)
            print(row, flush=True)
    mp.undo()
    lines += ["", "- mean per call over chunks of 16 back-to-back eager calls (synchronised between chunks, "
              "outside the timed span); "
              "`python benchmarks/overhead/bench_overhead.py`"]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
