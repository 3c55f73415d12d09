// The backward's epilogue: dK * scale and dV of the keys inside the sequence (zeros where no query
// sees a key): dK's first 128 columns, its last 64 and dV, each to its own strided rows (Params).
//
// Through shared memory, as the forward's epilogue (+0-6% on the backward, most on short
// sequences; RESULTS.md), so that whole rows (384 bytes of dK, 256 of dV) are stored in 16-byte
// chunks instead of 4-byte words scattered over 8 rows per warp store. The Q / dO stages (80 KiB)
// hold both warpgroups' dK and dV once both are past their last GEMM that reads them (K and the dS
// buffers stay untouched: the other warpgroup's last dQ GEMM may still read them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "named_barriers.h"
#include "tile_scheduler.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace bwd {

// One consumer warpgroup (wg): this thread holds the dK / dV fragments of key rows kr and kr + 8 of
// the warpgroup's 64 (kw0: its first key in the sequence; t = 32 warp + lane).
template <bool kHalf>
__device__ __forceinline__ void store_dk_dv(const Params& p, const Smem& smem, const Tile& w, float (&dk)[96],
                                            float (&dv)[64], int wg, int t, int lane, int kr, int kw0) {
  const int lk = w.lk, k_start = w.k_start, kvh = w.kvh;
  const float scale = p.scale;
  // Through shared memory, as the forward's epilogue (+0-6% on the backward, most on short
  // sequences; RESULTS.md), so that whole rows (384 bytes of dK, 256 of dV) are stored in 16-byte chunks instead
  // of 4-byte words scattered over 8 rows per warp store. The Q / dO stages (80 KiB) hold both
  // warpgroups' dK and dV once both are past their last GEMM that reads them (K and the dS
  // buffers stay untouched: the other warpgroup's last dQ GEMM may still read them).
  {
    named_barrier_sync<256>(barrier_id(BwdBarrier::kConsumers));
    constexpr int kDkRow = kDqk * 2, kDvRow = kDv * 2;  // bytes per staged row
    static_assert(2 * 64 * (kDkRow + kDvRow) <= offsetof(SharedStorage, ds) - offsetof(SharedStorage, q),
                  "dK / dV staging over the Q / dO stages");
    const uint32_t sk = smem.q(0) + wg * 64 * (kDkRow + kDvRow);
    const uint32_t sv = sk + 64 * kDkRow;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = kr + 8 * r;
#pragma unroll
      for (int cc = 0; cc < kDqk / 8; ++cc)
        sts_b32(sk + row * kDkRow + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4),
                pack2<kHalf>(dk[4 * cc + 2 * r] * scale, dk[4 * cc + 2 * r + 1] * scale));
#pragma unroll
      for (int cc = 0; cc < kDv / 8; ++cc)
        sts_b32(sv + row * kDvRow + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4),
                pack2<kHalf>(dv[4 * cc + 2 * r], dv[4 * cc + 2 * r + 1]));
    }
    named_barrier_sync<128>(barrier_id(BwdBarrier::kEpilogue0) + wg);
    // The warpgroup's 64 staged rows of kChunks 16-byte chunks at stage, to the key rows of the
    // destination at_of(key row, chunk) returns.
    auto store_rows = [&](auto chunks, uint32_t stage, auto at_of) {
      constexpr int kChunks = decltype(chunks)::value, kRowBytes = kChunks * 16;
#pragma unroll
      for (int i = 0; i < 64 * kChunks / 128; ++i) {
        const int id = i * 128 + t, row = id / kChunks, ch = id % kChunks;
        const uint4 v = lds_v4(stage + row * kRowBytes + ((ch ^ (row & 7)) << 4));
        if (kw0 + row < lk) *reinterpret_cast<uint4*>(at_of(static_cast<int64_t>(k_start + kw0 + row), ch)) = v;
      }
    };
    // 12 chunks of dK per thread: the first 16 of a row to dk, the last 8 to dk_pe.
    store_rows(std::integral_constant<int, kDkRow / 16>{}, sk, [&](int64_t key, int ch) {
      return ch < 16 ? static_cast<uint8_t*>(p.dk) + key * p.dk_rs + kvh * p.dk_hs + ch * 16
                     : static_cast<uint8_t*>(p.dk_pe) + key * p.dkp_rs + kvh * p.dkp_hs + (ch - 16) * 16;
    });
    store_rows(std::integral_constant<int, kDvRow / 16>{}, sv, [&](int64_t key, int ch) {  // 8 of dV
      return static_cast<uint8_t*>(p.dv) + key * p.dv_rs + kvh * p.dv_hs + ch * 16;
    });
  }
}

}  // namespace bwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
