// The binding layer's one dependency on torch: the LibTorch stable ABI (torch/csrc/stable), built
// with TORCH_TARGET_VERSION = 2.9 so one binary serves every later torch of its CUDA major.
//
// Everything the ops need from torch goes through this header: error checks that format the
// message themselves (the op and the argument first), tensor creation, the few aten ops that are
// called through the dispatcher, the current CUDA stream, and checked integer arithmetic for sizes.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/stat.h>
#include <sys/sysinfo.h>

#include <cstdlib>
#include <fstream>
#endif

#ifdef VERL_OPS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "../core/thd_layout.h"

namespace verl_ops {
namespace st {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

// ---- what differs between the stable headers of torch 2.9 and 2.10+ ----------------------------
// The same sources build against every torch from 2.9.1 on. torch 2.10 moved the StableIValue
// conversions into torch::stable::detail and added TORCH_BOX, copy_, element_size and toString;
// 2.9 has the conversions at global scope and none of the rest. So this header uses only what
// both have: the conversions through sv_from / sv_to below, its own boxing (VERL_BOX), and the
// C shim (aoti_torch_*) for the copy, the element size and the dtype names.
#if __has_include(<torch/csrc/stable/version.h>)
#define VERL_OPS_STABLE_DETAIL 1
#endif

template <typename T>
StableIValue sv_from(T v) {
#ifdef VERL_OPS_STABLE_DETAIL
  return torch::stable::detail::from(v);
#else
  return from(v);
#endif
}

template <typename T>
T sv_to(StableIValue v) {
#ifdef VERL_OPS_STABLE_DETAIL
  return torch::stable::detail::to<T>(v);
#else
  return to<T>(v);
#endif
}

constexpr ScalarType kBool = ScalarType::Bool;
constexpr ScalarType kByte = ScalarType::Byte;
constexpr ScalarType kChar = ScalarType::Char;
constexpr ScalarType kShort = ScalarType::Short;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;

// ---- messages and checks ---------------------------------------------------------------------

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  ((os << args), ...);
  return os.str();
}

// Throws RuntimeError with exactly the given text (no file / line prefix): every message starts
// with the op's name and names the argument.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw std::runtime_error(cat(args...));
}

#define VERL_CHECK(cond, ...)                          \
  do {                                                 \
    if (__builtin_expect(!(cond), 0)) {                \
      ::verl_ops::st::fail(__VA_ARGS__);               \
    }                                                  \
  } while (0)

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: return "Bool";
    case ScalarType::Byte: return "Byte";
    case ScalarType::Char: return "Char";
    case ScalarType::Short: return "Short";
    case ScalarType::Int: return "Int";
    case ScalarType::Long: return "Long";
    case ScalarType::Half: return "Half";
    case ScalarType::BFloat16: return "BFloat16";
    case ScalarType::Float: return "Float";
    case ScalarType::Double: return "Double";
    case ScalarType::ComplexHalf: return "ComplexHalf";
    case ScalarType::ComplexFloat: return "ComplexFloat";
    case ScalarType::ComplexDouble: return "ComplexDouble";
    case ScalarType::Float8_e5m2: return "Float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "Float8_e4m3fn";
    case ScalarType::Float8_e5m2fnuz: return "Float8_e5m2fnuz";
    case ScalarType::Float8_e4m3fnuz: return "Float8_e4m3fnuz";
    case ScalarType::UInt16: return "UInt16";
    case ScalarType::UInt32: return "UInt32";
    case ScalarType::UInt64: return "UInt64";
    default: return "an unsupported dtype";
  }
}

// The kernels' code of a floating dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16; any other is
// `op`'s error naming argument `name`.
inline int float_code(const char* op, const char* name, ScalarType t) {
  if (t == ScalarType::Float) return 0;
  if (t == ScalarType::Double) return 1;
  if (t == ScalarType::Half) return 2;
  if (t == ScalarType::BFloat16) return 3;
  fail(op, ": ", name, " must be float32, float64, float16 or bfloat16, got ", dtype_name(t));
}

