// Forward attention of the varlen backend on Hopper (SM90a) for MLA's head dims: packed THD rows,
// Dqk 192 / Dv 128, fp16 or bf16, causal (top-left or bottom-right) or not, grouped kv heads.
//
// Persistent and warp-specialised: one CTA per SM (384 threads, ~225 KiB of shared memory).
// - A schedule kernel ranks the sequences longest first and counts their 128-row query tiles on
//   the device (no host read of the lengths); tiles run in that order, within a sequence head by
//   head and the query tiles from the last down (under a causal mask the last see the most
//   keys), so tiles running at the same time share K / V in L2. A CTA's first tile is its index,
//   the next ones come from an atomic counter (dynamic: ragged tiles balance across SMs).
// - Producer warpgroup (one thread): decodes each tile (sequence, head, query tile, key tiles)
//   and hands it to the consumers whole through a two-slot ring in shared memory (they start on
//   it without the decode's dependent global loads), loads the tile's Q (128 x 192) once and its
//   K (128 x 192) and V (128 x 128) tiles through TMA (128-byte swizzle, the wgmma operand
//   layout) into a two-stage ring with separate K and V barriers, so the next K loads while V
//   is still in use.
// - Two consumer warpgroups, 64 query rows each: S = Q K^T (wgmma, both operands in shared
//   memory), online softmax in registers (exp2, the running max moved only when it grows by
//   more than 2^8, so O is rarely rescaled), O += P V (wgmma, P from registers). The S GEMM of
//   key tile j + 1 and the PV GEMM of tile j are in flight while the softmax of tile j + 1 runs,
//   and the two warpgroups take turns issuing GEMMs (named barriers; a tile's first S GEMM
//   too), so one's softmax overlaps the other's GEMMs. A warpgroup whose rows see none of the
//   last 64 keys of the tile's first (highest) key tile, e.g. warpgroup 0 on a top-left causal
//   diagonal, runs that tile's S GEMM over the first 64 keys only (m64n64); a warpgroup whose
//   rows all lie past the sequence's end (a last query tile of at most 64 rows) issues no GEMM
//   and only keeps the turns and barriers in step.
// - Two details the SASS needs (checked with nvdisasm; benchmarks/prof_mla_sm90_ab.sh measures
//   them): the descriptors derive from warp-uniform values (a shuffle from lane 0), so they live
//   in uniform registers and the 20 wgmmas of a key tile issue back to back; and a store of the
//   softmax's row sums sits before the wait for the PV GEMM, so ptxas cannot hoist that wait
//   above the softmax (it did, which ran the softmax after the GEMM instead of beside it).
// - Epilogue: O is normalised into a shared-memory stage (half its columns at a time, 16-byte
//   chunks swizzled by the row) and stored as whole 128-byte row segments, not as scattered
//   4-byte words (the epilogue went from ~3.4k to ~1.7k cycles per tile).
// Writes O [Tq, Hq, 128] and the natural-log log-sum-exp [Tq, Hq] (+inf for a row that sees no
// key) of every row of every sequence: the layout cuDNN's backward reads.
#include "mla_sm90_fwd.h"

#include "mla_sm90_common.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBM = 128;      // query rows per CTA (two consumer warpgroups of 64)
constexpr int kBN = 128;      // keys per tile
constexpr int kDqk = 192;
constexpr int kDv = 128;
constexpr int kStages = 2;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups

constexpr int kQBytes = kBM * kDqk * 2;   // 48 KiB: three 64-column chunks of 128 rows x 128 B
constexpr int kKBytes = kBN * kDqk * 2;   // 48 KiB
constexpr int kVBytes = kBN * kDv * 2;    // 32 KiB: two 64-column chunks
constexpr int kSmemQ = 0;
constexpr int kSmemK = kSmemQ + kQBytes;
constexpr int kSmemV = kSmemK + kStages * kKBytes;
constexpr int kSmemBar = kSmemV + kStages * kVBytes;
constexpr int kNumBars = 2 + 4 * kStages + 4;  // q full / empty, K / V full / empty, tile ring
constexpr int kSlotInts = 8;                         // a decoded tile (TileInfo as 8 ints) per ring slot
constexpr int kSmemSlots = kSmemBar + kNumBars * 8;  // the tile ring's two slots
constexpr int kSmemScratch = kSmemSlots + 2 * kSlotInts * 4;  // a word written, never read (see the loop)
// The epilogue's staging of O: per consumer warpgroup 64 rows x 64 columns (half of O at a time),
// bf16 / fp16, 128-byte rows with their 16-byte chunks swizzled by the row.
constexpr int kSmemO = (kSmemScratch + 8 + 127) / 128 * 128;
constexpr int kOStageBytes = 64 * 64 * 2;
constexpr int kSmemBytes = kSmemO + 2 * kOStageBytes + 1024;  // + slack to align the base to 1 KiB
static_assert(kSmemBytes <= 232448, "shared memory over the SM90 per-block limit");

