// The varlen backend of mla_forward_padded: cuDNN's fused SDPA run directly on the packed THD rows
// (no dense padding), through the graph API of the cuDNN frontend (header-only C++).
//
// How the batch is described to cuDNN: every tensor is a logical [B, H, S, D] tensor with token-major
// strides (D, H * D for the head and sequence axes, as the THD rows are laid out) whose per-sequence
// start is a ragged offset: an int64 [B + 1] device tensor of *element* offsets (cu_seqlens[b] times
// the elements of one token: H * D; H for the [T, H] float log-sum-exp). The per-sequence lengths
// (int32 [B]) switch on cuDNN's padding mask, so rows past a sequence's length are neither read nor
// written. A graph is built for a bucket of shapes (batch, max_seqlen and token totals rounded up,
// varlen_bucket); a call with fewer sequences appends sequences of length 0 in its metadata.
//
// This header has no cuDNN and no torch types: the frontend is compiled in one translation unit
// (mla_cudnn_varlen.cpp), the metadata kernels in mla_cudnn_varlen_kernels.cu, and the ATen-facing
// code (csrc/mla/mla_ops_cuda.cpp) allocates every buffer and passes raw pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace verl_ops {
namespace cuda {

enum class VarlenDtype : int { kHalf = 0, kBFloat16 = 1 };

// What one cuDNN graph is built for. `batch`, the max_seqlens and the totals are bucket values
// (varlen_bucket); the totals bound the packed token counts (the backward's workspace is sized
// from them) and are 0 in the forward, which does not use them.
struct VarlenProblem {
  int device = 0;
  VarlenDtype dtype = VarlenDtype::kBFloat16;
  bool backward = false;
  bool causal = false;
  bool bottom_right = false;  // causal diagonal at each sequence's bottom-right corner
  int64_t batch = 0, hq = 0, hk = 0, dqk = 0, dv = 0;
  int64_t max_seqlen_q = 0, max_seqlen_kv = 0;
  int64_t total_q = 0, total_kv = 0;
  double scale = 0.0;
};

// Bucket rounding: sizes a graph is built for, so that the calls of a training run (whose batch
// size, longest sequence and token count change every micro-batch) share a few graphs.
// Powers of two for the batch (at least 1) and the max_seqlens (at least 64; cuDNN's backward also
// rejects s_q = s_kv = 1); quarter-octave steps (at most 25% over) for the token totals, which size
// the backward's float32 workspace.
inline int64_t varlen_round_pow2(int64_t x, int64_t floor) {
  int64_t r = floor;
  while (r < x) r <<= 1;
  return r;
}

inline int64_t varlen_round_quarter_octave(int64_t x, int64_t floor) {
  if (x <= floor) return floor;
  int64_t p = 1;
  while (p <= x / 2) p <<= 1;  // largest power of two <= x
  const int64_t step = p >= 4 ? p / 4 : 1;
  return (x + step - 1) / step * step;
}

inline VarlenProblem varlen_bucket(VarlenProblem p) {
  p.batch = varlen_round_pow2(p.batch, 1);
  p.max_seqlen_q = varlen_round_pow2(p.max_seqlen_q, 64);
  p.max_seqlen_kv = varlen_round_pow2(p.max_seqlen_kv, 64);
  if (p.backward) {
    p.total_q = varlen_round_quarter_octave(p.total_q, 64);
    p.total_kv = varlen_round_quarter_octave(p.total_kv, 64);
  } else {
    p.total_q = p.total_kv = 0;
  }
  return p;
}

// Per-call metadata for a bucket of `batch_bucket` sequences, in one device buffer:
// seq_len_q / seq_len_kv int32 [batch_bucket] (0 for the appended sequences) and the ragged
// element offsets int64 [batch_bucket + 1] of q (and dq), k (dk), v (dv), o (do) and the [T, H]
// log-sum-exp (the appended sequences start at the end of the rows).
struct VarlenMetadata {
  int32_t* seq_len_q = nullptr;
  int32_t* seq_len_kv = nullptr;
  int64_t* offset_q = nullptr;
  int64_t* offset_k = nullptr;
  int64_t* offset_v = nullptr;
  int64_t* offset_o = nullptr;
  int64_t* offset_stats = nullptr;
};

// Bytes of the metadata buffer (every part 16-byte aligned within it) and its parts at `base`
// (which must be 16-byte aligned).
size_t varlen_metadata_bytes(int64_t batch_bucket);
VarlenMetadata varlen_metadata_at(void* base, int64_t batch_bucket);

// The order of the sequences in cuDNN's batch slots. kInput: slot i is sequence i.
// kLargestFirst: the sequences with the most work (lq * lk) first, so that the short ones fill the
// last wave (ragged batches); same results, only the launch order changes. Taken only for
// 1 < batch <= kLargestFirstMaxBatch (one thread per sequence compares it with every other).
enum class VarlenOrder { kInput, kLargestFirst };
constexpr int64_t kLargestFirstMaxBatch = 1024;

// The order the backend uses: VERL_OPS_VARLEN_ORDER=input|largest_first (read once), default
// largest_first.
VarlenOrder varlen_order();

// Fills the metadata from the int32 offsets cu_seqlens_q / cu_seqlens_kv [batch + 1], on the
// device (one launch; no host read of the lengths). Every sequence is clamped into the tq query
// and tk key rows, so bad offsets never send cuDNN outside the tensors.
cudaError_t launch_varlen_metadata(const int32_t* cu_q, const int32_t* cu_kv, int64_t batch,
                                   int64_t batch_bucket, int64_t tq, int64_t tk, int64_t hq,
                                   int64_t hk, int64_t dqk, int64_t dv, const VarlenMetadata& m,
                                   VarlenOrder order, cudaStream_t stream);

// Rows that attend to nothing get the values of the other backends, whatever cuDNN leaves there:
// forward: a query that sees no key (its sequence has no keys, or causal with lq > lk: queries
// i < lq - lk) gets a zero output row and a +inf log-sum-exp (`lse_th` is [tq, hq] float32);
// backward: such a query gets a zero dq row, and a key that no query sees (its sequence has no
// queries) zero dk and dv rows. 16-bit elements. One launch each.
cudaError_t launch_varlen_empty_rows_forward(const int32_t* cu_q, const int32_t* cu_kv,
                                             int64_t batch, bool causal, int64_t tq, int64_t hq,
                                             int64_t dv, void* out, float* lse_th,
                                             cudaStream_t stream);

cudaError_t launch_varlen_empty_rows_backward(const int32_t* cu_q, const int32_t* cu_kv,
                                              int64_t batch, bool causal, int64_t tq, int64_t tk,
                                              int64_t hq, int64_t hk, int64_t dqk, int64_t dv,
                                              void* dq, void* dk, void* dv_rows,
                                              cudaStream_t stream);

// Whether backend=auto may choose the varlen backend on `device`: a device of compute capability
// 9.x (Hopper, where it was measured; on 8.x cuDNN has no backward for ragged log-sum-exp).
// Cached per device; false when the device cannot be queried. (Builds with the backend also ask
// for a loaded cuDNN of at least kVarlenAutoMinCudnn.)
bool varlen_auto_device(int device);

// The oldest cuDNN that backend=auto sends work to the varlen backend with: 9.7.0, the first whose
// SDPA has every feature the graphs use (ragged int64 offsets, the padding mask, bottom-right
// causal alignment). Mirrored in verl_ops/_fake.py.
constexpr int64_t kVarlenAutoMinCudnn = 90700;

#ifdef VERL_OPS_WITH_CUDNN_FE

// A built cuDNN graph (opaque; owned by the plan cache, which may evict it: a caller keeps its
// reference for as long as it runs the plan).
struct VarlenPlan;

// The plan of `bucket` (a varlen_bucket result) for the calling thread's cuDNN handle on
// bucket.device, built on a miss. Throws std::runtime_error naming `op` when cuDNN cannot build
// it (remembered: later calls of the bucket raise the same error without building), or on a miss
// while `stream` is being captured into a CUDA graph (building is not capturable: run the shape
// once before capture; a plan used during a capture is never evicted).
std::shared_ptr<const VarlenPlan> varlen_plan(const char* op, const VarlenProblem& bucket,
                                              cudaStream_t stream);

// The loaded cuDNN's version (cudnnGetVersion: major * 10000 + minor * 100 + patch), 0 when cuDNN
// cannot be loaded. Read once.
int64_t varlen_cudnn_version();

// Sets the plan cache's capacity (0: no limit; the least recently used plans beyond it are
// dropped now and later) and returns the previous one.
int64_t varlen_set_cache_capacity(int64_t capacity);

// Workspace bytes the plan needs at execution.
int64_t varlen_workspace_bytes(const VarlenPlan* plan);

struct VarlenForwardArgs {
  const void* q = nullptr;  // [Tq, Hq, Dqk]
  const void* k = nullptr;  // [Tk, Hk, Dqk]
  const void* v = nullptr;  // [Tk, Hk, Dv]
  void* out = nullptr;      // [Tq, Hq, Dv]
  float* stats = nullptr;   // [Tq, Hq] natural-log log-sum-exp of the scaled scores
  VarlenMetadata meta;
};

struct VarlenBackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* grad_out = nullptr;  // [Tq, Hq, Dv]
  const float* stats = nullptr;    // [Tq, Hq]
  void* grad_q = nullptr;          // [Tq, Hq, Dqk]
  void* grad_k = nullptr;          // [Tk, Hk, Dqk]
  void* grad_v = nullptr;          // [Tk, Hk, Dv]
  VarlenMetadata meta;
};

// Runs the plan on `stream` (the calling thread's handle is set to it). Every pointer is device
// memory, 16-byte aligned; rows contiguous ([T, H, D] row-major).
void varlen_forward(const char* op, const VarlenPlan* plan, const VarlenForwardArgs& args,
                    void* workspace, cudaStream_t stream);
void varlen_backward(const char* op, const VarlenPlan* plan, const VarlenBackwardArgs& args,
                     void* workspace, cudaStream_t stream);

// Plan cache counters: entries, lookups that found a plan, lookups that did not, graphs built,
// builds that failed, plans evicted, the capacity (0: no limit), buckets whose build failed.
struct VarlenCacheStats {
  int64_t size = 0, hits = 0, misses = 0, builds = 0, failures = 0, evictions = 0, capacity = 0,
          failed_buckets = 0;
};

VarlenCacheStats varlen_cache_stats();

#endif  // VERL_OPS_WITH_CUDNN_FE

}  // namespace cuda
}  // namespace verl_ops
