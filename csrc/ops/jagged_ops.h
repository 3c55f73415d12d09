// Jagged row gather / scatter: select and reorder whole sequences of a jagged batch.
//
// gather:  out [total_out, *F], output sequence j = rows [src_starts[j], src_starts[j] + len_j) of
//          values, len_j = cu_seqlens_out[j+1] - cu_seqlens_out[j].
// scatter: the adjoint; `grad` is shaped like the gather's output and out [total_in, *F] is zero
//          except the rows put back where the gather took them from (the spans must be disjoint).
#pragma once

#include <ATen/ATen.h>

#include "../core/thd_rows.h"

namespace verl_ops {
namespace ops {

struct JaggedCall {
  at::Tensor src;  // contiguous
  at::Tensor src_starts, cu_out;
  core::JaggedGatherPlan plan;
  int64_t row_bytes;
  int64_t gathered_rows;  // rows of the gather's output side (the rows a kernel walks)
};

// Checks the arguments (their values too when they live on the CPU), allocates `out` and builds
// the plan. One implementation for both directions and both devices.
JaggedCall prepare_jagged(const char* op, const at::Tensor& values, const at::Tensor& src_starts,
                          const at::Tensor& cu_seqlens_out, int64_t total, bool scatter,
                          at::Tensor* out);

at::Tensor jagged_gather_cpu(const at::Tensor& values, const at::Tensor& src_starts,
                             const at::Tensor& cu_seqlens_out, int64_t total_out);
at::Tensor jagged_scatter_cpu(const at::Tensor& grad, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_in);
at::Tensor jagged_gather_meta(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, c10::SymInt total_out);
at::Tensor jagged_scatter_meta(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, c10::SymInt total_in);
#ifdef VERL_OPS_WITH_CUDA
at::Tensor jagged_gather_cuda(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_out);
at::Tensor jagged_scatter_cuda(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, int64_t total_in);
#endif

}  // namespace ops
}  // namespace verl_ops
