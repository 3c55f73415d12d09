// Router replay kernels (docs/router_replay.md).
//
// Both kernels work on tiles of consecutive output rows, like the THD row kernels: the rows of
// a tile are resolved once into shared memory (core/router_rows.h, the same functions the CPU
// loops call). An item moves 8 indices of one token in one layer (K % 8 == 0, aligned data).
//
// The two sides of each op are laid out differently ([T, K] per layer vs [T, L, K]), so a tile
// goes through shared memory: it is read in the order that makes the reads contiguous and written
// in the order that makes the writes contiguous (a transpose of (row, layer)). Reading 64-byte
// pieces scattered over 48 layers, or 16-byte pieces 768 bytes apart, runs at half the copy
// bandwidth or less; staged, both sides are full-warp contiguous runs. The stage rows are padded
// by 16 bytes so that the transposed accesses hit distinct banks.
//
// Record reads the L layer tensors through a pointer table (a kernel argument, staged in shared
// memory so that lanes reading different layers do not serialise on the constant bank).
// Shapes that do not fit the staged path (K % 8 != 0, odd strides or alignment, a stage row over
// the shared-memory budget) take a plain per-item loop.
#include "router_kernels.h"

#include <algorithm>

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kMaxLayersPerLaunch = 128;
// Shared memory for one tile's stage (dynamic; under the 48 KB default, 5 blocks per SM).
constexpr int64_t kStageBytes = 40 * 1024;

// Rows per staged tile for stage rows of `pitch_bytes`, or 0 when one row does not fit.
int32_t staged_tile_rows(int64_t pitch_bytes) {
  if (pitch_bytes > kStageBytes) return 0;
  return static_cast<int32_t>(std::min<int64_t>(kBlock, kStageBytes / pitch_bytes));
}

struct LayerTable {
  const void* ptr[kMaxLayersPerLaunch];
  int64_t row_stride[kMaxLayersPerLaunch];
  int64_t col_stride[kMaxLayersPerLaunch];
};

// Eight consecutive elements; p is aligned to min(16, 8 * sizeof(T)) bytes.
template <typename T>
__device__ __forceinline__ void load8(const T* p, T* v) {
  if constexpr (sizeof(T) == 1) {
    *reinterpret_cast<uint2*>(v) = __ldg(reinterpret_cast<const uint2*>(p));
  } else {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T)) / 2; ++i) {
      reinterpret_cast<uint4*>(v)[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    }
  }
}

template <typename T>
__device__ __forceinline__ int16_t to_int16(T v, bool* bad) {
  const int64_t x = static_cast<int64_t>(v);
  if (core::fits_int16(x)) return static_cast<int16_t>(x);
  *bad = true;
  return core::kOutOfRangeIndex;
}

template <typename T>
__device__ __forceinline__ void zero8(T* v) {
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = T(0);
}

// u = q * d + rem, advanced by a fixed step without a division per step (integer division by a
// run-time value costs tens of instructions, which the narrow int16 units cannot hide).
struct DivCursor {
  int32_t q, rem, step_q, step_rem, d;
  __device__ DivCursor(int32_t u, int32_t step, int32_t divisor)
      : q(u / divisor), rem(u % divisor), step_q(step / divisor), step_rem(step % divisor), d(divisor) {}
  __device__ __forceinline__ void advance() {
    q += step_q;
    rem += step_rem;
    if (rem >= d) {
      rem -= d;
      ++q;
    }
  }
};

// The vector paths move units of 8 indices (K % 8 == 0): each thread keeps kUnroll units' loads
// in flight before it converts and stores them, enough bytes in flight per SM to cover memory
// latency even for 16-byte int16 units.
constexpr int kUnroll = 4;

