// The forward's main loop, both sides of its pipelines.
// - Producer (one thread): a tile's Q (128 x 192) once and its K (128 x 192) and V (128 x 128)
//   tiles through TMA (128-byte swizzle, the wgmma operand layout) into a two-stage ring with
//   separate K and V barriers, so the next K loads while V is still in use.
// - Consumers (two warpgroups, 64 query rows each): S = Q K^T (wgmma, both operands in shared
//   memory), mask and online softmax in registers, O += P V (wgmma, P from registers). The S GEMM
//   of key tile j + 1 and the PV GEMM of tile j are in flight while the softmax of tile j + 1 runs,
//   and the two warpgroups take turns issuing GEMMs (FwdBarrier::kTurn0 / kTurn1; a tile's first S
//   GEMM too), so one's softmax overlaps the other's GEMMs. A warpgroup whose rows see none of the
//   last 64 keys of the tile's first (highest) key tile, e.g. warpgroup 0 on a top-left causal
//   diagonal, runs that tile's S GEMM over the first 64 keys only (m64n64); a warpgroup whose rows
//   all lie past the sequence's end (a last query tile of at most 64 rows) issues no GEMM and only
//   keeps the turns and barriers in step.
// Two details the SASS needs (checked with nvdisasm; benchmarks/mla/harness/prof_mla_sm90_ab.sh
// measures them): the descriptors derive from warp-uniform values (a shuffle from lane 0), so they
// live in uniform registers and the 20 wgmmas of a key tile issue back to back; and a store of the
// softmax's row sums sits before the wait for the PV GEMM, so ptxas cannot hoist that wait above
// the softmax (it did, which ran the softmax after the GEMM instead of beside it).
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "mask.cuh"
#include "named_barriers.h"
#include "params.h"
#include "ptx.cuh"
#include "shared_storage.h"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "trace.cuh"
#include "wgmma.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace fwd {

// Producer: the loads of tile ti (iteration iter): Q once (once the consumers freed the Q buffer),
// then each of its n_blocks key tiles, the last first (the highest keys see the most rows under a
// causal mask). kv_it / q_it count the K-V stages / Q buffers used so far (the ring positions and
// phases).
// The maps: q's first 128 columns (tq) and last 64 (tqp), likewise k (tk, tkp: one head for every kv
// head where p.k_pe_shared), v.
__device__ __forceinline__ void load_tile(const CUtensorMap& tq, const CUtensorMap& tqp, const CUtensorMap& tk,
                                          const CUtensorMap& tkp, const CUtensorMap& tv, const Params& p,
                                          const Smem& smem, const TileInfo& ti, int& kv_it, int& q_it,
                                          int iter) {
  (void)iter;
  // Where a tile's boxes start: its Q rows, its key tile `it` (the last first), its kv head.
  auto q_row_of = [&](const TileInfo& x) { return static_cast<int>(x.q_start) + x.m_block * kBM; };
  auto k_row_of = [&](const TileInfo& x, int it) {
    return static_cast<int>(x.k_start) + (x.n_blocks - 1 - it) * kBN;
  };
  auto kv_head_of = [&](const TileInfo& x) { return x.h / (p.hq / p.hk); };
  if (ti.n_blocks > 0) {
    mbar_wait(smem.q_empty(), (q_it & 1) ^ 1);
    SM90_TRACE(0, iter, 1, clock64());
    ++q_it;
    const int q_row = q_row_of(ti);
    mbar_expect_tx(smem.q_full(), kQBytes);
#pragma unroll
    for (int c = 0; c < 2; ++c)
      tma_load_3d(smem.q() + c * kBM * 128, &tq, c * 64, ti.h, q_row, smem.q_full());
    tma_load_3d(smem.q() + 2 * kBM * 128, &tqp, 0, ti.h, q_row, smem.q_full());
    const int hk = kv_head_of(ti);
    const int hkp = p.k_pe_shared ? 0 : hk;
    for (int it = 0; it < ti.n_blocks; ++it, ++kv_it) {
      const int s = kv_it % kStages;
      const uint32_t phase = (kv_it / kStages) & 1;
      const int k_row = k_row_of(ti, it);
      mbar_wait(smem.k_empty(s), phase ^ 1);
      mbar_expect_tx(smem.k_full(s), kKBytes);
#pragma unroll
      for (int c = 0; c < 2; ++c)
        tma_load_3d(smem.k(s) + c * kBN * 128, &tk, c * 64, hk, k_row, smem.k_full(s));
      tma_load_3d(smem.k(s) + 2 * kBN * 128, &tkp, 0, hkp, k_row, smem.k_full(s));
      mbar_wait(smem.v_empty(s), phase ^ 1);
      mbar_expect_tx(smem.v_full(s), kVBytes);
#pragma unroll
      for (int c = 0; c < kDv / 64; ++c)
        tma_load_3d(smem.v(s) + c * kBN * 128, &tv, c * 64, hk, k_row, smem.v_full(s));
    }
  }
}

