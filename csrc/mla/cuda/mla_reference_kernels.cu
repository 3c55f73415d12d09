// float32 / float64 attention of mla_forward_padded / mla_backward_padded on CUDA (see the header).
//
// The lanes of a warp split a row's head dim (lane d, d + 32, ...: coalesced loads); dot products
// are summed across the warp with a butterfly, which leaves the same bits in every lane, so every
// lane runs the same softmax recurrence. A lane keeps kChunks columns of a row in registers: 256
// columns per warp, MLA's 192 / 128 and every FlashAttention head dim in one pass; wider rows read
// their remaining columns from memory (dot products) or loop over tiles of 256 output columns
// (recomputing the scores, which is slower but keeps any head dim correct).
//
// Cost: the attention's FLOPs on CUDA cores, one warp-wide reduction per (row, key) pair, plus
// the backward's dK / dV warps recomputing q.k and dO.v for every pair again (no matrix units; a
// debugging path, far from the fp16 / bf16 backends' speed).
#include "mla_reference_kernels.h"

#include <algorithm>

#include "../mla.h"

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int kChunks = 8;
constexpr int64_t kTile = 32 * kChunks;
// Blocks per launch at most; the warps stride over the remaining items (any number of rows).
constexpr int64_t kMaxBlocks = int64_t{1} << 24;

template <typename T>
__device__ __forceinline__ T infinity();
template <>
__device__ __forceinline__ float infinity<float>() {
  return __int_as_float(0x7f800000);
}
template <>
__device__ __forceinline__ double infinity<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Columns lane + 32 c (c < kChunks) of a row of n elements, zeros past n.
template <typename T>
__device__ __forceinline__ void load_row(T (&r)[kChunks], const T* row, int64_t n, int lane) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t d = lane + 32 * c;
    r[c] = d < n ? row[d] : T(0);
  }
}

// a . b over n columns, summed over the warp: a's first kTile columns from its registers (load_row
// of a_row), the rest from a_row.
template <typename T>
__device__ __forceinline__ T warp_dot(const T (&a)[kChunks], const T* a_row, const T* b_row,
                                      int64_t n, int lane) {
  T s = 0;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < n) s += a[c] * b_row[d];
  }
  for (int64_t d = kTile + lane; d < n; d += 32) s += a_row[d] * b_row[d];
  return warp_sum(s);
}

__device__ __forceinline__ int64_t first_warp() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}

__device__ __forceinline__ int64_t warp_stride() {
  return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
}

// The keys [k0, k0 + end) a query row sees (end = 0: none, or no sequence covers the row).
struct QueryKeys {
  int64_t k0, end;
};

__device__ __forceinline__ QueryKeys query_keys(const MlaReferenceProblem& p, int64_t row) {
  const core::RowSequence rs = core::row_sequence(p.cu_seqlens_q, p.num_seqs, p.tq, row);
  int64_t k0 = 0, lk = 0;
  core::sequence_rows(p.cu_seqlens_kv, rs.seq, p.tk, &k0, &lk);
  const int64_t end = rs.covered ? core::attention_key_end(row - rs.begin, rs.len, lk, p.causal) : 0;
  return {k0, end};
}

// One warp per (query row, query head) = item (row * hq + h): online softmax over its keys, the
// output in tiles of kTile columns.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(MlaReferenceProblem p, const T* __restrict__ q, const T* __restrict__ k,
                   const T* __restrict__ v, T* __restrict__ out, T* __restrict__ lse) {
  const int lane = threadIdx.x & 31;
  const T scale = static_cast<T>(p.scale);
  for (int64_t item = first_warp(); item < p.tq * p.hq; item += warp_stride()) {
    const int64_t row = item / p.hq, h = item - row * p.hq;
    const int64_t g = core::kv_head_of(h, p.hq, p.hk);
    const QueryKeys keys = query_keys(p, row);
    const T* qi = q + item * p.dqk;
    T* oi = out + item * p.dv;
    T qr[kChunks];
    load_row(qr, qi, p.dqk, lane);
    for (int64_t c0 = 0; c0 < p.dv; c0 += kTile) {
      T acc[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) acc[c] = T(0);
      T m = -infinity<T>(), l = T(0);
      for (int64_t j = 0; j < keys.end; ++j) {
        const int64_t kv = (keys.k0 + j) * p.hk + g;
        const T s = scale * warp_dot(qr, qi, k + kv * p.dqk, p.dqk, lane);
        const T m_new = s > m ? s : m;
        const T correction = exp_of(m - m_new);  // 0 at the first key (m = -inf)
        const T e = exp_of(s - m_new);
        l = l * correction + e;
        const T* vj = v + kv * p.dv;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int64_t col = c0 + lane + 32 * c;
          if (col < p.dv) acc[c] = acc[c] * correction + e * vj[col];
        }
        m = m_new;
      }
      // A query that sees no key: zero output, +inf log-sum-exp (the CPU reference's values).
      const T inv = keys.end > 0 ? T(1) / l : T(0);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t col = c0 + lane + 32 * c;
        if (col < p.dv) oi[col] = acc[c] * inv;
      }
      if (c0 == 0 && lane == 0) {
        lse[h * p.tq + row] = keys.end > 0 ? m + log_of(l) : infinity<T>();
      }
    }
  }
}

