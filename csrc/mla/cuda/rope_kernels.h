// CUDA kernel of mla_rope (mla/rope.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../rope.h"

namespace verl_ops {
namespace cuda {

// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16. out is contiguous [rows, heads, dim]. A row
// whose position lies outside [0, table_rows) gets zeros (positions are not read on the host).
cudaError_t launch_mla_rope(const core::RopeProblem& p, int dtype, const void* x, const void* cos,
                            const void* sin, const int64_t* positions, void* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
