// Two kernels, the same arithmetic. Products and sums are rounded one by one (no fused
// multiply-add) so the result matches Megatron's sequence of elementwise ops bit for bit.
// - rope_vec_kernel (16-bit types, 16-byte aligned rows, dim a multiple of 16): one thread per
//   (row, head, 8 pairs), 16-byte loads and stores. All of a head's threads lie in one warp and
//   load everything before any of them stores, so the output may be the input itself (in place).
// - rope_kernel (any other case): one thread per (row, head, pair), scalar loads and stores; the
//   output must not overlap the input.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "rope_kernels.h"

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 256;

// __fadd_rn / __dadd_rn are never contracted into a fused multiply-add: the product is rounded on
// its own.
__device__ __forceinline__ float round_alone(float v) { return __fadd_rn(v, 0.0f); }
__device__ __forceinline__ double round_alone(double v) { return __dadd_rn(v, 0.0); }

// float and double: computed in their own type.
template <typename T>
struct Native {
  using Store = T;
  using Acc = T;
  static __device__ __forceinline__ Acc load(Store v) { return v; }
  static __device__ __forceinline__ Store store(Acc v) { return v; }
  static __device__ __forceinline__ Acc round(Acc v) { return round_alone(v); }
};

// A 16-bit type computed in float, every product rounded to the stored type (as Megatron's
// elementwise ops in that dtype do).
template <typename S, float (*Widen)(S), S (*Narrow)(float)>
struct Half {
  using Store = S;
  using Acc = float;
  static __device__ __forceinline__ Acc load(Store v) { return Widen(v); }
  static __device__ __forceinline__ Store store(Acc v) { return Narrow(v); }
  static __device__ __forceinline__ Acc round(Acc v) { return Widen(Narrow(v)); }
};

using F32 = Native<float>;
using F64 = Native<double>;
using F16 = Half<__half, __half2float, __float2half_rn>;
using BF16 = Half<__nv_bfloat16, __bfloat162float, __float2bfloat16_rn>;

template <typename D>
__global__ void __launch_bounds__(kBlock)
    rope_kernel(core::RopeProblem p, const typename D::Store* __restrict__ x,
                const typename D::Store* __restrict__ cs, const typename D::Store* __restrict__ sn,
                const int64_t* __restrict__ positions, typename D::Store* __restrict__ out) {
  using A = typename D::Acc;
  const int64_t half = p.dim / 2;
  const int64_t pairs = p.rows * p.heads * half;
  const auto rnd = [](A v) { return D::round(v); };
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t k = i % half;
    const int64_t rh = i / half;
    const int64_t h = rh % p.heads;
    const int64_t r = rh / p.heads;
    int64_t i0, i1, o0, o1;
    core::rope_pair_offsets(p, k, &i0, &i1, &o0, &o1);
    typename D::Store* oi = out + r * p.out_row_stride + h * p.out_head_stride;
    const int64_t pos = positions[r];
    if (pos < 0 || pos >= p.table_rows) {
      oi[o0] = D::store(A(0));
      oi[o1] = D::store(A(0));
      continue;
    }
    const typename D::Store* xi = x + r * p.row_stride + h * p.head_stride;
    const typename D::Store* c = cs + pos * p.dim;
    const typename D::Store* s = sn + pos * p.dim;
    A r0, r1;
    core::rope_pair<A>(p.backward, D::load(xi[i0]), D::load(xi[i1]), D::load(c[k]), D::load(s[k]),
                       D::load(c[k + half]), D::load(s[k + half]), rnd, &r0, &r1);
    oi[o0] = D::store(r0);
    oi[o1] = D::store(r1);
  }
}


// 8 values of a 16-bit type in one 16-byte vector.
union Pack8 {
  uint4 raw;
  unsigned short bits[8];
};

template <typename D>
__device__ __forceinline__ float unpack(const Pack8& v, int i) {
  typename D::Store s;
  static_assert(sizeof(s) == 2, "16-bit types only");
  memcpy(&s, &v.bits[i], 2);
  return D::load(s);
}

template <typename D>
__device__ __forceinline__ void pack(Pack8* v, int i, float a) {
  const typename D::Store s = D::store(a);
  memcpy(&v->bits[i], &s, 2);
}

__device__ __forceinline__ Pack8 load16(const void* p) {
  Pack8 v;
  v.raw = *static_cast<const uint4*>(p);
  return v;
}

