// Backward attention of the varlen backend on Hopper (SM90a) for MLA's head dims: packed THD rows,
// Dqk 192 / Dv 128, fp16 or bf16, causal (top-left or bottom-right) or not, grouped kv heads.
// Reads what either forward (mla_sm90_fwd.cu or cuDNN's) wrote: O and the natural-log log-sum-exp (by strides).
//
// Three kernels:
// - pre: D = rowsum(dO * O) per row and head, next to lse * log2(e), as float2 [Hq, Tq]
//   (dQ's fp32 accumulator is zeroed by a memset before it).
// - main: a CTA per (sequence, kv head, block of 128 keys), 384 threads. Warp 0 of the producer
//   warpgroup loads the block's K (128 x 192) and V (128 x 128) once, then, for each q head of
//   the group and each 64-row query block that sees one of these keys, its Q (64 x 192) and dO
//   (64 x 128) through TMA (128-byte swizzle) and its rows' lse2 / D into a two-stage ring. Two
//   consumer warpgroups, 64 keys each, hold dK (64 x 192) and dV (64 x 128) in fp32 registers
//   over all query blocks (160 of their 240 registers, so S^T and dP^T are never live together):
//     S^T = K Q^T                       (wgmma, both operands in shared memory)
//     P^T = exp2(S^T * scale * log2(e) - lse2), masked, into bf16 / fp16 A fragments
//     dV += P^T dO and dP^T = V dO^T    (issued together)
//     dS^T = P^T * (dP^T - D);  dK += dS^T Q  (A fragments from registers)
//     dS^T to shared memory; a block later, once both warpgroups' halves are there (mbarriers,
//     two buffers), dQ (64 rows) += dS K over the 128 keys, warpgroup w taking the 64 columns
//     64 w ... and 32 of the last 64, added to the fp32 accumulator with 16-byte vector
//     reductions (the two lanes of a pair swap a column pair first, so each holds four
//     consecutive columns: half the reductions of 8-byte ones, and 1.08-1.14x the backward)
//   and write dK * scale and dV for the keys inside the sequence (zeros where no query sees them),
//   staged through the freed Q / dO stages so that whole rows are stored in 16-byte chunks.
// - post: dQ = accumulator * scale, to the input dtype, for every row.
// Sequences run longest first (the forward's schedule kernel over the key lengths), no host read.
#include "mla_sm90_bwd.h"

#include "mla_sm90_common.cuh"
#include "mla_sm90_fwd.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBN = 128;  // keys per CTA: two consumer warpgroups of 64
constexpr int kBM = 64;   // query rows per block
constexpr int kDqk = 192;
constexpr int kDv = 128;
constexpr int kStages = 2;
constexpr int kThreads = 384;

constexpr int kKBytes = kBN * kDqk * 2;   // 48 KiB: three 64-column chunks of 128 rows x 128 B
constexpr int kVBytes = kBN * kDv * 2;    // 32 KiB
constexpr int kQBytes = kBM * kDqk * 2;   // 24 KiB: three chunks of 64 rows x 128 B
constexpr int kOBytes = kBM * kDv * 2;    // 16 KiB (dO)
constexpr int kDSBytes = kBN * kBM * 2;   // 16 KiB: dS^T [128 keys][64 queries], both warpgroups
constexpr int kSmemK = 0;
constexpr int kSmemV = kSmemK + kKBytes;
constexpr int kSmemQ = kSmemV + kVBytes;
constexpr int kSmemDO = kSmemQ + kStages * kQBytes;
constexpr int kSmemDS = kSmemDO + kStages * kOBytes;     // two buffers
constexpr int kSmemLD = kSmemDS + 2 * kDSBytes;          // lse2 / D: [stage][64] float2
constexpr int kSmemBar = kSmemLD + kStages * kBM * 8;
constexpr int kNumBars = 1 + 2 * kStages + 4;            // K / V full, Q / dO / lse full and empty, dS full and empty
constexpr int kSmemBytes = kSmemBar + kNumBars * 8 + 1024;
static_assert(kSmemBytes <= 232448, "shared memory over the 227 KiB an SM90 CTA can opt in to");