struct Params {
  const int32_t* order;        // [batch]: sequences, longest first
  const int32_t* tile_prefix;  // [batch + 1]: first tile of each sequence in that order
  int32_t* counter;            // tiles taken past the grid's first ones
  const int32_t* cu_q;
  const int32_t* cu_kv;
  void* out;
  float* lse;
  int64_t tq, tk;
  int hq, hk, batch;
  float scale, scale_log2;
  int causal, bottom_right;
};

#if defined(VERL_OPS_SM90_TRACE)
// Diagnostics build only (benchmarks/prof_mla_sm90.cu, TRACE=1): clock64 stamps per CTA, role
// (0 producer, 1 / 2 consumer warpgroups), tile taken and event; see sm90_trace_read.
__device__ long long g_sm90_trace[kSm90TraceCtas * 3 * kSm90TraceTiles * kSm90TraceEvents];
#define SM90_TRACE(role, k, e, v)                                                          \
  do {                                                                                     \
    if (blockIdx.x < kSm90TraceCtas && (k) < kSm90TraceTiles)                              \
      g_sm90_trace[((blockIdx.x * 3 + (role)) * kSm90TraceTiles + (k)) * kSm90TraceEvents + \
                   (e)] = (v);                                                            \
  } while (0)
#else
#define SM90_TRACE(role, k, e, v) \
  do {                            \
  } while (0)
#endif

__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// D[64x128] (+)= A[64x16] (shared, K-major) * B[16x128] (shared, K-major).
template <bool kHalf>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
  }
}

// D[64x128] += A[64x16] (registers) * B[16x128] (shared, MN-major: rows of B are contiguous).
template <bool kHalf>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
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

// Key tiles a query tile needs: every tile holding a key some row of it sees.
__device__ __forceinline__ int key_tiles(const Params& p, int lq, int lk, int m_block) {
  int end = lk;
  if (p.causal) {
    const int lim = (m_block + 1) * kBM + (p.bottom_right ? lk - lq : 0);
    end = min(end, max(lim, 0));
  }
  return (end + kBN - 1) / kBN;
}

struct TileInfo {
  int64_t q_start, k_start;
  int lq, lk, h, m_block, n_blocks;
};

