// CUDA helper kernels of mla_forward_padded: raw pointers, sizes and a stream, no ATen.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../mla.h"

namespace verl_ops {
namespace cuda {

// One tensor to pad: src rows [tokens, heads, src_cols] (strides of g in elements, unit inner
// stride) -> dst [tokens, heads, dst_cols] contiguous, zeros in columns [src_cols, dst_cols).
struct PadJob {
  const void* src;
  void* dst;
  core::PadGeometry g;
};

constexpr int kMaxPadJobs = 3;

// Pads up to kMaxPadJobs tensors that share the column counts and element size in one launch.
cudaError_t launch_pad_last_dim(const PadJob* jobs, int num_jobs, int64_t src_cols,
                                int64_t dst_cols, int64_t elem_bytes, cudaStream_t stream);

// out_q[i] = clamp(cu_q[i], 0, rows_q) and out_kv[i] = clamp(cu_kv[i], 0, rows_kv) for i < n: the
// offsets the padded path hands to FlashAttention, whose kernels read them unchecked. Valid
// offsets are unchanged; bad ones (checked on the host only with validate=True) can shrink or
// empty a sequence but never send a kernel outside q, k, v or the outputs.
cudaError_t launch_clamp_offsets(const int32_t* cu_q, int32_t* out_q, int64_t rows_q, const int32_t* cu_kv,
                                 int32_t* out_kv, int64_t rows_kv, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
