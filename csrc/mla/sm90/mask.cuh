// The attention masks of the SM90 kernels: key j is seen by query row i of a sequence when
// j < lk (the sequence's keys) and, under a causal mask, j <= i + shift (shift 0 top-left, lk - lq
// bottom-right). Rows past the sequence's end (i >= lq) see nothing in the backward.
#pragma once

#include <cmath>

#include "params.h"

namespace verl_ops {
namespace cuda {
namespace {

namespace fwd {

// Scores of key tile n_block for this thread's rows row0 and row0 + 8 (= row1) of the tile, in
// the wgmma accumulator layout (column c * 8 + 2 * (lane % 4) + {0, 1}): -inf where the key is not
// seen. Only a tile that reaches past the keys or past the diagonal of the warpgroup's first row
// (m_block * kBM + wg * 64) is touched.
__device__ __forceinline__ void mask_scores(float (&sacc)[64], const Params& p, int n_block, int lk,
                                            int m_block, int wg, int shift, int row0, int row1,
                                            int lane) {
  const int key0 = n_block * kBN;
  const bool need_mask =
      key0 + kBN > lk || (p.causal && key0 + kBN - 1 > m_block * kBM + wg * 64 + shift);
  if (need_mask) {
    const int lim0 = p.causal ? min(lk, row0 + shift + 1) : lk;
    const int lim1 = p.causal ? min(lk, row1 + shift + 1) : lk;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int j = key0 + c * 8 + 2 * (lane % 4);
      if (j >= lim0) sacc[4 * c + 0] = -INFINITY;
      if (j + 1 >= lim0) sacc[4 * c + 1] = -INFINITY;
      if (j >= lim1) sacc[4 * c + 2] = -INFINITY;
      if (j + 1 >= lim1) sacc[4 * c + 3] = -INFINITY;
    }
  }
}

}  // namespace fwd

namespace bwd {

// The first key that query row qi (in the sequence) does not see: lk, or under a causal mask
// min(lk, qi + shift + 1). A row past the sequence's end (qi >= lq) sees none.
template <bool kCausal>
__device__ __forceinline__ int key_limit(int qi, int lk, int shift) {
  return kCausal ? min(lk, qi + shift + 1) : lk;
}

}  // namespace bwd

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