// Tile -> (sequence, head, query tile): sequences longest first; in a sequence head by head,
// the query tiles from the last (most keys under a causal mask) down, so the tiles that run at
// the same time share their K / V in L2.
__device__ __forceinline__ TileInfo decode_tile(const Params& p, int tile) {
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_prefix[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int b = p.order[lo];
  const int local = tile - p.tile_prefix[lo];
  TileInfo ti;
  ti.lq = clamp_len(p.cu_q, b, p.tq);
  ti.q_start = clamp_start(p.cu_q, b, p.tq);
  ti.lk = clamp_len(p.cu_kv, b, p.tk);
  ti.k_start = clamp_start(p.cu_kv, b, p.tk);
  const int mb = (ti.lq + kBM - 1) / kBM;
  ti.h = local / mb;
  ti.m_block = mb - 1 - local % mb;
  ti.n_blocks = key_tiles(p, ti.lq, ti.lk, ti.m_block);
  return ti;
}

template <bool kHalf>
__global__ void __launch_bounds__(kThreads, 1)
    mla_sm90_fwd_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                        const __grid_constant__ CUtensorMap tv, const Params p) {
#if defined(VERL_OPS_SM90A)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t{1023});
  const uint32_t base = smem_u32(smem);
  const uint32_t bar_q_full = base + kSmemBar, bar_q_empty = base + kSmemBar + 8;
  auto bar_full_k = [&](int s) { return base + kSmemBar + 8 * (2 + s); };
  auto bar_full_v = [&](int s) { return base + kSmemBar + 8 * (2 + kStages + s); };
  auto bar_empty_k = [&](int s) { return base + kSmemBar + 8 * (2 + 2 * kStages + s); };
  auto bar_empty_v = [&](int s) { return base + kSmemBar + 8 * (2 + 3 * kStages + s); };
  auto bar_tile_full = [&](int s) { return base + kSmemBar + 8 * (2 + 4 * kStages + s); };
  auto bar_tile_empty = [&](int s) { return base + kSmemBar + 8 * (4 + 4 * kStages + s); };
  volatile int* tile_slot = reinterpret_cast<volatile int*>(smem + kSmemSlots);

  // Warp-uniform values read through a shuffle from lane 0: ptxas then keeps what derives from
  // them (the wgmma descriptors) in uniform registers, and the GEMMs issue back to back.
  const int warp_group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    mbar_init(bar_q_full, 1);
    mbar_init(bar_q_empty, 256);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full_k(s), 1);
      mbar_init(bar_full_v(s), 1);
      mbar_init(bar_empty_k(s), 256);
      mbar_init(bar_empty_v(s), 256);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(bar_tile_full(s), 1);
      mbar_init(bar_tile_empty(s), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp_group == 0) {
    // Producer: one thread takes tiles (its first from the grid, the next from a counter), hands
    // each to the consumers through a two-slot ring, and loads the tile's Q and its K / V tiles.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      const int total = p.tile_prefix[p.batch];
      // Where a tile's boxes start: its Q rows, its key tile `it` (the last first), its kv head.
      auto q_row_of = [&](const TileInfo& x) { return static_cast<int>(x.q_start) + x.m_block * kBM; };
      auto k_row_of = [&](const TileInfo& x, int it) {
        return static_cast<int>(x.k_start) + (x.n_blocks - 1 - it) * kBN;
      };
      auto kv_head_of = [&](const TileInfo& x) { return x.h / (p.hq / p.hk); };
      auto claim = [&]() { return static_cast<int>(gridDim.x) + atomicAdd(p.counter, 1); };
      int tile = blockIdx.x, kv_it = 0, q_it = 0;
      for (int iter = 0;; ++iter) {
        const int slot = iter & 1;
        // The tile decoded here, once, and handed over whole: the consumers start on it without
        // the dependent global loads of the decode.
        TileInfo ti{};
        if (tile < total) ti = decode_tile(p, tile);
        mbar_wait(bar_tile_empty(slot), ((iter >> 1) & 1) ^ 1);
        {
          volatile int* sl = tile_slot + slot * kSlotInts;
          sl[0] = tile < total ? tile : -1;
          sl[1] = static_cast<int>(ti.q_start);
          sl[2] = static_cast<int>(ti.k_start);
          sl[3] = ti.lq;
          sl[4] = ti.lk;
          sl[5] = ti.h;
          sl[6] = ti.m_block;
          sl[7] = ti.n_blocks;
        }
        mbar_arrive(bar_tile_full(slot));
        if (tile >= total) break;
        SM90_TRACE(0, iter, 0, clock64());
        if (ti.n_blocks > 0) {
          mbar_wait(bar_q_empty, (q_it & 1) ^ 1);
          SM90_TRACE(0, iter, 1, clock64());
          ++q_it;
          const int q_row = q_row_of(ti);
          mbar_expect_tx(bar_q_full, kQBytes);
#pragma unroll
          for (int c = 0; c < kDqk / 64; ++c)
            tma_load_3d(base + kSmemQ + c * kBM * 128, &tq, c * 64, ti.h, q_row, bar_q_full);
          const int hk = kv_head_of(ti);
          for (int it = 0; it < ti.n_blocks; ++it, ++kv_it) {
            const int s = kv_it % kStages;
            const uint32_t phase = (kv_it / kStages) & 1;
            const int k_row = k_row_of(ti, it);
            mbar_wait(bar_empty_k(s), phase ^ 1);
            mbar_expect_tx(bar_full_k(s), kKBytes);
#pragma unroll
            for (int c = 0; c < kDqk / 64; ++c)
              tma_load_3d(base + kSmemK + s * kKBytes + c * kBN * 128, &tk, c * 64, hk, k_row,
                          bar_full_k(s));
            mbar_wait(bar_empty_v(s), phase ^ 1);
            mbar_expect_tx(bar_full_v(s), kVBytes);
#pragma unroll
            for (int c = 0; c < kDv / 64; ++c)
              tma_load_3d(base + kSmemV + s * kVBytes + c * kBN * 128, &tv, c * 64, hk, k_row,
                          bar_full_v(s));
          }
        }
        SM90_TRACE(0, iter, 2, clock64());
        SM90_TRACE(0, iter, 7, ti.n_blocks);
        tile = claim();
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int wg = warp_group - 1;  // 0 or 1: query rows 64 * wg ...
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  const int r0 = wg * 64 + warp * 16 + lane / 4;  // this thread's rows r0 and r0 + 8 of the tile
  const float sl2 = p.scale_log2;
  const uint32_t q_base = base + kSmemQ + wg * 64 * 128;

  float o[64];
  float sacc[64];
  uint32_t pa[8][4];
  float m0, m1, l0, l1;
  int lk = 0, row0 = 0, row1 = 0, shift = 0, m_block = 0;

  // S = Q K^T for the key tile of stage s, issued (not waited for): over its 128 keys, or (half_c
  // true) over its first 64 only, into columns 0-63 of sacc (the mask sets the others): for a
  // warpgroup whose rows see none of the last 64 keys of its first key tile (see the loop).
  auto issue_s = [&](int stage, auto half_c) {
    const int s = __shfl_sync(0xffffffffu, stage, 0);  // warp-uniform (see warp_group)
    // One descriptor per operand, the k-steps as constant offsets of its address field (in 16 B
    // units; shared addresses stay below 2^18, so the field never carries into the next one).
    const uint64_t dq = smem_desc(q_base, 16, 1024);
    const uint64_t dk = smem_desc(base + kSmemK + s * kKBytes, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDqk / 16; ++kk) {
      const uint32_t chunk = kk / 4, off = (kk % 4) * 32;
      const uint64_t da = desc_at(dq, (chunk * kBM * 128 + off) >> 4);
      const uint64_t db = desc_at(dk, (chunk * kBN * 128 + off) >> 4);
      if constexpr (decltype(half_c)::value) {
        wgmma_ss_n64<kHalf>(reinterpret_cast<float(&)[32]>(sacc), da, db, kk > 0);
      } else {
        wgmma_ss<kHalf>(sacc, da, db, kk > 0);
      }
    }
    wgmma_commit();
  };
  // O += P V for the value tile of stage s, issued.
  auto issue_pv = [&](int stage) {
    const int s = __shfl_sync(0xffffffffu, stage, 0);
    const uint64_t dv = smem_desc(base + kSmemV + s * kVBytes, kBN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kBN / 16; ++j) wgmma_rs<kHalf>(o, pa[j], desc_at(dv, (j * 16 * 128) >> 4));
    wgmma_commit();
  };
  // Masks sacc (key tile n_block), updates the running max and sum, turns sacc into P (fp32)
  // and gives the factors the accumulated O must be scaled by.
  auto softmax = [&](int n_block, float& alpha0, float& alpha1) {
    const int key0 = n_block * kBN;
    const bool need_mask =
        key0 + kBN > lk || (p.causal && key0 + kBN - 1 > m_block * kBM + wg * 64 + shift);
    if (need_mask) {
      const int lim0 = p.causal ? min(lk, row0 + shift + 1) : lk;
      const int lim1 = p.causal ? min(lk, row1 + shift + 1) : lk;
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const int j = key0 + c * 8 + 2 * (lane % 4);
        if (j >= lim0) sacc[4 * c + 0] = -INFINITY;
        if (j + 1 >= lim0) sacc[4 * c + 1] = -INFINITY;
        if (j >= lim1) sacc[4 * c + 2] = -INFINITY;
        if (j + 1 >= lim1) sacc[4 * c + 3] = -INFINITY;
      }
    }
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      mx0 = fmaxf(mx0, fmaxf(sacc[4 * c + 0], sacc[4 * c + 1]));
      mx1 = fmaxf(mx1, fmaxf(sacc[4 * c + 2], sacc[4 * c + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    // The running max moves only when a row's max grows by more than 2^8 in exp2 units: below
    // that the stale max keeps every exponent <= 8 (no overflow in fp32), and O needs no rescale.
    if (mx0 * sl2 - m0 * sl2 <= 8.f) mx0 = m0;
    if (mx1 * sl2 - m1 * sl2 <= 8.f) mx1 = m1;
    const float ms0 = mx0 == -INFINITY ? 0.f : mx0 * sl2;
    const float ms1 = mx1 == -INFINITY ? 0.f : mx1 * sl2;
    // Branch-free (ex2 always, then a select): a data-dependent branch here would make ptxas
    // wait for the in-flight PV GEMM before the softmax instead of overlapping the two.
    const float e0 = ex2(m0 * sl2 - ms0), e1 = ex2(m1 * sl2 - ms1);
    alpha0 = mx0 == m0 ? 1.f : e0;
    alpha1 = mx1 == m1 ? 1.f : e1;
    m0 = mx0;
    m1 = mx1;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      sacc[4 * c + 0] = ex2(fmaf(sacc[4 * c + 0], sl2, -ms0));
      sacc[4 * c + 1] = ex2(fmaf(sacc[4 * c + 1], sl2, -ms0));
      sacc[4 * c + 2] = ex2(fmaf(sacc[4 * c + 2], sl2, -ms1));
      sacc[4 * c + 3] = ex2(fmaf(sacc[4 * c + 3], sl2, -ms1));
      s0 += sacc[4 * c + 0] + sacc[4 * c + 1];
      s1 += sacc[4 * c + 2] + sacc[4 * c + 3];
    }
    l0 = fmaf(l0, alpha0, s0);
    l1 = fmaf(l1, alpha1, s1);
  };
  auto to_pa = [&]() {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      pa[j][0] = pack2<kHalf>(sacc[8 * j + 0], sacc[8 * j + 1]);
      pa[j][1] = pack2<kHalf>(sacc[8 * j + 2], sacc[8 * j + 3]);
      pa[j][2] = pack2<kHalf>(sacc[8 * j + 4], sacc[8 * j + 5]);
      pa[j][3] = pack2<kHalf>(sacc[8 * j + 6], sacc[8 * j + 7]);
    }
  };
  // The two consumer warpgroups take turns issuing their GEMMs (named barriers 1 and 2), so one
  // runs its softmax while the other's GEMMs hold the tensor cores.
  // (Without turns, as FlashAttention-3 / -4 run head dim 192, the forward measured 0.96-0.98x.)
  auto sched_sync = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  auto sched_arrive = [&]() { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory"); };

  int kv_it = 0, q_it = 0;
  for (int iter = 0;; ++iter) {
    const int slot = iter & 1;
    mbar_wait(bar_tile_full(slot), (iter >> 1) & 1);
    TileInfo ti;
    int tile;
    {
      volatile const int* sl = tile_slot + slot * kSlotInts;
      tile = sl[0];
      ti.q_start = sl[1];
      ti.k_start = sl[2];
      ti.lq = sl[3];
      ti.lk = sl[4];
      ti.h = sl[5];
      ti.m_block = sl[6];
      ti.n_blocks = sl[7];
    }
    mbar_arrive(bar_tile_empty(slot));
    if (tile < 0) break;
    if (t == 0) SM90_TRACE(1 + wg, iter, 0, clock64());
    const int n_blocks = ti.n_blocks, lq = ti.lq, h = ti.h;
    const int64_t q_start = ti.q_start;
    lk = ti.lk;
    m_block = ti.m_block;
    row0 = m_block * kBM + r0;
    row1 = row0 + 8;
    shift = p.causal ? (p.bottom_right ? lk - lq : 0) : 0;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    m0 = -INFINITY;
    m1 = -INFINITY;
    l0 = 0.f;
    l1 = 0.f;

    if (n_blocks > 0) {
      mbar_wait(bar_q_full, q_it & 1);
      if (t == 0) SM90_TRACE(1 + wg, iter, 1, clock64());
      ++q_it;
      if (wg == 1) sched_arrive();
      // A warpgroup whose 64 rows all lie past the sequence's end (warpgroup 1 on a last query
      // tile of at most 64 rows) runs no GEMM and no softmax: it only keeps the turns and the
      // stages' barriers in step with the other warpgroup, which then has the tensor cores to
      // itself (forward +0.7% RL-like, +2.4% 64 short sequences, RESULTS.md). Its epilogue
      // writes nothing to global memory (no row inside the sequence).
      if (__shfl_sync(0xffffffffu, m_block * kBM + wg * 64 >= lq ? 1 : 0, 0)) {
        for (int it = 0; it < n_blocks; ++it) {
          const int g = kv_it + it, s = g % kStages, sp = (g + kStages - 1) % kStages;
          mbar_wait(bar_full_k(s), (g / kStages) & 1);
          sched_sync();
          if (it > 0) mbar_wait(bar_full_v(sp), ((g - 1) / kStages) & 1);
          sched_arrive();
          mbar_arrive(bar_empty_k(s));
          if (it == n_blocks - 1) mbar_arrive(bar_q_empty);
          if (it > 0) mbar_arrive(bar_empty_v(sp));
        }
        const int gl = kv_it + n_blocks - 1, sl = gl % kStages;
        mbar_wait(bar_full_v(sl), (gl / kStages) & 1);
        sched_sync();
        if (wg == 0) sched_arrive();
        mbar_arrive(bar_empty_v(sl));
        kv_it += n_blocks;
      } else {
        // Key tile 0: S, softmax, P. Then for each next tile the S GEMM of tile it and the PV
        // GEMM of tile it - 1 run on the tensor cores while this warpgroup does the softmax of
        // tile it.
        {
          const int s = kv_it % kStages;
          mbar_wait(bar_full_k(s), (kv_it / kStages) & 1);
          // The first S GEMM of a tile takes its turn too, so warpgroup 0's runs first and its
          // softmax overlaps warpgroup 1's GEMM instead of both softmaxes running while the tensor
          // cores idle (+0.7-2.4% on the forward, RESULTS.md). The turns stay balanced: per tile
          // each warpgroup syncs and arrives once more.
          // The first key tile is the last one (the tiles run from the last down). Where this
          // warpgroup's rows see none of its last 64 keys (warpgroup 0 on the diagonal of a
          // top-left causal mask; a bottom-right one whose offset lk - lq leaves at most 64 keys
          // of the tile to the warpgroup; a sequence's last key tile of at most 64 keys), its S
          // GEMM covers the first 64 keys only: half the S work of that tile (forward +1-3% on
          // causal and short batches, RESULTS.md). The whole turn is in each branch: an issue and
          // its wait in different branches make ptxas serialise every wgmma of the kernel.
          const int lim = p.causal ? min(lk, m_block * kBM + wg * 64 + 64 + shift) : lk;
          if (__shfl_sync(0xffffffffu, lim <= (n_blocks - 1) * kBN + 64 ? 1 : 0, 0)) {
            sched_sync();
            issue_s(s, std::true_type{});
            sched_arrive();
            wgmma_wait<0>();
          } else {
            sched_sync();
            issue_s(s, std::false_type{});
            sched_arrive();
            wgmma_wait<0>();
          }
          fence_regs(sacc);
          if (t == 0) SM90_TRACE(1 + wg, iter, 2, clock64());
          mbar_arrive(bar_empty_k(s));
          if (n_blocks == 1) mbar_arrive(bar_q_empty);
        }
        float a0, a1;
        softmax(n_blocks - 1, a0, a1);
        to_pa();
#if defined(VERL_OPS_SM90_TRACE)
        asm volatile("" ::"r"(pa[0][0]), "r"(pa[7][3]), "f"(l0), "f"(l1) : "memory");
        if (t == 0) SM90_TRACE(1 + wg, iter, 3, clock64());
#endif
        for (int it = 1; it < n_blocks; ++it) {
          const int g = kv_it + it;
          const int s = g % kStages, sp = (g - 1) % kStages;
          mbar_wait(bar_full_k(s), (g / kStages) & 1);
          sched_sync();
          issue_s(s, std::false_type{});
          mbar_wait(bar_full_v(sp), ((g - 1) / kStages) & 1);
          issue_pv(sp);
          sched_arrive();
          wgmma_wait<1>();
          fence_regs(sacc);
          mbar_arrive(bar_empty_k(s));
          if (it == n_blocks - 1) mbar_arrive(bar_q_empty);
          softmax(n_blocks - 1 - it, a0, a1);
#ifndef VERL_OPS_SM90_NO_SOFTMAX_FENCE
          // ptxas schedules the wait for the PV GEMM early, before most of the softmax, which then
          // runs after the GEMM instead of beside it. A shared-memory store of the row sums (a
          // scratch word nobody reads) depends on every exponential of the softmax and is not moved
          // past the wait, so the softmax stays ahead of it.
          asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + kSmemScratch), "f"(l0 + l1) : "memory");
#endif
          wgmma_wait<0>();
          fence_regs(o);
          mbar_arrive(bar_empty_v(sp));
          if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
            for (int c = 0; c < 16; ++c) {
              o[4 * c + 0] *= a0;
              o[4 * c + 1] *= a0;
              o[4 * c + 2] *= a1;
              o[4 * c + 3] *= a1;
            }
          }
          to_pa();
        }
        if (t == 0) SM90_TRACE(1 + wg, iter, 4, clock64());
        const int gl = kv_it + n_blocks - 1;
        const int sl = gl % kStages;
        mbar_wait(bar_full_v(sl), (gl / kStages) & 1);
        sched_sync();
        issue_pv(sl);
        if (wg == 0) sched_arrive();
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(bar_empty_v(sl));
        if (t == 0) SM90_TRACE(1 + wg, iter, 5, clock64());
        kv_it += n_blocks;
      }
    }

    // Epilogue: normalise, write O and the log-sum-exp of the rows inside the sequence.
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    constexpr float kLn2 = 0.6931471805599453f;
    // O through shared memory, half of its columns at a time: each thread writes its fragments
    // (4-byte words, the 16-byte chunks swizzled by the row: no bank conflicts), then the
    // warpgroup reads back 16-byte chunks and stores whole 128-byte row segments (a warp covers
    // four rows) instead of scattered 4-byte words.
    {
      const uint32_t ob = base + kSmemO + wg * kOStageBytes;
      const int lr0 = warp * 16 + lane / 4, lr1 = lr0 + 8;  // rows of the warpgroup's 64
      const int first_row = m_block * kBM + wg * 64;        // in the sequence
      uint8_t* out_bytes = static_cast<uint8_t*>(p.out);
      const int64_t row_bytes = static_cast<int64_t>(p.hq) * kDv * 2;
      auto wg_sync = [&]() { asm volatile("bar.sync %0, 128;\n" ::"r"(3 + wg) : "memory"); };
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (half > 0) wg_sync();  // the first half's chunks are read
#pragma unroll
        for (int cl = 0; cl < 8; ++cl) {
          const int c = 8 * half + cl;
          const uint32_t w0 = pack2<kHalf>(o[4 * c] * inv0, o[4 * c + 1] * inv0);
          const uint32_t w1 = pack2<kHalf>(o[4 * c + 2] * inv1, o[4 * c + 3] * inv1);
          sts_b32(ob + lr0 * 128 + ((cl ^ (lr0 & 7)) << 4) + 4 * (lane % 4), w0);
          sts_b32(ob + lr1 * 128 + ((cl ^ (lr1 & 7)) << 4) + 4 * (lane % 4), w1);
        }
        wg_sync();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = i * 16 + t / 8, cl = t % 8;
          const uint4 v = lds_v4(ob + row * 128 + ((cl ^ (row & 7)) << 4));
          if (first_row + row < lq) {
            uint8_t* dst = out_bytes + (q_start + first_row + row) * row_bytes +
                           static_cast<int64_t>(h) * kDv * 2 + half * 128 + cl * 16;
            *reinterpret_cast<uint4*>(dst) = v;
          }
        }
      }
      wg_sync();  // every chunk read before the next tile's epilogue writes again
      if (lane % 4 == 0) {
        if (row0 < lq) p.lse[(q_start + row0) * p.hq + h] = l0 > 0.f ? (m0 * sl2 + __log2f(l0)) * kLn2 : INFINITY;
        if (row1 < lq) p.lse[(q_start + row1) * p.hq + h] = l1 > 0.f ? (m1 * sl2 + __log2f(l1)) * kLn2 : INFINITY;
      }
    }
    if (t == 0) SM90_TRACE(1 + wg, iter, 6, clock64());
    if (t == 0) SM90_TRACE(1 + wg, iter, 7, n_blocks);
  }