inline std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

inline std::string device_of(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  int32_t type = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &type));
  return type == aoti_torch_device_type_meta() ? "meta" : "device type " + std::to_string(type);
}

inline bool same_device(const Tensor& a, const Tensor& b) {
  return a.is_cpu() == b.is_cpu() && a.is_cuda() == b.is_cuda() &&
         (!a.is_cuda() || a.get_device_index() == b.get_device_index());
}

inline bool is_integral(ScalarType t) {
  return t == kByte || t == kChar || t == kShort || t == kInt || t == kLong;
}

inline bool is_floating(ScalarType t) {
  return t == kHalf || t == kBFloat16 || t == kFloat || t == kDouble;
}

// ---- checked integer arithmetic (sizes, ranks, products) ---------------------------------------

inline int64_t checked_mul(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t r;
  VERL_CHECK(!__builtin_mul_overflow(a, b, &r), op, ": ", what, " overflows int64 (", a, " * ", b,
             ")");
  return r;
}

inline int64_t checked_add(const char* op, const char* what, int64_t a, int64_t b) {
  int64_t r;
  VERL_CHECK(!__builtin_add_overflow(a, b, &r), op, ": ", what, " overflows int64 (", a, " + ", b,
             ")");
  return r;
}

// A size or rank argument that the kernels hold in int32.
inline int32_t int32_arg(const char* op, const char* name, int64_t v, int64_t lo = 0) {
  VERL_CHECK(v >= lo && v <= std::numeric_limits<int32_t>::max(), op, ": ", name, " must be in [",
             lo, ", ", std::numeric_limits<int32_t>::max(), "], got ", v);
  return static_cast<int32_t>(v);
}

// cp_size in [1, 2^30] and cp_rank in [-1 (all ranks) or 0, cp_size).
inline void check_cp(const char* op, int64_t cp_size, int64_t cp_rank, bool allow_all) {
  VERL_CHECK(cp_size >= 1 && cp_size <= (int64_t{1} << 30), op, ": cp_size must be in [1, 2^30], got ",
             cp_size);
  VERL_CHECK(cp_rank >= (allow_all ? -1 : 0) && cp_rank < cp_size, op, ": cp_rank must be in [0, cp_size=",
             cp_size, ")", allow_all ? " (or -1 for all ranks)" : "", ", got ", cp_rank);
}

// The int cp_layout argument of the raw ops (the stable ABI at 2.9 has no str arguments; the
// Python API takes the names): 0 = zigzag, 1 = contiguous.
inline core::CpLayout cp_layout_arg(const char* op, int64_t cp_layout) {
  if (cp_layout == 0) return core::CpLayout::kZigzag;
  if (cp_layout == 1) return core::CpLayout::kContiguous;
  fail(op, ": cp_layout must be 0 (zigzag) or 1 (contiguous), got ", cp_layout);
}

// ---- tensors ----------------------------------------------------------------------------------

inline std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> s(static_cast<size_t>(t.dim()));
  for (int64_t d = 0; d < t.dim(); ++d) s[static_cast<size_t>(d)] = t.size(d);
  return s;
}

// Uninitialised / zero tensor on `like`'s device.
// (new_empty / new_zeros take a std::vector at 2.9 and an array ref, built from one, later.)
inline Tensor empty(const Tensor& like, const std::vector<int64_t>& sizes, ScalarType dtype) {
  return torch::stable::new_empty(like, sizes, dtype);
}

inline Tensor zeros(const Tensor& like, const std::vector<int64_t>& sizes, ScalarType dtype) {
  return torch::stable::new_zeros(like, sizes, dtype);
}

