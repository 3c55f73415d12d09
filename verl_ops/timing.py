"""Timing helpers shared by the demo and the benchmarks: median of repeats, synchronised."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CYCLES_PER_US = None


def _cycles_per_us():
    global _CYCLES_PER_US
    if _CYCLES_PER_US is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        torch.cuda.synchronize()
        _CYCLES_PER_US = 2_000_000 / max(s.elapsed_time(e) * 1e3, 1.0)
    return _CYCLES_PER_US


def device_time(fn, device, n, warmup=3):
    """Median device time of fn(i) in seconds.

    CUDA: an event pair around each call; a sleep kernel queued first keeps the GPU busy while the
    host enqueues a batch of calls, so the events see GPU time, not Python launch overhead.
    CPU: wall clock per call.
    """
    for i in range(warmup):
        fn(i)
    sync(device)
    times = []
    if device.type != "cuda":
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    t0 = time.perf_counter()
    for i in range(3):
        fn(i)
    host = (time.perf_counter() - t0) / 3  # enqueue cost per call (upper bound)
    sync(device)
    sleeper = hasattr(torch.cuda, "_sleep")
    batch = 32
    for b0 in range(0, n, batch):
        k = min(batch, n - b0)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(k)]
        if sleeper:
            torch.cuda._sleep(int(min(host * k * 1.5 + 50e-6, 0.1) * 1e6 * _cycles_per_us()))
        for j in range(k):
            ev[j][0].record()
            fn(b0 + j)
            ev[j][1].record()
        torch.cuda.synchronize(device)
        times += [s.elapsed_time(e) * 1e-3 for s, e in ev]
    return statistics.median(times)


def wall_time(fn, device, n, warmup=1):
    """Median wall-clock seconds of fn() including a final synchronisation."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.2f} s "
