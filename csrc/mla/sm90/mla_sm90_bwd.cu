// Backward attention of the varlen backend on Hopper (SM90a) for MLA's head dims: packed THD rows,
// Dqk 192 / Dv 128, fp16 or bf16, causal (top-left or bottom-right) or not, grouped kv heads.
// Reads what either forward (mla_sm90_fwd.cu or cuDNN's) wrote: O and the natural-log log-sum-exp (by strides).
//
// Three kernels:
// - pre: D = rowsum(dO * O) per row and head, next to lse * log2(e), as float2 [Hq, Tq]
//   (dQ's fp32 accumulator is zeroed by a memset before it).
// - main: a CTA per (sequence, kv head, block of 128 keys), 384 threads. Warp 0 of the producer
//   warpgroup loads the block's K (128 x 192) and V (128 x 128) once, then, for each q head of
//   the group and each 64-row query block that sees one of these keys, its Q (64 x 192) and dO
//   (64 x 128) through TMA (128-byte swizzle) and its rows' lse2 / D into a two-stage ring. Two
//   consumer warpgroups, 64 keys each, hold dK (64 x 192) and dV (64 x 128) in fp32 registers
//   over all query blocks (160 of their 240 registers, so S^T and dP^T are never live together):
//     S^T = K Q^T                       (wgmma, both operands in shared memory)
//     P^T = exp2(S^T * scale * log2(e) - lse2), masked, into bf16 / fp16 A fragments
//     dV += P^T dO and dP^T = V dO^T    (issued together)
//     dS^T = P^T * (dP^T - D);  dK += dS^T Q  (A fragments from registers)
//     dS^T to shared memory; a block later, once both warpgroups' halves are there (mbarriers,
//     two buffers), dQ (64 rows) += dS K over the 128 keys, warpgroup w taking the 64 columns
//     64 w ... and 32 of the last 64, added to the fp32 accumulator with 16-byte vector
//     reductions (the two lanes of a pair swap a column pair first, so each holds four
//     consecutive columns: half the reductions of 8-byte ones, and 1.08-1.14x the backward)
//   and write dK * scale and dV for the keys inside the sequence (zeros where no query sees them),
//   staged through the freed Q / dO stages so that whole rows are stored in 16-byte chunks.
// - post: dQ = accumulator * scale, to the input dtype, for every row.
// Sequences run longest first (the forward's schedule kernel over the key lengths), no host read.
//
// This file is the host side (the launches). The main kernel is split by role, as the forward's:
//   kernel_bwd.cuh      the __global__ kernel: shared memory, barriers, warp roles
//   tile_scheduler.cuh  sequences longest first, a CTA's (sequence, kv head, key block)
//   mainloop_bwd.cuh    producer TMA loads; consumer GEMMs, P^T, dS^T and the dQ reductions
//   mask.cuh, softmax.cuh   the causal / length mask, P from the forward's log-sum-exp
//   epilogue_bwd.cuh    dK / dV to global memory
//   prepost_bwd.cuh     the pre (D) and post (dQ) kernels
//   params.h, shared_storage.h, named_barriers.h, ptx.cuh, wgmma.cuh, launch.h: shared with the
//   forward (see mla_sm90_fwd.cu)
#include "mla_sm90_bwd.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernel_bwd.cuh"
#include "launch.h"
#include "mla_sm90_fwd.h"
#include "prepost_bwd.cuh"

