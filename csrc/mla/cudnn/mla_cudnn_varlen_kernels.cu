// Device-side helpers of the varlen (cuDNN) backend of mla_forward_padded: the per-call metadata
// (sequence lengths and ragged element offsets, from cu_seqlens on the device: no host read) and
// the fix-up of rows that attend to nothing.
#include "mla_cudnn_varlen.h"

#include <algorithm>
#include <atomic>

#include "../mla.h"
#include "../../core/thd_rows.h"

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 256;

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Slot `slot` of the metadata: the five ragged offsets from the sequence's first q / kv rows and,
// for the slots of the bucket (slot < batch_bucket), its lengths. Both metadata kernels write
// through here, so the two orders fill the same arrays the same way.
__device__ __forceinline__ void write_slot(const VarlenMetadata& m, int64_t slot, int64_t batch_bucket,
                                           int64_t start_q, int64_t start_kv, int64_t lq, int64_t lk,
                                           int64_t q_token, int64_t k_token, int64_t v_token,
                                           int64_t o_token, int64_t stats_token) {
  m.offset_q[slot] = start_q * q_token;
  m.offset_o[slot] = start_q * o_token;
  m.offset_stats[slot] = start_q * stats_token;
  m.offset_k[slot] = start_kv * k_token;
  m.offset_v[slot] = start_kv * v_token;
  if (slot < batch_bucket) {
    m.seq_len_q[slot] = static_cast<int32_t>(lq);
    m.seq_len_kv[slot] = static_cast<int32_t>(lk);
  }
}

// Sequence b's first row and length from offsets cu over `rows` rows, clamped into [0, rows):
// valid offsets are unchanged; bad ones (checked on the host only with validate=True: offsets
// past the rows, negative or decreasing) can shrink or empty a sequence, never point cuDNN
// outside q, k, v, the outputs or the statistics.
__device__ __forceinline__ int64_t clamped_start(const int32_t* cu, int64_t b, int64_t rows) {
  const int64_t s = cu[b];
  return s < 0 ? int64_t{0} : (s > rows ? rows : s);
}

__device__ __forceinline__ int64_t clamped_length(const int32_t* cu, int64_t b, int64_t rows) {
  const int64_t s = clamped_start(cu, b, rows);
  const int64_t e = cu[b + 1];
  return e <= s ? int64_t{0} : (e > rows ? rows : e) - s;
}

__global__ void __launch_bounds__(kBlock)
    metadata_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_kv,
                    int64_t batch, int64_t batch_bucket, int64_t tq, int64_t tk, int64_t q_token,
                    int64_t k_token, int64_t v_token, int64_t o_token, int64_t stats_token,
                    VarlenMetadata m) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i <= batch_bucket;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Appended sequences (i >= batch) start at the end of the rows and have length 0.
    const int64_t b = i < batch ? i : batch;
    const int64_t lq = i < batch ? clamped_length(cu_q, i, tq) : 0;
    const int64_t lk = i < batch ? clamped_length(cu_kv, i, tk) : 0;
    write_slot(m, i, batch_bucket, clamped_start(cu_q, b, tq), clamped_start(cu_kv, b, tk), lq, lk, q_token,
               k_token, v_token, o_token, stats_token);
  }
}

