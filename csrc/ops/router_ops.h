// ATen-facing router replay ops (OPS.md section 4): argument checks, output allocation, dispatch.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../core/router_rows.h"

namespace verl_ops {
namespace ops {

// Everything a device implementation of router_topk_record needs, after the checks.
struct RouterRecordCall {
  std::vector<core::LayerSlice> layers;
  core::IndexDtype dtype;
  int64_t num_layers = 0;
  int64_t topk = 0;
  int64_t out_rows = 0;
  at::Tensor cu, cu_padded, mask_csum;  // kept alive for the plan's pointers (fused only)
  core::RouterRecordPlan plan;
};

struct RouterScatterCall {
  at::Tensor routes;  // contiguous
  at::Tensor cu, cu_padded, mask_csum, replay;
  core::RouterScatterPlan plan;
  core::IndexDtype dtype;
  int64_t num_layers = 0;
  int64_t topk = 0;
  int64_t rows = 0;  // T_sp
};

RouterRecordCall prepare_router_record(at::TensorList indices,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       const std::optional<at::Tensor>& cu_seqlens_padded,
                                       int64_t total_tokens,
                                       const std::optional<at::Tensor>& attention_mask,
                                       at::Tensor* routes, at::Tensor* overflow);

RouterScatterCall prepare_router_scatter(const at::Tensor& routes, const at::Tensor& cu_seqlens,
                                         const at::Tensor& cu_seqlens_padded, int64_t local_rows,
                                         int64_t tp_size, int64_t tp_rank, int64_t cp_size,
                                         int64_t cp_rank, const std::string& cp_layout,
                                         const std::optional<at::Tensor>& attention_mask,
                                         const std::optional<at::Tensor>& replay_mask,
                                         at::Tensor* targets, at::Tensor* replay_out);

std::tuple<at::Tensor, at::Tensor> router_topk_record_cpu(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, int64_t total_tokens,
    const std::optional<at::Tensor>& attention_mask);

std::tuple<at::Tensor, at::Tensor> router_topk_record_meta(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, c10::SymInt total_tokens,
    const std::optional<at::Tensor>& attention_mask);

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_cpu(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask);

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_meta(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    c10::SymInt local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> router_topk_record_cuda(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, int64_t total_tokens,
    const std::optional<at::Tensor>& attention_mask);

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_cuda(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask);
#endif

}  // namespace ops
}  // namespace verl_ops
