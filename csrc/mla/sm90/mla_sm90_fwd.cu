// Forward attention of the varlen backend on Hopper (SM90a) for MLA's head dims: packed THD rows,
// Dqk 192 / Dv 128, fp16 or bf16, causal (top-left or bottom-right) or not, grouped kv heads.
// Writes O [Tq, Hq, 128] and the natural-log log-sum-exp [Tq, Hq] (+inf for a row that sees no
// key) of every row of every sequence: the layout cuDNN's backward reads.
//
// This file is the host side: the schedule launch, the tensor maps and the kernel launch. The
// kernel is split by role, as FlashAttention's hopper/ kernels are:
//   kernel_fwd.cuh      the __global__ kernel: shared memory, barriers, warp roles
//   tile_scheduler.cuh  sequences longest first, tiles handed out persistently
//   mainloop_fwd.cuh    producer TMA loads; consumer GEMMs, turns, softmax per key tile
//   mask.cuh, softmax.cuh   the causal / length mask, the online softmax
//   epilogue_fwd.cuh    O and the log-sum-exp to global memory
//   params.h, shared_storage.h, named_barriers.h   tile shapes and Params, shared memory, barrier ids
//   ptx.cuh, wgmma.cuh  the PTX wrappers (shared with the backward)
//   launch.h            host helpers shared with the backward
#include "mla_sm90_fwd.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernel_fwd.cuh"
#include "launch.h"

namespace verl_ops {
namespace cuda {

namespace {

template <bool kHalf>
cudaError_t launch(const Sm90FwdArgs& a, const fwd::Params& p, cudaStream_t stream) {
  CUtensorMap m[5];
  if (!make_part_maps(m, a.in, a.tq, a.tk, fwd::kBM, fwd::kBN, kHalf)) return cudaErrorInvalidValue;
  constexpr auto kernel = fwd::mla_sm90_fwd_kernel<kHalf>;
  const cudaError_t err = opt_in_smem<kernel>(fwd::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM at most, never more than there can be tiles.
  const int64_t tiles_bound = a.hq * ((a.tq + fwd::kBM - 1) / fwd::kBM + a.batch);
  dim3 grid(static_cast<unsigned>(std::min<int64_t>(sm_count(), tiles_bound)));
  kernel<<<grid, fwd::kThreads, fwd::kSmemBytes, stream>>>(m[0], m[1], m[2], m[3], m[4], p);
  return cudaGetLastError();
}

}  // namespace

#if defined(VERL_OPS_SM90_TRACE)
cudaError_t sm90_trace_clear() {
  void* ptr = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&ptr, g_sm90_trace);
  return err != cudaSuccess ? err : cudaMemset(ptr, 0, sizeof(g_sm90_trace));
}
cudaError_t sm90_trace_read(long long* host) {
  return cudaMemcpyFromSymbol(host, g_sm90_trace, sizeof(g_sm90_trace));
}
#endif

bool sm90_forward_compiled() {
#if defined(VERL_OPS_HAS_SM90A)
  return true;
#else
  return false;
#endif
}

bool sm90_forward_enabled() {
  static const bool enabled = sm90_forward_compiled() && !env_selects_cudnn("VERL_OPS_VARLEN_FORWARD");
  return enabled;
}

bool sm90_forward_device(int device) {
  // Else cuDNN's forward runs.
  return sm90_forward_enabled() && sm90_device_supported(device);
}

bool sm90_kernels_device(int device) { return sm90_forward_compiled() && sm90_device_supported(device); }

cudaError_t launch_sm90_forward(const Sm90FwdArgs& a, cudaStream_t stream) {
  if (a.tq <= 0 || a.batch <= 0) return cudaSuccess;
  if (a.tk <= 0) return cudaSuccess;  // every row sees no key: the caller's empty-rows pass
  fwd::Params p;
  launch_schedule<fwd::kBM>(p, a.workspace, a.cu_q, a.tq, a.batch, a.hq, stream);
  p.counter = a.workspace + 2 * a.batch + 1;
  p.out = a.out;
  p.lse = a.lse;
  set_shared_params(p, a);
  p.k_pe_shared = a.in.k_pe.heads == 1 && a.hk > 1 ? 1 : 0;
  return a.half ? launch<true>(a, p, stream) : launch<false>(a, p, stream);
}

}  // namespace cuda
}  // namespace verl_ops
