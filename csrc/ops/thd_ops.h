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

// The layout of a batch and its summary in one call (the Python layout's fast path):
// x: the lengths [B] or, with x_is_offsets, the offsets [B + 1] of a jagged batch (any integer
// dtype, CPU). Returns offsets int32 [2, B + 1] (cu_seqlens, cu_seqlens_padded) and info int64
// [kLayoutInfoHead + B]: {index of the first length outside [0, 2**31 - 1] or -1, that length,
// total tokens, padded total, longest padded sequence, longest and shortest sequence, then the
// B lengths}. A bad length leaves the offsets unset (the caller raises); the layout rules raise
// as thd_layout does.
constexpr int64_t kLayoutInfoHead = 7;
std::tuple<Tensor, Tensor> thd_layout_info(const Tensor& x, bool x_is_offsets, int64_t tp_size,
                                           int64_t cp_size, int64_t cp_layout, bool fp8_padding,
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
