"""Build of verl_ops._C: CPU kernels always, CUDA kernels whenever nvcc and a CUDA-enabled
torch are present (a GPU is not needed to compile them).

Environment:
  VERL_OPS_CPU_ONLY=1      skip the CUDA sources even when nvcc is available.
  TORCH_CUDA_ARCH_LIST     GPU architectures (default "8.0;9.0").
  MAX_JOBS                 parallel compile jobs (ninja).
"""

import glob
import os
import re
import subprocess

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0"


def _nvcc_version(cuda_home):
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.check_output([nvcc, "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _want_cuda():
    if os.environ.get("VERL_OPS_CPU_ONLY", "0") == "1":
        return False
    cuda_home = cpp_extension.CUDA_HOME
    if torch.version.cuda is None or cuda_home is None:
        print("verl_ops: building CPU kernels only (no CUDA-enabled torch or no nvcc found)")
        return False
    nvcc = _nvcc_version(cuda_home)
    if nvcc is None:
        print(f"verl_ops: building CPU kernels only (cannot run nvcc under {cuda_home})")
        return False
    torch_major = int(torch.version.cuda.split(".")[0])
    if nvcc[0] != torch_major:
        raise RuntimeError(
            f"verl_ops: nvcc at {cuda_home} is CUDA {nvcc[0]}.{nvcc[1]} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; the major versions "
            "must match. Point CUDA_HOME at a matching toolkit, install the matching torch, "
            "or set VERL_OPS_CPU_ONLY=1."
        )
    return True


def _shared_libstdcxx_link_args():
    """Make sure the extension links the shared libstdc++ that torch itself uses.

    A compiler driver that only finds a static libstdc++.a would embed a second copy of the C++
    runtime in the extension; its iostream/locale state is then not the process's, and formatting
    a number into an error message crashes. When the driver has no shared libstdc++, link the
    one already loaded in this process (torch loaded it) explicitly.
    """
    cxx = os.environ.get("CXX", "c++")
    try:
        found = subprocess.check_output([cxx, "-print-file-name=libstdc++.so"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    except OSError:
        loaded = []
    if not loaded:
        raise RuntimeError(
            f"verl_ops: the C++ compiler {cxx} has no shared libstdc++ and none is loaded in this "
            "process; set CXX to a compiler that links libstdc++ dynamically."
        )
    print(f"verl_ops: {cxx} has no shared libstdc++; linking {loaded[0]} explicitly")
    return [loaded[0]]


def _extension():
    sources = sorted(
        glob.glob(os.path.join("csrc", "*.cpp"))
        + glob.glob(os.path.join("csrc", "cpu", "*.cpp"))
        + [p for p in glob.glob(os.path.join("csrc", "ops", "*.cpp")) if not p.endswith("_cuda.cpp")]
    )
    cxx_flags = ["-O3", "-std=c++17"]
    link_args = _shared_libstdcxx_link_args()
    if not _want_cuda():
        return cpp_extension.CppExtension(
            "verl_ops._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_args
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    sources += sorted(glob.glob(os.path.join("csrc", "ops", "*_cuda.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    cxx_flags.append("-DVERL_OPS_WITH_CUDA")
    nvcc_flags = ["-O3", "-std=c++17", "-DVERL_OPS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"]
    return cpp_extension.CUDAExtension(
        "verl_ops._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_args,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