struct BwdParams {
  const int32_t* order;        // [batch]: sequences, longest first (by keys)
  const int32_t* tile_prefix;  // [batch + 1]: first CTA of each sequence in that order
  const int32_t* cu_q;
  const int32_t* cu_kv;
  const float2* lse_d;         // [hq, tq]: {lse * log2(e), D}
  float* dq_accum;             // [tq, hq, 192]
  void* dk;                    // [tk, hk, 192]
  void* dv;                    // [tk, hk, 128]
  int64_t tq, tk;
  int hq, hk, batch;
  float scale, scale_log2;
  int causal, bottom_right;
};

template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory float2 store by 32-bit shared address (a generic pointer would compile to a
// generic ST).
__device__ __forceinline__ void sts_f2(uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}

template <bool kHalf>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (kHalf) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  }
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

// D[64x32] (+)= A[64x16] (shared, MN-major) * B[16x32] (shared, MN-major).
template <bool kHalf>
__device__ __forceinline__ void wgmma_ss_n32_tt(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate));
  }
}

// D[64x128] += A[64x16] (registers) * B[16x128] (shared, MN-major).
template <bool kHalf>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  }
}

// D[64x192] += A[64x16] (registers) * B[16x192] (shared, MN-major).
template <bool kHalf>
__device__ __forceinline__ void wgmma_rs_n192(float (&d)[96], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
  }
}