namespace verl_ops {
namespace cuda {

namespace {

template <bool kHalf>
cudaError_t launch_bwd(const Sm90BwdArgs& a, bwd::Params& p, cudaStream_t stream) {
  CUtensorMap m[5], mdo;
  const Sm90Rows dout{a.dout, a.hq * kDv, kDv, a.hq};
  if (!make_part_maps(m, a.in, a.tq, a.tk, bwd::kBM, bwd::kBN, kHalf) ||
      !make_map(&mdo, dout, a.tq, kDv, bwd::kBM, kHalf))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(a.dq_accum, 0, sizeof(float) * a.tq * a.hq * kDqk, stream);
  if (err != cudaSuccess) return err;
  {
    const int64_t threads = a.tq * a.hq * 16;
    bwd::bwd_pre_kernel<kHalf><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        static_cast<const uint4*>(a.out), static_cast<const uint4*>(a.dout), a.lse, a.lse_row_stride,
        a.lse_head_stride, a.lse_d, a.tq,
        static_cast<int>(a.hq));
  }
  constexpr auto kernel = bwd::mla_sm90_bwd_kernel<kHalf>;
  err = opt_in_smem<kernel>(bwd::kSmemBytes);
  if (err != cudaSuccess) return err;
  // A CTA per (sequence, kv head, key block): at most hk * (tk / kBN + batch); the ones past the
  // schedule's total return at once.
  const int64_t ctas = a.hk * ((a.tk + bwd::kBN - 1) / bwd::kBN + a.batch);
  kernel<<<static_cast<unsigned>(ctas), bwd::kThreads, bwd::kSmemBytes, stream>>>(m[0], m[1], m[2], m[3], m[4],
                                                                                  mdo, p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t n4 = a.tq * a.hq * kDqk / 4;
  const unsigned post_blocks = static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 8 * 132));
  bwd::bwd_post_kernel<kHalf><<<post_blocks, 256, 0, stream>>>(
      reinterpret_cast<const float4*>(a.dq_accum), static_cast<uint2*>(a.dq), n4, a.scale);
  return cudaGetLastError();
}

}  // namespace

bool sm90_backward_enabled() {
  // On by default (on an H200 it is 1.02-1.14x cuDNN's backward at the op level, see
  // benchmarks/LOG.md); VERL_OPS_VARLEN_BACKWARD=cudnn keeps cuDNN's backward plan.
  static const bool enabled = sm90_forward_compiled() && !env_selects_cudnn("VERL_OPS_VARLEN_BACKWARD");
  return enabled;
}

bool sm90_backward_device(int device) {
  // The forward's device test (compute capability 9.0, the tensor-map encoder) without its switch.
  return sm90_backward_enabled() && sm90_device_supported(device);
}

cudaError_t launch_sm90_backward(const Sm90BwdArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.tq <= 0 || a.tk <= 0) {
    // No query or no key anywhere: every gradient is zero (the tensor maps need rows).
    const size_t elem = 2;
    cudaError_t err = cudaSuccess;
    if (a.tq > 0) err = cudaMemsetAsync(a.dq, 0, elem * a.tq * a.hq * kDqk, stream);
    // A part's rows * hk head rows of d columns, head_stride apart (row_stride == hk * head_stride),
    // or with one head its rows, row_stride apart.
    auto zero = [&](const Sm90GradRows& g, int64_t d) {
      if (err != cudaSuccess || a.tk <= 0) return;
      if (a.hk == 1) {
        err = cudaMemset2DAsync(g.ptr, elem * g.row_stride, 0, elem * d, a.tk, stream);
      } else if (g.row_stride == a.hk * g.head_stride) {
        err = cudaMemset2DAsync(g.ptr, elem * g.head_stride, 0, elem * d, a.tk * a.hk, stream);
      } else {
        err = cudaErrorInvalidValue;
      }
    };
    zero(a.dk, 128);
    zero(a.dk_pe, 64);
    zero(a.dv, kDv);
    return err;
  }
  bwd::Params p;
  launch_schedule<bwd::kBN>(p, a.workspace, a.cu_kv, a.tk, a.batch, a.hk, stream);
  p.lse_d = a.lse_d;
  p.dq_accum = a.dq_accum;
  p.dk = a.dk.ptr;
  p.dk_pe = a.dk_pe.ptr;
  p.dv = a.dv.ptr;
  p.dk_rs = 2 * a.dk.row_stride;
  p.dk_hs = 2 * a.dk.head_stride;
  p.dkp_rs = 2 * a.dk_pe.row_stride;
  p.dkp_hs = 2 * a.dk_pe.head_stride;
  p.dv_rs = 2 * a.dv.row_stride;
  p.dv_hs = 2 * a.dv.head_stride;
  set_shared_params(p, a);
  p.k_pe_shared = a.in.k_pe.heads == 1 && a.hk > 1 ? 1 : 0;
  return a.half ? launch_bwd<true>(a, p, stream) : launch_bwd<false>(a, p, stream);
}

}  // namespace cuda
}  // namespace verl_ops
