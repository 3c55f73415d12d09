// Shared pieces of the SM90 (Hopper, sm_90a) attention kernels mla_sm90_fwd.cu and
// mla_sm90_bwd.cu: mbarrier / TMA / wgmma wrappers, the shared-memory descriptor, the
// sequence-ranking schedule kernel and the host-side tensor maps. Included by those .cu files only
// (everything sits in an anonymous namespace: each includes its own copy).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <mutex>

namespace verl_ops {
namespace cuda {
namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VERL_OPS_SM90A 1
#endif


__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A 4-byte store and a 16-byte load of shared memory by 32-bit shared address (a generic
// pointer would compile to generic ST / LD): the epilogues' staging of rows.
__device__ __forceinline__ void sts_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 lds_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
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

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
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


// The descriptor of the operand at 16-byte offset `off16` from the one of d0: the low word's
// address field plus the offset (shared addresses stay below 2^18, so it never carries into the
// leading-byte-offset field); the high word (stride, swizzle) is shared.
__device__ __forceinline__ uint64_t desc_at(uint64_t d0, uint32_t off16) {
  return (d0 & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d0) + off16);
}


// D[64x64] (+)= A[64x16] * B[16x64], both in shared memory: K-major (kMnMajor 0), or both
// MN-major (kMnMajor 1: the transpose flags of A and B set).
template <bool kHalf, int kMnMajor = 0>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %35;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate), "n"(kMnMajor));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %35;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate), "n"(kMnMajor));
  }
}

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

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ int64_t clamp_start(const int32_t* cu, int b, int64_t rows) {
  const int64_t s = cu[b];
  return s < 0 ? 0 : (s > rows ? rows : s);
}
__device__ __forceinline__ int clamp_len(const int32_t* cu, int b, int64_t rows) {
  const int64_t s = clamp_start(cu, b, rows);
  const int64_t e = cu[b + 1];
  return e <= s ? 0 : static_cast<int>((e > rows ? rows : e) - s);
}


// The tile schedule, one block of kScheduleThreads: order[rank] = b ranks the sequences by their
// length in cu (query rows for the forward, keys for the backward), longest first (ties: lower index first; past kScheduleThreads sequences the input
// order, as the ranking is one thread per sequence against all others), tile_prefix[rank] is the
// first tile of that sequence and tile_prefix[batch] the total; the counter is zeroed.
constexpr int kScheduleThreads = 1024;

// A tile is kRows rows of one sequence and one of `heads` heads.
template <int kRows>
__global__ void __launch_bounds__(kScheduleThreads)
    schedule_kernel(const int32_t* __restrict__ cu, int64_t rows, int batch, int heads,
                    int32_t* __restrict__ order, int32_t* __restrict__ tile_prefix,
                    int32_t* __restrict__ counter) {
  __shared__ int by_rank[kScheduleThreads];
  __shared__ int scan[kScheduleThreads];
  const int tid = threadIdx.x;
  const bool ranked = batch <= kScheduleThreads;
  auto tiles = [&](int b) { return (clamp_len(cu, b, rows) + kRows - 1) / kRows * heads; };
  int local = 0;  // tiles of the ranks this thread owns
  const int per = ranked ? 1 : (batch + kScheduleThreads - 1) / kScheduleThreads;
  const int first = tid * per, last = min(batch, first + per);
  if (ranked) {
    if (tid < batch) {
      const int lb = clamp_len(cu, tid, rows);
      int rank = 0;
      for (int c = 0; c < batch; ++c) {
        const int lc = clamp_len(cu, c, rows);
        rank += (lc > lb) || (lc == lb && c < tid);
      }
      order[rank] = tid;
      by_rank[rank] = tiles(tid);
    }
    __syncthreads();
    local = tid < batch ? by_rank[tid] : 0;
  } else {
    for (int b = first; b < last; ++b) {
      order[b] = b;
      local += tiles(b);
    }
  }
  scan[tid] = local;
  __syncthreads();
  for (int off = 1; off < kScheduleThreads; off <<= 1) {
    const int add = tid >= off ? scan[tid - off] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  int running = scan[tid] - local;
  if (ranked) {
    if (tid < batch) tile_prefix[tid] = running;
  } else {
    for (int b = first; b < last; ++b) {
      tile_prefix[b] = running;
      running += tiles(b);
    }
  }
  if (tid == kScheduleThreads - 1) tile_prefix[batch] = scan[tid];
  if (tid == 0) *counter = 0;
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &q);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr,
                                                    cudaEnableDefault, &q);
#endif
    if (err == cudaSuccess && q == cudaDriverEntryPointSuccess && ptr != nullptr)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

// [rows, heads, d] rows as a 3-D map (d, heads, rows), a box of 64 columns x 1 head x box_rows,
// 128-byte swizzle (the wgmma operand layout).
bool make_map(CUtensorMap* map, const void* ptr, int64_t rows, int64_t heads, int64_t d,
              int box_rows, bool half) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                        static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(d * 2), static_cast<cuuint64_t>(heads * d * 2)};
  cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  cuuint32_t elem[3] = {1, 1, 1};
  return fn(map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
            const_cast<void*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  return n;
}

}  // namespace
}  // namespace cuda
}  // namespace verl_ops
