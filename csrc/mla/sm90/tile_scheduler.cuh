// Which tiles run where, in which order. Both kernels run the sequences longest first:
// schedule_kernel ranks them on the device (no host read of the lengths) and counts their tiles.
// - Forward: persistent, one CTA per SM. A CTA's first tile is its index, the next ones come from
//   an atomic counter (dynamic: ragged tiles balance across SMs). The producer thread decodes each
//   tile and hands it whole to the consumer warpgroups through a two-slot ring in shared memory,
//   so they start on it without the decode's dependent global loads.
// - Backward: one CTA per (sequence, kv head, block of 128 keys), decoded from blockIdx.x.
#pragma once

#include <cstdint>

#include "params.h"
#include "ptx.cuh"
#include "shared_storage.h"

namespace verl_ops {
namespace cuda {
namespace {

// Sequence b's first row and its length, clamped to [0, rows] (offsets are trusted as the op's
// contract states them; the clamps keep a bad offset from reaching past the tensors).
__device__ __forceinline__ int64_t clamp_start(const int32_t* cu, int b, int64_t rows) {
  const int64_t s = cu[b];
  return s < 0 ? 0 : (s > rows ? rows : s);
}
__device__ __forceinline__ int clamp_len(const int32_t* cu, int b, int64_t rows) {
  const int64_t s = clamp_start(cu, b, rows);
  const int64_t e = cu[b + 1];
  return e <= s ? 0 : static_cast<int>((e > rows ? rows : e) - s);
}

// The rank (in the schedule's order) of the sequence that tile `tile` belongs to: the last rank
// whose first tile is at most `tile` (binary search over p.tile_prefix, of either kernel's Params).
template <class Params>
__device__ __forceinline__ int rank_of_tile(const Params& p, int tile) {
  int hi = p.batch - 1, lo = 0;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_prefix[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The tile schedule, one block of kScheduleThreads: order[rank] = b ranks the sequences by their
// length in cu (query rows for the forward, keys for the backward), longest first (ties: lower index first; past kScheduleThreads sequences the input
// order, as the ranking is one thread per sequence against all others), tile_prefix[rank] is the
// first tile of that sequence and tile_prefix[batch] the total; the counter is zeroed.
constexpr int kScheduleThreads = 1024;

// A tile is kRows rows of one sequence and one of `heads` heads.
template <int kRows>
__global__ void __launch_bounds__(kScheduleThreads)
    schedule_kernel(const int32_t* __restrict__ cu, int64_t rows, int batch, int heads,
                    int32_t* __restrict__ order, int32_t* __restrict__ tile_prefix,
                    int32_t* __restrict__ counter) {
  __shared__ int by_rank[kScheduleThreads];
  __shared__ int scan[kScheduleThreads];
  const int tid = threadIdx.x;
  const bool ranked = batch <= kScheduleThreads;
  auto tiles = [&](int b) { return (clamp_len(cu, b, rows) + kRows - 1) / kRows * heads; };
  int local = 0;  // tiles of the ranks this thread owns
  const int per = ranked ? 1 : (batch + kScheduleThreads - 1) / kScheduleThreads;
  const int first = tid * per, last = min(batch, first + per);
  if (ranked) {
    if (tid < batch) {
      const int lb = clamp_len(cu, tid, rows);
      int rank = 0;
      for (int c = 0; c < batch; ++c) {
        const int lc = clamp_len(cu, c, rows);
        rank += (lc > lb) || (lc == lb && c < tid);
      }
      order[rank] = tid;
      by_rank[rank] = tiles(tid);
    }
    __syncthreads();
    local = tid < batch ? by_rank[tid] : 0;
  } else {
    for (int b = first; b < last; ++b) {
      order[b] = b;
      local += tiles(b);
    }
  }
  scan[tid] = local;
  __syncthreads();
  for (int off = 1; off < kScheduleThreads; off <<= 1) {
    const int add = tid >= off ? scan[tid - off] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  int running = scan[tid] - local;
  if (ranked) {
    if (tid < batch) tile_prefix[tid] = running;
  } else {
    for (int b = first; b < last; ++b) {
      tile_prefix[b] = running;
      running += tiles(b);
    }
  }
  if (tid == kScheduleThreads - 1) tile_prefix[batch] = scan[tid];
  if (tid == 0) *counter = 0;
}

namespace fwd {

// Key tiles a query tile needs: every tile holding a key some row of it sees.
__device__ __forceinline__ int key_tiles(const Params& p, int lq, int lk, int m_block) {
  int end = lk;
  if (p.causal) {
    const int lim = (m_block + 1) * kBM + (p.bottom_right ? lk - lq : 0);
    end = min(end, max(lim, 0));
  }
  return (end + kBN - 1) / kBN;
}

struct TileInfo {
  int64_t q_start, k_start;
  int lq, lk, h, m_block, n_blocks;
};

// Tile -> (sequence, head, query tile): sequences longest first; in a sequence head by head,
// the query tiles from the last (most keys under a causal mask) down, so the tiles that run at
// the same time share their K / V in L2.
__device__ __forceinline__ TileInfo decode_tile(const Params& p, int tile) {
  const int rank = rank_of_tile(p, tile);
  const int b = p.order[rank];
  const int local = tile - p.tile_prefix[rank];
  TileInfo ti;
  ti.lq = clamp_len(p.cu_q, b, p.tq);
  ti.q_start = clamp_start(p.cu_q, b, p.tq);
  ti.lk = clamp_len(p.cu_kv, b, p.tk);
  ti.k_start = clamp_start(p.cu_kv, b, p.tk);
  const int mb = (ti.lq + kBM - 1) / kBM;
  ti.h = local / mb;
  ti.m_block = mb - 1 - local % mb;
  ti.n_blocks = key_tiles(p, ti.lq, ti.lk, ti.m_block);
  return ti;
}

// The persistent schedule and the producer -> consumers tile ring (slot iter & 1 of iteration
// iter; the slot's mbarriers: tile_full, arrived on by the producer thread, and tile_empty, by the
// 256 consumer threads).
struct TileScheduler {
  const Params& p;
  Smem smem;
  volatile int* slots;  // SharedStorage::tile_slots

  // Producer: the tile after the first one (blockIdx.x).
  __device__ __forceinline__ int next_tile() const {
    return static_cast<int>(gridDim.x) + atomicAdd(p.counter, 1);
  }
  // Producer: hands `tile` (ti its decode), or the end (tile >= total: the slot says -1), over.
  __device__ __forceinline__ void publish(int iter, int tile, int total, const TileInfo& ti) const {
    const int slot = iter & 1;
    mbar_wait(smem.tile_empty(slot), ((iter >> 1) & 1) ^ 1);
    {
      volatile int* sl = slots + slot * kSlotInts;
      sl[0] = tile < total ? tile : -1;
      sl[1] = static_cast<int>(ti.q_start);
      sl[2] = static_cast<int>(ti.k_start);
      sl[3] = ti.lq;
      sl[4] = ti.lk;
      sl[5] = ti.h;
      sl[6] = ti.m_block;
      sl[7] = ti.n_blocks;
    }
    mbar_arrive(smem.tile_full(slot));
  }
  // Consumer: the tile of iteration iter (-1: no more) and its decode.
  __device__ __forceinline__ int receive(int iter, TileInfo& ti) const {
    const int slot = iter & 1;
    mbar_wait(smem.tile_full(slot), (iter >> 1) & 1);
    int tile;
    {
      volatile const int* sl = slots + slot * kSlotInts;
      tile = sl[0];
      ti.q_start = sl[1];
      ti.k_start = sl[2];
      ti.lq = sl[3];
      ti.lk = sl[4];
      ti.h = sl[5];
      ti.m_block = sl[6];
      ti.n_blocks = sl[7];
    }
    mbar_arrive(smem.tile_empty(slot));
    return tile;
  }
};

}  // namespace fwd

namespace bwd {

// A CTA's work: one block of kBN keys of one sequence and kv head, against every query block (of
// every q head of the group) that sees one of its keys.
struct Tile {
  int lq, lk;
  int q_start, k_start;  // row indices fit in 32 bits (the caller routes only tq, tk < 2^31 here)
  int kvh;               // kv head
  int key0;              // the block's first key (in the sequence)
  int shift;             // causal: row i sees key j <= i + shift
  int m_begin, nblk;     // the query blocks that see a key of this block: m_begin ... + nblk
  int group;             // q heads per kv head
  int blocks;            // (q head, query block) pairs: group * nblk
};

__device__ __forceinline__ Tile decode_tile(const Params& p, int tile) {
  const int rank = rank_of_tile(p, tile);
  const int b = p.order[rank];
  const int local = tile - p.tile_prefix[rank];
  Tile w;
  w.lq = clamp_len(p.cu_q, b, p.tq);
  w.lk = clamp_len(p.cu_kv, b, p.tk);
  w.q_start = static_cast<int>(clamp_start(p.cu_q, b, p.tq));
  w.k_start = static_cast<int>(clamp_start(p.cu_kv, b, p.tk));
  const int nkb = (w.lk + kBN - 1) / kBN;
  w.kvh = local / nkb;
  w.key0 = (local % nkb) * kBN;
  w.shift = p.causal ? (p.bottom_right ? w.lk - w.lq : 0) : 0;
  // Under a causal mask row i sees key j <= i + shift.
  w.m_begin = p.causal ? max(0, w.key0 - w.shift) / kBM : 0;
  const int m_end = (w.lq + kBM - 1) / kBM;
  w.nblk = max(0, m_end - w.m_begin);
  w.group = p.hq / p.hk;
  w.blocks = w.group * w.nblk;
  return w;
}

}  // namespace bwd

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
