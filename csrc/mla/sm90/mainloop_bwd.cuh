// The backward's main loop, both sides of its pipelines, for one CTA: a block of 128 keys of one
// sequence and kv head (tile_scheduler.cuh, bwd::Tile).
// - Producer (warp 0 of warpgroup 0): the block's K (128 x 192) and V (128 x 128) once, then, for
//   each q head of the group and each 64-row query block that sees one of these keys, its Q
//   (64 x 192) and dO (64 x 128) through TMA (128-byte swizzle) and its rows' lse2 / D into a
//   two-stage ring.
// - Consumers (two warpgroups, 64 keys each) hold dK (64 x 192) and dV (64 x 128) in fp32 registers
//   over all query blocks (160 of their 240 registers, so S^T and dP^T are never live together):
//     S^T = K Q^T                       (wgmma, both operands in shared memory)
//     P^T = exp2(S^T * scale * log2(e) - lse2), masked, into bf16 / fp16 A fragments
//     dV += P^T dO and dP^T = V dO^T    (issued together)
//     dS^T = P^T * (dP^T - D);  dK += dS^T Q  (A fragments from registers)
//     dS^T to shared memory; a block later, once both warpgroups' halves are there (mbarriers,
//     two buffers), dQ (64 rows) += dS K over the 128 keys, warpgroup w taking the 64 columns
//     64 w ... and 32 of the last 64, added to the fp32 accumulator with 16-byte vector
//     reductions (the two lanes of a pair swap a column pair first, so each holds four
//     consecutive columns: half the reductions of 8-byte ones, and 1.08-1.14x the backward).
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "mask.cuh"
#include "params.h"
#include "ptx.cuh"
#include "shared_storage.h"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "wgmma.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace bwd {

// Producer (warp 0 of warpgroup 0; nothing to do when the block sees no query): lane 0 issues the
// TMA loads, every lane writes two rows of lse2 / D per query block.
// The maps: q's first 128 columns (tq) and last 64 (tqp), likewise k (tk, tkp: one head for every kv
// head where p.k_pe_shared), v, dO.
__device__ __forceinline__ void load(const CUtensorMap& tq, const CUtensorMap& tqp, const CUtensorMap& tk,
                                     const CUtensorMap& tkp, const CUtensorMap& tv, const CUtensorMap& tdo,
                                     const Params& p, const Smem& smem, const Tile& w) {
  const int lq = w.lq, q_start = w.q_start, k_start = w.k_start, kvh = w.kvh, key0 = w.key0;
  const int m_begin = w.m_begin, nblk = w.nblk, group = w.group, blocks = w.blocks;
  if (threadIdx.x < 32 && blocks > 0) {
    const int lane = threadIdx.x;
    const int k_row = k_start + key0;
    if (lane == 0) {
      mbar_expect_tx(smem.kv_full(), kKBytes + kVBytes);
#pragma unroll
      for (int c = 0; c < 2; ++c)
        tma_load_3d(smem.k() + c * kBN * 128, &tk, c * 64, kvh, k_row, smem.kv_full());
      tma_load_3d(smem.k() + 2 * kBN * 128, &tkp, 0, p.k_pe_shared ? 0 : kvh, k_row, smem.kv_full());
#pragma unroll
      for (int c = 0; c < kDv / 64; ++c)
        tma_load_3d(smem.v() + c * kBN * 128, &tv, c * 64, kvh, k_row, smem.kv_full());
    }
    for (int i = 0; i < blocks; ++i) {
      const int s = i % kStages;
      const uint32_t phase = (i / kStages) & 1;
      const int h = kvh * group + i / nblk;
      const int q0 = (m_begin + i % nblk) * kBM;
      const int q_row = q_start + q0;
      mbar_wait(smem.empty(s), phase ^ 1);
      if (lane == 0) {
        mbar_expect_tx(smem.full(s), kQBytes + kOBytes);
#pragma unroll
        for (int c = 0; c < 2; ++c)
          tma_load_3d(smem.q(s) + c * kBM * 128, &tq, c * 64, h, q_row, smem.full(s));
        tma_load_3d(smem.q(s) + 2 * kBM * 128, &tqp, 0, h, q_row, smem.full(s));
#pragma unroll
        for (int c = 0; c < kDv / 64; ++c)
          tma_load_3d(smem.dout(s) + c * kBM * 128, &tdo, c * 64, h, q_row,
                      smem.full(s));
      }
      const uint32_t ld = smem.lse_d(s);
#pragma unroll
      for (int r = 0; r < kBM / 32; ++r) {
        const int qi = q0 + lane + 32 * r;
        sts_f2(ld + (lane + 32 * r) * 8, qi < lq ? p.lse_d[static_cast<int64_t>(h) * p.tq + (q_start + qi)]
                                                 : make_float2(INFINITY, 0.f));
      }
      mbar_arrive(smem.full(s));
    }
  }
}

