// Router replay ops (docs/router_replay.md) on the stable ABI: argument checks, output allocation,
// dispatch.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "../core/router_rows.h"
#include "stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

// The recorded indices as the kernels read them: one slice (pointer + strides) per layer.
// `owner` is a tensor of the layers' dtype and device (it allocates the outputs).
struct RecordLayers {
  std::vector<core::LayerSlice> slices;
  core::IndexDtype dtype = core::IndexDtype::kInt64;
  int64_t rows = 0;  // T_local_sp
  int64_t topk = 0;
  Tensor owner;
};

// indices [L, T, K], any integer dtype and strides.
RecordLayers record_layers_of(const Tensor& indices);
// A list of [T, K] tensors (the second library, which can take list arguments).
RecordLayers record_layers_of(const std::vector<Tensor>& indices);

std::tuple<Tensor, Tensor> router_record_cpu(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                             const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                             const std::optional<Tensor>& attention_mask);

std::tuple<Tensor, Tensor> router_topk_record_cpu(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                  const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                                  const std::optional<Tensor>& attention_mask);

std::tuple<Tensor, Tensor> router_topk_scatter_cpu(const Tensor& routes, const Tensor& cu_seqlens,
                                                   const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t tp_size,
                                                   int64_t tp_rank, int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                                   const std::optional<Tensor>& attention_mask,
                                                   const std::optional<Tensor>& replay_mask);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<Tensor, Tensor> router_record_cuda(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                              const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                              const std::optional<Tensor>& attention_mask);

std::tuple<Tensor, Tensor> router_topk_record_cuda(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                   const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                                   const std::optional<Tensor>& attention_mask);

std::tuple<Tensor, Tensor> router_topk_scatter_cuda(const Tensor& routes, const Tensor& cu_seqlens,
                                                    const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t tp_size,
                                                    int64_t tp_rank, int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                                    const std::optional<Tensor>& attention_mask,
                                                    const std::optional<Tensor>& replay_mask);
#endif

// Shared by the CPU and CUDA implementations (internal).
struct RouterRecordCall {
  Tensor cu, cu_padded, mask_csum;  // kept alive for the plan's pointers (fused only)
  Tensor routes, overflow;
  core::RouterRecordPlan plan;
  int64_t out_rows = 0;
};

struct RouterScatterCall {
  Tensor routes;  // contiguous
  Tensor cu, cu_padded, mask_csum, replay;
  Tensor targets, replay_out;
  core::RouterScatterPlan plan;
  core::IndexDtype dtype = core::IndexDtype::kInt64;
  int64_t num_layers = 0;
  int64_t topk = 0;
  int64_t rows = 0;  // T_sp
};

RouterRecordCall prepare_router_record(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                       const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                       const std::optional<Tensor>& attention_mask);

RouterScatterCall prepare_router_scatter(const Tensor& routes, const Tensor& cu_seqlens, const Tensor& cu_seqlens_padded,
                                         int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size,
                                         int64_t cp_rank, int64_t cp_layout, const std::optional<Tensor>& attention_mask,
                                         const std::optional<Tensor>& replay_mask);

}  // namespace ops
}  // namespace verl_ops
