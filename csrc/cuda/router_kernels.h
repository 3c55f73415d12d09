// CUDA router replay launchers: raw pointers, sizes and a stream, no ATen.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/router_rows.h"

namespace verl_ops {
namespace cuda {

// Record: out [rows, L, K] int16 from the L layer slices (host array of device pointers; the
// table travels as a kernel argument, so the call is CUDA-graph capturable). Values outside the
// int16 range are stored as core::kOutOfRangeIndex; `overflow` (core::kOverflowSlots int32, no
// initialisation needed) comes out non-zero somewhere iff that happened. The caller reads it when
// it chooses (no host synchronisation here). One launch per 128 layers.
cudaError_t launch_router_record(const core::RouterRecordPlan& plan,
                                 const core::LayerSlice* layers, int64_t num_layers, int64_t topk,
                                 core::IndexDtype dtype, int16_t* out, int64_t rows,
                                 int32_t* overflow, cudaStream_t stream);

// Replay: targets [L, rows, K] int64 (and replay_out [rows] bool when replay_in is given) from
// routes [token rows, L, K] (contiguous). One launch.
cudaError_t launch_router_scatter(const core::RouterScatterPlan& plan, const void* routes,
                                  core::IndexDtype dtype, int64_t num_layers, int64_t topk,
                                  const bool* replay_in, int64_t* targets, bool* replay_out,
                                  int64_t rows, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