// Bytes per element of the dtypes ops allocate (a lower bound of 1 for any other: only used to
// refuse outputs larger than memory).
inline int64_t dtype_bytes(ScalarType t) {
  switch (t) {
    case ScalarType::Short: case ScalarType::Half: case ScalarType::BFloat16: case ScalarType::UInt16:
      return 2;
    case ScalarType::Int: case ScalarType::Float: case ScalarType::UInt32: case ScalarType::ComplexHalf:
      return 4;
    case ScalarType::Long: case ScalarType::Double: case ScalarType::UInt64: case ScalarType::ComplexFloat:
      return 8;
    case ScalarType::ComplexDouble:
      return 16;
    default:
      return 1;
  }
}

#if defined(__linux__)
// ---- the memory this process may use: the host's, or its memory cgroup's limit -------------
// A container (docker, kubernetes, slurm) runs in a memory cgroup whose limit is often far below
// the host's RAM; past it the kernel's OOM killer ends the process just as under overcommit. So
// the bound is min(RAM + swap, the cgroup's limit), the cgroup read from /proc/self/cgroup.
//
// Test hooks (read once, at the first CPU output): VERL_OPS_PROC_CGROUP replaces
// /proc/self/cgroup and VERL_OPS_CGROUP_ROOT replaces the mount point /sys/fs/cgroup, so a test
// can point both at a fake tree; the bound is cached, so such a test sets them in a child process.

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(fallback);
}

