#include "../cuda/thd_kernels.h"
#include "jagged_ops.h"

namespace verl_ops {
namespace ops {

namespace {

// One launch on the current stream; index values are not read on the host (no synchronisation).
Tensor jagged_rows_cuda(const char* op, bool scatter, const Tensor& values, const Tensor& src_starts,
                        const Tensor& cu_out, int64_t total) {
  const st::DeviceGuard guard(st::guard_index(values));
  const JaggedCall c = prepare_jagged(op, values, src_starts, cu_out, total, scatter);
  const cudaStream_t stream = st::current_stream(values);
  st::check_launch(op, scatter ? cuda::launch_jagged_scatter(c.plan, c.src.data_ptr(), c.out.data_ptr(),
                                                             c.gathered_rows, c.row_bytes, stream)
                               : cuda::launch_jagged_gather(c.plan, c.src.data_ptr(), c.out.data_ptr(),
                                                            c.gathered_rows, c.row_bytes, stream));
  return c.out;
}

}  // namespace

Tensor jagged_gather_cuda(const Tensor& values, const Tensor& src_starts, const Tensor& cu_seqlens_out,
                          int64_t total_out) {
  return jagged_rows_cuda("jagged_gather", false, values, src_starts, cu_seqlens_out, total_out);
}

Tensor jagged_scatter_cuda(const Tensor& grad, const Tensor& src_starts, const Tensor& cu_seqlens_out,
                           int64_t total_in) {
  return jagged_rows_cuda("jagged_scatter", true, grad, src_starts, cu_seqlens_out, total_in);
}

}  // namespace ops
}  // namespace verl_ops
