"""benchmarks/megatron/gpu_clocks.py: per-window summaries of sampled GPU clocks, and a sampler that
stays harmless where NVML is missing."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "megatron"))
import gpu_clocks  # noqa: E402


def test_samples_count_for_the_windows_they_fall_in():
    # (time s, MHz, energy counter mJ, C)
    samples = [(0.0, 1980, 1000, 60), (1.0, 1800, 1600, 70), (2.0, 1700, 2300, 75), (3.0, 1900, None, None),
               (4.0, 1600, 4000, 72), (4.5, 1600, 4300, 72)]
    windows = [("a", 0.0, 1.0), ("b", 1.5, 2.5), ("a", 2.9, 3.1), ("c", 10.0, 11.0), ("d", 3.9, 4.9)]
    got = gpu_clocks.summarize(samples, windows, max_mhz=1980)
    assert got["a"]["samples"] == 3  # t = 0, 1 (both ends inside) and 3
    assert got["a"]["sm_mhz"] == pytest.approx((1980 + 1800 + 1900) / 3)
    assert got["a"]["sm_mhz_min"] == 1800
    assert got["a"]["temp_c"] == pytest.approx(65)
    # energy: only the first window has two counted samples: 600 mJ over 1 s
    assert got["a"]["power_w"] == pytest.approx(0.6)
    assert got["a"]["energy_j"] == pytest.approx(0.6)
    # one sample: a clock, no energy
    assert got["b"] == {"samples": 1, "sm_mhz": 1700, "sm_mhz_min": 1700, "power_w": None, "energy_j": None,
                        "temp_c": 75}
    assert got["c"] == {"samples": 0, "sm_mhz": None, "sm_mhz_min": None, "power_w": None, "energy_j": None,
                        "temp_c": None}
    # 300 mJ between the samples at 4.0 and 4.5 s: 0.6 W; the window is 1 s long: 0.6 J
    assert got["d"]["power_w"] == pytest.approx(0.6)
    assert got["d"]["energy_j"] == pytest.approx(0.6)
    assert got["_device"] == {"sm_mhz_max": 1980}


def test_energy_is_the_mean_over_windows():
    samples = [(0.0, 1, 0, None), (1.0, 1, 2000, None), (5.0, 1, 2000, None), (6.0, 1, 6000, None)]
    got = gpu_clocks.summarize(samples, [("p", 0.0, 1.0), ("p", 5.0, 6.0)])
    assert got["p"]["energy_j"] == pytest.approx((2.0 + 4.0) / 2)
    assert got["p"]["power_w"] == pytest.approx(6.0 / 2.0)  # 6 J over the 2 s the counter was read across


def test_cpu_device_is_never_sampled():
    s = gpu_clocks.ClockSampler(torch.device("cpu"))
    assert not s.ok and s.why == "not a CUDA device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-NVML case: a machine without a GPU")
def test_without_nvml_the_sampler_does_nothing():
    s = gpu_clocks.ClockSampler(torch.device("cpu"))
    assert not s.ok and s.why
    s.start()
    s.window("a", 0.0, 1.0)
    s.stop()
    assert s.samples == [] and s.summary() == {"a": {"samples": 0, "sm_mhz": None, "sm_mhz_min": None,
                                                     "power_w": None, "energy_j": None, "temp_c": None},
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