template <bool kHalf>
__global__ void __launch_bounds__(kThreads, 1)
    mla_sm90_bwd_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                        const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tdo,
                        const BwdParams p) {
#if defined(VERL_OPS_SM90A)
  const int total = p.tile_prefix[p.batch];
  const int tile = blockIdx.x;
  if (tile >= total) return;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t{1023});
  const uint32_t base = smem_u32(smem);
  const uint32_t bar_kv = base + kSmemBar;
  auto bar_full = [&](int s) { return base + kSmemBar + 8 * (1 + s); };
  auto bar_empty = [&](int s) { return base + kSmemBar + 8 * (1 + kStages + s); };
  auto bar_ds_full = [&](int b) { return base + kSmemBar + 8 * (1 + 2 * kStages + b); };
  auto bar_ds_empty = [&](int b) { return base + kSmemBar + 8 * (3 + 2 * kStages + b); };

  // The CTA's sequence (binary search over the schedule), kv head and key block.
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_prefix[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int b = p.order[lo];
  const int local = tile - p.tile_prefix[lo];
  const int lq = clamp_len(p.cu_q, b, p.tq), lk = clamp_len(p.cu_kv, b, p.tk);
  // Row indices fit in 32 bits (the caller routes only tq, tk < 2^31 here).
  const int q_start = static_cast<int>(clamp_start(p.cu_q, b, p.tq));
  const int k_start = static_cast<int>(clamp_start(p.cu_kv, b, p.tk));
  const int nkb = (lk + kBN - 1) / kBN;
  const int kvh = local / nkb;
  const int key0 = (local % nkb) * kBN;
  const int shift = p.causal ? (p.bottom_right ? lk - lq : 0) : 0;
  // Query blocks that see a key of this block: under a causal mask row i sees key j <= i + shift.
  const int m_begin = p.causal ? max(0, key0 - shift) / kBM : 0;
  const int m_end = (lq + kBM - 1) / kBM;
  const int nblk = max(0, m_end - m_begin);
  const int group = p.hq / p.hk;
  const int blocks = group * nblk;

  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full(s), 1 + 32);  // the TMA bytes, and each producer lane's lse2 / D rows
      mbar_init(bar_empty(s), 256);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(bar_ds_full(b), 256);
      mbar_init(bar_ds_empty(b), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp_group == 0) {
    // Producer: warp 0. Lane 0 issues the TMA loads; every lane writes two rows of lse2 / D.
    // 24 + 2 x 240 = 3 x 168, the registers per thread the CTA was launched with: a larger sum
    // would leave setmaxnreg.inc waiting forever.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x < 32 && blocks > 0) {
      const int lane = threadIdx.x;
      const int k_row = k_start + key0;
      if (lane == 0) {
        mbar_expect_tx(bar_kv, kKBytes + kVBytes);
#pragma unroll
        for (int c = 0; c < kDqk / 64; ++c)
          tma_load_3d(base + kSmemK + c * kBN * 128, &tk, c * 64, kvh, k_row, bar_kv);
#pragma unroll
        for (int c = 0; c < kDv / 64; ++c)
          tma_load_3d(base + kSmemV + c * kBN * 128, &tv, c * 64, kvh, k_row, bar_kv);
      }
      for (int i = 0; i < blocks; ++i) {
        const int s = i % kStages;
        const uint32_t phase = (i / kStages) & 1;
        const int h = kvh * group + i / nblk;
        const int q0 = (m_begin + i % nblk) * kBM;
        const int q_row = q_start + q0;
        mbar_wait(bar_empty(s), phase ^ 1);
        if (lane == 0) {
          mbar_expect_tx(bar_full(s), kQBytes + kOBytes);
#pragma unroll
          for (int c = 0; c < kDqk / 64; ++c)
            tma_load_3d(base + kSmemQ + s * kQBytes + c * kBM * 128, &tq, c * 64, h, q_row, bar_full(s));
#pragma unroll
          for (int c = 0; c < kDv / 64; ++c)
            tma_load_3d(base + kSmemDO + s * kOBytes + c * kBM * 128, &tdo, c * 64, h, q_row,
                        bar_full(s));
        }
        const uint32_t ld = base + kSmemLD + s * kBM * 8;
#pragma unroll
        for (int r = 0; r < kBM / 32; ++r) {
          const int qi = q0 + lane + 32 * r;
          sts_f2(ld + (lane + 32 * r) * 8, qi < lq ? p.lse_d[static_cast<int64_t>(h) * p.tq + (q_start + qi)]
                                                   : make_float2(INFINITY, 0.f));
        }
        mbar_arrive(bar_full(s));
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int wg = warp_group - 1;  // keys 64 * wg ... of the block
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  const int kr = warp * 16 + lane / 4;  // this thread's key rows kr and kr + 8 of the warpgroup
  const int kw0 = key0 + wg * 64;       // the warpgroup's first key (in the sequence)
  const int key_a = kw0 + kr, key_b = key_a + 8;
  const float sl2 = p.scale_log2;

  float dv[64], dk[96];
#pragma unroll
  for (int i = 0; i < 64; ++i) dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) dk[i] = 0.f;

  if (blocks > 0) {
    mbar_wait(bar_kv, 0);
    const uint32_t k_base = base + kSmemK + wg * 64 * 128;
    const uint32_t v_base = base + kSmemV + wg * 64 * 128;
    const uint64_t dk_a = smem_desc(k_base, 16, 1024);   // K as A (K-major)
    const uint64_t dv_a = smem_desc(v_base, 16, 1024);   // V as A (K-major)
    // dQ = dS K over all 128 keys, split by columns: warpgroup w takes the 64-column chunk w and
    // the 32 columns 128 + 32 w ... of chunk 2 (K as B, MN-major).
    const uint64_t dk_b0 = smem_desc(base + kSmemK + wg * kBN * 128, 16, 1024);
    const uint64_t dk_b1 = smem_desc(base + kSmemK + 2 * kBN * 128 + wg * 64, 16, 1024);
    const int col_a = wg * 64, col_b = 128 + wg * 32;  // first dQ column of qa, of qb

    // dQ (64 rows) += dS K for block j over the 128 keys, in this warpgroup's 96 columns: once
    // both warpgroups' dS^T of block j are in buffer j & 1 (it runs a block behind, so the two
    // warpgroups need not move in step).
    // (h, q0: block j's query head and first query row, carried over from the main loop's
    // counters.)
    auto dq_step = [&](int j, int h, int q0) {
      const int b = __shfl_sync(0xffffffffu, j & 1, 0);
      float qa[32], qb[16];
      const uint64_t ds_a = smem_desc(base + kSmemDS + b * kDSBytes, 16, 1024);  // dS^T as A (MN-major)
      mbar_wait(bar_ds_full(b), (j / 2) & 1);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma_ss_n64<kHalf, 1>(qa, desc_at(ds_a, (k * 2048) >> 4), desc_at(dk_b0, (k * 2048) >> 4), k > 0);
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma_ss_n32_tt<kHalf>(qb, desc_at(ds_a, (k * 2048) >> 4), desc_at(dk_b1, (k * 2048) >> 4), k > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(qa);
      fence_acc(qb);
      mbar_arrive(bar_ds_empty(b));
      const int qrow = q_start + q0 + kr;  // accumulator rows kr, kr + 8: queries
      // Lanes 2u and 2u + 1 of a quad swap one column pair per two 8-column chunks, so each holds
      // four consecutive columns: one 16-byte reduction where there were two 8-byte ones.
      const bool odd = lane & 1;
      const int q4 = 2 * (lane % 4) - (odd ? 2 : 0);  // first column of the four, in the chunk
      // One chunk pair: c0 = 2 cp, c1 = c0 + 1 of the accumulator x (32 or 16 floats), added at
      // dst + 16 cp (dst: this lane's first column of the row's chunk pairs).
      auto pair4 = [&](const float* x, int cp, int r, bool ok, float* dst) {
        const int c0 = 2 * cp, c1 = c0 + 1;
        const float sx = odd ? x[4 * c0 + 2 * r] : x[4 * c1 + 2 * r];
        const float sy = odd ? x[4 * c0 + 2 * r + 1] : x[4 * c1 + 2 * r + 1];
        const float rx = __shfl_xor_sync(0xffffffffu, sx, 1), ry = __shfl_xor_sync(0xffffffffu, sy, 1);
        const float4 v = odd ? make_float4(rx, ry, x[4 * c1 + 2 * r], x[4 * c1 + 2 * r + 1])
                             : make_float4(x[4 * c0 + 2 * r], x[4 * c0 + 2 * r + 1], rx, ry);
        if (ok) red_add4(dst + cp * 16, v);
      };
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool ok = q0 + kr + 8 * r < lq;
        float* dst = p.dq_accum + (static_cast<int64_t>(qrow + 8 * r) * p.hq + h) * kDqk + q4 + (odd ? 8 : 0);
#pragma unroll
        for (int cp = 0; cp < 4; ++cp) pair4(qa, cp, r, ok, dst + col_a);
#pragma unroll
        for (int cp = 0; cp < 2; ++cp) pair4(qb, cp, r, ok, dst + col_b);
      }
    };

    // Block i's query block (i % nblk) and head (kvh * group + i / nblk) as counters: a division
    // per block (~30 instructions, with the dQ step's) sat between one block's last GEMM and the
    // next one's first.
    int mi = 0, hcur = kvh * group, prev_h = 0, prev_q0 = 0;
    for (int i = 0; i < blocks; ++i) {
      const int s = __shfl_sync(0xffffffffu, i % kStages, 0);
      const uint32_t phase = (i / kStages) & 1;
      const int q0 = (m_begin + mi) * kBM;  // the block's first query row (in the sequence)
      const int db = __shfl_sync(0xffffffffu, i & 1, 0);  // dS buffer
      const uint32_t ds_base = base + kSmemDS + db * kDSBytes;
      // Whether some key of this warpgroup is seen by some row of the block, and whether every
      // one is seen by every row (no mask).
      const bool active = kw0 < lk && (!p.causal || kw0 <= q0 + kBM - 1 + shift);
      const bool full = q0 + kBM <= lq && kw0 + 64 <= lk && (!p.causal || kw0 + 63 <= q0 + shift);
      mbar_wait(bar_full(s), phase);
      const uint32_t ld = base + kSmemLD + s * kBM * 8;  // lse2 / D of the block's rows
      uint32_t dsfrag[4][4];
      if (active) {
        const uint32_t q_base = base + kSmemQ + s * kQBytes;
        const uint32_t do_base = base + kSmemDO + s * kOBytes;
        float sacc[32], dpacc[32];
        // S^T = K Q^T (12 k-steps over 192), issued.
        const uint64_t dq_b = smem_desc(q_base, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kDqk / 16; ++kk) {
          const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
          wgmma_ss_n64<kHalf>(sacc, desc_at(dk_a, (chunk * kBN * 128 + off) >> 4),
                              desc_at(dq_b, (chunk * kBM * 128 + off) >> 4), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(sacc);
        // P^T, straight into the A fragments of dV += P^T dO (registers: dK and dV hold 160 of
        // them, so S^T and dP^T are not live at once). Column c of the accumulator is query
        // q0 + c, row kr (kr + 8) key key_a (key_b).
        uint32_t pfrag[4][4];
        // Three copies of the loop: unmasked, masked causal, masked non-causal. One loop with the
        // mask under a branch per column pair was cut into eight basic blocks (no interleaving
        // of the column pairs' exp2s), 1-3% slower; the masked copy split by p.causal too (ptxas
        // tested it per column pair) +1-5% more (RESULTS.md).
        auto p_loop = [&](auto masked_c, auto causal_c) {
          constexpr bool kMasked = decltype(masked_c)::value;
#pragma unroll
          for (int cc = 0; cc < 8; ++cc) {
            float pv[4];
            // Both columns' lse2 (and D) in one 16-byte load (half the shared-memory loads of
            // two 4-byte ones each: +2-5% on the backward, RESULTS.md).
            const uint4 ldv = lds_v4(ld + (cc * 8 + 2 * (lane % 4)) * 8);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = cc * 8 + 2 * (lane % 4) + e;
              const float l2 = __uint_as_float(e ? ldv.z : ldv.x);
              float pa = ex2(fmaf(sacc[4 * cc + e], sl2, -l2));
              float pb = ex2(fmaf(sacc[4 * cc + 2 + e], sl2, -l2));
              if constexpr (kMasked) {
                const int qi = q0 + c;
                const int lim = decltype(causal_c)::value ? min(lk, qi + shift + 1) : lk;
                if (qi >= lq || key_a >= lim) pa = 0.f;
                if (qi >= lq || key_b >= lim) pb = 0.f;
              }
              pv[e] = pa;
              pv[2 + e] = pb;
            }
            pfrag[cc / 2][(cc % 2) * 2 + 0] = pack2<kHalf>(pv[0], pv[1]);
            pfrag[cc / 2][(cc % 2) * 2 + 1] = pack2<kHalf>(pv[2], pv[3]);
          }
        };
        if (full)
          p_loop(std::false_type{}, std::false_type{});
        else if (p.causal)
          p_loop(std::true_type{}, std::true_type{});
        else
          p_loop(std::true_type{}, std::false_type{});
        // dV += P^T dO (B MN-major: 64-column chunks kBM * 128 bytes apart, a k-step of 16
        // query rows 2 KiB on) and dP^T = V dO^T (8 k-steps over 128), issued.
        {
          const uint64_t ddo_t = smem_desc(do_base, kBM * 128, 1024);
          const uint64_t ddo_b = smem_desc(do_base, 16, 1024);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_rs_n128<kHalf>(dv, pfrag[j], desc_at(ddo_t, (j * 2048) >> 4));
#pragma unroll
          for (int kk = 0; kk < kDv / 16; ++kk) {
            const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
            wgmma_ss_n64<kHalf>(dpacc, desc_at(dv_a, (chunk * kBN * 128 + off) >> 4),
                                desc_at(ddo_b, (chunk * kBM * 128 + off) >> 4), kk > 0);
          }
          wgmma_commit();
        }
        wgmma_wait<0>();
        fence_acc(dpacc);
        fence_acc(dv);
        // dS^T = P^T (dP^T - D), from the P^T fragments, straight into the A fragments of dK.
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) {
          const uint4 ldv = lds_v4(ld + (cc * 8 + 2 * (lane % 4)) * 8);
          const float d0 = __uint_as_float(ldv.y), d1 = __uint_as_float(ldv.w);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float2 pr = unpack2<kHalf>(pfrag[cc / 2][(cc % 2) * 2 + r]);
            dsfrag[cc / 2][(cc % 2) * 2 + r] =
                pack2<kHalf>(pr.x * (dpacc[4 * cc + 2 * r] - d0), pr.y * (dpacc[4 * cc + 2 * r + 1] - d1));
          }
        }
        // dK += dS^T Q (B MN-major), issued.
        {
          const uint64_t dq_t = smem_desc(q_base, kBM * 128, 1024);
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_rs_n192<kHalf>(dk, dsfrag[j], desc_at(dq_t, (j * 2048) >> 4));
          wgmma_commit();
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int u = 0; u < 4; ++u) dsfrag[j][u] = 0u;
      }
      // dS^T (zeros where this warpgroup's keys are unseen) to shared memory, rows 64 wg ... of
      // [128 keys][64 queries] with the 128-byte swizzle: the A operand (MN-major) of dQ = dS K.
      // Two buffers, each free again once both warpgroups' dQ GEMMs of block i - 2 are done.
      mbar_wait(bar_ds_empty(db), ((i / 2) & 1) ^ 1);
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = wg * 64 + kr + 8 * r;
          const uint32_t addr = ds_base + row * 128 + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(dsfrag[cc / 2][(cc % 2) * 2 + r]));
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(bar_ds_full(db));
      // The dK GEMM done (its A fragments then free their registers): the stage's Q / dO / lse2 / D
      // are no longer read. Then the dQ of the block before.
      wgmma_wait<0>();
      fence_acc(dk);
      mbar_arrive(bar_empty(s));
      if (i > 0) dq_step(i - 1, prev_h, prev_q0);
      prev_h = hcur;
      prev_q0 = q0;
      if (++mi == nblk) {
        mi = 0;
        ++hcur;
      }
    }
    if (blocks > 0) dq_step(blocks - 1, prev_h, prev_q0);
  }
  // dK * scale and dV of the keys inside the sequence.
  const float scale = p.scale;
  // Through shared memory, as the forward's epilogue (+0-6% on the backward, most on short
  // sequences; RESULTS.md), so that whole rows (384 bytes of dK, 256 of dV) are stored in 16-byte chunks instead
  // of 4-byte words scattered over 8 rows per warp store. The Q / dO stages (80 KiB) hold both
  // warpgroups' dK and dV once both are past their last GEMM that reads them (K and the dS
  // buffers stay untouched: the other warpgroup's last dQ GEMM may still read them).
  {
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    constexpr int kDkRow = kDqk * 2, kDvRow = kDv * 2;  // bytes per staged row
    static_assert(2 * 64 * (kDkRow + kDvRow) <= kSmemDS - kSmemQ, "dK / dV staging over the Q / dO stages");
    const uint32_t sk = base + kSmemQ + wg * 64 * (kDkRow + kDvRow);
    const uint32_t sv = sk + 64 * kDkRow;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = kr + 8 * r;
#pragma unroll
      for (int cc = 0; cc < kDqk / 8; ++cc)
        sts_b32(sk + row * kDkRow + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4),
                pack2<kHalf>(dk[4 * cc + 2 * r] * scale, dk[4 * cc + 2 * r + 1] * scale));