// A cgroup limit file: its number of bytes, or nothing for "max", a missing or unreadable file, or
// anything else that is not a plain decimal number. long double: no overflow on any digit count.
inline std::optional<long double> cgroup_value(const std::string& file) {
  std::ifstream in(file);
  std::string s;
  if (!(in >> s) || s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  long double v = 0;
  for (char c : s) v = v * 10 + static_cast<long double>(c - '0');
  return v;
}

inline bool is_dir(const std::string& path) {
  struct stat sb {};
  return stat(path.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
}

// The smallest value of `file` in the cgroup `path` (below the mount `mount`) and in each of its
// ancestors up to the mount's root: a parent's limit bounds its children too. A path that is not
// there is read from the mount's root alone: inside a container the mount is often the
// container's own cgroup while /proc/self/cgroup names it by its path on the host.
inline std::optional<long double> cgroup_min(const std::string& mount, std::string path, const char* file) {
  while (!path.empty() && path.back() == '/') path.pop_back();
  if (!is_dir(mount + path)) path.clear();
  std::optional<long double> lowest;
  for (;;) {
    const std::optional<long double> v = cgroup_value(mount + path + "/" + file);
    if (v && (!lowest || *v < *lowest)) lowest = v;
    const size_t up = path.rfind('/');
    if (path.empty() || up == std::string::npos) return lowest;
    path.erase(up);
  }
}

// The memory cgroup's bound on RAM + swap, given the host's RAM and swap (a missing limit is the
// host's amount; a value at or above it, such as cgroup v1's "unlimited" 9223372036854771712, so
// bounds nothing). Anything unreadable leaves the host's RAM + swap.
inline long double cgroup_memory_bound(long double ram, long double swap) {
  std::ifstream in(env_or("VERL_OPS_PROC_CGROUP", "/proc/self/cgroup"));
  const std::string root = env_or("VERL_OPS_CGROUP_ROOT", "/sys/fs/cgroup");
  std::string line, v2_path;
  bool has_v2 = false;
  while (std::getline(in, line)) {
    // "hierarchy-id:controller,controller:path"; the path may itself hold ':'.
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    const std::string path = line.substr(b + 1);
    if (controllers.find(",memory,") != std::string::npos) {
      // cgroup v1: memory.limit_in_bytes bounds RAM (the cgroup may still swap to the host's
      // swap), memory.memsw.limit_in_bytes, where swap accounting is on, RAM and swap together.
      const std::string mount = root + "/memory";
      const auto mem = cgroup_min(mount, path, "memory.limit_in_bytes");
      const auto memsw = cgroup_min(mount, path, "memory.memsw.limit_in_bytes");
      long double bound = (mem ? std::min(*mem, ram) : ram) + swap;
      if (memsw) bound = std::min(bound, *memsw);
      return std::min(bound, ram + swap);
    }
    if (line.compare(0, 3, "0::") == 0) {
      has_v2 = true;
      v2_path = path;
    }
  }
  // cgroup v2 (only when no v1 memory controller: on a hybrid host the "0::" line is the unified
  // hierarchy, which holds no memory controller). memory.max bounds RAM and memory.swap.max swap
  // separately; a swap.max of "max", or none (no swap accounting), leaves the host's swap usable.
  if (has_v2) {
    const auto mem = cgroup_min(root, v2_path, "memory.max");
    const auto sw = cgroup_min(root, v2_path, "memory.swap.max");
    return (mem ? std::min(*mem, ram) : ram) + (sw ? std::min(*sw, swap) : swap);
  }
  return ram + swap;
}
#endif

// The memory this process may use: the host's RAM and swap together, or less where its memory
// cgroup's limit is lower (Linux; elsewhere no bound). A CPU output larger than that cannot be
// filled: under memory overcommit (vm.overcommit_memory=1, common on GPU servers) its allocation
// would still succeed, and the zero fill or the first writes would bring the OOM killer onto the
// process instead of an error. Computed once; never throws (no bound where sysinfo fails).
inline int64_t host_memory_bytes() {
#if defined(__linux__)
  static const int64_t bytes = []() noexcept {
    constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
    struct sysinfo si {};
    if (sysinfo(&si) != 0) return kNone;
    const long double unit = static_cast<long double>(si.mem_unit);
    const long double ram = static_cast<long double>(si.totalram) * unit;
    const long double swap = static_cast<long double>(si.totalswap) * unit;
    long double total = ram + swap;
    try {
      total = cgroup_memory_bound(ram, swap);
    } catch (...) {  // std::bad_alloc, say: the cgroup only lowers the bound, never makes an error
    }
    return total >= static_cast<long double>(kNone) ? kNone : static_cast<int64_t>(total);
  }();
  return bytes;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

// An op's output, whose sizes come from the caller's arguments (`sized_by` names them): an
// allocation the allocator refuses (too large, or out of memory), or a CPU one larger than the
// host's memory, is an error that names the op, the argument and the shape, not the shim's "API
// call failed" text (nor the OOM killer).
inline Tensor output(const char* op, const char* sized_by, const Tensor& like, const std::vector<int64_t>& sizes,
                     ScalarType dtype, bool zero = false) {
  try {
    if (like.is_cpu()) {
      long double bytes = static_cast<long double>(dtype_bytes(dtype));
      for (int64_t n : sizes) bytes *= static_cast<long double>(n < 0 ? 0 : n);
      if (bytes > static_cast<long double>(host_memory_bytes())) throw std::runtime_error("over the host's memory");
    }
    return zero ? zeros(like, sizes, dtype) : empty(like, sizes, dtype);
  } catch (const std::exception&) {
    std::ostringstream shape;
    shape << "[";
    for (size_t i = 0; i < sizes.size(); ++i) shape << (i ? ", " : "") << sizes[i];
    shape << "]";
    fail(op, ": cannot allocate the output sized by ", sized_by, " (shape ", shape.str(), ", ", dtype_name(dtype),
         ") on ",
         like.is_cpu() ? cat("the CPU: out of memory, or larger than the host's memory (or its memory cgroup's limit) of ",
                             host_memory_bytes(), " bytes")
                       : std::string("the GPU: out of memory, or larger than the allocator allows"));
  }
}

// dst <- src (same shape; dtype converted).
inline void copy_into(const Tensor& dst, const Tensor& src) {
  TORCH_ERROR_CODE_CHECK(aoti_torch_copy_(dst.get(), src.get(), /*non_blocking=*/0));
}

inline Tensor contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t, sizes_of(t), t.scalar_type());
  copy_into(out, t);
  return out;
}

// t as rows read with 16-byte vectors / through TMA or by cuDNN: contiguous and 16-byte aligned
// (a copy only when it is not).
inline Tensor aligned_rows(const Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  Tensor out = empty(t, sizes_of(t), t.scalar_type());
  copy_into(out, t);
  return out;
}

inline int64_t element_size(const Tensor& t) {
  int32_t dtype = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  return static_cast<int64_t>(aoti_torch_dtype_element_size(dtype));
}

// Row-major elements of dims [skip, dim) times the element size.
inline int64_t row_bytes(const char* op, const Tensor& t, int64_t skip) {
  int64_t n = element_size(t);
  for (int64_t d = skip; d < t.dim(); ++d) n = checked_mul(op, "the row size", n, t.size(d));
  return n;
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Any aten op through the dispatcher: arguments in schema order, returns in `stack[0..]`.
template <size_t N = 8, typename... Args>
std::array<StableIValue, N> call_aten(const char* name, const char* overload, Args... args) {
  static_assert(sizeof...(Args) <= N, "call_aten: stack too small");
  std::array<StableIValue, N> stack{};
  size_t i = 0;
  ((stack[i++] = sv_from(args)), ...);
  TORCH_ERROR_CODE_CHECK(aoti_torch_call_dispatcher(name, overload, stack.data()));
  return stack;
}

inline Tensor to_tensor(StableIValue v) { return sv_to<Tensor>(v); }

// Views through the dispatcher (torch 2.9's stable ops have no flatten / unsqueeze).
inline Tensor flatten(const Tensor& t, int64_t start_dim, int64_t end_dim) {
  return to_tensor(call_aten("aten::flatten", "using_ints", t, start_dim, end_dim)[0]);
}

inline Tensor unsqueeze(const Tensor& t, int64_t dim) {
  return to_tensor(call_aten("aten::unsqueeze", "", t, dim)[0]);
}

inline int64_t storage_offset(const Tensor& t) {
  int64_t off = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_storage_offset(t.get(), &off));
  return off;
}

// Inclusive prefix counts of a bool [B, S] mask along dim 1, as int32.
inline Tensor cumsum_int32(const Tensor& mask) {
  return to_tensor(call_aten("aten::cumsum", "", mask, int64_t{1},
                             std::optional<ScalarType>(kInt))[0]);
}

// A CPU int32 copy of a 1-D tensor (host reads of small index tensors only).
inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  Tensor out = empty(t, sizes_of(t), dtype);
  copy_into(out, t);
  return out;
}

