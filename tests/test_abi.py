"""The extension binds to torch only through the stable C ABI: every symbol it takes from torch's
libraries is a C shim function (aoti_torch_* / torch_*), never a C++ symbol of at::, c10:: or
torch:: whose mangled name changes between releases (that is what breaks a binary built against
one torch under the next)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import verl_ops

_TORCH_CXX = re.compile(r"^(?:\S+ )?(?:at|c10|torch|caffe2)::")


def _libraries():
    pkg = Path(verl_ops.__file__).parent
    libs = sorted(pkg.glob("_C*.so"))
    assert libs, f"no compiled library next to {pkg}"
    return libs


@pytest.mark.parametrize("lib", _libraries(), ids=lambda p: p.name)
def test_only_stable_c_symbols_from_torch(lib):
    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed for this check"
    out = subprocess.run([nm, "-D", "--undefined-only", "-C", str(lib)], check=True, capture_output=True, text=True)
    undefined = [parts[1] for parts in (line.split(None, 1) for line in out.stdout.splitlines()) if len(parts) == 2]
    cxx_torch = [s for s in undefined if _TORCH_CXX.search(s)]
    assert not cxx_torch, f"{lib.name} uses torch C++ symbols outside the stable ABI: {cxx_torch[:10]}"
    shims = [s for s in undefined if s.startswith(("aoti_torch_", "torch_"))]
    assert shims, "expected the stable shim functions among the undefined symbols"


def test_no_python_version_specific_symbols():
    """Built against the limited Python API (abi3): one module for every Python >= 3.10."""
    nm = shutil.which("nm")
    assert nm
    for lib in _libraries():
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], check=True, capture_output=True, text=True).stdout
        private = [ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-1].startswith("_Py")]
        assert not private, f"{lib.name} uses private CPython symbols: {private}"
