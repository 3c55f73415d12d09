#include "cuda/rope_kernels.h"
#include "rope_ops.h"

namespace verl_ops {
namespace ops {

// One launch on the current stream; positions are not read on the host.
Tensor mla_rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                     bool interleaved, bool backward) {
  const st::DeviceGuard guard(st::guard_index(x));
  const RopeCall c = prepare_rope(x, cos, sin, positions, interleaved, backward);
  st::check_launch("mla_rope", cuda::launch_mla_rope(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(),
                                                     c.sin.data_ptr(), st::ptr<int64_t>(c.positions),
                                                     c.out.data_ptr(), st::current_stream(x)));
  return c.out;
}

}  // namespace ops
}  // namespace verl_ops
