// CUDA pack / unpack launchers: raw pointers, sizes and a stream, no ATen.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/thd_rows.h"

namespace verl_ops {
namespace cuda {

// One launch; every output row is written (copied or zeroed). `positions` may be null.
cudaError_t launch_pack(const core::PackPlan& plan, const void* src, void* dst, int64_t* positions,
                        int64_t out_rows, int64_t row_bytes, cudaStream_t stream);

cudaError_t launch_unpack(const core::UnpackPlan& plan, const void* src, void* dst,
                          int64_t out_rows, int64_t row_bytes, cudaStream_t stream);

// Jagged row gather (see core::JaggedGatherPlan) and its adjoint scatter (dst pre-zeroed;
// src_rows = rows of the gather's output).
cudaError_t launch_jagged_gather(const core::JaggedGatherPlan& plan, const void* src, void* dst,
                                 int64_t out_rows, int64_t row_bytes, cudaStream_t stream);
cudaError_t launch_jagged_scatter(const core::JaggedGatherPlan& plan, const void* src, void* dst,
                                  int64_t src_rows, int64_t row_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
