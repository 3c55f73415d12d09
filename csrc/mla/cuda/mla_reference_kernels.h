// CUDA reference kernels of mla_forward_padded / mla_backward_padded for float32 and float64
// inputs (docs/mla.md#what-runs-where): the CPU reference's math on the GPU, accumulated in the
// input's type. Raw pointers, sizes and a stream, no ATen.
//
// One warp per output row: the forward and dQ per (query row, query head), dK / dV per (key row,
// kv head). Every output element is written by exactly one warp in a fixed order (no atomics: the
// results are deterministic), nothing is read on the host, and the offsets are clamped into the
// rows before any use (core::row_sequence), so bad offsets never lead outside the tensors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace verl_ops {
namespace cuda {

struct MlaReferenceProblem {
  const int32_t* cu_seqlens_q;   // [num_seqs + 1]
  const int32_t* cu_seqlens_kv;  // [num_seqs + 1]
  int64_t num_seqs;              // >= 1
  int64_t tq, tk, hq, hk, dqk, dv;
  bool causal;
  double scale;
};

// out [tq, hq, dv] and lse [hq, tq] (+inf for a query that sees no key, whose output is zero) from
// q [tq, hq, dqk], k [tk, hk, dqk], v [tk, hk, dv]; every tensor contiguous, T float or double.
template <typename T>
cudaError_t launch_mla_reference_forward(const MlaReferenceProblem& p, const T* q, const T* k,
                                         const T* v, T* out, T* lse, cudaStream_t stream);

// dq [tq, hq, dqk], dk [tk, hk, dqk], dv [tk, hk, dv] (every element written; zeros where no query
// sees a key) from the forward's inputs, out, grad_out [tq, hq, dv] and lse [hq, tq]. delta
// [hq, tq] is a workspace (rowsum(grad_out * out), written by the first launch, read by the
// second). Two launches on `stream`.
template <typename T>
cudaError_t launch_mla_reference_backward(const MlaReferenceProblem& p, const T* q, const T* k,
                                          const T* v, const T* out, const T* grad_out,
                                          const T* lse, T* delta, T* dq, T* dk, T* dv,
                                          cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
