// CUDA implementations of the THD ops: same checks and plans as the CPU path, one launch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../cuda/thd_kernels.h"
#include "thd_ops.h"

namespace verl_ops {
namespace ops {

std::tuple<at::Tensor, at::Tensor> preprocess_thd_cuda(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout, bool roll,
    const std::optional<at::Tensor>& attention_mask) {
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor packed, positions;
  PackCall call = prepare_pack(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size, cp_rank,
                               cp_layout, roll, attention_mask, &packed, &positions);
  const cudaError_t err =
      cuda::launch_pack(call.plan, call.values.data_ptr(), packed.data_ptr(),
                        positions.data_ptr<int64_t>(), call.out_rows, call.row_bytes,
                        at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "preprocess_thd: kernel launch failed: ",
              cudaGetErrorString(err));
  return {packed, positions};
}

at::Tensor postprocess_thd_cuda(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                                const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                                int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                                bool roll, const std::optional<at::Tensor>& attention_mask) {
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor out;
  UnpackCall call = prepare_unpack(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size,
                                   cp_rank, cp_layout, roll, attention_mask, &out);
  const cudaError_t err =
      cuda::launch_unpack(call.plan, call.packed.data_ptr(), out.data_ptr(), call.out_rows,
                          call.row_bytes, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "postprocess_thd: kernel launch failed: ",
              cudaGetErrorString(err));
  return out;
}

}  // namespace ops
}  // namespace verl_ops
