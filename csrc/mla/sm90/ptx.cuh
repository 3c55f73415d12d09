// The PTX both SM90 attention kernels use, wrapped once: shared-memory loads and stores by 32-bit
// shared address, mbarriers, TMA, register reallocation, named barriers, and the few arithmetic
// and shuffle helpers of their softmaxes and epilogues. wgmma lives in wgmma.cuh.
//
// Everything here and in the other headers of this folder is __device__ __forceinline__ (or
// constexpr) inside an anonymous namespace: mla_sm90_fwd.cu and mla_sm90_bwd.cu each compile their
// own copy, so splitting the kernels into these headers leaves their code as it was.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

// The kernels' bodies exist only in the sm_90a pass of nvcc (the "a" features: wgmma, setmaxnreg);
// other architectures compile them to nothing.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VERL_OPS_SM90A 1
#endif

namespace verl_ops {
namespace cuda {
namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Stores and loads by 32-bit shared address (a generic pointer would compile to generic ST / LD):
// the epilogues' staging of rows, the backward's lse2 / D rows.
__device__ __forceinline__ void sts_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// ... without the compiler memory barrier: the backward's dS^T stores, which the compiler may move
// among other memory accesses (a proxy fence and an mbarrier arrive order them for wgmma).
__device__ __forceinline__ void sts_b32_unordered(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}
__device__ __forceinline__ void sts_f2(uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ uint4 lds_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// mbarriers (shared::cta).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// The inits visible to the async proxy (TMA) and the other threads, before the __syncthreads.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Generic-proxy writes to shared memory (st.shared) made visible to the async proxy (wgmma reading
// them as an operand).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A box of a 3-D tensor map into shared memory at dst, completing on the mbarrier bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Registers per thread handed from the producer warpgroup to the consumers (warpgroup-wide).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers (ids: named_barriers.h) over kThreads threads.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across this point (after a
// wgmma wait: the registers hold the GEMM's result only from there on).
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Two floats as a packed fp16 / bf16 pair (lo in the low half), and back.
template <bool kHalf>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kHalf) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
template <bool kHalf>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (kHalf) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  }
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max / sum over the four lanes of a quad (the threads holding one accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A vector reduction of four floats (16 bytes, aligned; RED.E.ADD.F32x4 on sm_90: the result is
// unused). The float4 overload of atomicAdd exists from sm_90 on; the kernel that calls this is
// compiled for sm_90a only.
__device__ __forceinline__ void red_add4(float* addr, float4 v) {
#if defined(VERL_OPS_SM90A)
  atomicAdd(reinterpret_cast<float4*>(addr), v);
#else
  (void)addr;
  (void)v;
#endif
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