// One warp per (query row, query head): delta = rowsum(dO * O) (kept for dk_dv_kernel), then
// dQ = scale * sum_j p_ij (dO . v_j - delta) k_j with p_ij recomputed from the forward's lse.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(MlaReferenceProblem p, const T* __restrict__ q, const T* __restrict__ k,
              const T* __restrict__ v, const T* __restrict__ out, const T* __restrict__ grad_out,
              const T* __restrict__ lse, T* __restrict__ delta, T* __restrict__ dq) {
  const int lane = threadIdx.x & 31;
  const T scale = static_cast<T>(p.scale);
  for (int64_t item = first_warp(); item < p.tq * p.hq; item += warp_stride()) {
    const int64_t row = item / p.hq, h = item - row * p.hq;
    const int64_t g = core::kv_head_of(h, p.hq, p.hk);
    const QueryKeys keys = query_keys(p, row);
    const T* qi = q + item * p.dqk;
    const T* doi = grad_out + item * p.dv;
    T dor[kChunks], qr[kChunks];
    load_row(dor, doi, p.dv, lane);
    load_row(qr, qi, p.dqk, lane);
    const T d_i = warp_dot(dor, doi, out + item * p.dv, p.dv, lane);
    if (lane == 0) delta[h * p.tq + row] = d_i;
    const T l = lse[h * p.tq + row];
    T* dqi = dq + item * p.dqk;
    for (int64_t c0 = 0; c0 < p.dqk; c0 += kTile) {
      T acc[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) acc[c] = T(0);
      for (int64_t j = 0; j < keys.end; ++j) {
        const int64_t kv = (keys.k0 + j) * p.hk + g;
        const T* kj = k + kv * p.dqk;
        const T pij = exp_of(scale * warp_dot(qr, qi, kj, p.dqk, lane) - l);
        const T ds = pij * (warp_dot(dor, doi, v + kv * p.dv, p.dv, lane) - d_i);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int64_t col = c0 + lane + 32 * c;
          if (col < p.dqk) acc[c] += ds * kj[col];
        }
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t col = c0 + lane + 32 * c;
        if (col < p.dqk) dqi[col] = scale * acc[c];
      }
    }
  }
}