// The block's 8-index units u = threadIdx.x, + kBlock, ... < units, kUnroll loads in flight:
// locate(u, &src, &slot) names a unit's source (nullptr: zeros) and its staging slot, in order of
// u; store(slot, v) stages it. Shared by the record and replay kernels.
template <typename T, typename Locate, typename Store>
__device__ __forceinline__ void load_and_stage(int32_t units, Locate&& locate, Store&& store) {
  int32_t u = threadIdx.x;
  for (; u + (kUnroll - 1) * kBlock < units; u += kUnroll * kBlock) {
    alignas(16) T v[kUnroll][8];
    int32_t slot[kUnroll];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) {
      const T* src;
      locate(u + q * kBlock, &src, &slot[q]);
      if (src != nullptr) {
        load8(src, v[q]);
      } else {
        zero8(v[q]);
      }
    }
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) store(slot[q], v[q]);
  }
  for (; u < units; u += kBlock) {
    alignas(16) T v[8];
    const T* src;
    int32_t slot;
    locate(u, &src, &slot);
    if (src != nullptr) {
      load8(src, v);
    } else {
      zero8(v);
    }
    store(slot, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    record_kernel(core::RouterRecordPlan plan, LayerTable table, int32_t nl, int32_t layer0,
                  int32_t num_layers, int32_t topk, int16_t* __restrict__ out, int64_t rows,
                  int32_t tile_rows, bool vec, int32_t* __restrict__ flags, int32_t slots) {
  extern __shared__ uint4 stage[];  // vector path: tile_rows x (nl * K / 8 + 1) 16-byte units
  __shared__ int64_t tile_src[kBlock];
  __shared__ const T* s_ptr[kMaxLayersPerLaunch];
  __shared__ int64_t s_row_stride[kMaxLayersPerLaunch];
  __shared__ int64_t s_col_stride[kMaxLayersPerLaunch];
  for (int32_t l = threadIdx.x; l < nl; l += kBlock) {
    s_ptr[l] = static_cast<const T*>(table.ptr[l]);
    s_row_stride[l] = table.row_stride[l];
    s_col_stride[l] = table.col_stride[l];
  }
  bool bad = false;
  const int32_t kc = topk >> 3;  // 8-index units per (row, layer) on the vector path
  const int64_t num_tiles = (rows + tile_rows - 1) / tile_rows;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t row0 = tile * tile_rows;
    const int32_t n = static_cast<int32_t>(rows - row0 < tile_rows ? rows - row0 : tile_rows);
    if (threadIdx.x < n) tile_src[threadIdx.x] = core::router_record_source_row(plan, row0 + threadIdx.x);
    __syncthreads();
    const int32_t items = n * nl;
    if (vec) {
      // Read: unit u = (layer l, chunk c, row r), row-fastest, so a warp reads consecutive rows of
      // one layer. Stage: int16 [n][pitch] in 16-byte units. Write: the tile's output rows in order.
      const int32_t row_units = nl * kc;
      const int32_t pitch = row_units + 1;
      const int32_t units = n * row_units;
      // Unit u = j * n + r: the cursor's quotient is j (layer, chunk), its remainder the row r.
      auto locate = [&](const DivCursor& cur, const T** src, int32_t* slot) {
        const int32_t r = cur.rem;
        const int32_t j = cur.q;
        const int32_t l = kc == 1 ? j : j / kc;
        const int32_t c = j - l * kc;
        const int64_t sr = tile_src[r];
        *slot = r * pitch + j;
        *src = sr >= 0 ? s_ptr[l] + sr * s_row_stride[l] + c * 8 : nullptr;
      };
      auto convert = [&](const T* v) {
        alignas(16) int16_t o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = to_int16(v[i], &bad);
        return *reinterpret_cast<const uint4*>(o);
      };
      DivCursor cur(threadIdx.x, kBlock, n);
      load_and_stage<T>(
          units,
          [&](int32_t, const T** src, int32_t* slot) {  // units come in order: the cursor follows
            locate(cur, src, slot);
            cur.advance();
          },
          [&](int32_t slot, const T* v) { stage[slot] = convert(v); });
      __syncthreads();
      DivCursor wc(threadIdx.x, kBlock, row_units);  // w = r * row_units + x
      for (int32_t w = threadIdx.x; w < units; w += kBlock, wc.advance()) {
        uint4* dst = reinterpret_cast<uint4*>(out + ((row0 + wc.q) * num_layers + layer0) * topk) + wc.rem;
        *dst = stage[wc.q * pitch + wc.rem];
      }
    } else {
      for (int32_t j = threadIdx.x; j < items; j += kBlock) {
        const int32_t r = j / nl;
        const int32_t l = j - r * nl;
        const int64_t sr = tile_src[r];
        int16_t* dst = out + ((row0 + r) * num_layers + layer0 + l) * topk;
        if (sr < 0) {
          for (int32_t k = 0; k < topk; ++k) dst[k] = 0;
          continue;
        }
        const T* src = s_ptr[l] + sr * s_row_stride[l];
        const int64_t cs = s_col_stride[l];
        for (int32_t k = 0; k < topk; ++k) dst[k] = to_int16(src[k * cs], &bad);
      }
    }
    __syncthreads();
  }
  // Every slot of this launch's range gets written (by block i % gridDim.x), so no slot keeps
  // stale memory and the flag tensor needs no zeroing launch.
  const int any_bad = __syncthreads_or(bad ? 1 : 0);
  if (threadIdx.x == 0) {
    for (int32_t i = blockIdx.x; i < slots; i += gridDim.x) flags[i] = any_bad;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    scatter_kernel(core::RouterScatterPlan plan, const T* __restrict__ routes, int32_t num_layers,
                   int32_t topk, const bool* __restrict__ replay_in, int64_t* __restrict__ targets,
                   bool* __restrict__ replay_out, int64_t rows, int32_t tile_rows, bool vec) {
  extern __shared__ uint4 stage[];  // vector path: tile_rows x (L * K * sizeof(T) / 16 + 1) vectors
  __shared__ int64_t tile_src[kBlock];
  const int32_t kc = topk >> 3;
  const int64_t num_tiles = (rows + tile_rows - 1) / tile_rows;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t row0 = tile * tile_rows;
    const int32_t n = static_cast<int32_t>(rows - row0 < tile_rows ? rows - row0 : tile_rows);
    if (threadIdx.x < n) {
      const int64_t sr = core::router_scatter_source_row(plan, row0 + threadIdx.x);
      tile_src[threadIdx.x] = sr;
      if (replay_out != nullptr) replay_out[row0 + threadIdx.x] = sr >= 0 && replay_in[sr];
    }
    __syncthreads();
    const int32_t items = n * num_layers;
    if (vec) {
      // Read: the tile's source rows whole (row-major [L * K], contiguous per row). Stage: T
      // [n][pitch] in 8-index units of kUnitBytes, rows padded by 16 bytes. Write: layer-major,
      // so a warp writes consecutive rows of one layer's int64 targets.
      constexpr int32_t kUnitVecs = static_cast<int32_t>(sizeof(T)) / 2;  // 16-byte vectors per unit
      const int32_t row_units = num_layers * kc;
      const int32_t pitch_vecs = row_units * kUnitVecs + 1;
      const int32_t units = n * row_units;
      const int64_t src_row_units = static_cast<int64_t>(num_layers) * kc;
      auto locate = [&](int32_t uu, const T** src, int32_t* slot) {
        const int32_t r = uu / row_units;
        const int32_t x = uu - r * row_units;
        const int64_t sr = tile_src[r];
        *slot = r * pitch_vecs + x * kUnitVecs;
        *src = sr >= 0 ? routes + (sr * src_row_units + x) * 8 : nullptr;
      };
      auto put = [&](int32_t slot, const T* v) {
        const uint4* pv = reinterpret_cast<const uint4*>(v);
#pragma unroll
        for (int i = 0; i < kUnitVecs; ++i) stage[slot + i] = pv[i];
      };
      load_and_stage<T>(units, locate, put);
      __syncthreads();
      // Each thread stores one 16-byte vector (two int64 targets), so every store instruction
      // of a warp covers 512 contiguous bytes: whole sectors, no partial writes.
      const T* st = reinterpret_cast<const T*>(stage);
      const int32_t pitch_elems = pitch_vecs * static_cast<int32_t>(16 / sizeof(T));
      const int32_t layer_vecs = n * topk / 2;
      const int32_t total_vecs = num_layers * layer_vecs;
      for (int32_t w = threadIdx.x; w < total_vecs; w += kBlock) {
        const int32_t l = w / layer_vecs;
        const int32_t e = (w - l * layer_vecs) * 2;  // element of this layer's [n, K] block
        const int32_t r = e / topk;
        const int32_t k = e - r * topk;  // even, and k + 1 < K (K % 8 == 0)
        const T* sv = st + r * pitch_elems + l * topk + k;
        longlong2 o;
        o.x = static_cast<long long>(sv[0]);
        o.y = static_cast<long long>(sv[1]);
        *reinterpret_cast<longlong2*>(targets + (static_cast<int64_t>(l) * rows + row0) * topk + e) = o;
      }
    } else {
      for (int32_t j = threadIdx.x; j < items; j += kBlock) {
        const int32_t l = j / n;
        const int32_t r = j - l * n;
        const int64_t sr = tile_src[r];
        int64_t* dst = targets + (static_cast<int64_t>(l) * rows + row0 + r) * topk;
        if (sr < 0) {
          for (int32_t k = 0; k < topk; ++k) dst[k] = 0;
          continue;
        }
        const T* src = routes + (sr * num_layers + l) * topk;
        for (int32_t k = 0; k < topk; ++k) dst[k] = static_cast<int64_t>(src[k]);
      }
    }
    __syncthreads();
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0; }

int64_t grid_for(int64_t tiles) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return std::max<int64_t>(1, std::min<int64_t>(tiles, static_cast<int64_t>(sms) * 16));
}

template <typename T>
cudaError_t record_with(const core::RouterRecordPlan& plan, const core::LayerSlice* layers,
                        int64_t num_layers, int64_t topk, int16_t* out, int64_t rows,
                        int32_t* overflow, cudaStream_t stream) {
  const int64_t vec_align = std::min<int64_t>(16, 8 * static_cast<int64_t>(sizeof(T)));
  const int64_t chunks = (num_layers + kMaxLayersPerLaunch - 1) / kMaxLayersPerLaunch;
  const int64_t per_chunk = core::kOverflowSlots / chunks;  // >= 1: num_layers is bounded by the op
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t layer0 = c * kMaxLayersPerLaunch;
    const int32_t nl = static_cast<int32_t>(std::min<int64_t>(kMaxLayersPerLaunch, num_layers - layer0));
    LayerTable table;
    bool vec = topk % 8 == 0 && aligned(out, 16);
    for (int32_t l = 0; l < nl; ++l) {
      const core::LayerSlice& s = layers[layer0 + l];
      table.ptr[l] = s.ptr;
      table.row_stride[l] = s.row_stride;
      table.col_stride[l] = s.col_stride;
      vec = vec && s.col_stride == 1 && aligned(s.ptr, vec_align) &&
            (s.row_stride * static_cast<int64_t>(sizeof(T))) % vec_align == 0;
    }
    // This launch's flag slots; the last launch also covers the remainder.
    const int64_t slot0 = c * per_chunk;
    const int64_t slots = (c + 1 == chunks) ? core::kOverflowSlots - slot0 : per_chunk;
    const int64_t pitch_bytes = (static_cast<int64_t>(nl) * (topk / 8) + 1) * 16;
    int32_t tile_rows = vec ? staged_tile_rows(pitch_bytes) : 0;
    vec = tile_rows > 0;
    if (!vec) tile_rows = static_cast<int32_t>(std::clamp<int64_t>(kBlock * 4 / nl, 1, kBlock));
    const size_t smem = vec ? static_cast<size_t>(tile_rows * pitch_bytes) : 0;
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
    const int64_t grid = std::min<int64_t>(grid_for(tiles), slots);
    record_kernel<T><<<static_cast<unsigned>(grid), kBlock, smem, stream>>>(
        plan, table, nl, static_cast<int32_t>(layer0), static_cast<int32_t>(num_layers),
        static_cast<int32_t>(topk), out, rows, tile_rows, vec, overflow + slot0, static_cast<int32_t>(slots));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t scatter_with(const core::RouterScatterPlan& plan, const void* routes,
                         int64_t num_layers, int64_t topk, const bool* replay_in,
                         int64_t* targets, bool* replay_out, int64_t rows, cudaStream_t stream) {
  const int64_t vec_align = std::min<int64_t>(16, 8 * static_cast<int64_t>(sizeof(T)));
  // The staged path moves 8-index units of whole 16-byte vectors: 2-byte and wider indices.
  bool vec = sizeof(T) >= 2 && topk % 8 == 0 && aligned(routes, vec_align) && aligned(targets, 16);
  const int64_t pitch_bytes = num_layers * (topk / 8) * 8 * static_cast<int64_t>(sizeof(T)) + 16;
  int32_t tile_rows = vec ? staged_tile_rows(pitch_bytes) : 0;
  vec = tile_rows > 0;
  // Unstaged: at least 32 rows per tile keeps each layer's writes in runs of >= 32 * K * 8 bytes.
  if (!vec) tile_rows = static_cast<int32_t>(std::clamp<int64_t>(kBlock * 8 / std::max<int64_t>(num_layers, 1), 32, kBlock));
  const size_t smem = vec ? static_cast<size_t>(tile_rows * pitch_bytes) : 0;
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  scatter_kernel<T><<<static_cast<unsigned>(grid_for(tiles)), kBlock, smem, stream>>>(
      plan, static_cast<const T*>(routes), static_cast<int32_t>(num_layers),
      static_cast<int32_t>(topk), replay_in, targets, replay_out, rows, tile_rows, vec);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_router_record(const core::RouterRecordPlan& plan,
                                 const core::LayerSlice* layers, int64_t num_layers, int64_t topk,
                                 core::IndexDtype dtype, int16_t* out, int64_t rows,
                                 int32_t* overflow, cudaStream_t stream) {
  if (num_layers < 1 || num_layers > kMaxLayersPerLaunch * core::kOverflowSlots) return cudaErrorInvalidValue;
  if (rows == 0 || topk == 0) {
    // Nothing to move; the flags still must not hold stale memory.
    return cudaMemsetAsync(overflow, 0, core::kOverflowSlots * sizeof(int32_t), stream);
  }
  if (topk > (int64_t{1} << 20)) return cudaErrorInvalidValue;
  switch (dtype) {
    case core::IndexDtype::kUInt8: return record_with<uint8_t>(plan, layers, num_layers, topk, out, rows, overflow, stream);
    case core::IndexDtype::kInt8: return record_with<int8_t>(plan, layers, num_layers, topk, out, rows, overflow, stream);
    case core::IndexDtype::kInt16: return record_with<int16_t>(plan, layers, num_layers, topk, out, rows, overflow, stream);
    case core::IndexDtype::kInt32: return record_with<int32_t>(plan, layers, num_layers, topk, out, rows, overflow, stream);
    case core::IndexDtype::kInt64: return record_with<int64_t>(plan, layers, num_layers, topk, out, rows, overflow, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_router_scatter(const core::RouterScatterPlan& plan, const void* routes,
                                  core::IndexDtype dtype, int64_t num_layers, int64_t topk,
                                  const bool* replay_in, int64_t* targets, bool* replay_out,
                                  int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (num_layers * topk == 0 && replay_out == nullptr) return cudaSuccess;
  if (num_layers > (int64_t{1} << 20) || topk > (int64_t{1} << 20)) return cudaErrorInvalidValue;
  switch (dtype) {
    case core::IndexDtype::kUInt8: return scatter_with<uint8_t>(plan, routes, num_layers, topk, replay_in, targets, replay_out, rows, stream);
    case core::IndexDtype::kInt8: return scatter_with<int8_t>(plan, routes, num_layers, topk, replay_in, targets, replay_out, rows, stream);
    case core::IndexDtype::kInt16: return scatter_with<int16_t>(plan, routes, num_layers, topk, replay_in, targets, replay_out, rows, stream);
    case core::IndexDtype::kInt32: return scatter_with<int32_t>(plan, routes, num_layers, topk, replay_in, targets, replay_out, rows, stream);
    case core::IndexDtype::kInt64: return scatter_with<int64_t>(plan, routes, num_layers, topk, replay_in, targets, replay_out, rows, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace verl_ops