#pragma unroll
      for (int cc = 0; cc < kDv / 8; ++cc)
        sts_b32(sv + row * kDvRow + ((cc ^ (row & 7)) << 4) + 4 * (lane % 4),
                pack2<kHalf>(dv[4 * cc + 2 * r], dv[4 * cc + 2 * r + 1]));
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
    // The warpgroup's 64 staged rows of kChunks 16-byte chunks at stage, to the key rows of dst.
    auto store_rows = [&](auto chunks, uint32_t stage, void* dst) {
      constexpr int kChunks = decltype(chunks)::value, kRowBytes = kChunks * 16;
      uint8_t* bytes = static_cast<uint8_t*>(dst);
#pragma unroll
      for (int i = 0; i < 64 * kChunks / 128; ++i) {
        const int id = i * 128 + t, row = id / kChunks, ch = id % kChunks;
        const uint4 v = lds_v4(stage + row * kRowBytes + ((ch ^ (row & 7)) << 4));
        if (kw0 + row < lk)
          *reinterpret_cast<uint4*>(bytes + ((k_start + kw0 + row) * static_cast<int64_t>(p.hk) + kvh) * kRowBytes +
                                    ch * 16) = v;
      }
    };
    store_rows(std::integral_constant<int, kDkRow / 16>{}, sk, p.dk);  // 12 chunks of dK per thread
    store_rows(std::integral_constant<int, kDvRow / 16>{}, sv, p.dv);  // 8 of dV
  }
