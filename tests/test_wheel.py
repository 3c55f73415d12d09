"""The wheel built from this tree installs into a fresh virtual environment and works there, away
from the source tree. The fresh environment sees the torch of the interpreter running the tests
through a .pth file (it holds no packages of its own but the wheel), so this works whether that
interpreter is a system Python or itself a virtual environment."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

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


def build_wheel(out_dir: Path) -> Path:
    """`pip wheel` of this tree against the running interpreter's torch; returns the wheel."""
    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", str(ROOT), "-w", str(out_dir)],
        check=True, env=env, cwd=out_dir,
    )
    wheels = list(out_dir.glob("verl_ops-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def fresh_venv(path: Path, see_site_packages: str | None) -> Path:
    """A new venv; with see_site_packages, a .pth file puts that directory on its path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    if see_site_packages:
        Path(purelib, "_verl_ops_test_torch.pth").write_text(see_site_packages + "\n")
    return py


def install_wheel(py: Path, wheel: Path) -> None:
    # The venv has no pip of its own; the running interpreter's pip installs into it.
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", purelib, str(wheel)],
        check=True,
    )


@pytest.mark.timeout(1800)
def test_wheel_installs_in_fresh_venv(tmp_path):
    wheel = build_wheel(tmp_path)
    # The name says what the binary needs: one abi3 wheel for every Python >= 3.10, the CUDA
    # major (or cpu) as the local version; the metadata asks for torch >= 2.9.
    assert "-cp310-abi3-" in wheel.name, wheel.name
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: torch>=2.9" in meta, meta
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    py = fresh_venv(tmp_path / "venv", torch_site)
    install_wheel(py, wheel)
    # A fresh environment: no PYTHONPATH of the caller's (which may name this source tree).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", SMOKE], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "wheel smoke ok" in out.stdout
