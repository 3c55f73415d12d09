#include "cuda/rope_kernels.h"
#include "rope_ops.h"

namespace verl_ops {
namespace ops {

// One launch on the current stream; positions are not read on the host.
Tensor mla_rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                     bool interleaved, bool backward) {
  const st::DeviceGuard guard(st::guard_index(x));
  const RopeCall c = prepare_rope(x, cos, sin, positions, interleaved, backward, false);
  st::check_launch("mla_rope", cuda::launch_mla_rope(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(),
                                                     c.sin.data_ptr(), st::ptr<int64_t>(c.positions),
                                                     c.out.data_ptr(), st::current_stream(x)));
  return c.out;
}

// In place where the vector kernel applies (16-bit, aligned rows: MLA's rope columns of q and of
// its gradient); otherwise into a buffer that is copied back.
void mla_rope_inplace_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           bool interleaved, bool backward) {
  const st::DeviceGuard guard(st::guard_index(x));
  RopeCall c = prepare_rope(x, cos, sin, positions, interleaved, backward, true);
  if (c.problem.rows * c.problem.heads == 0) return;
  const bool direct = c.out.data_ptr() == x.data_ptr() &&
                      cuda::rope_vector_ok(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(), c.sin.data_ptr(),
                                           c.out.data_ptr());
  if (!direct) rope_buffer(c);
  st::check_launch("mla_rope_", cuda::launch_mla_rope(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(),
                                                      c.sin.data_ptr(), st::ptr<int64_t>(c.positions),
                                                      c.out.data_ptr(), st::current_stream(x)));
  if (!direct) st::copy_into(x, c.out);
}

}  // namespace ops
}  // namespace verl_ops
