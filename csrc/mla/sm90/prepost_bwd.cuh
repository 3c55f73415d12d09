// The backward's two small kernels around the main one: before it, D = rowsum(dO * O) per row and
// head next to lse * log2(e), as float2 [Hq, Tq] (dQ's fp32 accumulator is zeroed by a memset);
// after it, dQ = accumulator * scale in the input dtype, for every row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx.cuh"

namespace verl_ops {
namespace cuda {
namespace {
namespace bwd {

// D = rowsum(dO * O) for each row and head, next to lse * log2(e): lse_d [hq, tq]. 16 threads per
// (row, head), 8 elements each.
template <bool kHalf>
__global__ void __launch_bounds__(256) bwd_pre_kernel(const uint4* __restrict__ out,
                                                      const uint4* __restrict__ dout,
                                                      const float* __restrict__ lse,
                                                      int64_t lse_sr, int64_t lse_sh,
                                                      float2* __restrict__ lse_d, int64_t tq, int hq) {
  const int64_t gid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t pair = gid / 16;
  const int part = static_cast<int>(gid % 16);
  const bool ok = pair < tq * hq;
  float acc = 0.f;
  if (ok) {
    const uint4 o = out[pair * 16 + part], d = dout[pair * 16 + part];
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 of = unpack2<kHalf>(ow[w]), df = unpack2<kHalf>(dw[w]);
      acc = fmaf(of.x, df.x, fmaf(of.y, df.y, acc));
    }
  }
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (ok && part == 0) {
    const int64_t row = pair / hq;
    const int h = static_cast<int>(pair % hq);
    lse_d[h * tq + row] = make_float2(lse[row * lse_sr + h * lse_sh] * 1.4426950408889634f, acc);
  }
}

// dQ = accumulator * scale in the input dtype, four elements per thread.
template <bool kHalf>
__global__ void __launch_bounds__(256) bwd_post_kernel(const float4* __restrict__ acc, uint2* __restrict__ dq,
                                                       int64_t n4, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = acc[i];
    dq[i] = make_uint2(pack2<kHalf>(a.x * scale, a.y * scale), pack2<kHalf>(a.z * scale, a.w * scale));
  }
}

}  // namespace bwd
}  // namespace
}  // namespace cuda
}  // namespace verl_ops
