// mla_forward_padded / mla_backward_padded: variable-length (THD) attention for MLA head dims
// (Dv <= Dqk), docs/mla.md#semantics. Argument checks, backend choice, output layout and the CPU
// implementation here (mla_ops.cpp), CUDA in mla_ops_cuda.cpp. The fake (Meta) kernels live in
// Python (verl_ops/_fake.py) and mirror the checks and the layout rule below.
//
// This folder holds the whole op: mla.h (index rules shared by the kernels), the host dispatch
// (mla_ops*.cpp), cpu/ (the float reference), cuda/ (the pad kernel of the padded backend, and
// the reference kernels that run float32 / float64 on CUDA),
// cudnn/ (the varlen backend: cuDNN frontend graphs and their metadata kernels) and sm90/ (the
// varlen backend's own Hopper forward and backward for Dqk 192 / Dv 128). mla_rope (MLA's RoPE of
// THD rows, what megatron_mla.install() puts under Megatron's THD RoPE) is rope.h, rope_ops*.cpp,
// cpu/rope_kernels.* and cuda/rope_kernels.*.
//
// Output layout rule (what the fake kernels must mirror):
//   backend = resolve_mla_backend(...)  (a function of the shapes, causal, shares_offsets and,
//             for backend=auto, varlen_auto: whether the build has the varlen backend and q's
//             device is a CUDA device of compute capability 9.x; and varlen_uniform: that, and
//             the own SM90 forward and backward are on, as mla_cache_info reports; and
//             reference: float32 / float64 on CUDA, which every backend code runs on the CUDA
//             reference kernels)
//   if backend == kPadded and Dv < Dqk:
//     out    [Tq, Hq, Dv] is out_buf[:, :, :Dv] of a fresh contiguous [Tq, Hq, Dqk] buffer
//            (strides (Hq * Dqk, Dqk, 1), storage offset 0);
//     grad_v [Tk, Hk, Dv] is likewise the [.., :Dv] view of a contiguous [Tk, Hk, Dqk] buffer;
//   otherwise (native, varlen, reference, or Dv == Dqk): out / grad_v are contiguous [T, H, Dv].
//   softmax_lse is a contiguous [Hq, Tq] (float32; float64 for float64 inputs);
//   grad_q [Tq, Hq, Dqk] and grad_k [Tk, Hk, Dqk] are always contiguous.
// This holds on every device (the CPU runs one reference for all backends but returns the chosen
// backend's layout), including the empty cases (Tq == 0, Tk == 0 or B == 0).
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include "../ops/stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

// The raw ops' int backend argument (the stable ABI has no str at 2.9; Python maps the names).
// varlen: cuDNN's SDPA on the packed rows through the cuDNN frontend (csrc/mla/cudnn/mla_cudnn_varlen.h),
// compiled only where setup.py found the frontend's headers (VERL_OPS_WITH_CUDNN_FE).
// reference: float32 / float64 on CUDA (csrc/mla/cuda/mla_reference_kernels.h), whatever backend
// code was asked for; never chosen for float16 / bfloat16 or on the CPU.
enum class MlaBackend { kPadded, kNative, kVarlen, kReference };
constexpr int64_t kMlaBackendAuto = 0;
constexpr int64_t kMlaBackendPadded = 1;
constexpr int64_t kMlaBackendNative = 2;
constexpr int64_t kMlaBackendVarlen = 3;

// Sizes of a checked call.
struct MlaSizes {
  int64_t tq, tk, hq, hk, dqk, dv, batch;
};

// Shape / dtype / device checks shared by every implementation (no data reads).
MlaSizes check_mla_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                        int64_t max_seqlen_q, int64_t max_seqlen_kv,
                        const std::optional<double>& softmax_scale);

// Checks of the backward's extra inputs (grad_out, out, softmax_lse) against the forward sizes.
void check_mla_backward_args(const char* op, const Tensor& grad_out, const Tensor& out,
                             const Tensor& softmax_lse, const Tensor& q, const MlaSizes& s);