// Consumer: one warpgroup's dV and dK over every query block of the CTA, and its share of each
// block's dQ.
template <bool kHalf>
struct Mainloop {
  const Params& p;
  Smem smem;
  const Tile& w;
  int wg;                // keys 64 * wg ... of the block
  int t, warp, lane;     // thread in the warpgroup
  int kr;                // this thread's key rows kr and kr + 8 of the warpgroup
  int kw0;               // the warpgroup's first key (in the sequence)
  int key_a, key_b;      // this thread's keys
  float sl2;             // scale * log2(e)
  // dQ = dS K over all 128 keys, split by columns: warpgroup w takes the 64-column chunk w and
  // the 32 columns 128 + 32 w ... of chunk 2 (K as B, MN-major; set by mma).
  uint64_t dk_b0, dk_b1;
  int col_a, col_b;  // first dQ column of qa, of qb

  // warp_group: 1 or 2 (warpgroup 0 is the producer).
  __device__ __forceinline__ Mainloop(const Params& params, const Smem& s, const Tile& tile, int warp_group)
      : p(params),
        smem(s),
        w(tile),
        wg(warp_group - 1),
        t(threadIdx.x % 128),
        warp(t / 32),
        lane(t % 32),
        kr(warp * 16 + lane / 4),
        kw0(tile.key0 + wg * 64),
        key_a(kw0 + kr),
        key_b(key_a + 8),
        sl2(params.scale_log2) {}

  // dQ (64 rows) += dS K for block j over the 128 keys, in this warpgroup's 96 columns: once
  // both warpgroups' dS^T of block j are in buffer j & 1 (it runs a block behind, so the two
  // warpgroups need not move in step).
  // (h, q0: block j's query head and first query row, carried over from the main loop's
  // counters.)
  __device__ __forceinline__ void dq_step(int j, int h, int q0) {
    const int b = __shfl_sync(0xffffffffu, j & 1, 0);
    float qa[32], qb[16];
    const uint64_t ds_a = smem_desc(smem.ds(b), 16, 1024);  // dS^T as A (MN-major)
    mbar_wait(smem.ds_full(b), (j / 2) & 1);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBN / 16; ++k)
      wgmma_ss_n64<kHalf, 1>(qa, desc_at(ds_a, (k * 2048) >> 4), desc_at(dk_b0, (k * 2048) >> 4), k > 0);
#pragma unroll
    for (int k = 0; k < kBN / 16; ++k)
      wgmma_ss_n32_tt<kHalf>(qb, desc_at(ds_a, (k * 2048) >> 4), desc_at(dk_b1, (k * 2048) >> 4), k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(qa);
    fence_acc(qb);
    mbar_arrive(smem.ds_empty(b));
    const int qrow = w.q_start + q0 + kr;  // accumulator rows kr, kr + 8: queries
    // Lanes 2u and 2u + 1 of a quad swap one column pair per two 8-column chunks, so each holds
    // four consecutive columns: one 16-byte reduction where there were two 8-byte ones.
    const bool odd = lane & 1;
    const int q4 = 2 * (lane % 4) - (odd ? 2 : 0);  // first column of the four, in the chunk
    // One chunk pair: c0 = 2 cp, c1 = c0 + 1 of the accumulator x (32 or 16 floats), added at
    // dst + 16 cp (dst: this lane's first column of the row's chunk pairs).
    auto pair4 = [&](const float* x, int cp, int r, bool ok, float* dst) {
      const int c0 = 2 * cp, c1 = c0 + 1;
      const float sx = odd ? x[4 * c0 + 2 * r] : x[4 * c1 + 2 * r];
      const float sy = odd ? x[4 * c0 + 2 * r + 1] : x[4 * c1 + 2 * r + 1];
      const float rx = __shfl_xor_sync(0xffffffffu, sx, 1), ry = __shfl_xor_sync(0xffffffffu, sy, 1);
      const float4 v = odd ? make_float4(rx, ry, x[4 * c1 + 2 * r], x[4 * c1 + 2 * r + 1])
                           : make_float4(x[4 * c0 + 2 * r], x[4 * c0 + 2 * r + 1], rx, ry);
      if (ok) red_add4(dst + cp * 16, v);
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool ok = q0 + kr + 8 * r < w.lq;
      float* dst = p.dq_accum + (static_cast<int64_t>(qrow + 8 * r) * p.hq + h) * kDqk + q4 + (odd ? 8 : 0);
#pragma unroll
      for (int cp = 0; cp < 4; ++cp) pair4(qa, cp, r, ok, dst + col_a);
#pragma unroll
      for (int cp = 0; cp < 2; ++cp) pair4(qb, cp, r, ok, dst + col_b);
    }
  }

