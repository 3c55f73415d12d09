// CUDA launchers of dynamic_cp_merge's header and reorder index (see ops/merge_ops.h for the
// layouts): raw pointers, sizes and a stream, no ATen.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace verl_ops {
namespace cuda {

// out [9 + 2B] int64: meta[0..8], then lengths (0-padded) and sample ids (-1-padded) of the n
// sequences; lengths / ids are int64 when *_64, else int32. One launch.
cudaError_t launch_merge_header(const int64_t* meta, const void* lengths, bool lengths_64,
                                const void* ids, bool ids_64, int64_t n, int64_t B, int64_t* out,
                                cudaStream_t stream);

// The reorder index of the gathered header hdr [G, 9 + 2B] into buf / cu (layout in
// ops/merge_ops.h). One launch of one block (B is a micro-batch's sequence count).
cudaError_t launch_merge_index(const int64_t* hdr, int64_t G, int64_t B, bool validate, int64_t* buf,
                               int32_t* cu, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