template <typename D>
__global__ void __launch_bounds__(kBlock)
    rope_vec_kernel(core::RopeProblem p, const typename D::Store* x, const typename D::Store* __restrict__ cs,
                    const typename D::Store* __restrict__ sn, const int64_t* __restrict__ positions,
                    typename D::Store* out) {
  using S = typename D::Store;
  const int64_t half = p.dim / 2;
  const int64_t chunks = half / 8;  // threads per head
  const int64_t total = p.rows * p.heads * chunks;
  const bool in_il = p.interleaved && !p.backward;
  const bool out_il = p.interleaved && p.backward;
  const auto rnd = [](float v) { return D::round(v); };
  const int lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlock;
  // The loop runs on the warp's first index, so every lane of a warp takes the same trips and
  // reaches each __syncwarp.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kBlock + (threadIdx.x - lane); base < total;
       base += stride) {
    const int64_t i = base + lane;
    const bool active = i < total;
    const int64_t j = active ? i % chunks : 0;
    const int64_t rh = active ? i / chunks : 0;
    const int64_t h = rh % p.heads;
    const int64_t r = rh / p.heads;
    const int64_t pos = active ? positions[r] : 0;
    const bool in_table = pos >= 0 && pos < p.table_rows;
    Pack8 a0, a1;
    Pack8 c0, s0, c1, s1;
    if (active && in_table) {
      const S* xi = x + r * p.row_stride + h * p.head_stride;
      if (in_il) {
        a0 = load16(xi + 16 * j);
        a1 = load16(xi + 16 * j + 8);
      } else {
        a0 = load16(xi + 8 * j);
        a1 = load16(xi + half + 8 * j);
      }
      const S* c = cs + pos * p.dim;
      const S* sv = sn + pos * p.dim;
      c0 = load16(c + 8 * j);
      s0 = load16(sv + 8 * j);
      c1 = load16(c + half + 8 * j);
      s1 = load16(sv + half + 8 * j);
    }
    __syncwarp();  // every load of the head is done before any store (in place)
    if (!active) continue;
    Pack8 o0, o1;
    if (!in_table) {
      o0.raw = make_uint4(0, 0, 0, 0);
      o1.raw = o0.raw;
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        // Pair k = 8 j + t: its inputs a, b (de-interleaved or the two halves).
        const float a = in_il ? unpack<D>(t < 4 ? a0 : a1, (2 * t) & 7) : unpack<D>(a0, t);
        const float b = in_il ? unpack<D>(t < 4 ? a0 : a1, (2 * t + 1) & 7) : unpack<D>(a1, t);
        float r0, r1;
        core::rope_pair<float>(p.backward, a, b, unpack<D>(c0, t), unpack<D>(s0, t), unpack<D>(c1, t),
                               unpack<D>(s1, t), rnd, &r0, &r1);
        if (out_il) {
          Pack8& o = t < 4 ? o0 : o1;
          pack<D>(&o, (2 * t) & 7, r0);
          pack<D>(&o, (2 * t + 1) & 7, r1);
        } else {
          pack<D>(&o0, t, r0);
          pack<D>(&o1, t, r1);
        }
      }
    }
    S* oi = out + r * p.out_row_stride + h * p.out_head_stride;
    if (out_il) {
      *reinterpret_cast<uint4*>(oi + 16 * j) = o0.raw;
      *reinterpret_cast<uint4*>(oi + 16 * j + 8) = o1.raw;
    } else {
      *reinterpret_cast<uint4*>(oi + 8 * j) = o0.raw;
      *reinterpret_cast<uint4*>(oi + half + 8 * j) = o1.raw;
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// The vector kernel's conditions: 16-bit data, dim a multiple of 16 with its head's threads in one
// warp (dim / 16 divides 32), every row / head start and table row 16-byte aligned.
bool rope_vector_ok(const core::RopeProblem& p, int dtype, const void* x, const void* cos, const void* sin,
               const void* out) {
  if (dtype != 2 && dtype != 3) return false;
  if (p.rows * p.heads * (p.dim / 2) <= 0) return false;
  if (p.dim % 16 != 0 || 32 % (p.dim / 16) != 0) return false;
  const int64_t strides[] = {p.row_stride, p.head_stride, p.out_row_stride, p.out_head_stride, p.dim};
  for (int64_t s : strides) {
    if (s % 8 != 0) return false;
  }
  return aligned16(x) && aligned16(cos) && aligned16(sin) && aligned16(out);
}

namespace {

template <typename D>
cudaError_t launch(const core::RopeProblem& p, int dtype, const void* x, const void* cos, const void* sin,
                   const int64_t* positions, void* out, cudaStream_t stream) {
  using S = typename D::Store;
  const int64_t pairs = p.rows * p.heads * (p.dim / 2);
  if (pairs <= 0) return cudaSuccess;
  if constexpr (sizeof(S) == 2) {
    if (rope_vector_ok(p, dtype, x, cos, sin, out)) {
      const int64_t threads = pairs / 8;
      const int64_t blocks = std::min<int64_t>((threads + kBlock - 1) / kBlock, int64_t{1} << 20);
      rope_vec_kernel<D><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
          p, static_cast<const S*>(x), static_cast<const S*>(cos), static_cast<const S*>(sin), positions,
          static_cast<S*>(out));
      return cudaGetLastError();
    }
  }
  if (x == out) return cudaErrorInvalidValue;  // the scalar kernel does not run in place
  const int64_t blocks = std::min<int64_t>((pairs + kBlock - 1) / kBlock, int64_t{1} << 20);
  rope_kernel<D><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
      p, static_cast<const S*>(x), static_cast<const S*>(cos), static_cast<const S*>(sin), positions,
      static_cast<S*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mla_rope(const core::RopeProblem& p, int dtype, const void* x, const void* cos,
                            const void* sin, const int64_t* positions, void* out, cudaStream_t stream) {
  switch (dtype) {
    case 0: return launch<F32>(p, dtype, x, cos, sin, positions, out, stream);
    case 1: return launch<F64>(p, dtype, x, cos, sin, positions, out, stream);
    case 2: return launch<F16>(p, dtype, x, cos, sin, positions, out, stream);
    default: return launch<BF16>(p, dtype, x, cos, sin, positions, out, stream);
  }
}

}  // namespace cuda
}  // namespace verl_ops
