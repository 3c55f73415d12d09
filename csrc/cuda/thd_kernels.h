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

}  // namespace cuda
}  // namespace verl_ops
