// Rotary position embedding of MLA's rope head dims on THD rows (docs/megatron.md#rope):
// Megatron-Core's `_apply_rotary_pos_emb_bshd` (rotate-half RoPE, optionally after MLA's
// de-interleave of each head's rope dims) in one pass over the rows, with the same roundings, so
// the result is bit-identical to Megatron's chain of elementwise ops in any dtype.
//
// Row r, head h, pair k < half (half = dim / 2), cos / sin rows c, s = table[positions[r]]
// (already scaled by mscale and rounded to the data's dtype, as Megatron does), rnd() = round to
// the data's dtype:
//   forward  (x -> out):  y = x de-interleaved (y[k] = x[2k], y[k + half] = x[2k + 1]) or x itself
//     out[k]        = rnd(rnd(y[k] c[k]) - rnd(y[k + half] s[k]))
//     out[k + half] = rnd(rnd(y[k + half] c[k + half]) + rnd(y[k] s[k + half]))
//   backward (grad_out -> grad_x): the adjoint, with autograd's roundings
//     gy[k]         = rnd(rnd(g[k] c[k]) + rnd(g[k + half] s[k + half]))
//     gy[k + half]  = rnd(rnd(g[k + half] c[k + half]) - rnd(g[k] s[k]))
//     grad_x = gy interleaved back (grad_x[2k] = gy[k], grad_x[2k + 1] = gy[k + half]) or gy.
#pragma once

#include <cstdint>

#include "../core/thd_layout.h"

namespace verl_ops {
namespace core {

struct RopeProblem {
  int64_t rows, heads, dim;           // data [rows, heads, dim]
  int64_t row_stride, head_stride;    // of the input, in elements (inner stride 1)
  int64_t out_row_stride, out_head_stride;  // of the output (inner stride 1)
  int64_t table_rows;                 // cos / sin [table_rows, dim], contiguous
  bool interleaved;                   // MLA's de-interleave of the rope dims
  bool backward;
};

// Element offsets (within a head) of pair k on the input and the output side.
VERL_HD void rope_pair_offsets(const RopeProblem& p, int64_t k, int64_t* in0, int64_t* in1, int64_t* out0,
                               int64_t* out1) {
  const int64_t half = p.dim / 2;
  const bool input_interleaved = p.interleaved && !p.backward;
  const bool output_interleaved = p.interleaved && p.backward;
  *in0 = input_interleaved ? 2 * k : k;
  *in1 = input_interleaved ? 2 * k + 1 : k + half;
  *out0 = output_interleaved ? 2 * k : k;
  *out1 = output_interleaved ? 2 * k + 1 : k + half;
}

// The pair's two results from its two inputs (a, b) and the table entries at k and k + half.
template <typename Acc, typename Round>
VERL_HD void rope_pair(bool backward, Acc a, Acc b, Acc c0, Acc s0, Acc c1, Acc s1, Round rnd, Acc* o0,
                       Acc* o1) {
  if (!backward) {
    *o0 = rnd(rnd(a * c0) - rnd(b * s0));
    *o1 = rnd(rnd(b * c1) + rnd(a * s1));
  } else {
    *o0 = rnd(rnd(a * c0) + rnd(b * s1));
    *o1 = rnd(rnd(b * c1) - rnd(a * s0));
  }
}

}  // namespace core
}  // namespace verl_ops
