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
    assert dict(idle_gaps.overlaps_per_window(ev, [(5, 45)])[0]) == {"cudaMalloc": 5 + 5, "cudaStreamSynchronize": 22}


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


def test_a_kernel_launched_with_no_op_open_goes_by_its_launch_call():
    # FlashAttention-4's kernels: launched through the driver inside a range, no aten op open; the
    # kernel and its cuLaunchKernel share a CUPTI correlation id (77), the call runs on thread 1
    ops = [(0, 100 * US, "bench::core_attention", 1, 40), (5 * US, 6 * US, "aten::empty", 1, 41)]
    runtime = [(50 * US, 51 * US, "cuLaunchKernel", 77, 1)]
    device = [(0, 1 * US, "k0", 41, 5), (60 * US, 70 * US, "flash_fwd", 0, 77)]
    r = idle_gaps.analyse(device, runtime, ops, min_gap=20 * US)
    g = r["largest"][0]
    assert (g["kernel_after"], g["launched_by"], g["range"]) == ("flash_fwd", "cuLaunchKernel", "bench::core_attention")
    assert g["host_calls_ms"] == pytest.approx({"cuLaunchKernel": 0.001})


def test_overlaps_per_window_places_each_event_once():
    windows = [(10, 20), (30, 40), (50, 60)]
    ev = [(0, 100, "sync"), (15, 35, "malloc"), (41, 49, "none"), (55, 56, "launch")]
    got = idle_gaps.overlaps_per_window(ev, windows)
    assert [dict(c) for c in got] == [{"sync": 10, "malloc": 5}, {"sync": 10, "malloc": 5},
                                      {"sync": 10, "launch": 1}]


def test_a_launch_bound_step():
    """20,000 kernels, each after a gap, 20,000 launch calls and 40,000 ops: every gap counted and
    tied to its range. (The analysis places each event by bisection; a scan of every event per gap
    would take minutes here.)"""
    n = 20_000
    ops, runtime, device = [], [], []
    for i in range(n):
        t = i * 100 * US
        ops.append((t, t + 50 * US, "bench::loss", 1, 2 * i + 1))
        ops.append((t + 10 * US, t + 20 * US, "aten::exp", 1, 2 * i + 2))
        runtime.append((t + 12 * US, t + 13 * US, "cudaLaunchKernel", 10 ** 6 + i, 1))
        device.append((t + 40 * US, t + 45 * US, "k", 2 * i + 2, 10 ** 6 + i))
    r = idle_gaps.analyse(device, runtime, ops, min_gap=20 * US)
    assert r["n_gaps"] == n - 1 and r["by_label_ms"] == pytest.approx({"bench::loss": (n - 1) * 0.095})
    assert r["host_calls_ms"] == pytest.approx({"cudaLaunchKernel": (n - 1) * 0.001})
    assert r["largest"][0]["launched_by"] == "aten::exp"


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
