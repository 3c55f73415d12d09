// One block per row (rows grid-strided). Forward: the row's max, then the sum of exp(x - max) (the
// row is read twice; the second read hits L2 while the resident blocks' rows fit in it, e.g. a
// 32k-id bf16 slice, and comes from memory again for slices of a few hundred thousand ids), each thread's partial results reduced across
// the block. Backward: one pass writing (softmax - one-hot) * -g. float32 math throughout, as
// Megatron's cross entropy converts the logits to float32 first; expf and IEEE division (no fast math).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "log_probs_kernels.h"

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 512;

template <typename T>
__device__ __forceinline__ float widen(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float widen<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T narrow(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// VEC elements of T in one load (VEC * sizeof(T) == 16) or one (VEC == 1).
template <typename T, int VEC>
struct Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load(const T* p) {
  Vec<T, VEC> out;
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(&out, &raw, 16);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = p[i];
  }
  return out;
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const Vec<T, VEC>& v) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw;
    memcpy(&raw, &v, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = v.v[i];
  }
}

__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || a >= b) ? a : b; }

// Block-wide reductions; every thread gets the result. `scratch` holds kBlock / 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch is free (a previous reduction has been read)
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kBlock / 32 ? scratch[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kBlock / 32 ? scratch[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename L>
__device__ __forceinline__ int64_t label_of(const L* labels, int64_t r) {
  return static_cast<int64_t>(labels[r]);
}

template <typename T, int VEC, typename L>
__global__ void __launch_bounds__(kBlock)
    forward_kernel(core::LogProbProblem p, const T* __restrict__ logits, const L* __restrict__ labels,
                   float* __restrict__ lp, float* __restrict__ mx, float* __restrict__ se,
                   float* __restrict__ ll) {
  __shared__ float scratch[kBlock / 32];
  const int64_t vecs = p.vocab / VEC;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* x = logits + r * p.row_stride;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < vecs; i += kBlock) {
      const Vec<T, VEC> v = load<T, VEC>(x + i * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) m = max_nan(m, widen(v.v[k]));
    }
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < vecs; i += kBlock) {
      const Vec<T, VEC> v = load<T, VEC>(x + i * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += expf(widen(v.v[k]) - m);
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
      const int64_t t = core::slice_index(label_of(labels, r), p);
      const bool in = t >= 0;
      const float xt = in ? widen(x[t]) : 0.0f;
      mx[r] = m;
      se[r] = s;
      ll[r] = xt;
      lp[r] = core::row_log_prob(m, s, in, xt);
    }
  }
}

template <typename T, int VEC, typename L>
__global__ void __launch_bounds__(kBlock)
    backward_kernel(core::LogProbProblem p, const float* __restrict__ grad, const T* __restrict__ logits,
                    const L* __restrict__ labels, const float* __restrict__ mx, const float* __restrict__ se,
                    T* __restrict__ out) {
  const int64_t vecs = p.vocab / VEC;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* x = logits + r * p.row_stride;
    T* o = out + r * p.vocab;
    const float g = -grad[r];
    const float m = mx[r], s = se[r];
    const int64_t t = core::slice_index(label_of(labels, r), p);
    for (int64_t i = threadIdx.x; i < vecs; i += kBlock) {
      const Vec<T, VEC> v = load<T, VEC>(x + i * VEC);
      Vec<T, VEC> w;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float sm = __fdiv_rn(expf(widen(v.v[k]) - m), s);
        if (i * VEC + k == t) sm -= 1.0f;
        w.v[k] = narrow<T>(__fmul_rn(sm, g));
      }
      store<T, VEC>(o + i * VEC, w);
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, 1 << 16)); }

template <typename T, typename L>
cudaError_t forward_typed(const core::LogProbProblem& p, const void* logits, const void* labels, float* lp,
                          float* mx, float* se, float* ll, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  const L* lab = static_cast<const L*>(labels);
  if (aligned16(logits) && p.vocab % kVec == 0 && p.row_stride % kVec == 0) {
    forward_kernel<T, kVec, L><<<grid_for(p.rows), kBlock, 0, stream>>>(p, x, lab, lp, mx, se, ll);
  } else {
    forward_kernel<T, 1, L><<<grid_for(p.rows), kBlock, 0, stream>>>(p, x, lab, lp, mx, se, ll);
  }
  return cudaGetLastError();
}

template <typename T, typename L>
cudaError_t backward_typed(const core::LogProbProblem& p, const float* grad, const void* logits, const void* labels,
                           const float* mx, const float* se, void* out, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  const L* lab = static_cast<const L*>(labels);
  T* o = static_cast<T*>(out);
  if (aligned16(logits) && aligned16(out) && p.vocab % kVec == 0 && p.row_stride % kVec == 0) {
    backward_kernel<T, kVec, L><<<grid_for(p.rows), kBlock, 0, stream>>>(p, grad, x, lab, mx, se, o);
  } else {
    backward_kernel<T, 1, L><<<grid_for(p.rows), kBlock, 0, stream>>>(p, grad, x, lab, mx, se, o);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_labels(const core::LogProbProblem& p, const void* logits, const void* labels, int bits,
                           float* lp, float* mx, float* se, float* ll, cudaStream_t stream) {
  return bits == 64 ? forward_typed<T, int64_t>(p, logits, labels, lp, mx, se, ll, stream)
                    : forward_typed<T, int32_t>(p, logits, labels, lp, mx, se, ll, stream);
}

template <typename T>
cudaError_t backward_labels(const core::LogProbProblem& p, const float* grad, const void* logits, const void* labels,
                            int bits, const float* mx, const float* se, void* out, cudaStream_t stream) {
  return bits == 64 ? backward_typed<T, int64_t>(p, grad, logits, labels, mx, se, out, stream)
                    : backward_typed<T, int32_t>(p, grad, logits, labels, mx, se, out, stream);
}

}  // namespace

cudaError_t launch_log_probs_forward(const core::LogProbProblem& p, int dtype, const void* logits,
                                     const void* labels, int label_bits, float* log_probs, float* logits_max,
                                     float* sum_exp, float* label_logit, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  switch (dtype) {
    case 0: return forward_labels<float>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit, stream);
    case 1: return forward_labels<double>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit, stream);
    case 2: return forward_labels<__half>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit, stream);
    default:
      return forward_labels<__nv_bfloat16>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit,
                                           stream);
  }
}

cudaError_t launch_log_probs_backward(const core::LogProbProblem& p, int dtype, const float* grad,
                                      const void* logits, const void* labels, int label_bits,
                                      const float* logits_max, const float* sum_exp, void* grad_logits,
                                      cudaStream_t stream) {
  if (p.rows <= 0 || p.vocab <= 0) return cudaSuccess;
  switch (dtype) {
    case 0: return backward_labels<float>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits, stream);
    case 1: return backward_labels<double>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits, stream);
    case 2: return backward_labels<__half>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits, stream);
    default:
      return backward_labels<__nv_bfloat16>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits,
                                            stream);
  }
}

}  // namespace cuda
}  // namespace verl_ops
