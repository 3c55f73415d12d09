"""Build of verl_ops._C: CPU kernels always, CUDA kernels whenever nvcc and a CUDA-enabled
torch are present (a GPU is not needed to compile them).

The binding layer uses only the LibTorch stable ABI, targeting torch 2.9
(TORCH_TARGET_VERSION), and the module only the limited Python API (abi3): one binary wheel works
under every torch >= 2.9 of the CUDA major it was built for, and every Python >= 3.10.

The varlen backend of mla_forward_padded (cuDNN's attention on packed rows) is compiled when the
cuDNN frontend's C++ headers (>= 1.32; `pip install nvidia-cudnn-frontend`, header-only for this
use) and cudnn.h (the nvidia-cudnn-cu* package torch depends on, or a system cuDNN) are found;
otherwise the build goes on without it (VERL_OPS_WITH_CUDNN_FE undefined) and asking for it
raises. The frontend loads libcudnn at run time (dlopen), so the module has no link dependency on it.

Environment:
  VERL_OPS_CPU_ONLY=1      skip the CUDA sources even when nvcc is available.
  VERL_OPS_NO_CUDNN_FE=1   build without the varlen (cuDNN frontend) backend.
  CUDNN_FRONTEND_INCLUDE   directory holding cudnn_frontend.h (default: searched, see above).
  CUDNN_INCLUDE            directory holding cudnn.h (default: searched).
  TORCH_CUDA_ARCH_LIST     GPU architectures (default "8.0;9.0a"). A bare "9.0" is built as
                           "9.0a" (the same GPUs, H100 / H200), which the SM90 attention kernel
                           of the varlen backend (wgmma, TMA) needs; "9.0+PTX" is kept as given
                           and that kernel is then left out (cuDNN's forward runs instead).
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
DEFAULT_ARCH_LIST = "8.0;9.0a"
VERSION = "0.1.0"
# The stable-ABI version the binding layer targets: torch 2.9.
TORCH_TARGET_VERSION = "0x0209000000000000"
# verl_ops._C_layers: the one piece that needs list (Tensor[]) arguments, torch 2.10.
TORCH_TARGET_VERSION_LISTS = "0x020A000000000000"
# The limited Python API of Python 3.10 (the module only creates an empty module object).
PY_LIMITED_API = "0x030A0000"


def _cxx_standard():
    """C++17, or C++20 when the target torch's own C++ API requires it (torch 2.15 does; the
    stable headers we include do not, but the toolchain then has to speak C++20 anyway)."""
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    for rel in ("ATen/ATen.h", "torch/csrc/api/include/torch/all.h", "torch/csrc/stable/library.h"):
        try:
            with open(os.path.join(include, rel)) as f:
                if "C++20 or later" in f.read():
                    return "c++20"
        except OSError:
            pass
    return "c++17"


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


def _torch_at_least(major, minor):
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) >= (major, minor)


# The varlen backend: the one translation unit that includes the cuDNN frontend (slow to compile),
# and the frontend's minimum version (the API it is written against).
CUDNN_FE_SOURCE = os.path.join("csrc", "mla", "cudnn", "mla_cudnn_varlen.cpp")
CUDNN_FE_MIN_VERSION = (1, 32)


def _site_dirs():
    import site
    import sysconfig

    dirs = []
    for d in [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")] + list(
        getattr(site, "getsitepackages", lambda: [])()
    ):
        if d and d not in dirs:
            dirs.append(d)
    return dirs


def _header_version(path, names):
    """The integers #define'd as `names` in the header at `path` (None where absent)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    out = []
    for name in names:
        m = re.search(rf"#define\s+{name}\s+(\d+)", text)
        if m is None:
            return None
        out.append(int(m.group(1)))
    return tuple(out)


