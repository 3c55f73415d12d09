// ATen-facing THD ops: argument checks, output allocation, dispatch to the kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "../core/thd_rows.h"

namespace verl_ops {
namespace ops {

std::tuple<at::Tensor, at::Tensor> thd_layout(const at::Tensor& lengths, int64_t tp_size,
                                              int64_t cp_size, const std::string& cp_layout,
                                              bool fp8_padding,
                                              std::optional<int64_t> min_local_rows,
                                              std::optional<int64_t> pad_to_length_bucket);

std::tuple<at::Tensor, at::Tensor> thd_layout_meta(const at::Tensor& lengths, int64_t tp_size,
                                                   int64_t cp_size, const std::string& cp_layout,
                                                   bool fp8_padding,
                                                   std::optional<int64_t> min_local_rows,
                                                   std::optional<int64_t> pad_to_length_bucket);

// Everything a device implementation needs, after the checks.
struct PackCall {
  at::Tensor values;  // contiguous
  at::Tensor mask_csum;  // int32 [B, S] or undefined
  at::Tensor cu, cu_padded;  // contiguous offsets the plan points into
  core::PackPlan plan;
  int64_t out_rows;
  int64_t row_bytes;
};

struct UnpackCall {
  at::Tensor packed;  // contiguous
  at::Tensor mask_csum;
  at::Tensor cu, cu_padded;
  core::UnpackPlan plan;
  int64_t out_rows;
  int64_t row_bytes;
};

// Shared by the CPU and CUDA implementations: checks, allocates outputs, fills the plan.
PackCall prepare_pack(const at::Tensor& values, const at::Tensor& cu_seqlens,
                      const at::Tensor& cu_seqlens_padded, int64_t local_rows, int64_t cp_size,
                      int64_t cp_rank, const std::string& cp_layout, bool roll,
                      const std::optional<at::Tensor>& attention_mask, at::Tensor* packed,
                      at::Tensor* positions);

UnpackCall prepare_unpack(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                          const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                          int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                          bool roll, const std::optional<at::Tensor>& attention_mask,
                          at::Tensor* out);

std::tuple<at::Tensor, at::Tensor> preprocess_thd_cpu(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout, bool roll,
    const std::optional<at::Tensor>& attention_mask);

at::Tensor postprocess_thd_cpu(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                               const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                               int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                               bool roll, const std::optional<at::Tensor>& attention_mask);

std::tuple<at::Tensor, at::Tensor> preprocess_thd_meta(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    c10::SymInt local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
    bool roll, const std::optional<at::Tensor>& attention_mask);

at::Tensor postprocess_thd_meta(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                                const at::Tensor& cu_seqlens_padded, c10::SymInt total_tokens,
                                int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                                bool roll, const std::optional<at::Tensor>& attention_mask);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> preprocess_thd_cuda(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout, bool roll,
    const std::optional<at::Tensor>& attention_mask);

at::Tensor postprocess_thd_cuda(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                                const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                                int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                                bool roll, const std::optional<at::Tensor>& attention_mask);
#endif

}  // namespace ops
}  // namespace verl_ops
