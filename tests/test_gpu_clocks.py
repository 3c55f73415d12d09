"""benchmarks/megatron/gpu_clocks.py: per-window summaries of sampled GPU clocks, and a sampler that
stays harmless where NVML is missing."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "megatron"))
import gpu_clocks  # noqa: E402


def test_samples_count_for_the_windows_they_fall_in():
    samples = [(0.0, 1980, 500.0, 60), (1.0, 1800, 690.0, 70), (2.0, 1700, 700.0, 75), (3.0, 1900, None, None),
               (4.0, 1600, 650.0, 72)]
    windows = [("a", 0.0, 1.0), ("b", 1.5, 2.5), ("a", 2.9, 3.1), ("c", 10.0, 11.0)]
    got = gpu_clocks.summarize(samples, windows, max_mhz=1980)
    assert got["a"]["samples"] == 3  # t = 0, 1 (both ends inside) and 3
    assert got["a"]["sm_mhz"] == pytest.approx((1980 + 1800 + 1900) / 3)
    assert got["a"]["sm_mhz_min"] == 1800
    assert got["a"]["power_w"] == pytest.approx((500 + 690) / 2)  # the sample without power left out
    assert got["a"]["temp_c"] == pytest.approx(65)
    assert got["b"] == {"samples": 1, "sm_mhz": 1700, "sm_mhz_min": 1700, "power_w": 700.0, "temp_c": 75}
    assert got["c"] == {"samples": 0, "sm_mhz": None, "sm_mhz_min": None, "power_w": None, "temp_c": None}
    assert got["_device"] == {"sm_mhz_max": 1980}
    assert "d" not in got  # no window: no entry; sample at t = 4 outside every window


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-NVML case: a machine without a GPU")
def test_without_nvml_the_sampler_does_nothing():
    s = gpu_clocks.ClockSampler(torch.device("cpu"))
    assert not s.ok and s.why
    s.start()
    s.window("a", 0.0, 1.0)
    s.stop()
    assert s.samples == [] and s.summary() == {"a": {"samples": 0, "sm_mhz": None, "sm_mhz_min": None,
                                                     "power_w": None, "temp_c": None},
                                               "_device": {"sm_mhz_max": None}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sampler_reads_the_gpu():
    import time

    s = gpu_clocks.ClockSampler(torch.device("cuda", torch.cuda.current_device()))
    if not s.ok:
        pytest.skip(s.why)
    s.start()
    t0 = time.perf_counter()
    time.sleep(0.1)
    s.window("idle", t0, time.perf_counter())
    s.stop()
    got = s.summary()["idle"]
    assert got["samples"] >= 5 and got["sm_mhz"] > 0
