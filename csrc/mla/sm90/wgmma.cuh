// wgmma (warpgroup MMA) for the SM90 attention kernels: the shared-memory matrix descriptor, the
// fence / commit / wait of an issue, and one wrapper per shape the kernels issue (m64, k16, fp32
// accumulators, fp16 or bf16 operands):
//   wgmma_ss_n32_tt   D[64x32]  (+)= A[64x16] * B[16x32], both in shared memory, both MN-major
//   wgmma_ss_n64      D[64x64]  (+)= A * B, shared, K-major (kMnMajor 0) or both MN-major (1)
//   wgmma_ss_n128     D[64x128] (+)= A * B, shared, K-major
//   wgmma_rs_n128     D[64x128]  += A (registers) * B (shared, MN-major)
//   wgmma_rs_n192     D[64x192]  += A (registers) * B (shared, MN-major)
// The accumulator is a float array in the wgmma fragment layout; `accumulate` 0 overwrites D.
#pragma once

#include <cstdint>

namespace verl_ops {
namespace cuda {
namespace {

// Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// The descriptor of the operand at 16-byte offset `off16` from the one of d0: the low word's
// address field plus the offset (shared addresses stay below 2^18, so it never carries into the
// leading-byte-offset field); the high word (stride, swizzle) is shared.
__device__ __forceinline__ uint64_t desc_at(uint64_t d0, uint32_t off16) {
  return (d0 & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d0) + off16);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The asm operand lists: accumulator registers {%0, ...} and the "+f" bindings of d[0 ...].
#define VERL_OPS_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define VERL_OPS_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define VERL_OPS_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define VERL_OPS_WGMMA_D96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define VERL_OPS_WGMMA_F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define VERL_OPS_WGMMA_F16(d) VERL_OPS_WGMMA_F8(d, 0), VERL_OPS_WGMMA_F8(d, 8)
#define VERL_OPS_WGMMA_F32(d) VERL_OPS_WGMMA_F8(d, 0), VERL_OPS_WGMMA_F8(d, 8), VERL_OPS_WGMMA_F8(d, 16), VERL_OPS_WGMMA_F8(d, 24)
#define VERL_OPS_WGMMA_F64(d) VERL_OPS_WGMMA_F8(d, 0), VERL_OPS_WGMMA_F8(d, 8), VERL_OPS_WGMMA_F8(d, 16), VERL_OPS_WGMMA_F8(d, 24), VERL_OPS_WGMMA_F8(d, 32), VERL_OPS_WGMMA_F8(d, 40), VERL_OPS_WGMMA_F8(d, 48), VERL_OPS_WGMMA_F8(d, 56)
#define VERL_OPS_WGMMA_F96(d) VERL_OPS_WGMMA_F8(d, 0), VERL_OPS_WGMMA_F8(d, 8), VERL_OPS_WGMMA_F8(d, 16), VERL_OPS_WGMMA_F8(d, 24), VERL_OPS_WGMMA_F8(d, 32), VERL_OPS_WGMMA_F8(d, 40), VERL_OPS_WGMMA_F8(d, 48), VERL_OPS_WGMMA_F8(d, 56), VERL_OPS_WGMMA_F8(d, 64), VERL_OPS_WGMMA_F8(d, 72), VERL_OPS_WGMMA_F8(d, 80), VERL_OPS_WGMMA_F8(d, 88)

// Each wrapper spells its instruction once, as VERL_OPS_WGMMA(type), for "f16" and "bf16".
// The scale-d predicate p comes from `accumulate`; the immediates after it are the A / B scales (1)
// and, for shared-memory operands, the A / B transposes.

template <bool kHalf>
__device__ __forceinline__ void wgmma_ss_n32_tt(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
#define VERL_OPS_WGMMA(T)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " " VERL_OPS_WGMMA_D16     \
               ", %16, %17, p, 1, 1, 1, 1;\n}\n"                                                \
               : VERL_OPS_WGMMA_F16(d)                                                          \
               : "l"(da), "l"(db), "r"(accumulate))
  if constexpr (kHalf) VERL_OPS_WGMMA("f16"); else VERL_OPS_WGMMA("bf16");
#undef VERL_OPS_WGMMA
}

template <bool kHalf, int kMnMajor = 0>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#define VERL_OPS_WGMMA(T)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " VERL_OPS_WGMMA_D32     \
               ", %32, %33, p, 1, 1, %35, %35;\n}\n"                                            \
               : VERL_OPS_WGMMA_F32(d)                                                          \
               : "l"(da), "l"(db), "r"(accumulate), "n"(kMnMajor))
  if constexpr (kHalf) VERL_OPS_WGMMA("f16"); else VERL_OPS_WGMMA("bf16");
#undef VERL_OPS_WGMMA
}

template <bool kHalf>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
#define VERL_OPS_WGMMA(T)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " VERL_OPS_WGMMA_D64    \
               ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                \
               : VERL_OPS_WGMMA_F64(d)                                                          \
               : "l"(da), "l"(db), "r"(accumulate))
  if constexpr (kHalf) VERL_OPS_WGMMA("f16"); else VERL_OPS_WGMMA("bf16");
#undef VERL_OPS_WGMMA
}

template <bool kHalf>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
#define VERL_OPS_WGMMA(T)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " VERL_OPS_WGMMA_D64    \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                  \
               : VERL_OPS_WGMMA_F64(d)                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
  if constexpr (kHalf) VERL_OPS_WGMMA("f16"); else VERL_OPS_WGMMA("bf16");
#undef VERL_OPS_WGMMA
}

template <bool kHalf>
__device__ __forceinline__ void wgmma_rs_n192(float (&d)[96], const uint32_t (&a)[4], uint64_t db) {
#define VERL_OPS_WGMMA(T)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"                                   \
               "wgmma.mma_async.sync.aligned.m64n192k16.f32." T "." T " " VERL_OPS_WGMMA_D96    \
               ", {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"                                 \
               : VERL_OPS_WGMMA_F96(d)                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
  if constexpr (kHalf) VERL_OPS_WGMMA("f16"); else VERL_OPS_WGMMA("bf16");
#undef VERL_OPS_WGMMA
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