#endif
}

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
      float2 of, df;
      if constexpr (kHalf) {
        of = __half22float2(*reinterpret_cast<const __half2*>(&ow[w]));
        df = __half22float2(*reinterpret_cast<const __half2*>(&dw[w]));
      } else {
        of = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ow[w]));
        df = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dw[w]));
      }
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

template <bool kHalf>
cudaError_t launch_bwd(const Sm90BwdArgs& a, BwdParams& p, cudaStream_t stream) {
  CUtensorMap mq, mk, mv, mdo;
  if (!make_map(&mq, a.q, a.tq, a.hq, kDqk, kBM, kHalf) ||
      !make_map(&mk, a.k, a.tk, a.hk, kDqk, kBN, kHalf) ||
      !make_map(&mv, a.v, a.tk, a.hk, kDv, kBN, kHalf) ||
      !make_map(&mdo, a.dout, a.tq, a.hq, kDv, kBM, kHalf))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(a.dq_accum, 0, sizeof(float) * a.tq * a.hq * kDqk, stream);
  if (err != cudaSuccess) return err;
  {
    const int64_t threads = a.tq * a.hq * 16;
    bwd_pre_kernel<kHalf><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
        static_cast<const uint4*>(a.out), static_cast<const uint4*>(a.dout), a.lse, a.lse_row_stride,
        a.lse_head_stride, a.lse_d, a.tq,
        static_cast<int>(a.hq));
  }
  auto kernel = mla_sm90_bwd_kernel<kHalf>;
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> opted_in[kMaxDevices];
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices || !opted_in[dev].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < kMaxDevices) opted_in[dev].store(true, std::memory_order_release);
  }
  // A CTA per (sequence, kv head, key block): at most hk * (tk / kBN + batch); the ones past the
  // schedule's total return at once.
  const int64_t ctas = a.hk * ((a.tk + kBN - 1) / kBN + a.batch);
  kernel<<<static_cast<unsigned>(ctas), kThreads, kSmemBytes, stream>>>(mq, mk, mv, mdo, p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t n4 = a.tq * a.hq * kDqk / 4;
  const unsigned post_blocks = static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 8 * 132));
  bwd_post_kernel<kHalf><<<post_blocks, 256, 0, stream>>>(
      reinterpret_cast<const float4*>(a.dq_accum), static_cast<uint2*>(a.dq), n4, a.scale);
  return cudaGetLastError();
}

}  // namespace