// Consumer: one warpgroup's GEMMs and softmax over a tile's key tiles, into O and the softmax's
// running max and sum.
template <bool kHalf>
struct Mainloop {
  const Params& p;
  Smem smem;
  int wg;                  // 0 or 1: query rows 64 * wg ... of the tile
  int t, warp, lane;       // thread in the warpgroup
  int r0;                  // this thread's rows r0 and r0 + 8 of the tile
  float sl2;               // scale * log2(e)
  uint32_t q_base;         // the warpgroup's 64 rows of Q
  // The warpgroup's registers across tiles, owned by the kernel (arrays held here would not all
  // stay in registers: ptxas then serialises the wgmmas).
  float (&sacc)[64];     // S, then P, of the current key tile
  uint32_t (&pa)[8][4];  // P as the PV GEMM's A fragments
  // The tile's: keys, first query tile row, this thread's rows, causal offset.
  int lk = 0, row0 = 0, row1 = 0, shift = 0, m_block = 0;

  // warp_group: 1 or 2 (warpgroup 0 is the producer).
  __device__ __forceinline__ Mainloop(const Params& params, const Smem& s, int warp_group,
                                      float (&sacc_regs)[64], uint32_t (&pa_regs)[8][4])
      : p(params),
        smem(s),
        wg(warp_group - 1),
        t(threadIdx.x % 128),
        warp(t / 32),
        lane(t % 32),
        r0(wg * 64 + warp * 16 + lane / 4),
        sl2(params.scale_log2),
        q_base(s.q() + wg * 64 * 128),
        sacc(sacc_regs),
        pa(pa_regs) {}