// Largest-first order: cuDNN's grid runs its batch slots in order, so the sequences with the most
// work (lq * lk) go first and the short ones fill the tail of the last wave instead of one long
// sequence running alone at the end. Sequence i takes slot rank(i): the number of sequences with
// more work, ties by index (a permutation of [0, batch)). Appended sequences keep their slots.
// Every per-slot array (lengths, the five offsets) follows the same slot, so the results do not
// change, only the launch order. One thread per sequence; the lengths are read through shared
// memory in chunks of kBlock.
__global__ void __launch_bounds__(kBlock)
    metadata_lpt_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_kv,
                        int64_t batch, int64_t batch_bucket, int64_t tq, int64_t tk, int64_t q_token,
                        int64_t k_token, int64_t v_token, int64_t o_token, int64_t stats_token,
                        VarlenMetadata m) {
  __shared__ int64_t chunk_work[kBlock];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  const int64_t lq = i < batch ? clamped_length(cu_q, i, tq) : 0;
  const int64_t lk = i < batch ? clamped_length(cu_kv, i, tk) : 0;
  const int64_t work = lq * lk;
  int64_t rank = 0;
  for (int64_t j0 = 0; j0 < batch; j0 += kBlock) {
    const int64_t j = j0 + threadIdx.x;
    chunk_work[threadIdx.x] = j < batch ? clamped_length(cu_q, j, tq) * clamped_length(cu_kv, j, tk) : -1;
    __syncthreads();
    const int64_t n = batch - j0 < kBlock ? batch - j0 : kBlock;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t w = chunk_work[t];
      rank += (w > work) || (w == work && j0 + t < i);
    }
    __syncthreads();
  }
  if (i > batch_bucket) return;
  const int64_t slot = i < batch ? rank : i;
  const int64_t b = i < batch ? i : batch;  // appended slots: empty, at the end of the rows
  write_slot(m, slot, batch_bucket, clamped_start(cu_q, b, tq), clamped_start(cu_kv, b, tk), lq, lk, q_token,
             k_token, v_token, o_token, stats_token);
}

int grid_for(int64_t items, int64_t per_block) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, static_cast<int64_t>(sms) * 8)));
}

constexpr int kWarps = kBlock / 32;

// The sequence covering row `row` of offsets cu [batch + 1], or -1 past the last one.
__device__ __forceinline__ int64_t sequence_of(const int32_t* cu, int64_t batch, int64_t row) {
  if (batch <= 0 || row >= static_cast<int64_t>(cu[batch]) || row < static_cast<int64_t>(cu[0])) {
    return -1;
  }
  return core::upper_segment(cu, batch, row);
}

// `n` 16-bit elements at p, zeroed by the lanes of one warp.
__device__ __forceinline__ void zero_row(uint16_t* p, int64_t n, int lane) {
  for (int64_t c = lane; c < n; c += 32) p[c] = 0;
}

// One warp per query row: zero output and +inf log-sum-exp when the query sees no key.
__global__ void __launch_bounds__(kBlock)
    empty_rows_forward_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_kv,
                              int64_t batch, bool causal, int64_t tq, int64_t hq, int64_t dv,
                              uint16_t* __restrict__ out, float* __restrict__ lse_th) {
  const int lane = threadIdx.x & 31;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); row < tq;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t b = sequence_of(cu_q, batch, row);
    if (b < 0) continue;
    const int64_t lq = core::valid_length(cu_q, b), lk = core::valid_length(cu_kv, b);
    if (core::attention_key_end(row - cu_q[b], lq, lk, causal) > 0) continue;
    zero_row(out + row * hq * dv, hq * dv, lane);
    for (int64_t h = lane; h < hq; h += 32) lse_th[row * hq + h] = __int_as_float(0x7f800000);
  }
}

// One warp per query row (zero dq when it sees no key), then one per key row (zero dk, dv when
// its sequence has no queries, so no query sees it).
__global__ void __launch_bounds__(kBlock)
    empty_rows_backward_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_kv,
                               int64_t batch, bool causal, int64_t tq, int64_t tk, int64_t hq,
                               int64_t hk, int64_t dqk, int64_t dv, uint16_t* __restrict__ dq,
                               uint16_t* __restrict__ dk, uint16_t* __restrict__ dv_rows) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); r < tq + tk;
       r += static_cast<int64_t>(gridDim.x) * kWarps) {
    if (r < tq) {
      const int64_t b = sequence_of(cu_q, batch, r);
      if (b < 0) continue;
      const int64_t lq = core::valid_length(cu_q, b), lk = core::valid_length(cu_kv, b);
      if (core::attention_key_end(r - cu_q[b], lq, lk, causal) > 0) continue;
      zero_row(dq + r * hq * dqk, hq * dqk, lane);
    } else {
      const int64_t row = r - tq;
      const int64_t b = sequence_of(cu_kv, batch, row);
      if (b < 0 || core::valid_length(cu_q, b) > 0) continue;
      zero_row(dk + row * hk * dqk, hk * dqk, lane);
      zero_row(dv_rows + row * hk * dv, hk * dv, lane);
    }
  }
}

}  // namespace

