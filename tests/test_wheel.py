"""The wheel built from this tree installs into a fresh virtual environment (sharing the installed
torch) and works there, away from the source tree."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = textwrap.dedent(
    """
    import sys, torch, verl_ops
    assert verl_ops.__file__.startswith(sys.prefix), verl_ops.__file__
    lens = [5, 1, 9, 4]
    layout = verl_ops.ThdLayout.from_lengths(lens, cp_size=2)
    x = torch.randn(sum(lens), 3)
    shards = torch.stack([verl_ops.preprocess_thd(x, layout, r)[0] for r in range(2)])
    back = verl_ops.postprocess_thd(shards, layout, as_nested=False)
    assert torch.equal(back, x)
    print("wheel smoke ok", verl_ops.__version__, verl_ops.cuda_available())
    """
)


@pytest.mark.timeout(1800)
def test_wheel_installs_in_fresh_venv(tmp_path):
    wheel_dir = tmp_path / "wheels"
    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", str(ROOT),
         "-w", str(wheel_dir)],
        check=True, env=env, cwd=tmp_path,
    )
    wheels = list(wheel_dir.glob("verl_ops-*.whl"))
    assert len(wheels) == 1, wheels

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], check=True)
    out = subprocess.run([str(py), "-c", SMOKE], check=True, cwd=tmp_path, capture_output=True, text=True)
    assert "wheel smoke ok" in out.stdout