#ifdef VERL_OPS_WITH_CUDA
// The current CUDA stream of the tensor's device (sets nothing).
inline cudaStream_t current_stream(const Tensor& t) {
  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &s));
  return static_cast<cudaStream_t>(s);
}

inline void check_launch(const char* op, cudaError_t err) {
  VERL_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// The device a CUDA kernel of `t`'s op runs on: t's, or the current one when t is not a CUDA
// tensor (dispatch reaches the CUDA kernel when any argument is on CUDA; the checks then report
// the device mix).
inline int32_t guard_index(const Tensor& t) {
  return t.is_cuda() ? t.get_device_index() : torch::stable::accelerator::getCurrentDeviceIndex();
}
#endif

// ---- boxing (TORCH_BOX exists from torch 2.10 on only) -----------------------------------------
// VERL_BOX(&fn): the boxed kernel of `R fn(Args...)`: arguments from the stack in schema order
// (each handle's ownership moves into the argument, as the stable ABI hands it over), returns
// (a Tensor or a std::tuple of Tensors) written back from stack[0].
template <typename T>
using unboxed_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <typename R>
void box_returns(StableIValue* stack, R&& r) {
  if constexpr (std::is_same_v<unboxed_t<R>, Tensor>) {
    stack[0] = sv_from(r);
  } else {
    std::apply([&](auto&... x) {
      size_t i = 0;
      ((stack[i++] = sv_from(x)), ...);
    }, r);
  }
}

// A None given for a `Tensor` argument (not `Tensor?`) reaches a kernel as an undefined tensor when
// nothing above the backend kernel checks it (the Python Autograd kernels do, but inference mode
// skips them): every boxed kernel tests its Tensor arguments first and names the op and the
// argument, from the op's schema (remembered by VERL_DEF) and the kernel's op (by VERL_IMPL).
struct OpRegistry {
  std::vector<std::pair<const void*, std::string>> kernels;  // kernel function -> op name
  std::vector<std::string> schemas;
  static OpRegistry& get() {
    static OpRegistry r;
    return r;
  }
};

inline const char* remember_schema(const char* schema) {
  OpRegistry::get().schemas.emplace_back(schema);
  return schema;
}

inline const char* remember_kernel(const void* fn, const char* op) {
  OpRegistry::get().kernels.emplace_back(fn, op);
  return op;
}

// The op name of kernel `fn` and the name of its schema's argument `index` ("argument <index>"
// where unknown).
inline std::pair<std::string, std::string> op_argument_name(const void* fn, size_t index) {
  const OpRegistry& r = OpRegistry::get();
  std::string op = "verl_ops", arg = "argument " + std::to_string(index);
  for (const auto& [f, name] : r.kernels) {
    if (f != fn) continue;
    op = name;
    for (const std::string& schema : r.schemas) {
      if (schema.compare(0, name.size() + 1, name + "(") != 0) continue;
      // the arguments between the first "(" and its ")", split at top-level commas
      size_t pos = name.size() + 1, depth = 0, start = pos, k = 0;
      for (; pos < schema.size(); ++pos) {
        const char c = schema[pos];
        if (c == '(' || c == '[') ++depth;
        if ((c == ')' || c == ']') && depth > 0) { --depth; continue; }
        if ((c == ',' && depth == 0) || (c == ')' && depth == 0)) {
          if (k == index) {
            std::string a = schema.substr(start, pos - start);
            const size_t eq = a.find('=');
            if (eq != std::string::npos) a = a.substr(0, eq);
            while (!a.empty() && a.back() == ' ') a.pop_back();
            const size_t sp = a.rfind(' ');
            arg = sp == std::string::npos ? a : a.substr(sp + 1);
            break;
          }
          ++k;
          start = pos + 1;
          if (c == ')') break;
        }
      }
    }
    break;
  }
  return {op, arg};
}

template <auto F>
struct Boxed;

template <typename R, typename... Args, R (*F)(Args...)>
struct Boxed<F> {
  template <typename T>
  static void check_defined(const T& v, size_t index) {
    if constexpr (std::is_same_v<T, Tensor>) {
      if (!v.defined()) {
        const auto [op, arg] = op_argument_name(reinterpret_cast<const void*>(F), index);
        fail(op, ": ", arg, " must be a tensor, got None");
      }
    }
  }
  template <size_t... I>
  static void run(StableIValue* stack, std::index_sequence<I...>) {
    std::tuple<unboxed_t<Args>...> args{sv_to<unboxed_t<Args>>(stack[I])...};
    (check_defined(std::get<I>(args), I), ...);
    if constexpr (std::is_void_v<R>) {
      F(std::get<I>(args)...);  // an in-place op: returns nothing
    } else {
      box_returns(stack, F(std::get<I>(args)...));
    }
  }
  static void call(StableIValue* stack, uint64_t /*num_args*/, uint64_t /*num_outputs*/) {
    run(stack, std::index_sequence_for<Args...>{});
  }
};

#define VERL_BOX(fn) (&::verl_ops::st::Boxed<fn>::call)
// m.def(schema) / m.impl(name, VERL_BOX(fn)), remembering the schema and which op `fn` implements
// (for Boxed's error naming the argument).
#define VERL_DEF(m, schema) m.def(::verl_ops::st::remember_schema(schema))
#define VERL_IMPL(m, name, fn) \
  m.impl(::verl_ops::st::remember_kernel(reinterpret_cast<const void*>(fn), name), VERL_BOX(fn))

}  // namespace st
}  // namespace verl_ops
