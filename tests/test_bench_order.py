"""benchmarks/megatron/bench_megatron_step.time_paths: which path runs which batch, in which order,
and which steps fall inside the timed windows, for the alternating and the blocked (back to back)
schedules, on the CPU with a recording step."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "megatron"))
import bench_megatron_step as bench  # noqa: E402


class RecordingStep:
    """What time_paths needs of a step: .model, .use(path), step(batch); records (path, batch), and
    "|" for every read of the clock (time.perf_counter, patched by ``clocked``)."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.path = None
        self.calls = []

    def use(self, path):
        self.path = path

    def __call__(self, batch):
        self.calls.append((self.path, batch))


@pytest.fixture
def clocked(monkeypatch):
    def make():
        step = RecordingStep()
        real = time.perf_counter

        def perf_counter():
            step.calls.append("|")
            return real()

        monkeypatch.setattr(bench.time, "perf_counter", perf_counter)
        return step

    return make


def timed(calls):
    """The steps between a pair of clock reads (t0 ... t1), and the steps outside any pair."""
    inside, outside, open_ = [], [], False
    for c in calls:
        if c == "|":
            open_ = not open_
        else:
            (inside if open_ else outside).append(c)
    assert not open_, "a timed window was not closed"
    return inside, outside


def test_alternate_warms_every_path_first_then_takes_turns(clocked):
    step = clocked()
    out = bench.time_paths(step, ["b0", "b1"], ["p", "q"], reps=3, warmup=2, device=torch.device("cpu"))
    inside, outside = timed(step.calls)
    assert outside == [("p", "b0"), ("p", "b1"), ("q", "b0"), ("q", "b1")]  # warm-ups, untimed
    assert inside == [
        ("p", "b0"), ("q", "b0"),  # round 0
        ("q", "b1"), ("p", "b1"),  # round 1, reversed
        ("p", "b0"), ("q", "b0"),  # round 2
    ]
    assert step.calls.count("|") == 2 * 6  # one window per timed step
    assert [len(out[p]["wall_ms_all"]) for p in ("p", "q")] == [3, 3]


def test_blocked_runs_each_path_warm_up_and_timed_steps_back_to_back(clocked):
    step = clocked()
    out = bench.time_paths(step, ["b0", "b1"], ["p", "q"], reps=3, warmup=1, device=torch.device("cpu"),
                           order="blocked")
    # warm-up max(1, 2 batches) = 2 steps, untimed, right before the path's 3 timed steps
    assert [c for c in step.calls if c != "|"] == [
        ("p", "b0"), ("p", "b1"), ("p", "b0"), ("p", "b1"), ("p", "b0"),
        ("q", "b0"), ("q", "b1"), ("q", "b0"), ("q", "b1"), ("q", "b0")]
    inside, outside = timed(step.calls)
    assert outside == [("p", "b0"), ("p", "b1"), ("q", "b0"), ("q", "b1")]
    assert inside == [("p", "b0"), ("p", "b1"), ("p", "b0"), ("q", "b0"), ("q", "b1"), ("q", "b0")]
    assert [len(out[p]["wall_ms_all"]) for p in ("p", "q")] == [3, 3]
    assert all(out[p]["wall_ms"] >= 0 for p in ("p", "q"))


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="time_paths: order"):
        bench.time_paths(RecordingStep(), ["b0"], ["p"], reps=1, warmup=0, device=torch.device("cpu"),
                         order="random")
