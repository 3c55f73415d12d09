// The forward's epilogue: O normalised and written with the natural-log log-sum-exp of every row
// inside the sequence (+inf for a row that sees no key): [Tq, Hq, 128] and [Tq, Hq], the layout
// cuDNN's backward reads too.
//
// O goes through a shared-memory stage, half its columns at a time (16-byte chunks swizzled by the
// row), and is stored as whole 128-byte row segments instead of scattered 4-byte words (the
// epilogue went from ~3.4k to ~1.7k cycles per tile).
#pragma once

#include <cmath>
#include <cstdint>

#include "named_barriers.h"
#include "softmax.cuh"
#include "tile_scheduler.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace fwd {

// One consumer warpgroup (wg) of tile ti: this thread holds O's fragments of rows row0 / row1 of
// the tile (warp, lane: its place in the warpgroup, t = 32 warp + lane). row0 / row1 come by
// reference: as values, the compiler orders their compares with lq the other way round, and the
// SASS is no longer the single-function kernel's.
template <bool kHalf>
__device__ __forceinline__ void store_o_lse(const Params& p, const Smem& smem, const TileInfo& ti,
                                            float (&o)[64], OnlineSoftmax& sm, int wg, int t, int warp,
                                            int lane, const int& row0, const int& row1, float sl2) {
  const int lq = ti.lq, h = ti.h, m_block = ti.m_block;
  const int64_t q_start = ti.q_start;
  sm.l0 = quad_sum(sm.l0);
  sm.l1 = quad_sum(sm.l1);
  const float l0 = sm.l0, l1 = sm.l1;
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  constexpr float kLn2 = 0.6931471805599453f;
  // Each thread writes its fragments (4-byte words, the 16-byte chunks swizzled by the row: no
  // bank conflicts), then the warpgroup reads back 16-byte chunks and stores whole 128-byte row
  // segments (a warp covers four rows).
  const uint32_t ob = smem.o_stage(wg);
  const int lr0 = warp * 16 + lane / 4, lr1 = lr0 + 8;  // rows of the warpgroup's 64
  const int first_row = m_block * kBM + wg * 64;        // in the sequence
  uint8_t* out_bytes = static_cast<uint8_t*>(p.out);
  const int64_t row_bytes = static_cast<int64_t>(p.hq) * kDv * 2;
  auto wg_sync = [&]() { named_barrier_sync<128>(barrier_id(FwdBarrier::kEpilogue0) + wg); };
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (half > 0) wg_sync();  // the first half's chunks are read
#pragma unroll
    for (int cl = 0; cl < 8; ++cl) {
      const int c = 8 * half + cl;
      const uint32_t w0 = pack2<kHalf>(o[4 * c] * inv0, o[4 * c + 1] * inv0);
      const uint32_t w1 = pack2<kHalf>(o[4 * c + 2] * inv1, o[4 * c + 3] * inv1);
      sts_b32(ob + lr0 * 128 + ((cl ^ (lr0 & 7)) << 4) + 4 * (lane % 4), w0);
      sts_b32(ob + lr1 * 128 + ((cl ^ (lr1 & 7)) << 4) + 4 * (lane % 4), w1);
    }
    wg_sync();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i * 16 + t / 8, cl = t % 8;
      const uint4 v = lds_v4(ob + row * 128 + ((cl ^ (row & 7)) << 4));
      if (first_row + row < lq) {
        uint8_t* dst = out_bytes + (q_start + first_row + row) * row_bytes +
                       static_cast<int64_t>(h) * kDv * 2 + half * 128 + cl * 16;
        *reinterpret_cast<uint4*>(dst) = v;
      }
    }
  }
  wg_sync();  // every chunk read before the next tile's epilogue writes again
  if (lane % 4 == 0) {
    if (row0 < lq) p.lse[(q_start + row0) * p.hq + h] = l0 > 0.f ? (sm.m0 * sl2 + __log2f(l0)) * kLn2 : INFINITY;
    if (row1 < lq) p.lse[(q_start + row1) * p.hq + h] = l1 > 0.f ? (sm.m1 * sl2 + __log2f(l1)) * kLn2 : INFINITY;
  }
}

}  // namespace fwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
