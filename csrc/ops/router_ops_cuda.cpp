// CUDA implementations of the router replay ops: same checks and plans as the CPU path.
#include "../cuda/router_kernels.h"
#include "router_ops.h"

namespace verl_ops {
namespace ops {

std::tuple<Tensor, Tensor> router_record_cuda(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                              const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                              const std::optional<Tensor>& attention_mask) {
  const st::DeviceGuard guard(st::guard_index(layers.owner));
  RouterRecordCall call = prepare_router_record(layers, cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
  st::check_launch("router_topk_record",
                   cuda::launch_router_record(call.plan, layers.slices.data(), static_cast<int64_t>(layers.slices.size()),
                                              layers.topk, layers.dtype, st::ptr<int16_t>(call.routes), call.out_rows,
                                              st::ptr<int32_t>(call.overflow), st::current_stream(layers.owner)));
  return {call.routes, call.overflow};
}

std::tuple<Tensor, Tensor> router_topk_record_cuda(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                   const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                                   const std::optional<Tensor>& attention_mask) {
  return router_record_cuda(record_layers_of(indices), cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
}

std::tuple<Tensor, Tensor> router_topk_scatter_cuda(const Tensor& routes, const Tensor& cu_seqlens,
                                                    const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t tp_size,
                                                    int64_t tp_rank, int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                                    const std::optional<Tensor>& attention_mask,
                                                    const std::optional<Tensor>& replay_mask) {
  const st::DeviceGuard guard(st::guard_index(routes));
  RouterScatterCall call = prepare_router_scatter(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size, tp_rank,
                                                  cp_size, cp_rank, cp_layout, attention_mask, replay_mask);
  const bool* rin = replay_mask.has_value() ? st::ptr<bool>(call.replay) : nullptr;
  bool* rout = replay_mask.has_value() ? st::ptr<bool>(call.replay_out) : nullptr;
  st::check_launch("router_topk_scatter",
                   cuda::launch_router_scatter(call.plan, call.routes.data_ptr(), call.dtype, call.num_layers, call.topk,
                                               rin, st::ptr<int64_t>(call.targets), rout, call.rows,
                                               st::current_stream(routes)));
  return {call.targets, call.replay_out};
}

}  // namespace ops
}  // namespace verl_ops
