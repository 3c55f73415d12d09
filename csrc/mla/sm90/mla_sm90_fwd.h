// Forward attention for MLA shapes (Dqk 192, Dv 128) on Hopper, see mla_sm90_fwd.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace verl_ops {
namespace cuda {

struct Sm90FwdArgs {
  const void* q;  // [tq, hq, 192], contiguous, 16-byte aligned
  const void* k;  // [tk, hk, 192]
  const void* v;  // [tk, hk, 128]
  void* out;      // [tq, hq, 128]
  float* lse;     // [tq, hq]
  const int32_t* cu_q;
  const int32_t* cu_kv;
  int32_t* workspace;  // sm90_forward_workspace_ints(batch) int32 on the device
  int64_t batch, tq, tk, hq, hk, max_seqlen_q;
  float scale;
  bool causal, bottom_right, half;
};

inline int64_t sm90_forward_workspace_ints(int64_t batch) { return 2 * batch + 2; }

// Whether this build holds the SM90a kernel (TORCH_CUDA_ARCH_LIST with 9.0a, see setup.py).
bool sm90_forward_compiled();
// ... and the varlen backend runs its forward with it: compiled, and not turned off by
// VERL_OPS_VARLEN_FORWARD=cudnn (read once).
bool sm90_forward_enabled();
// ... on this device: enabled and compute capability 9.0 (cached per device; no sync).
bool sm90_forward_device(int device);

// Writes out and lse for every row some key is visible to; rows that see no key are left to the
// caller (the varlen backend's empty-rows pass writes zeros and +inf there).
cudaError_t launch_sm90_forward(const Sm90FwdArgs& a, cudaStream_t stream);

#if defined(VERL_OPS_SM90_TRACE)
// Diagnostics build only (-DVERL_OPS_SM90_TRACE, benchmarks/mla/harness/prof_mla_sm90.cu): per CTA,
// role (0 producer, 1 and 2 the consumer warpgroups) and tile taken (the first kSm90TraceTiles), the
// clock64 of each event. Producer: 0 tile handed out, 1 Q buffer free (Q load issued), 2 last
// K / V load issued, 7 key tiles. Consumer: 0 tile received, 1 Q arrived, 2 first S done, 3 first
// softmax done, 4 main loop done, 5 last PV done, 6 epilogue done, 7 key tiles.
constexpr int kSm90TraceCtas = 160, kSm90TraceTiles = 128, kSm90TraceEvents = 8;
cudaError_t sm90_trace_clear();
cudaError_t sm90_trace_read(long long* host);  // kSm90TraceCtas * 3 * kSm90TraceTiles * 8
#endif

}  // namespace cuda
}  // namespace verl_ops