bool sm90_backward_enabled() {
  // On by default (on an H200 it is 1.02-1.14x cuDNN's backward at the op level, see
  // benchmarks/RESULTS.md); VERL_OPS_VARLEN_BACKWARD=cudnn keeps cuDNN's backward plan.
  static const bool enabled = [] {
    const char* env = std::getenv("VERL_OPS_VARLEN_BACKWARD");
    return sm90_forward_compiled() && !(env != nullptr && std::strcmp(env, "cudnn") == 0);
  }();
  return enabled;
}

bool sm90_backward_device(int device) {
  // The forward's device test (compute capability 9.0, the tensor-map encoder) without its switch.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0: not queried yet, 1: no, 2: yes
  if (!sm90_backward_enabled() || device < 0 || device >= kMaxDevices) return false;
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    k = ok && major == 9 && minor == 0 && encode_fn() != nullptr ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

cudaError_t launch_sm90_backward(const Sm90BwdArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.tq <= 0 || a.tk <= 0) {
    // No query or no key anywhere: every gradient is zero (the tensor maps need rows).
    const size_t elem = 2;
    cudaError_t err = cudaSuccess;
    if (a.tq > 0) err = cudaMemsetAsync(a.dq, 0, elem * a.tq * a.hq * kDqk, stream);
    if (err == cudaSuccess && a.tk > 0) err = cudaMemsetAsync(a.dk, 0, elem * a.tk * a.hk * kDqk, stream);
    if (err == cudaSuccess && a.tk > 0) err = cudaMemsetAsync(a.dv, 0, elem * a.tk * a.hk * kDv, stream);
    return err;
  }
  BwdParams p;
  p.order = a.workspace;
  p.tile_prefix = a.workspace + a.batch;
  schedule_kernel<kBN><<<1, kScheduleThreads, 0, stream>>>(
      a.cu_kv, a.tk, static_cast<int>(a.batch), static_cast<int>(a.hk), a.workspace,
      a.workspace + a.batch, a.workspace + 2 * a.batch + 1);
  p.cu_q = a.cu_q;
  p.cu_kv = a.cu_kv;
  p.lse_d = a.lse_d;
  p.dq_accum = a.dq_accum;
  p.dk = a.dk;
  p.dv = a.dv;
  p.tq = a.tq;
  p.tk = a.tk;
  p.hq = static_cast<int>(a.hq);
  p.hk = static_cast<int>(a.hk);
  p.batch = static_cast<int>(a.batch);
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.causal = a.causal ? 1 : 0;
  p.bottom_right = a.bottom_right ? 1 : 0;
  return a.half ? launch_bwd<true>(a, p, stream) : launch_bwd<false>(a, p, stream);
}

}  // namespace cuda
}  // namespace verl_ops
