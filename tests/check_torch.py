"""Compatibility check across torch versions (not collected by pytest; run it directly).

    python tests/check_torch.py --wheel-torch 2.11.0 2.15.0 --source-torch 2.9.1 2.10.0

builds the wheel once against the running interpreter's torch, then for each --wheel-torch
version makes a fresh venv with that torch from PyPI, installs the same wheel unchanged and runs
the smoke test and a short subset of the suite there, away from the source tree. For each
--source-torch version it makes a venv with that torch and builds the package from source in it
(CPU kernels only unless nvcc's CUDA major matches that torch's), then runs the same checks.
Prints a table (torch, how built, import, smoke, tests) and exits non-zero if any row failed.
`--wheel PATH` reuses a built wheel; `--cpu-torch` installs torch without its CUDA libraries'
packages where PyPI has a CPU wheel (not for Linux x86 PyPI torch, so off by default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_wheel import SMOKE  # noqa: E402

# A short subset of the suite: the layout rules, pack/unpack, jagged ops, router and MLA on the
# CPU, opcheck and torch.compile included.
SUBSET = [
    "tests/test_layout.py",
    "tests/test_jagged.py",
    "tests/test_thd.py",
    "tests/test_router.py",
    "tests/test_mla.py",
]


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], **kw)


def make_venv(path: Path, torch_version: str) -> Path:
    run([sys.executable, "-m", "venv", path], check=True)
    py = path / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    run([py, "-m", "pip", "install", "-q", f"torch=={torch_version}", "numpy", "pytest", "pytest-timeout",
         "setuptools>=77", "wheel", "ninja"], check=True)
    return py


def torch_cuda_major(py: Path) -> str | None:
    out = run([py, "-c", "import torch; print(torch.version.cuda or '')"], check=True, capture_output=True, text=True)
    v = out.stdout.strip()
    return v.split(".")[0] if v else None


def nvcc_major() -> str | None:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    import re

    m = re.search(r"release (\d+)\.", out)
    return m.group(1) if m else None


def check_env(py: Path, work: Path, tests: list[str], timeout: int) -> tuple[str, str, str]:
    """(import, smoke, tests) results in the venv of `py`, run away from the source tree."""
    imp = run([py, "-c", "import torch, verl_ops; print(torch.__version__, verl_ops.__file__)"], cwd=work,
              capture_output=True, text=True)
    if imp.returncode != 0:
        print(imp.stdout, imp.stderr)
        return "FAIL", "-", "-"
    smoke = run([py, "-c", SMOKE], cwd=work, capture_output=True, text=True)
    print(smoke.stdout.strip(), smoke.stderr.strip()[-2000:])
    if not tests:
        return "ok", "ok" if smoke.returncode == 0 else "FAIL", "-"
    # Collected from the tree, but `import verl_ops` finds the installed package: pytest puts the
    # tests folder (not the repository root) on sys.path, and the run happens elsewhere.
    res = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not wheel", f"--timeout={timeout}",
               *[ROOT / t for t in tests]], cwd=work, capture_output=True, text=True)
    tail = [ln for ln in res.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    print(res.stdout[-3000:], res.stderr[-2000:])
    summary = tail[0].strip("= ")
    return "ok", "ok" if smoke.returncode == 0 else "FAIL", ("ok: " if res.returncode == 0 else "FAIL: ") + summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel-torch", nargs="*", default=[], help="torch versions to install the built wheel under")
    ap.add_argument("--source-torch", nargs="*", default=[], help="torch versions to build from source against")
    ap.add_argument("--wheel", type=Path, help="use this wheel instead of building one")
    ap.add_argument("--tests", nargs="*", default=SUBSET, help="test files to run in each environment")
    ap.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds")
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="verl_ops_check_"))
    rows = []
    wheel = args.wheel
    if args.wheel_torch and wheel is None:
        import torch

        from test_wheel import build_wheel

        t0 = time.time()
        wheel = build_wheel(work)
        print(f"built {wheel.name} against torch {torch.__version__} in {time.time() - t0:.0f} s", flush=True)
    for version in args.wheel_torch:
        venv = work / f"venv-wheel-{version}"
        py = make_venv(venv, version)
        run([py, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
        how = f"wheel {wheel.name} (torch CUDA {torch_cuda_major(py) or 'none'})"
        rows.append((version, how, *check_env(py, work, args.tests, args.timeout)))
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
    for version in args.source_torch:
        venv = work / f"venv-src-{version}"
        py = make_venv(venv, version)
        env = dict(os.environ)
        cuda = torch_cuda_major(py)
        how = "source, CUDA + CPU kernels"
        if cuda is None or cuda != nvcc_major():
            env["VERL_OPS_CPU_ONLY"] = "1"
            how = f"source, CPU kernels (torch CUDA {cuda}, nvcc {nvcc_major()})"
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        t0 = time.time()
        # A copy of the tree, so that this build's objects never mix with the checkout's build/.
        src = work / f"src-{version}"
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "gpu_out"))
        build = run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", src], env=env, cwd=work)
        how += f", built in {time.time() - t0:.0f} s"
        if build.returncode != 0:
            rows.append((version, how, "BUILD FAILED", "-", "-"))
        else:
            rows.append((version, how, *check_env(py, work, args.tests, args.timeout)))
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)

    print("\n| torch | how | import | smoke | tests |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    ok = all(r[2] == "ok" and r[3] == "ok" and not r[4].startswith("FAIL") for r in rows)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