  // S = Q K^T for the key tile of stage s, issued (not waited for): over its 128 keys, or (half_c
  // true) over its first 64 only, into columns 0-63 of sacc (the mask sets the others): for a
  // warpgroup whose rows see none of the last 64 keys of its first key tile (see mma).
  template <class HalfC>
  __device__ __forceinline__ void issue_s(int stage, HalfC half_c) {
    (void)half_c;
    const int s = __shfl_sync(0xffffffffu, stage, 0);  // warp-uniform (see the kernel's warp_group)
    // One descriptor per operand, the k-steps as constant offsets of its address field (in 16 B
    // units; shared addresses stay below 2^18, so the field never carries into the next one).
    const uint64_t dq = smem_desc(q_base, 16, 1024);
    const uint64_t dk = smem_desc(smem.k(s), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
      const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
      const uint64_t da = desc_at(dq, (chunk * kBM * 128 + off) >> 4);
      const uint64_t db = desc_at(dk, (chunk * kBN * 128 + off) >> 4);
      if constexpr (HalfC::value) {
        wgmma_ss_n64<kHalf>(reinterpret_cast<float(&)[32]>(sacc), da, db, kk > 0);
      } else {
        wgmma_ss_n128<kHalf>(sacc, da, db, kk > 0);
      }
    }
    wgmma_commit();
  }
  // O += P V for the value tile of stage s, issued.
  __device__ __forceinline__ void issue_pv(float (&o)[64], int stage) {
    const int s = __shfl_sync(0xffffffffu, stage, 0);
    const uint64_t dv = smem_desc(smem.v(s), kBN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kBN / 16; ++j) wgmma_rs_n128<kHalf>(o, pa[j], desc_at(dv, (j * 16 * 128) >> 4));
    wgmma_commit();
  }
  // Masks sacc (key tile n_block), updates the running max and sum, turns sacc into P (fp32)
  // and gives the factors the accumulated O must be scaled by.
  __device__ __forceinline__ void softmax(OnlineSoftmax& sm, int n_block, float& alpha0, float& alpha1) {
    mask_scores(sacc, p, n_block, lk, m_block, wg, shift, row0, row1, lane);
    sm.step(sacc, sl2, alpha0, alpha1);
  }
  // P (fp32 in sacc) -> the A fragments of the PV GEMM.
  __device__ __forceinline__ void to_pa() {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      pa[j][0] = pack2<kHalf>(sacc[8 * j + 0], sacc[8 * j + 1]);
      pa[j][1] = pack2<kHalf>(sacc[8 * j + 2], sacc[8 * j + 3]);
      pa[j][2] = pack2<kHalf>(sacc[8 * j + 4], sacc[8 * j + 5]);
      pa[j][3] = pack2<kHalf>(sacc[8 * j + 6], sacc[8 * j + 7]);
    }
  }
  // The turns at the tensor cores: wait for this warpgroup's, hand it to the other.
  // (Without turns, as FlashAttention-3 / -4 run head dim 192, the forward measured 0.96-0.98x.)
  __device__ __forceinline__ void turn_sync() const {
    named_barrier_sync<256>(barrier_id(FwdBarrier::kTurn0) + wg);
  }
  __device__ __forceinline__ void turn_arrive() const {
    named_barrier_arrive<256>(barrier_id(FwdBarrier::kTurn1) - wg);
  }

  // Tile ti: O and the softmax state from zero over its key tiles. kv_it / q_it: the K-V stages /
  // Q buffers consumed so far (ring positions and phases).
  __device__ __forceinline__ void mma(const TileInfo& ti, float (&o)[64], OnlineSoftmax& sm, int& kv_it,
                                      int& q_it, int iter) {
    (void)iter;
    const int n_blocks = ti.n_blocks, lq = ti.lq;
    lk = ti.lk;
    m_block = ti.m_block;
    row0 = m_block * kBM + r0;
    row1 = row0 + 8;
    shift = p.causal ? (p.bottom_right ? lk - lq : 0) : 0;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    sm.reset();
    if (n_blocks <= 0) return;

    mbar_wait(smem.q_full(), q_it & 1);
    if (t == 0) SM90_TRACE(1 + wg, iter, 1, clock64());
    ++q_it;
    if (wg == 1) turn_arrive();
    // A warpgroup whose 64 rows all lie past the sequence's end (warpgroup 1 on a last query
    // tile of at most 64 rows) runs no GEMM and no softmax: it only keeps the turns and the
    // stages' barriers in step with the other warpgroup, which then has the tensor cores to
    // itself (forward +0.7% RL-like, +2.4% 64 short sequences, RESULTS.md). Its epilogue
    // writes nothing to global memory (no row inside the sequence).
    if (__shfl_sync(0xffffffffu, m_block * kBM + wg * 64 >= lq ? 1 : 0, 0)) {
      for (int it = 0; it < n_blocks; ++it) {
        const int g = kv_it + it, s = g % kStages, sp = (g + kStages - 1) % kStages;
        mbar_wait(smem.k_full(s), (g / kStages) & 1);
        turn_sync();
        if (it > 0) mbar_wait(smem.v_full(sp), ((g - 1) / kStages) & 1);
        turn_arrive();
        mbar_arrive(smem.k_empty(s));
        if (it == n_blocks - 1) mbar_arrive(smem.q_empty());
        if (it > 0) mbar_arrive(smem.v_empty(sp));
      }
      const int gl = kv_it + n_blocks - 1, sl = gl % kStages;
      mbar_wait(smem.v_full(sl), (gl / kStages) & 1);
      turn_sync();
      if (wg == 0) turn_arrive();
      mbar_arrive(smem.v_empty(sl));
      kv_it += n_blocks;
      return;
    }
    // Key tile 0: S, softmax, P. Then for each next tile the S GEMM of tile it and the PV
    // GEMM of tile it - 1 run on the tensor cores while this warpgroup does the softmax of
    // tile it.
    {
      const int s = kv_it % kStages;
      mbar_wait(smem.k_full(s), (kv_it / kStages) & 1);
      // The first S GEMM of a tile takes its turn too, so warpgroup 0's runs first and its
      // softmax overlaps warpgroup 1's GEMM instead of both softmaxes running while the tensor
      // cores idle (+0.7-2.4% on the forward, RESULTS.md). The turns stay balanced: per tile
      // each warpgroup syncs and arrives once more.
      // The first key tile is the last one (the tiles run from the last down). Where this
      // warpgroup's rows see none of its last 64 keys (warpgroup 0 on the diagonal of a
      // top-left causal mask; a bottom-right one whose offset lk - lq leaves at most 64 keys
      // of the tile to the warpgroup; a sequence's last key tile of at most 64 keys), its S
      // GEMM covers the first 64 keys only: half the S work of that tile (forward +1-3% on
      // causal and short batches, RESULTS.md). The whole turn is in each branch: an issue and
      // its wait in different branches make ptxas serialise every wgmma of the kernel.
      const int lim = p.causal ? min(lk, m_block * kBM + wg * 64 + 64 + shift) : lk;
      if (__shfl_sync(0xffffffffu, lim <= (n_blocks - 1) * kBN + 64 ? 1 : 0, 0)) {
        turn_sync();
        issue_s(s, std::true_type{});
        turn_arrive();
        wgmma_wait<0>();
      } else {
        turn_sync();
        issue_s(s, std::false_type{});
        turn_arrive();
        wgmma_wait<0>();
      }
      fence_acc(sacc);
      if (t == 0) SM90_TRACE(1 + wg, iter, 2, clock64());
      mbar_arrive(smem.k_empty(s));
      if (n_blocks == 1) mbar_arrive(smem.q_empty());
    }
    float a0, a1;
    softmax(sm, n_blocks - 1, a0, a1);
    to_pa();
#if defined(VERL_OPS_SM90_TRACE)
    asm volatile("" ::"r"(pa[0][0]), "r"(pa[7][3]), "f"(sm.l0), "f"(sm.l1) : "memory");
    if (t == 0) SM90_TRACE(1 + wg, iter, 3, clock64());
#endif
    for (int it = 1; it < n_blocks; ++it) {
      const int g = kv_it + it;
      const int s = g % kStages, sp = (g - 1) % kStages;
      mbar_wait(smem.k_full(s), (g / kStages) & 1);
      turn_sync();
      issue_s(s, std::false_type{});
      mbar_wait(smem.v_full(sp), ((g - 1) / kStages) & 1);
      issue_pv(o, sp);
      turn_arrive();
      wgmma_wait<1>();
      fence_acc(sacc);
      mbar_arrive(smem.k_empty(s));
      if (it == n_blocks - 1) mbar_arrive(smem.q_empty());
      softmax(sm, n_blocks - 1 - it, a0, a1);
#ifndef VERL_OPS_SM90_NO_SOFTMAX_FENCE
      // ptxas schedules the wait for the PV GEMM early, before most of the softmax, which then
      // runs after the GEMM instead of beside it. A shared-memory store of the row sums (a
      // scratch word nobody reads) depends on every exponential of the softmax and is not moved
      // past the wait, so the softmax stays ahead of it.
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(smem.scratch()), "f"(sm.l0 + sm.l1) : "memory");
#endif
      wgmma_wait<0>();
      fence_acc(o);
      mbar_arrive(smem.v_empty(sp));
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) OnlineSoftmax::rescale(o, a0, a1);
      to_pa();
    }
    if (t == 0) SM90_TRACE(1 + wg, iter, 4, clock64());
    const int gl = kv_it + n_blocks - 1;
    const int sl = gl % kStages;
    mbar_wait(smem.v_full(sl), (gl / kStages) & 1);
    turn_sync();
    issue_pv(o, sl);
    if (wg == 0) turn_arrive();
    wgmma_wait<0>();
    fence_acc(o);
    mbar_arrive(smem.v_empty(sl));
    if (t == 0) SM90_TRACE(1 + wg, iter, 5, clock64());
    kv_it += n_blocks;
  }
};

}  // namespace fwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
