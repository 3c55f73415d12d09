// Softmax of the SM90 kernels, in the exp2 domain (scores times scale * log2(e)).
// - Forward: online, two rows per thread (the wgmma accumulator rows r and r + 8 of a warpgroup),
//   the running max moved only when it grows by more than 2^8 so O is rarely rescaled.
// - Backward: P^T recomputed from the forward's log-sum-exp (mainloop_bwd.cuh, where it goes
//   straight into the dV GEMM's A fragments).
#pragma once

#include <cmath>

#include "ptx.cuh"

namespace verl_ops {
namespace cuda {
namespace {

namespace fwd {

struct OnlineSoftmax {
  float m0, m1;  // running max of rows r, r + 8 (raw scores)
  float l0, l1;  // running sum (this thread's columns; summed over the quad in the epilogue)

  __device__ __forceinline__ void reset() {
    m0 = -INFINITY;
    m1 = -INFINITY;
    l0 = 0.f;
    l1 = 0.f;
  }

  // sacc: one key tile's masked scores -> P (fp32, not normalised); alpha0 / alpha1: the factors
  // the accumulated O of the two rows must be scaled by (1 when the max did not move).
  __device__ __forceinline__ void step(float (&sacc)[64], float sl2, float& alpha0, float& alpha1) {
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      mx0 = fmaxf(mx0, fmaxf(sacc[4 * c + 0], sacc[4 * c + 1]));
      mx1 = fmaxf(mx1, fmaxf(sacc[4 * c + 2], sacc[4 * c + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    // The running max moves only when a row's max grows by more than 2^8 in exp2 units: below
    // that the stale max keeps every exponent <= 8 (no overflow in fp32), and O needs no rescale.
    if (mx0 * sl2 - m0 * sl2 <= 8.f) mx0 = m0;
    if (mx1 * sl2 - m1 * sl2 <= 8.f) mx1 = m1;
    const float ms0 = mx0 == -INFINITY ? 0.f : mx0 * sl2;
    const float ms1 = mx1 == -INFINITY ? 0.f : mx1 * sl2;
    // Branch-free (ex2 always, then a select): a data-dependent branch here would make ptxas
    // wait for the in-flight PV GEMM before the softmax instead of overlapping the two.
    const float e0 = ex2(m0 * sl2 - ms0), e1 = ex2(m1 * sl2 - ms1);
    alpha0 = mx0 == m0 ? 1.f : e0;
    alpha1 = mx1 == m1 ? 1.f : e1;
    m0 = mx0;
    m1 = mx1;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      sacc[4 * c + 0] = ex2(fmaf(sacc[4 * c + 0], sl2, -ms0));
      sacc[4 * c + 1] = ex2(fmaf(sacc[4 * c + 1], sl2, -ms0));
      sacc[4 * c + 2] = ex2(fmaf(sacc[4 * c + 2], sl2, -ms1));
      sacc[4 * c + 3] = ex2(fmaf(sacc[4 * c + 3], sl2, -ms1));
      s0 += sacc[4 * c + 0] + sacc[4 * c + 1];
      s1 += sacc[4 * c + 2] + sacc[4 * c + 3];
    }
    l0 = fmaf(l0, alpha0, s0);
    l1 = fmaf(l1, alpha1, s1);
  }

  // Scales the accumulated O [64 rows x 128] fragments by the step's factors.
  __device__ __forceinline__ static void rescale(float (&o)[64], float alpha0, float alpha1) {
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      o[4 * c + 0] *= alpha0;
      o[4 * c + 1] *= alpha0;
      o[4 * c + 2] *= alpha1;
      o[4 * c + 3] *= alpha1;
    }
  }
};

}  // namespace fwd

namespace bwd {

// P = exp2(s * scale_log2 - lse2): one element of P^T from its score and its query row's lse2
// (the forward's log-sum-exp times log2(e); +inf for a row that sees no key, which gives 0).
__device__ __forceinline__ float prob_from_lse(float s, float sl2, float lse2) {
  return ex2(fmaf(s, sl2, -lse2));
}

}  // namespace bwd

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
