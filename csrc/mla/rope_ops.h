// mla_rope: MLA's rotary embedding of THD rows in one pass (mla/rope.h, docs/megatron.md#rope).
#pragma once

#include "rope.h"
#include "../ops/stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

struct RopeCall {
  core::RopeProblem problem;
  Tensor x, cos, sin, positions, out;
  int dtype = 0;  // 0 float32, 1 float64, 2 float16, 3 bfloat16
};

// Checks the arguments (positions' values too when they live on the CPU) and allocates the output;
// in_place (mla_rope_): the output is x itself where x has inner stride 1, else a buffer.
RopeCall prepare_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                      bool interleaved, bool backward, bool in_place);
// A contiguous output buffer for c (in place where the kernel cannot write x itself).
Tensor rope_buffer(RopeCall& c);

Tensor mla_rope_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                    bool interleaved, bool backward);
// mla_rope_: the same, written into x (x's rope dims rotated in place).
void mla_rope_inplace_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                          bool interleaved, bool backward);
#ifdef VERL_OPS_WITH_CUDA
Tensor mla_rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                     bool interleaved, bool backward);
void mla_rope_inplace_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           bool interleaved, bool backward);
#endif

}  // namespace ops
}  // namespace verl_ops
