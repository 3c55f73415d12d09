"""benchmarks/megatron/bench_megatron_step.time_paths: which path runs which batch, in which order,
for the alternating and the blocked (steady-state) schedules, on the CPU with a recording step."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "megatron"))
bench = pytest.importorskip("bench_megatron_step")


class RecordingStep:
    """What time_paths needs of a step: .model, .use(path), step(batch); records (path, batch)."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.path = None
        self.calls = []

    def use(self, path):
        self.path = path

    def __call__(self, batch):
        self.calls.append((self.path, batch))


def test_alternate_warms_every_path_first_then_takes_turns():
    step = RecordingStep()
    out = bench.time_paths(step, ["b0", "b1"], ["p", "q"], reps=3, warmup=2, device=torch.device("cpu"))
    assert step.calls == [
        ("p", "b0"), ("p", "b1"), ("q", "b0"), ("q", "b1"),  # warm-ups
        ("p", "b0"), ("q", "b0"),  # round 0
        ("q", "b1"), ("p", "b1"),  # round 1, reversed
        ("p", "b0"), ("q", "b0"),  # round 2
    ]
    assert [len(out[p]["wall_ms_all"]) for p in ("p", "q")] == [3, 3]


def test_blocked_runs_each_path_warm_up_and_timed_steps_back_to_back():
    step = RecordingStep()
    out = bench.time_paths(step, ["b0", "b1"], ["p", "q"], reps=3, warmup=1, device=torch.device("cpu"),
                           order="blocked")
    # warm-up max(1, 2 batches) = 2 steps, then 3 timed steps, per path
    assert step.calls == [("p", "b0"), ("p", "b1"), ("p", "b0"), ("p", "b1"), ("p", "b0"),
                          ("q", "b0"), ("q", "b1"), ("q", "b0"), ("q", "b1"), ("q", "b0")]
    assert [len(out[p]["wall_ms_all"]) for p in ("p", "q")] == [3, 3]
    assert all(out[p]["wall_ms"] >= 0 for p in ("p", "q"))


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="time_paths: order"):
        bench.time_paths(RecordingStep(), ["b0"], ["p"], reps=1, warmup=0, device=torch.device("cpu"),
                         order="random")