def _find_cudnn_frontend():
    """Include directories (frontend, cudnn.h) for the varlen backend, or None (reason printed)."""
    if os.environ.get("VERL_OPS_NO_CUDNN_FE", "0") == "1":
        print("verl_ops: VERL_OPS_NO_CUDNN_FE=1: building without the varlen (cuDNN frontend) backend")
        return None
    fe_candidates = [os.environ.get("CUDNN_FRONTEND_INCLUDE")]
    try:
        import importlib.metadata as metadata

        fe_candidates.append(str(metadata.distribution("nvidia-cudnn-frontend").locate_file("include")))
    except Exception:  # not installed (or no metadata): search the usual places
        pass
    fe_candidates += [os.path.join(d, "include") for d in _site_dirs()]
    fe_candidates += ["/usr/local/include", "/usr/include"]
    fe_dir = next((d for d in fe_candidates if d and os.path.isfile(os.path.join(d, "cudnn_frontend.h"))), None)
    if fe_dir is None:
        print(
            "verl_ops: cuDNN frontend headers not found (pip install nvidia-cudnn-frontend, or set "
            "CUDNN_FRONTEND_INCLUDE): building without the varlen backend of mla_forward_padded"
        )
        return None
    version = _header_version(
        os.path.join(fe_dir, "cudnn_frontend_version.h"),
        ("CUDNN_FRONTEND_MAJOR_VERSION", "CUDNN_FRONTEND_MINOR_VERSION"),
    )
    if version is None or version < CUDNN_FE_MIN_VERSION:
        print(
            f"verl_ops: the cuDNN frontend at {fe_dir} is version {version}, older than "
            f"{CUDNN_FE_MIN_VERSION}: building without the varlen backend of mla_forward_padded"
        )
        return None
    cudnn_candidates = [os.environ.get("CUDNN_INCLUDE")]
    cudnn_candidates += [os.path.join(d, "nvidia", "cudnn", "include") for d in _site_dirs()]
    if cpp_extension.CUDA_HOME:
        cudnn_candidates.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
    cudnn_candidates += ["/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/local/include"]
    cudnn_dir = next((d for d in cudnn_candidates if d and os.path.isfile(os.path.join(d, "cudnn.h"))), None)
    cudnn_version = cudnn_dir and _header_version(os.path.join(cudnn_dir, "cudnn_version.h"), ("CUDNN_MAJOR",))
    if cudnn_dir is None or cudnn_version is None or cudnn_version[0] < 9:
        print(
            "verl_ops: cudnn.h (cuDNN >= 9, e.g. from the nvidia-cudnn-cu* package torch depends on) "
            "not found (set CUDNN_INCLUDE): building without the varlen backend of mla_forward_padded"
        )
        return None
    print(
        f"verl_ops: varlen backend of mla_forward_padded: cuDNN frontend "
        f"{'.'.join(map(str, version))} at {fe_dir}, cuDNN {cudnn_version[0]} headers at {cudnn_dir}"
    )
    return [fe_dir, cudnn_dir]


