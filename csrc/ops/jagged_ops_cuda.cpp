#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "../cuda/thd_kernels.h"
#include "jagged_ops.h"

namespace verl_ops {
namespace ops {

namespace {

// One launch on the current stream; index values are not read on the host (no synchronisation).
at::Tensor jagged_rows_cuda(const char* op, bool scatter, const at::Tensor& values,
                            const at::Tensor& src_starts, const at::Tensor& cu_out, int64_t total) {
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor out;
  const JaggedCall c = prepare_jagged(op, values, src_starts, cu_out, total, scatter, &out);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err =
      scatter ? cuda::launch_jagged_scatter(c.plan, c.src.data_ptr(), out.data_ptr(), c.gathered_rows,
                                            c.row_bytes, stream)
              : cuda::launch_jagged_gather(c.plan, c.src.data_ptr(), out.data_ptr(), c.gathered_rows,
                                           c.row_bytes, stream);
  if (err != cudaSuccess) {
    TORCH_CHECK(false, std::string(op) + ": kernel launch failed: " + cudaGetErrorString(err));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

at::Tensor jagged_gather_cuda(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_out) {
  return jagged_rows_cuda("jagged_gather", false, values, src_starts, cu_seqlens_out, total_out);
}

at::Tensor jagged_scatter_cuda(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, int64_t total_in) {
  return jagged_rows_cuda("jagged_scatter", true, grad, src_starts, cu_seqlens_out, total_in);
}

}  // namespace ops
}  // namespace verl_ops
