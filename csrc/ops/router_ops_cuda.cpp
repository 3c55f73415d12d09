// CUDA implementations of the router replay ops: same checks and plans as the CPU path.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../cuda/router_kernels.h"
#include "router_ops.h"

namespace verl_ops {
namespace ops {

std::tuple<at::Tensor, at::Tensor> router_topk_record_cuda(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, int64_t total_tokens,
    const std::optional<at::Tensor>& attention_mask) {
  TORCH_CHECK(!indices.empty(), std::string("router_topk_record: indices must hold at least one layer, got an empty list"));
  // A CPU tensor among CUDA ones reaches this kernel too: prepare_router_record reports the mix.
  c10::cuda::OptionalCUDAGuard guard;
  if (indices[0].is_cuda()) guard.set_device(indices[0].device());
  at::Tensor routes, overflow;
  RouterRecordCall call = prepare_router_record(indices, cu_seqlens, cu_seqlens_padded, total_tokens,
                                                attention_mask, &routes, &overflow);
  const cudaError_t err = cuda::launch_router_record(
      call.plan, call.layers.data(), call.num_layers, call.topk, call.dtype, routes.data_ptr<int16_t>(),
      call.out_rows, overflow.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, std::string("router_topk_record: kernel launch failed: ") + cudaGetErrorString(err));
  return {routes, overflow};
}

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_cuda(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask) {
  c10::cuda::OptionalCUDAGuard guard;
  if (routes.is_cuda()) guard.set_device(routes.device());
  at::Tensor targets, replay_out;
  RouterScatterCall call = prepare_router_scatter(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size, tp_rank,
                                                  cp_size, cp_rank, cp_layout, attention_mask, replay_mask, &targets,
                                                  &replay_out);
  const bool* rin = call.replay.defined() ? call.replay.data_ptr<bool>() : nullptr;
  bool* rout = call.replay.defined() ? replay_out.data_ptr<bool>() : nullptr;
  const cudaError_t err = cuda::launch_router_scatter(call.plan, call.routes.data_ptr(), call.dtype, call.num_layers,
                                                      call.topk, rin, targets.data_ptr<int64_t>(), rout, call.rows,
                                                      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, std::string("router_topk_scatter: kernel launch failed: ") + cudaGetErrorString(err));
  return {targets, replay_out};
}

}  // namespace ops
}  // namespace verl_ops