def _hopper_arch_list():
    """Rewrites a bare "9.0" in TORCH_CUDA_ARCH_LIST to "9.0a" and says whether the list has 9.0a:
    compute capability 9.0 is H100 / H200 / GH200 only, every one of which runs sm_90a code, and
    the kernels of csrc/mla/sm90/ need the "a" features (wgmma, setmaxnreg)."""
    entries = [e for e in re.split(r"[;\s]+", os.environ.get("TORCH_CUDA_ARCH_LIST", "")) if e]
    rewritten = []
    for e in ("9.0a" if e == "9.0" else e for e in entries):
        if e not in rewritten:
            rewritten.append(e)
    if rewritten != entries:
        print(f"verl_ops: TORCH_CUDA_ARCH_LIST {';'.join(entries)} -> {';'.join(rewritten)} (sm_90a: the SM90 attention kernel)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(rewritten)
    has = any(e.split("+")[0] == "9.0a" for e in rewritten)
    if not has:
        print("verl_ops: no 9.0a in TORCH_CUDA_ARCH_LIST: the varlen backend's forward runs cuDNN's on Hopper")
    return has


def _make(name, sources, target, with_cuda, std, link_args, cudnn_fe_includes=None, sm90a=False):
    common = [f"-DTORCH_TARGET_VERSION={target}", f"-DPy_LIMITED_API={PY_LIMITED_API}"]
    cxx_flags = ["-O3", f"-std={std}", "-fvisibility=hidden"] + common
    if not with_cuda:
        return cpp_extension.CppExtension(
            name, sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_args, py_limited_api=True
        )
    # USE_CUDA: the CUDA declarations of the stable C shim (the current CUDA stream).
    cxx_flags += ["-DVERL_OPS_WITH_CUDA", "-DUSE_CUDA"]
    nvcc_flags = ["-O3", f"-std={std}", "-DVERL_OPS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"] + common
    if sm90a:
        nvcc_flags.append("-DVERL_OPS_HAS_SM90A")
    include_dirs = []
    if cudnn_fe_includes:
        # -g0: the frontend's templates make ~80 MB of debug info in the one translation unit that
        # includes them (a 57 MB module instead of 5 MB); nothing in it is ours to debug.
        cxx_flags += ["-DVERL_OPS_WITH_CUDNN_FE", "-g0"]
        nvcc_flags.append("-DVERL_OPS_WITH_CUDNN_FE")
        include_dirs = list(cudnn_fe_includes)
    return cpp_extension.CUDAExtension(
        name,
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_args,
        py_limited_api=True,
    )


# verl_ops._C: every op. Its CPU part (always built): the bindings, and per op family the ATen-facing
# functions and CPU kernels; csrc/mla/ holds the whole MLA op (host dispatch, cpu/, cuda/, cudnn/,
# sm90/). Patterns relative to the repository root; "!" excludes.
MAIN_CPU_SOURCES = ["csrc/*.cpp", "csrc/cpu/*.cpp", "csrc/ops/*.cpp", "!csrc/ops/*_cuda.cpp",
                    "csrc/mla/*.cpp", "!csrc/mla/*_cuda.cpp", "csrc/mla/cpu/*.cpp"]
# ... and its CUDA part (CUDNN_FE_SOURCE is added apart, when the cuDNN frontend is found).
MAIN_CUDA_SOURCES = ["csrc/ops/*_cuda.cpp", "csrc/cuda/*.cu", "csrc/mla/*_cuda.cpp", "csrc/mla/cuda/*.cu",
                     "csrc/mla/cudnn/*.cu", "csrc/mla/sm90/*.cu"]
# verl_ops._C_layers: its bindings and the router op they share with _C, compiled again at this
# library's own stable-ABI target (see _BuildExtension for why that needs no copies of the files).
LAYERS_CPU_SOURCES = ["csrc/layers/router_layers.cpp", "csrc/ops/router_ops.cpp", "csrc/cpu/router_kernels.cpp"]
LAYERS_CUDA_SOURCES = ["csrc/ops/router_ops_cuda.cpp", "csrc/cuda/router_kernels.cu"]


def _sources(patterns):
    """The files the patterns match (in order, each pattern's sorted), less those a "!" pattern matches."""
    excluded = {p for pat in patterns if pat.startswith("!") for p in glob.glob(pat[1:])}
    found = []
    for pat in patterns:
        if not pat.startswith("!"):
            found += [p for p in sorted(glob.glob(pat)) if p not in excluded and p not in found]
    return found


class _BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, building each extension's objects in a folder of its own.

    setuptools names an object file after its source path alone, in one build folder for all
    extensions; verl_ops._C_layers compiles some of _C's sources again with another
    TORCH_TARGET_VERSION, and the two builds would overwrite each other's objects. Extensions
    are then built one at a time (build_temp is switched per extension)."""

    def finalize_options(self):
        super().finalize_options()
        self.parallel = None

    def build_extension(self, ext):
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = build_temp


def _extensions():
    """verl_ops._C (every op, stable ABI target 2.9) and, built against torch >= 2.10,
    verl_ops._C_layers (router_topk_record over a list of tensors: list arguments need target 2.10)."""
    with_cuda = _want_cuda()
    sm90a = False
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        sm90a = _hopper_arch_list()
    std = _cxx_standard()
    link_args = _shared_libstdcxx_link_args()
    if not _torch_at_least(2, 10):
        # torch 2.9's torch/csrc/stable/tensor_inl.h defines Tensor::scalar_type() without
        # `inline` (fixed in 2.10), so every translation unit that includes the stable Tensor
        # emits the same strong symbol and the link fails with "multiple definition". The copies
        # are one header's code; the linker keeps the first. Builds against torch >= 2.10 link
        # strictly.
        link_args = link_args + ["-Wl,--allow-multiple-definition"]
    print(f"verl_ops: building against torch {torch.__version__} with -std={std}, stable ABI target 2.9")
    main = _sources(MAIN_CPU_SOURCES)
    layers = list(LAYERS_CPU_SOURCES)
    cudnn_fe_includes = None
    if with_cuda:
        main += _sources(MAIN_CUDA_SOURCES)
        layers += LAYERS_CUDA_SOURCES
        cudnn_fe_includes = _find_cudnn_frontend()
        if cudnn_fe_includes:
            main.append(CUDNN_FE_SOURCE)
    exts = [_make("verl_ops._C", main, TORCH_TARGET_VERSION, with_cuda, std, link_args, cudnn_fe_includes, sm90a)]
    if _torch_at_least(2, 10):
        exts.append(_make("verl_ops._C_layers", layers, TORCH_TARGET_VERSION_LISTS, with_cuda, std, link_args))
    else:
        print("verl_ops: torch < 2.10: no verl_ops._C_layers (list arguments); router record stacks its layers")
    return exts, with_cuda


def _local_version(with_cuda):
    """The wheel's local version names what the binary was built for: +cu13, +cpu."""
    if not with_cuda:
        return "cpu"
    return "cu" + torch.version.cuda.split(".")[0]


_EXTS, _WITH_CUDA = _extensions()
setup(
    version=f"{VERSION}+{_local_version(_WITH_CUDA)}",
    ext_modules=_EXTS,
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
)
