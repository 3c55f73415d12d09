// CUDA kernel of mla_rope (mla/rope.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../rope.h"

namespace verl_ops {
namespace cuda {

// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16. out [rows, heads, dim] with the problem's
// out strides. A row whose position lies outside [0, table_rows) gets zeros (positions are not read
// on the host). out may be x itself (in place) only where rope_vector_ok holds
// (cudaErrorInvalidValue otherwise); else it must not overlap x.
bool rope_vector_ok(const core::RopeProblem& p, int dtype, const void* x, const void* cos, const void* sin,
                    const void* out);
cudaError_t launch_mla_rope(const core::RopeProblem& p, int dtype, const void* x, const void* cos,
                            const void* sin, const int64_t* positions, void* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