  // P^T of one query block (S^T of this warpgroup's keys; ld: the block's lse2 / D rows; q0: its
  // first query row), straight into the A fragments of dV += P^T dO: column c of the accumulator
  // is query q0 + c, row kr (kr + 8) key key_a (key_b). kMasked false: every key seen by every row.
  // Three instantiations (unmasked, masked causal, masked non-causal): one loop with the mask
  // under a branch per column pair was cut into eight basic blocks (no interleaving of the column
  // pairs' exp2s), 1-3% slower; the masked copy split by p.causal too (ptxas tested it per column
  // pair) +1-5% more (RESULTS.md).
  template <bool kMasked, bool kCausal>
  __device__ __forceinline__ void p_fragments(const float (&sacc)[32], uint32_t ld, int q0,
                                              uint32_t (&pfrag)[4][4]) const {
    const int lq = w.lq, lk = w.lk, shift = w.shift;
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) {
      float pv[4];
      // Both columns' lse2 (and D) in one 16-byte load (half the shared-memory loads of
      // two 4-byte ones each: +2-5% on the backward, RESULTS.md).
      const uint4 ldv = lds_v4(ld + (cc * 8 + 2 * (lane % 4)) * 8);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = cc * 8 + 2 * (lane % 4) + e;
        const float l2 = __uint_as_float(e ? ldv.z : ldv.x);
        float pa = prob_from_lse(sacc[4 * cc + e], sl2, l2);
        float pb = prob_from_lse(sacc[4 * cc + 2 + e], sl2, l2);
        if constexpr (kMasked) {
          const int qi = q0 + c;
          const int lim = key_limit<kCausal>(qi, lk, shift);
          if (qi >= lq || key_a >= lim) pa = 0.f;
          if (qi >= lq || key_b >= lim) pb = 0.f;
        }
        pv[e] = pa;
        pv[2 + e] = pb;
      }
      pfrag[cc / 2][(cc % 2) * 2 + 0] = pack2<kHalf>(pv[0], pv[1]);
      pfrag[cc / 2][(cc % 2) * 2 + 1] = pack2<kHalf>(pv[2], pv[3]);
    }
  }

  __device__ __forceinline__ void mma(float (&dv)[64], float (&dk)[96]) {
    const int lq = w.lq, lk = w.lk, kvh = w.kvh, shift = w.shift;
    const int m_begin = w.m_begin, nblk = w.nblk, group = w.group, blocks = w.blocks;
    mbar_wait(smem.kv_full(), 0);
    const uint32_t k_base = smem.k() + wg * 64 * 128;
    const uint32_t v_base = smem.v() + wg * 64 * 128;
    const uint64_t dk_a = smem_desc(k_base, 16, 1024);   // K as A (K-major)
    const uint64_t dv_a = smem_desc(v_base, 16, 1024);   // V as A (K-major)
    dk_b0 = smem_desc(smem.k() + wg * kBN * 128, 16, 1024);
    dk_b1 = smem_desc(smem.k() + 2 * kBN * 128 + wg * 64, 16, 1024);
    col_a = wg * 64;
    col_b = 128 + wg * 32;

    // Block i's query block (i % nblk) and head (kvh * group + i / nblk) as counters: a division
    // per block (~30 instructions, with the dQ step's) sat between one block's last GEMM and the
    // next one's first.
    int mi = 0, hcur = kvh * group, prev_h = 0, prev_q0 = 0;
    for (int i = 0; i < blocks; ++i) {
      const int s = __shfl_sync(0xffffffffu, i % kStages, 0);
      const uint32_t phase = (i / kStages) & 1;
      const int q0 = (m_begin + mi) * kBM;  // the block's first query row (in the sequence)
      const int db = __shfl_sync(0xffffffffu, i & 1, 0);  // dS buffer
      const uint32_t ds_base = smem.ds(db);
      // Whether some key of this warpgroup is seen by some row of the block, and whether every
      // one is seen by every row (no mask).
      const bool active = kw0 < lk && (!p.causal || kw0 <= q0 + kBM - 1 + shift);
      const bool full = q0 + kBM <= lq && kw0 + 64 <= lk && (!p.causal || kw0 + 63 <= q0 + shift);
      mbar_wait(smem.full(s), phase);
      const uint32_t ld = smem.lse_d(s);  // lse2 / D of the block's rows
      uint32_t dsfrag[4][4];
      if (active) {
        const uint32_t q_base = smem.q(s);
        const uint32_t do_base = smem.dout(s);
        float sacc[32], dpacc[32];
        // S^T = K Q^T (12 k-steps over 192), issued.
        const uint64_t dq_b = smem_desc(q_base, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kDqk / 16; ++kk) {
          const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
          wgmma_ss_n64<kHalf>(sacc, desc_at(dk_a, (chunk * kBN * 128 + off) >> 4),
                              desc_at(dq_b, (chunk * kBM * 128 + off) >> 4), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(sacc);
        // P^T, straight into the A fragments of dV += P^T dO (registers: dK and dV hold 160 of
        // them, so S^T and dP^T are not live at once).
        uint32_t pfrag[4][4];
        if (full)
          p_fragments<false, false>(sacc, ld, q0, pfrag);
        else if (p.causal)
          p_fragments<true, true>(sacc, ld, q0, pfrag);
        else
          p_fragments<true, false>(sacc, ld, q0, pfrag);
        // dV += P^T dO (B MN-major: 64-column chunks kBM * 128 bytes apart, a k-step of 16
        // query rows 2 KiB on) and dP^T = V dO^T (8 k-steps over 128), issued.
        {
          const uint64_t ddo_t = smem_desc(do_base, kBM * 128, 1024);
          const uint64_t ddo_b = smem_desc(do_base, 16, 1024);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_rs_n128<kHalf>(dv, pfrag[j], desc_at(ddo_t, (j * 2048) >> 4));
#pragma unroll
          for (int kk = 0; kk < kDv / 16; ++kk) {
            const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
            wgmma_ss_n64<kHalf>(dpacc, desc_at(dv_a, (chunk * kBN * 128 + off) >> 4),
                                desc_at(ddo_b, (chunk * kBM * 128 + off) >> 4), kk > 0);
          }
          wgmma_commit();
        }
        wgmma_wait<0>();
        fence_acc(dpacc);
        fence_acc(dv);
        // dS^T = P^T (dP^T - D), from the P^T fragments, straight into the A fragments of dK.
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) {
          const uint4 ldv = lds_v4(ld + (cc * 8 + 2 * (lane % 4)) * 8);
          const float d0 = __uint_as_float(ldv.y), d1 = __uint_as_float(ldv.w);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float2 pr = unpack2<kHalf>(pfrag[cc / 2][(cc % 2) * 2 + r]);
            dsfrag[cc / 2][(cc % 2) * 2 + r] =
                pack2<kHalf>(pr.x * (dpacc[4 * cc + 2 * r] - d0), pr.y * (dpacc[4 * cc + 2 * r + 1] - d1));
          }
        }
        // dK += dS^T Q (B MN-major), issued.
        {
          const uint64_t dq_t = smem_desc(q_base, kBM * 128, 1024);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_rs_n192<kHalf>(dk, dsfrag[j], desc_at(dq_t, (j * 2048) >> 4));
          wgmma_commit();
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int u = 0; u < 4; ++u) dsfrag[j][u] = 0u;
      }
      // dS^T (zeros where this warpgroup's keys are unseen) to shared memory, rows 64 wg ... of
      // [128 keys][64 queries] with the 128-byte swizzle: the A operand (MN-major) of dQ = dS K.
      // Two buffers, each free again once both warpgroups' dQ GEMMs of block i - 2 are done.
      mbar_wait(smem.ds_empty(db), ((i / 2) & 1) ^ 1);
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = wg * 64 + kr + 8 * r;
          const uint32_t addr = ds_base + row * 128 + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4);
          sts_b32_unordered(addr, dsfrag[cc / 2][(cc % 2) * 2 + r]);
        }
      }
      fence_proxy_async_smem();
      mbar_arrive(smem.ds_full(db));
      // The dK GEMM done (its A fragments then free their registers): the stage's Q / dO / lse2 / D
      // are no longer read. Then the dQ of the block before.
      wgmma_wait<0>();
      fence_acc(dk);
      mbar_arrive(smem.empty(s));
      if (i > 0) dq_step(i - 1, prev_h, prev_q0);
      prev_h = hcur;
      prev_q0 = q0;
      if (++mi == nblk) {
        mi = 0;
        ++hcur;
      }
    }
    if (blocks > 0) dq_step(blocks - 1, prev_h, prev_q0);
  }
};

}  // namespace bwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
