"""benchmarks/overhead/launch_clock.c, the launch clock behind bench_overhead's "call -> launch" columns:
it must note the time a launch enters the runtime (CLOCK_MONOTONIC, Python's perf_counter_ns),
keep the first one until read, re-arm on read, and forward the launch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "overhead", "launch_clock.c")
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"), reason="needs a C compiler on Linux")


@pytest.fixture(scope="module")
def clock_so(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clock") / "launch_clock.so")
    subprocess.run([CC, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", out, SRC, "-ldl"], check=True)
    return out


def test_first_launch_time_kept_until_read(clock_so):
    # In a child process: the null launches leave the CUDA runtime's last error set
    # (cudaErrorInvalidDeviceFunction), which the next CUDA call of this process that checks it
    # (the next GPU test's) would report as its own.
    code = textwrap.dedent(
        f"""
        import ctypes, time
        import torch  # noqa: F401  (loads the CUDA runtime whose launch the clock forwards to)

        class Dim3(ctypes.Structure):
            _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]

        lib = ctypes.CDLL({clock_so!r})
        take = lib.verl_ops_launch_clock_take
        take.restype = ctypes.c_int64
        launch = getattr(lib, "__cudaLaunchKernel")
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        take()
        assert take() == 0  # nothing launched since the last read
        t0 = time.perf_counter_ns()
        launch(None, Dim3(1, 1, 1), Dim3(1, 1, 1), None, 0, None)  # a null kernel: the runtime refuses it
        t1 = time.perf_counter_ns()
        launch(None, Dim3(1, 1, 1), Dim3(1, 1, 1), None, 0, None)
        first = take()
        assert t0 <= first <= t1, (t0, first, t1)  # the first launch's time, on perf_counter_ns's clock
        assert take() == 0  # re-armed
        print("OK")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_preloaded_clock_sees_a_verl_ops_launch(clock_so):
    code = textwrap.dedent(
        f"""
        import ctypes, time, torch, verl_ops
        take = ctypes.CDLL({clock_so!r}).verl_ops_launch_clock_take
        take.restype = ctypes.c_int64
        layout = verl_ops.ThdLayout.from_lengths([3, 5, 2], device="cuda")
        values = torch.arange(10, device="cuda", dtype=torch.float32)
        torch.cuda.synchronize()
        take()
        t0 = time.perf_counter_ns()
        verl_ops.preprocess_thd(values, layout, 0, validate=False)
        t1 = take()
        print("OK" if t0 < t1 else f"no launch seen: {{t0}} {{t1}}")
        """
    )
    env = dict(os.environ, LD_PRELOAD=":".join(x for x in (clock_so, os.environ.get("LD_PRELOAD")) if x))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("OK"), res.stdout + res.stderr[-2000:]