// One warp per (key row, kv head) = item (row * hk + g): over the queries of every query head of
// the group that see this key (causal: query i of lq sees key j of lk when i >= j + lq - lk),
// dV = sum p_ij dO_i and dK = scale * sum p_ij (dO_i . v_j - delta_i) q_i. Reads the delta that
// dq_kernel wrote before it on the stream.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dk_dv_kernel(MlaReferenceProblem p, const T* __restrict__ q, const T* __restrict__ k,
                 const T* __restrict__ v, const T* __restrict__ grad_out,
                 const T* __restrict__ lse, const T* __restrict__ delta, T* __restrict__ dk,
                 T* __restrict__ dv) {
  const int lane = threadIdx.x & 31;
  const T scale = static_cast<T>(p.scale);
  const int64_t group = p.hq / p.hk;
  for (int64_t item = first_warp(); item < p.tk * p.hk; item += warp_stride()) {
    const int64_t row = item / p.hk, g = item - row * p.hk;
    const core::RowSequence rs = core::row_sequence(p.cu_seqlens_kv, p.num_seqs, p.tk, row);
    int64_t q0 = 0, lq = 0;
    core::sequence_rows(p.cu_seqlens_q, rs.seq, p.tq, &q0, &lq);
    const int64_t j = row - rs.begin;
    const int64_t causal_first = j + lq - rs.len > 0 ? j + lq - rs.len : 0;
    const int64_t first = !rs.covered ? lq : (p.causal ? causal_first : 0);
    const T* kj = k + item * p.dqk;
    const T* vj = v + item * p.dv;
    T kr[kChunks], vr[kChunks];
    load_row(kr, kj, p.dqk, lane);
    load_row(vr, vj, p.dv, lane);
    for (int64_t c0 = 0; c0 < p.dqk; c0 += kTile) {
      T dk_acc[kChunks], dv_acc[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) dk_acc[c] = dv_acc[c] = T(0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = first; i < lq; ++i) {
          const int64_t qrow = q0 + i, qitem = qrow * p.hq + h;
          const T* qi = q + qitem * p.dqk;
          const T* doi = grad_out + qitem * p.dv;
          const T pij = exp_of(scale * warp_dot(kr, kj, qi, p.dqk, lane) - lse[h * p.tq + qrow]);
          const T ds = pij * (warp_dot(vr, vj, doi, p.dv, lane) - delta[h * p.tq + qrow]);
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            const int64_t col = c0 + lane + 32 * c;
            if (col < p.dqk) dk_acc[c] += ds * qi[col];
            if (col < p.dv) dv_acc[c] += pij * doi[col];
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int64_t col = c0 + lane + 32 * c;
        if (col < p.dqk) dk[item * p.dqk + col] = scale * dk_acc[c];
        if (col < p.dv) dv[item * p.dv + col] = dv_acc[c];
      }
    }
  }
}

// Blocks for `items` warps (at least one item). The device query is not a stream operation, so it
// is allowed while a CUDA graph is captured.
unsigned blocks_for(int64_t items) {
  const int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxBlocks)));
}

}  // namespace

template <typename T>
cudaError_t launch_mla_reference_forward(const MlaReferenceProblem& p, const T* q, const T* k,
                                         const T* v, T* out, T* lse, cudaStream_t stream) {
  if (p.tq == 0 || p.hq == 0 || p.num_seqs < 1 || p.hk < 1) return cudaSuccess;
  forward_kernel<T><<<blocks_for(p.tq * p.hq), kThreads, 0, stream>>>(p, q, k, v, out, lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_mla_reference_backward(const MlaReferenceProblem& p, const T* q, const T* k,
                                          const T* v, const T* out, const T* grad_out,
                                          const T* lse, T* delta, T* dq, T* dk, T* dv,
                                          cudaStream_t stream) {
  if (p.num_seqs < 1 || p.hk < 1) return cudaSuccess;
  if (p.tq * p.hq > 0) {
    dq_kernel<T><<<blocks_for(p.tq * p.hq), kThreads, 0, stream>>>(p, q, k, v, out, grad_out, lse,
                                                                  delta, dq);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.tk * p.hk > 0) {
    dk_dv_kernel<T><<<blocks_for(p.tk * p.hk), kThreads, 0, stream>>>(p, q, k, v, grad_out, lse,
                                                                     delta, dk, dv);
  }
  return cudaGetLastError();
}

template cudaError_t launch_mla_reference_forward<float>(const MlaReferenceProblem&, const float*,
                                                         const float*, const float*, float*,
                                                         float*, cudaStream_t);
template cudaError_t launch_mla_reference_forward<double>(const MlaReferenceProblem&,
                                                          const double*, const double*,
                                                          const double*, double*, double*,
                                                          cudaStream_t);
template cudaError_t launch_mla_reference_backward<float>(const MlaReferenceProblem&, const float*,
                                                          const float*, const float*, const float*,
                                                          const float*, const float*, float*,
                                                          float*, float*, float*, cudaStream_t);
template cudaError_t launch_mla_reference_backward<double>(const MlaReferenceProblem&,
                                                           const double*, const double*,
                                                           const double*, const double*,
                                                           const double*, const double*, double*,
                                                           double*, double*, double*,
                                                           cudaStream_t);

}  // namespace cuda
}  // namespace verl_ops
