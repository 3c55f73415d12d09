// CPU kernel of mla_rope (mla/rope.h): raw pointers, one (row, head) per step.
#pragma once

#include <cstdint>

#include "../rope.h"

namespace verl_ops {
namespace cpu {

// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16. out [rows, heads, dim] with the problem's
// out strides, not overlapping x;
// every position must lie in [0, table_rows) (checked by the caller).
void mla_rope(const core::RopeProblem& p, int dtype, const void* x, const void* cos, const void* sin,
              const int64_t* positions, void* out);

}  // namespace cpu
}  // namespace verl_ops
