// The backward's main kernel: a CTA per (sequence, kv head, block of 128 keys), 384 threads. This
// file only sets up the shared memory and barriers and assigns the roles:
// - warpgroup 0, the producer: warp 0 loads K / V once and the query blocks' Q / dO / lse2-D
//   (mainloop_bwd.cuh, load); the warpgroup gives most of its registers to the consumers;
// - warpgroups 1 and 2, the consumers, 64 keys each: dV, dK and their share of dQ over every
//   query block (mainloop_bwd.cuh, Mainloop::mma), then dK / dV to global memory
//   (epilogue_bwd.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "epilogue_bwd.cuh"
#include "mainloop_bwd.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace bwd {

template <bool kHalf>
__global__ void __launch_bounds__(kThreads, 1)
    mla_sm90_bwd_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tqp,
                        const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tkp,
                        const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                        const Params p) {
#if defined(VERL_OPS_SM90A)
  // The grid is sized for the most tiles the batch can have; the ones past the schedule's total
  // return at once.
  const int total = p.tile_prefix[p.batch];
  const int tile = blockIdx.x;
  if (tile >= total) return;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem smem{smem_u32(aligned_smem(smem_raw))};
  const Tile w = decode_tile(p, tile);

  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    mbar_init(smem.kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem.full(s), 1 + 32);  // the TMA bytes, and each producer lane's lse2 / D rows
      mbar_init(smem.empty(s), 256);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(smem.ds_full(b), 256);
      mbar_init(smem.ds_empty(b), 256);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // 24 + 2 x 240 = 3 x 168, the registers per thread the CTA was launched with: a larger sum
    // would leave setmaxnreg.inc waiting forever.
    setmaxnreg_dec<24>();
    load(tq, tqp, tk, tkp, tv, tdo, p, smem, w);
    return;
  }

  setmaxnreg_inc<240>();
  Mainloop<kHalf> mainloop(p, smem, w, warp_group);
  float dv[64], dk[96];
#pragma unroll
  for (int i = 0; i < 64; ++i) dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) dk[i] = 0.f;
  if (w.blocks > 0) mainloop.mma(dv, dk);
  store_dk_dv<kHalf>(p, smem, w, dk, dv, mainloop.wg, mainloop.t, mainloop.lane, mainloop.kr, mainloop.kw0);
#endif
}

}  // namespace bwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