#endif
}

template <bool kHalf>
cudaError_t launch(const Sm90FwdArgs& a, const Params& p, cudaStream_t stream) {
  CUtensorMap mq, mk, mv;
  if (!make_map(&mq, a.q, a.tq, a.hq, kDqk, kBM, kHalf) ||
      !make_map(&mk, a.k, a.tk, a.hk, kDqk, kBN, kHalf) ||
      !make_map(&mv, a.v, a.tk, a.hk, kDv, kBN, kHalf))
    return cudaErrorInvalidValue;
  auto kernel = mla_sm90_fwd_kernel<kHalf>;
  // The shared-memory opt-in, once per device (function attributes are per device context).
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> opted_in[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices || !opted_in[dev].load(std::memory_order_acquire)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < kMaxDevices) opted_in[dev].store(true, std::memory_order_release);
  }
    // Persistent: one CTA per SM at most, never more than there can be tiles.
  const int64_t tiles_bound = a.hq * ((a.tq + kBM - 1) / kBM + a.batch);
  dim3 grid(static_cast<unsigned>(std::min<int64_t>(sm_count(), tiles_bound)));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(mq, mk, mv, p);
  return cudaGetLastError();
}

}  // namespace

#if defined(VERL_OPS_SM90_TRACE)
cudaError_t sm90_trace_clear() {
  void* ptr = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&ptr, g_sm90_trace);
  return err != cudaSuccess ? err : cudaMemset(ptr, 0, sizeof(g_sm90_trace));
}
cudaError_t sm90_trace_read(long long* host) {
  return cudaMemcpyFromSymbol(host, g_sm90_trace, sizeof(g_sm90_trace));
}
#endif