bool varlen_auto_device(int device) {
  // 0: not queried yet, 1: no, 2: yes (static storage: zero-initialised).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return false;
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    k = major == 9 ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

size_t varlen_metadata_bytes(int64_t batch_bucket) {
  const size_t b = static_cast<size_t>(batch_bucket);
  return 2 * align16(b * sizeof(int32_t)) + 5 * align16((b + 1) * sizeof(int64_t));
}

VarlenMetadata varlen_metadata_at(void* base, int64_t batch_bucket) {
  const size_t b = static_cast<size_t>(batch_bucket);
  char* p = static_cast<char*>(base);
  VarlenMetadata m;
  const size_t lens = align16(b * sizeof(int32_t)), offs = align16((b + 1) * sizeof(int64_t));
  m.seq_len_q = reinterpret_cast<int32_t*>(p);
  m.seq_len_kv = reinterpret_cast<int32_t*>(p + lens);
  p += 2 * lens;
  int64_t** parts[5] = {&m.offset_q, &m.offset_k, &m.offset_v, &m.offset_o, &m.offset_stats};
  for (int i = 0; i < 5; ++i) *parts[i] = reinterpret_cast<int64_t*>(p + i * offs);
  return m;
}

cudaError_t launch_varlen_metadata(const int32_t* cu_q, const int32_t* cu_kv, int64_t batch,
                                   int64_t batch_bucket, int64_t tq, int64_t tk, int64_t hq,
                                   int64_t hk, int64_t dqk, int64_t dv, const VarlenMetadata& m,
                                   VarlenOrder order, cudaStream_t stream) {
  if (batch < 0 || batch_bucket < batch) return cudaErrorInvalidValue;
  if (order == VarlenOrder::kLargestFirst && batch > 1 && batch <= kLargestFirstMaxBatch) {
    const int grid = static_cast<int>((batch_bucket + 1 + kBlock - 1) / kBlock);
    metadata_lpt_kernel<<<grid, kBlock, 0, stream>>>(cu_q, cu_kv, batch, batch_bucket, tq, tk, hq * dqk,
                                                     hk * dqk, hk * dv, hq * dv, hq, m);
    return cudaGetLastError();
  }
  const int grid = grid_for(batch_bucket + 1, kBlock);
  metadata_kernel<<<grid, kBlock, 0, stream>>>(cu_q, cu_kv, batch, batch_bucket, tq, tk, hq * dqk, hk * dqk,
                                               hk * dv, hq * dv, hq, m);
  return cudaGetLastError();
}

cudaError_t launch_varlen_empty_rows_forward(const int32_t* cu_q, const int32_t* cu_kv,
                                             int64_t batch, bool causal, int64_t tq, int64_t hq,
                                             int64_t dv, void* out, float* lse_th,
                                             cudaStream_t stream) {
  if (tq <= 0 || batch <= 0) return cudaSuccess;
  empty_rows_forward_kernel<<<grid_for(tq, kWarps), kBlock, 0, stream>>>(
      cu_q, cu_kv, batch, causal, tq, hq, dv, static_cast<uint16_t*>(out), lse_th);
  return cudaGetLastError();
}

cudaError_t launch_varlen_empty_rows_backward(const int32_t* cu_q, const int32_t* cu_kv,
                                              int64_t batch, bool causal, int64_t tq, int64_t tk,
                                              int64_t hq, int64_t hk, int64_t dqk, int64_t dv,
                                              void* dq, void* dk, void* dv_rows,
                                              cudaStream_t stream) {
  if (tq + tk <= 0 || batch <= 0) return cudaSuccess;
  empty_rows_backward_kernel<<<grid_for(tq + tk, kWarps), kBlock, 0, stream>>>(
      cu_q, cu_kv, batch, causal, tq, tk, hq, hk, dqk, dv, static_cast<uint16_t*>(dq),
      static_cast<uint16_t*>(dk), static_cast<uint16_t*>(dv_rows));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace verl_ops
