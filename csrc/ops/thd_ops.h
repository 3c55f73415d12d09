// THD ops on the stable ABI: argument checks, output allocation, dispatch to the kernels.
#pragma once

#include <optional>
#include <tuple>

#include "../core/thd_rows.h"
#include "stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

std::tuple<Tensor, Tensor> thd_layout(const Tensor& lengths, int64_t tp_size, int64_t cp_size,
                                      int64_t cp_layout, bool fp8_padding,
                                      std::optional<int64_t> min_local_rows,
                                      std::optional<int64_t> pad_to_length_bucket);

// Everything a device implementation needs, after the checks.
struct PackCall {
  Tensor values;     // contiguous
  Tensor mask_csum;  // int32 [B, S] (padded input only)
  Tensor cu, cu_padded;  // contiguous offsets the plan points into
  Tensor packed, positions;  // outputs
  core::PackPlan plan;
  int64_t out_rows = 0;
  int64_t row_bytes = 0;
};

struct UnpackCall {
  Tensor packed;  // contiguous
  Tensor mask_csum;
  Tensor cu, cu_padded;
  Tensor out;
  core::UnpackPlan plan;
  int64_t out_rows = 0;
  int64_t row_bytes = 0;
};

// Shared by the CPU and CUDA implementations: checks, allocates outputs, fills the plan.
PackCall prepare_pack(const Tensor& values, const Tensor& cu_seqlens,
                      const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t cp_size,
                      int64_t cp_rank, int64_t cp_layout, bool roll,
                      const std::optional<Tensor>& attention_mask);

UnpackCall prepare_unpack(const Tensor& packed, const Tensor& cu_seqlens,
                          const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                          int64_t cp_rank, int64_t cp_layout, bool roll,
                          const std::optional<Tensor>& attention_mask);

std::tuple<Tensor, Tensor> preprocess_thd_cpu(const Tensor& values, const Tensor& cu_seqlens,
                                              const Tensor& cu_seqlens_padded, int64_t local_rows,
                                              int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                              bool roll, const std::optional<Tensor>& attention_mask);

Tensor postprocess_thd_cpu(const Tensor& packed, const Tensor& cu_seqlens,
                           const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                           int64_t cp_rank, int64_t cp_layout, bool roll,
                           const std::optional<Tensor>& attention_mask);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<Tensor, Tensor> preprocess_thd_cuda(const Tensor& values, const Tensor& cu_seqlens,
                                               const Tensor& cu_seqlens_padded, int64_t local_rows,
                                               int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                               bool roll, const std::optional<Tensor>& attention_mask);

Tensor postprocess_thd_cuda(const Tensor& packed, const Tensor& cu_seqlens,
                            const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                            int64_t cp_rank, int64_t cp_layout, bool roll,
                            const std::optional<Tensor>& attention_mask);
#endif

}  // namespace ops
}  // namespace verl_ops
