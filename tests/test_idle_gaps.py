"""benchmarks/megatron/idle_gaps.py: the GPU idle report of a traced step, on hand-made timelines."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "megatron"))
import idle_gaps  # noqa: E402

US = 1000  # ns


def test_gaps_of_the_union_only():
    # two overlapping kernels (streams), then a gap of 5 us, then one inside nothing
    dev = [(0, 10, "a"), (5, 20, "b"), (25, 30, "c"), (30, 31, "d"), (40, 45, "e")]
    got = [(g[0], g[1], g[2], g[3], g[4]) for g in idle_gaps.gaps(dev)]
    assert got == [(5, 20, 25, "b", "c"), (9, 31, 40, "d", "e")]
    assert idle_gaps.gaps([]) == []


def test_overlap_by_name():
    ev = [(0, 10, "cudaMalloc"), (8, 30, "cudaStreamSynchronize"), (40, 50, "cudaMalloc")]
    assert dict(idle_gaps.overlap_by_name(ev, 5, 45)) == {"cudaMalloc": 5 + 5, "cudaStreamSynchronize": 22}


def _timeline():
    # host thread 1: bench::rope [0, 400 us] holds aten::index (id 11) [10, 300 us] and aten::mul (id 12)
    # [320, 330 us]; bench::loss [500, 600 us] holds aten::exp (id 21) [510, 520 us]
    ops = [
        (0, 400 * US, "bench::rope", 1, 10),
        (10 * US, 300 * US, "aten::index", 1, 11),
        (20 * US, 25 * US, "aten::item", 1, 13),
        (320 * US, 330 * US, "aten::mul", 1, 12),
        (500 * US, 600 * US, "bench::loss", 1, 20),
        (510 * US, 520 * US, "aten::exp", 1, 21),
    ]
    runtime = [(21 * US, 290 * US, "cudaStreamSynchronize"), (325 * US, 326 * US, "cudaLaunchKernel"),
               (515 * US, 516 * US, "cudaLaunchKernel"), (400 * US, 480 * US, "cudaMalloc")]
    device = [
        (5 * US, 15 * US, "k_index", 11),       # launched by aten::index
        (326 * US, 340 * US, "k_mul", 12),      # after a 311 us gap (the sync)
        (350 * US, 360 * US, "k_small", 12),    # a 10 us gap: below min_gap
        (516 * US, 530 * US, "k_exp", 21),      # after a 156 us gap (cudaMalloc in it)
    ]
    return device, runtime, ops


def test_analyse_names_each_gap_and_its_host_work():
    device, runtime, ops = _timeline()
    r = idle_gaps.analyse(device, runtime, ops, top=5, min_gap=20 * US)
    assert r["n_gaps"] == 2
    assert r["gaps_ms"] == pytest.approx((311 + 156) * 1e-3)
    assert r["small_gaps_ms"] == pytest.approx(10e-3)
    assert r["head_ms"] == pytest.approx(5e-3)          # first host op at 0, first kernel at 5 us
    assert r["tail_ms"] == pytest.approx(70e-3)         # last host op ends at 600 us, last kernel at 530
    assert r["idle_ms"] == pytest.approx((311 + 156 + 10 + 5 + 70) * 1e-3)
    first, second = r["largest"]
    assert (first["kernel_after"], first["kernel_before"]) == ("k_mul", "k_index")
    assert (first["launched_by"], first["range"]) == ("aten::mul", "bench::rope")
    assert first["ms"] == pytest.approx(0.311) and first["at_ms"] == pytest.approx(0.010)
    assert first["host_calls_ms"]["cudaStreamSynchronize"] == pytest.approx(0.269)
    assert first["ops_started"] == {"aten::item": 1, "aten::mul": 1}
    assert (second["kernel_after"], second["launched_by"], second["range"]) == ("k_exp", "aten::exp", "bench::loss")
    assert second["host_calls_ms"]["cudaMalloc"] == pytest.approx(0.080)
    assert r["by_label_ms"] == pytest.approx({"bench::rope": 0.311, "bench::loss": 0.156})
    assert r["host_calls_ms"]["cudaStreamSynchronize"] == pytest.approx(0.269)
    text = "\n".join(idle_gaps.describe("verl_ops", r))
    assert "2 gaps of >= 20 us" in text and "launched by aten::mul in bench::rope" in text


def test_backward_ops_go_by_their_autograd_node():
    # the autograd engine's thread (2): a backward node's range around the op that launches
    ops = [(0, 100 * US, "autograd::engine::evaluate_function: MulBackward0", 2, 30),
           (10 * US, 20 * US, "aten::mul", 2, 31)]
    device = [(0, 1 * US, "k0", 31), (50 * US, 60 * US, "k1", 31)]
    r = idle_gaps.analyse(device, [], ops, min_gap=20 * US)
    assert r["largest"][0]["range"] == "MulBackward0" and r["largest"][0]["launched_by"] == "aten::mul"


def test_analyse_unknown_launcher_and_empty():
    device, runtime, ops = _timeline()
    device = [(a, b, n, 999) for a, b, n, _ in device]  # launching ops not in the trace
    r = idle_gaps.analyse(device, runtime, ops, min_gap=20 * US)
    assert r["largest"][0]["launched_by"] is None and r["by_label_ms"] == pytest.approx({"(no range)": 0.467})
    empty = idle_gaps.analyse([], [], [])
    assert empty["idle_ms"] == 0 and empty["largest"] == [] and empty["n_gaps"] == 0


def test_from_profiler_on_the_cpu_runs():
    """On the CPU the trace has no device work: the report is empty, and reading Kineto's events
    works on this torch."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x = torch.randn(64, 64)
        (x @ x).sum().item()
    r = idle_gaps.from_profiler(prof)
    assert r["n_gaps"] == 0 and r["largest"] == [] and r["head_ms"] == 0
