"""The demo (`python -m verl_ops`, the Quick start's main job): it runs, checks its roundtrip, and
reports a mismatch with exit status 1 instead of printing OK."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import verl_ops
from verl_ops import demo

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and verl_ops.cuda_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_demo_runs_and_checks(device, capsys):
    rc = demo.main(["--device", device, "--batch", "9", "--hidden", "16", "--max-len", "300", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "9 sequences" in out
    for row in ("pack   cp=1", "unpack cp=1", "pack   cp=2", "unpack cp=2"):
        assert row in out
    assert out.rstrip().endswith("packing matches the loop: OK")


def test_demo_reports_a_wrong_pack(monkeypatch, capsys):
    real = verl_ops.preprocess_thd

    def off_by_one(values, layout, cp_rank, **kw):
        packed, pos = real(values, layout, cp_rank, **kw)
        return packed + 1, pos  # every value wrong

    monkeypatch.setattr(verl_ops, "preprocess_thd", off_by_one)
    rc = demo.main(["--device", "cpu", "--batch", "5", "--hidden", "8", "--max-len", "100", "--repeats", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "MISMATCH" in captured.err and "pack cp=1 rank 0: values" in captured.err
    assert "OK" not in captured.out


def test_demo_reports_a_wrong_unpack(monkeypatch, capsys):
    real = verl_ops.postprocess_thd

    def reversed_rows(packed, layout, **kw):
        out = real(packed, layout, **kw)
        return torch.nested.nested_tensor_from_jagged(out.values().flip(0), out.offsets())

    monkeypatch.setattr(verl_ops, "postprocess_thd", reversed_rows)
    rc = demo.main(["--device", "cpu", "--batch", "5", "--hidden", "8", "--max-len", "100", "--repeats", "1"])
    assert rc == 1
    assert "unpack cp=1: roundtrip" in capsys.readouterr().err


def test_python_dash_m_runs_the_demo():
    r = subprocess.run(
        [sys.executable, "-m", "verl_ops", "--device", "cpu", "--batch", "4", "--hidden", "8", "--repeats", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