bool sm90_forward_compiled() {
#if defined(VERL_OPS_HAS_SM90A)
  return true;
#else
  return false;
#endif
}

bool sm90_forward_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("VERL_OPS_VARLEN_FORWARD");
    return sm90_forward_compiled() && !(env != nullptr && std::strcmp(env, "cudnn") == 0);
  }();
  return enabled;
}

bool sm90_forward_device(int device) {
  // 0: not queried yet, 1: no, 2: yes (static storage: zero-initialised).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];
  if (!sm90_forward_enabled() || device < 0 || device >= kMaxDevices) return false;
  int k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    // ... and the driver gives the tensor-map encoder (else cuDNN's forward runs).
    k = ok && major == 9 && minor == 0 && encode_fn() != nullptr ? 2 : 1;
    known[device].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

cudaError_t launch_sm90_forward(const Sm90FwdArgs& a, cudaStream_t stream) {
  if (a.tq <= 0 || a.batch <= 0) return cudaSuccess;
  if (a.tk <= 0) return cudaSuccess;  // every row sees no key: the caller's empty-rows pass
  Params p;
  p.order = a.workspace;
  p.tile_prefix = a.workspace + a.batch;
  p.counter = a.workspace + 2 * a.batch + 1;
  schedule_kernel<kBM><<<1, kScheduleThreads, 0, stream>>>(
      a.cu_q, a.tq, static_cast<int>(a.batch), static_cast<int>(a.hq), a.workspace,
      a.workspace + a.batch, p.counter);
  p.cu_q = a.cu_q;
  p.cu_kv = a.cu_kv;
  p.out = a.out;
  p.lse = a.lse;
  p.tq = a.tq;
  p.tk = a.tk;
  p.hq = static_cast<int>(a.hq);
  p.hk = static_cast<int>(a.hk);
  p.batch = static_cast<int>(a.batch);
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.causal = a.causal ? 1 : 0;
  p.bottom_right = a.bottom_right ? 1 : 0;
  return a.half ? launch<true>(a, p, stream) : launch<false>(a, p, stream);
}

}  // namespace cuda
}  // namespace verl_ops
