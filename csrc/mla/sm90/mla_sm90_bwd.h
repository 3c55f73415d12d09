// Backward attention for MLA shapes (Dqk 192, Dv 128) on Hopper, see mla_sm90_bwd.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mla_sm90_fwd.h"  // Sm90Parts

namespace verl_ops {
namespace cuda {

// Rows [rows, heads, d] a gradient part is written to: the base (16-byte aligned) and the row and
// head strides in elements, the row stride heads * head_stride.
struct Sm90GradRows {
  void* ptr = nullptr;
  int64_t row_stride = 0, head_stride = 0;
};

struct Sm90BwdArgs {
  Sm90Parts in;      // q, q_pe, k, k_pe, v as the forward read them (mla_sm90_fwd.h)
  const void* out;   // [tq, hq, 128]: the forward's output
  const void* dout;  // [tq, hq, 128]
  const float* lse;  // the forward's natural-log log-sum-exp of (row, head) at
                     // row * lse_row_stride + head * lse_head_stride, +inf where no key is seen
  void* dq;          // [tq, hq, 192] contiguous: every row written (zeros outside the sequences)
  // dk's first 128 columns, its last 64 (per kv head, also where k_pe is shared: the caller sums
  // them over the heads) and dv [tk, hk, 128]: the rows inside the sequences written.
  Sm90GradRows dk, dk_pe, dv;
  const int32_t* cu_q;
  const int32_t* cu_kv;
  int32_t* workspace;  // sm90_backward_workspace_ints(batch) int32 on the device
  float* dq_accum;     // [tq, hq, 192] fp32 on the device
  float2* lse_d;       // [hq, tq] on the device
  int64_t lse_row_stride, lse_head_stride;
  int64_t batch, tq, tk, hq, hk;
  float scale;
  bool causal, bottom_right, half;
};

inline int64_t sm90_backward_workspace_ints(int64_t batch) { return 2 * batch + 2; }

// The varlen backend runs its backward with this kernel (unless VERL_OPS_VARLEN_BACKWARD=cudnn,
// read once) on a device where the forward's test holds (compiled for sm_90a, compute capability
// 9.0, the driver's tensor-map encoder).
bool sm90_backward_enabled();
bool sm90_backward_device(int device);

// Writes dq for every row (zeros outside the sequences) and dk / dv for every key row inside a
// sequence (zeros where no query sees the key); key rows outside every sequence are left as they
// are (all of them zero when there is no query row or no key row at all). Offsets are trusted as
// the op's contract states them (non-decreasing, cu[batch] the row count): the grid is sized for
// that. No host read, no plan: capturable in a CUDA graph.
cudaError_t launch_sm90_backward(const Sm90BwdArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
