// Jagged row gather / scatter: select and reorder whole sequences of a jagged batch.
//
// gather:  out [total_out, *F], output sequence j = rows [src_starts[j], src_starts[j] + len_j) of
//          values, len_j = cu_seqlens_out[j+1] - cu_seqlens_out[j].
// scatter: the adjoint; `grad` is shaped like the gather's output and out [total_in, *F] is zero
//          except the rows put back where the gather took them from (the spans must be disjoint).
#pragma once

#include "../core/thd_rows.h"
#include "stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

struct JaggedCall {
  Tensor src;  // contiguous
  Tensor src_starts, cu_out;
  Tensor out;
  core::JaggedGatherPlan plan;
  int64_t row_bytes = 0;
  int64_t gathered_rows = 0;  // rows of the gather's output side (the rows a kernel walks)
};

// Checks the arguments (their values too when they live on the CPU), allocates the output and
// builds the plan. One implementation for both directions and both devices.
JaggedCall prepare_jagged(const char* op, const Tensor& values, const Tensor& src_starts,
                          const Tensor& cu_seqlens_out, int64_t total, bool scatter);

Tensor jagged_gather_cpu(const Tensor& values, const Tensor& src_starts,
                         const Tensor& cu_seqlens_out, int64_t total_out);
Tensor jagged_scatter_cpu(const Tensor& grad, const Tensor& src_starts,
                          const Tensor& cu_seqlens_out, int64_t total_in);
#ifdef VERL_OPS_WITH_CUDA
Tensor jagged_gather_cuda(const Tensor& values, const Tensor& src_starts,
                          const Tensor& cu_seqlens_out, int64_t total_out);
Tensor jagged_scatter_cuda(const Tensor& grad, const Tensor& src_starts,
                           const Tensor& cu_seqlens_out, int64_t total_in);
#endif

}  // namespace ops
}  // namespace verl_ops
