#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../cuda/thd_kernels.h"
#include "jagged_ops.h"

namespace verl_ops {
namespace ops {

at::Tensor jagged_gather_cuda(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_out) {
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor out;
  JaggedCall c = prepare_jagged("jagged_gather", values, src_starts, cu_seqlens_out, total_out, false, &out);
  const cudaError_t err = cuda::launch_jagged_gather(c.plan, c.src.data_ptr(), out.data_ptr(), total_out,
                                                     c.row_bytes, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "jagged_gather: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor jagged_scatter_cuda(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, int64_t total_in) {
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor out;
  JaggedCall c = prepare_jagged("jagged_scatter", grad, src_starts, cu_seqlens_out, total_in, true, &out);
  const cudaError_t err = cuda::launch_jagged_scatter(c.plan, c.src.data_ptr(), out.data_ptr(), grad.size(0),
                                                      c.row_bytes, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "jagged_scatter: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace ops
}  // namespace verl_ops
