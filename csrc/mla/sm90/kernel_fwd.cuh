// The forward kernel: persistent and warp-specialised, one CTA per SM (384 threads, ~225 KiB of
// shared memory). This file only sets up the shared memory and barriers and assigns the roles:
// - warpgroup 0, the producer: one thread takes tiles (tile_scheduler.cuh), hands each to the
//   consumers and loads its Q / K / V (mainloop_fwd.cuh, load_tile); the warpgroup gives most of
//   its registers to the consumers;
// - warpgroups 1 and 2, the consumers, 64 query rows each: the GEMMs and softmax of a tile
//   (mainloop_fwd.cuh, Mainloop::mma), then its epilogue (epilogue_fwd.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "epilogue_fwd.cuh"
#include "mainloop_fwd.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace fwd {

template <bool kHalf>
__global__ void __launch_bounds__(kThreads, 1)
    mla_sm90_fwd_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tqp,
                        const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tkp,
                        const __grid_constant__ CUtensorMap tv, const Params p) {
#if defined(VERL_OPS_SM90A)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem_ptr = aligned_smem(smem_raw);
  const Smem smem{smem_u32(smem_ptr)};
  const TileScheduler scheduler{p, smem,
                                reinterpret_cast<volatile int*>(smem_ptr + offsetof(SharedStorage, tile_slots))};

  // Warp-uniform values read through a shuffle from lane 0: ptxas then keeps what derives from
  // them (the wgmma descriptors) in uniform registers, and the GEMMs issue back to back.
  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    mbar_init(smem.q_full(), 1);
    mbar_init(smem.q_empty(), 256);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem.k_full(s), 1);
      mbar_init(smem.v_full(s), 1);
      mbar_init(smem.k_empty(s), 256);
      mbar_init(smem.v_empty(s), 256);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(smem.tile_full(s), 1);
      mbar_init(smem.tile_empty(s), 256);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // Producer: its first tile from the grid, the next ones from the scheduler's counter.
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      const int total = p.tile_prefix[p.batch];
      int tile = blockIdx.x, kv_it = 0, q_it = 0;
      for (int iter = 0;; ++iter) {
        // The tile decoded here, once, and handed over whole.
        TileInfo ti{};
        if (tile < total) ti = decode_tile(p, tile);
        scheduler.publish(iter, tile, total, ti);
        if (tile >= total) break;
        SM90_TRACE(0, iter, 0, clock64());
        load_tile(tq, tqp, tk, tkp, tv, p, smem, ti, kv_it, q_it, iter);
        SM90_TRACE(0, iter, 2, clock64());
        SM90_TRACE(0, iter, 7, ti.n_blocks);
        tile = scheduler.next_tile();
      }
    }
    return;
  }

  // Consumers.
  setmaxnreg_inc<232>();
  // The state a consumer thread carries from tile to tile. Declared in this order and passed by
  // reference (not held in the Mainloop), so that the consumers compile to the same SASS as in
  // the single-function kernel this was split from (csrc/mla/sm90/check_sass.sh).
  float o[64];
  float sacc[64];
  uint32_t pa[8][4];
  OnlineSoftmax softmax;
  Mainloop<kHalf> mainloop(p, smem, warp_group, sacc, pa);
  const int wg = mainloop.wg, t = mainloop.t;
  int q_it = 0, kv_it = 0;
  for (int iter = 0;; ++iter) {
    TileInfo ti;
    const int tile = scheduler.receive(iter, ti);
    if (tile < 0) break;
    if (t == 0) SM90_TRACE(1 + wg, iter, 0, clock64());
    mainloop.mma(ti, o, softmax, kv_it, q_it, iter);
    store_o_lse<kHalf>(p, smem, ti, o, softmax, wg, t, mainloop.warp, mainloop.lane, mainloop.row0,
                       mainloop.row1, mainloop.sl2);
    if (t == 0) SM90_TRACE(1 + wg, iter, 6, clock64());
    if (t == 0) SM90_TRACE(1 + wg, iter, 7, ti.n_blocks);
  }
#endif
}

}  // namespace fwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
