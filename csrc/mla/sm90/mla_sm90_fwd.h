// Forward attention for MLA shapes (Dqk 192, Dv 128) on Hopper, see mla_sm90_fwd.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace verl_ops {
namespace cuda {

// Rows [rows, heads, d] of one operand part as the kernels read them through TMA: the base
// (16-byte aligned) and the row and head strides in elements (multiples of 8; the inner stride is 1).
struct Sm90Rows {
  const void* ptr = nullptr;
  int64_t row_stride = 0, head_stride = 0, heads = 0;
};

// The operands in parts: q = [q | q_pe] (128 + 64 columns), k = [k | k_pe] with k_pe of 1 head
// (shared by every kv head, MLA's rope key) or hk heads, v of 128 columns. A contiguous
// [t, h, 192] tensor is the parts at column offsets 0 and 128 of its rows (sm90_dense_parts).
struct Sm90Parts {
  Sm90Rows q, q_pe, k, k_pe, v;
};

struct Sm90FwdArgs {
  Sm90Parts in;
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

// The parts of contiguous q [tq, hq, 192], k [tk, hk, 192], v [tk, hk, 128].
inline Sm90Parts sm90_dense_parts(const void* q, const void* k, const void* v, int64_t hq, int64_t hk) {
  const char* qb = static_cast<const char*>(q);
  const char* kb = static_cast<const char*>(k);
  Sm90Parts p;
  p.q = {q, hq * 192, 192, hq};
  p.q_pe = {qb + 128 * 2, hq * 192, 192, hq};
  p.k = {k, hk * 192, 192, hk};
  p.k_pe = {kb + 128 * 2, hk * 192, 192, hk};
  p.v = {v, hk * 128, 128, hk};
  return p;
}

// Whether this build holds the SM90a kernel (TORCH_CUDA_ARCH_LIST with 9.0a, see setup.py).
bool sm90_forward_compiled();
// ... and the varlen backend runs its forward with it: compiled, and not turned off by
// VERL_OPS_VARLEN_FORWARD=cudnn (read once).
bool sm90_forward_enabled();
// ... on this device: enabled and compute capability 9.0 (cached per device; no sync).
bool sm90_forward_device(int device);
// Compiled, and this device can run them (compute capability 9.0, the tensor-map encoder), whatever
// the varlen backend's switches say: the kernels of mla_latent_forward / _backward.
bool sm90_kernels_device(int device);

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
