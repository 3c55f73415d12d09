// One thread per (row, head, pair): it reads the pair's two inputs and the four table entries and
// writes the pair's two outputs. Products and sums are rounded one by one (no fused multiply-add)
// so the result matches Megatron's sequence of elementwise ops bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

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
    typename D::Store* oi = out + rh * p.dim;
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

template <typename D>
cudaError_t launch(const core::RopeProblem& p, const void* x, const void* cos, const void* sin,
                   const int64_t* positions, void* out, cudaStream_t stream) {
  using S = typename D::Store;
  const int64_t pairs = p.rows * p.heads * (p.dim / 2);
  if (pairs <= 0) return cudaSuccess;
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
    case 0: return launch<F32>(p, x, cos, sin, positions, out, stream);
    case 1: return launch<F64>(p, x, cos, sin, positions, out, stream);
    case 2: return launch<F16>(p, x, cos, sin, positions, out, stream);
    default: return launch<BF16>(p, x, cos, sin, positions, out, stream);
  }
}

}  // namespace cuda
}  // namespace verl_ops