// The backend a call runs on (backend: 0 auto, 1 padded, 2 native, 3 varlen). A function of the
// shapes and of varlen_auto / varlen_uniform only, so the fake kernel knows the output layout (see
// the rule at the top of this file). same_offsets: q and kv use one cu_seqlens tensor (self-attention, as Megatron
// passes it), which lets the native backend take ragged causal batches (see shares_offsets).
// varlen_auto: auto may choose the varlen backend (for batches that are not uniform; the build has
// it, cuDNN >= 9.7.0, q on a CUDA device of compute capability 9.x).
// varlen_uniform: varlen_auto, and the build's own SM90 forward and backward are on (compiled for
// sm_90a, neither switched off by VERL_OPS_VARLEN_FORWARD / _BACKWARD; process-wide flags, the
// ones mla_cache_info reports, not a per-device check): auto then sends uniform batches with
// MLA's head dims 192 / 128 to varlen too (measured ahead of native and padded on every uniform
// batch, H200).
// reference: q is float32 / float64 on a CUDA device: every backend code (once checked) gives
// kReference, ahead of every other rule and of the native backend's shape checks (the reference
// kernels take every batch; the other CUDA backends take float16 / bfloat16 only).
MlaBackend resolve_mla_backend(const char* op, int64_t backend, const MlaSizes& s,
                               int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                               bool same_offsets, bool varlen_auto, bool varlen_uniform,
                               bool reference);

// True when a and b are the same offsets: the same first element (data pointer), shape, strides
// and dtype (no storage API on the stable ABI; the fake kernel compares storage and offset, which
// is the same test for live tensors).
bool shares_offsets(const Tensor& a, const Tensor& b);

double mla_softmax_scale(const std::optional<double>& softmax_scale, int64_t dqk);

// The dtype of softmax_lse: float64 for float64 inputs, float32 otherwise (every device).
st::ScalarType mla_lse_dtype(const Tensor& q);

// [rows, heads, cols] of dtype on `like`'s device, in the layout of `backend` (a narrowed
// [rows, heads, full_cols] buffer for the padded backend when cols < full_cols).
Tensor mla_alloc_rows(MlaBackend backend, const Tensor& like, int64_t rows, int64_t heads,
                      int64_t cols, int64_t full_cols, st::ScalarType dtype);

// The backward's extra inputs, for prepare_mla.
struct MlaBackwardInputs {
  const Tensor& grad_out;
  const Tensor& out;
  const Tensor& softmax_lse;
};

enum class MlaDevice { kCpu, kCuda };

// A checked call: sizes, backend and softmax scale.
struct MlaCall {
  MlaSizes s;
  MlaBackend backend;
  double scale;
};

// The preamble every implementation shares: argument checks (and the backward's, when given),
// the device's dtype check, the backend. No data reads (the CPU checks offsets on the host
// afterwards).
MlaCall prepare_mla(const char* op, MlaDevice device, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                    const std::optional<double>& softmax_scale, int64_t backend,
                    const MlaBackwardInputs* backward = nullptr);

std::tuple<Tensor, Tensor> mla_forward_padded_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, int64_t backend);

std::tuple<Tensor, Tensor, Tensor> mla_backward_padded_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& softmax_lse, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal, std::optional<double> softmax_scale,
    int64_t backend);

// The varlen backend's plan cache: int64 [kMlaCacheInfoFields] CPU tensor {compiled (1 when this
// build has the backend), size, hits, misses, builds, failed builds, evictions, capacity (0: no
// limit), buckets whose build failed (remembered), the loaded cuDNN's version (0: none), 1 when
// the backend's forward runs the own SM90 kernel for Dqk 192 / Dv 128 on compute capability 9.0
// (csrc/mla/sm90/mla_sm90_fwd.cu: built for 9.0a and not turned off by
// VERL_OPS_VARLEN_FORWARD=cudnn), 1 when its backward runs the own SM90 kernel likewise
// (csrc/mla/sm90/mla_sm90_bwd.cu; not turned off by VERL_OPS_VARLEN_BACKWARD=cudnn)}. `like` is any CPU tensor (the op needs one tensor argument to
// dispatch). `capacity` >= 0 sets the cache's capacity first (-1: unchanged).
constexpr int64_t kMlaCacheInfoFields = 12;
Tensor mla_cache_info(const Tensor& like, int64_t capacity);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<Tensor, Tensor> mla_forward_padded_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, int64_t backend);

std::tuple<Tensor, Tensor, Tensor> mla_backward_padded_cuda(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& softmax_lse, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal, std::optional<double> softmax_scale,
    int64_t backend);
#endif

}  // namespace ops
}  // namespace verl_ops
