// CUDA implementations of the THD ops: same checks and plans as the CPU path, one launch on the
// current stream.
#include "../cuda/thd_kernels.h"
#include "thd_ops.h"

namespace verl_ops {
namespace ops {

std::tuple<Tensor, Tensor> preprocess_thd_cuda(const Tensor& values, const Tensor& cu_seqlens,
                                               const Tensor& cu_seqlens_padded, int64_t local_rows,
                                               int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                               bool roll, const std::optional<Tensor>& attention_mask) {
  const st::DeviceGuard guard(st::guard_index(values));
  PackCall call = prepare_pack(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size, cp_rank,
                               cp_layout, roll, attention_mask);
  st::check_launch("preprocess_thd",
                   cuda::launch_pack(call.plan, call.values.data_ptr(), call.packed.data_ptr(),
                                     st::ptr<int64_t>(call.positions), call.out_rows, call.row_bytes,
                                     st::current_stream(values)));
  return {call.packed, call.positions};
}

Tensor postprocess_thd_cuda(const Tensor& packed, const Tensor& cu_seqlens,
                            const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                            int64_t cp_rank, int64_t cp_layout, bool roll,
                            const std::optional<Tensor>& attention_mask) {
  const st::DeviceGuard guard(st::guard_index(packed));
  UnpackCall call = prepare_unpack(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size,
                                   cp_rank, cp_layout, roll, attention_mask);
  st::check_launch("postprocess_thd",
                   cuda::launch_unpack(call.plan, call.packed.data_ptr(), call.out.data_ptr(),
                                       call.out_rows, call.row_bytes, st::current_stream(packed)));
  return call.out;
}

}  // namespace ops
}  // namespace verl_ops
