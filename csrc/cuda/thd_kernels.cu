// Fused row-gather kernels for THD pack / unpack.
//
// Each output row is resolved to its input row once (binary search over cu_seqlens, shared
// with the CPU path through core/thd_rows.h) and copied with the widest vector the row size
// and pointer alignment allow. A group of `threads_per_row` threads owns one row; narrow rows
// (ids) get one thread each, wide rows (hidden states) up to a whole block.
#include "thd_kernels.h"

#include <algorithm>

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kUnroll = 4;

template <typename Vec>
__device__ __forceinline__ Vec zero_vec() {
  Vec v;
  char* b = reinterpret_cast<char*>(&v);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec)); ++i) b[i] = 0;
  return v;
}

// Copies (or zeroes) `vecs` vectors of one row; lane strides by `tpr`, with kUnroll loads in
// flight before the first store.
template <typename Vec>
__device__ __forceinline__ void copy_row(const Vec* __restrict__ src, Vec* __restrict__ dst,
                                         int64_t vecs, int lane, int tpr) {
  if (src == nullptr) {
    const Vec z = zero_vec<Vec>();
    for (int64_t v = lane; v < vecs; v += tpr) dst[v] = z;
    return;
  }
  int64_t v = lane;
  for (; v + (kUnroll - 1) * tpr < vecs; v += kUnroll * tpr) {
    Vec buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) buf[u] = __ldg(src + v + u * tpr);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[v + u * tpr] = buf[u];
  }
  for (; v < vecs; v += tpr) dst[v] = __ldg(src + v);
}

template <typename Vec>
__global__ void __launch_bounds__(kBlock) pack_kernel(core::PackPlan plan,
                                                      const Vec* __restrict__ src,
                                                      Vec* __restrict__ dst,
                                                      int64_t* __restrict__ positions,
                                                      int64_t out_rows, int64_t vecs_per_row,
                                                      int tpr) {
  const int rows_per_block = kBlock / tpr;
  const int lane = threadIdx.x % tpr;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / tpr;
       row < out_rows; row += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    int64_t pos = 0;
    const int64_t s = core::pack_source_row(plan, row, &pos);
    if (positions != nullptr && lane == 0) positions[row] = pos;
    copy_row<Vec>(s >= 0 ? src + s * vecs_per_row : nullptr, dst + row * vecs_per_row,
                  vecs_per_row, lane, tpr);
  }
}

template <typename Vec>
__global__ void __launch_bounds__(kBlock) unpack_kernel(core::UnpackPlan plan,
                                                        const Vec* __restrict__ src,
                                                        Vec* __restrict__ dst, int64_t out_rows,
                                                        int64_t vecs_per_row, int tpr) {
  const int rows_per_block = kBlock / tpr;
  const int lane = threadIdx.x % tpr;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + threadIdx.x / tpr;
       row < out_rows; row += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t s = core::unpack_source_row(plan, row);
    copy_row<Vec>(s >= 0 ? src + s * vecs_per_row : nullptr, dst + row * vecs_per_row,
                  vecs_per_row, lane, tpr);
  }
}

// Widest power-of-two vector (<= 16 bytes) dividing the row size and both base addresses.
int vector_bytes(const void* a, const void* b, int64_t row_bytes) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                         static_cast<uintptr_t>(row_bytes);
  for (int w = 16; w > 1; w >>= 1) {
    if ((bits & static_cast<uintptr_t>(w - 1)) == 0) return w;
  }
  return 1;
}

struct LaunchShape {
  int tpr;
  unsigned grid;
};

LaunchShape launch_shape(int64_t out_rows, int64_t vecs_per_row) {
  // Threads per row: a power of two covering the row, at most one block. Rows narrower than
  // a vector-group waste lanes, so round down when that keeps >= 3/4 of lanes busy.
  int tpr = 1;
  while (tpr < kBlock && tpr * 2 <= vecs_per_row) tpr *= 2;
  const int64_t rows_per_block = kBlock / tpr;
  int64_t blocks = (out_rows + rows_per_block - 1) / rows_per_block;
  // Enough blocks to fill the device several times over; the grid-stride loop does the rest.
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, static_cast<int64_t>(sms) * 32));
  return LaunchShape{tpr, static_cast<unsigned>(blocks)};
}

template <typename Vec>
cudaError_t pack_with(const core::PackPlan& plan, const void* src, void* dst, int64_t* positions,
                      int64_t out_rows, int64_t row_bytes, cudaStream_t stream) {
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const LaunchShape ls = launch_shape(out_rows, vecs);
  pack_kernel<Vec><<<ls.grid, kBlock, 0, stream>>>(plan, static_cast<const Vec*>(src),
                                                   static_cast<Vec*>(dst), positions, out_rows,
                                                   vecs, ls.tpr);
  return cudaGetLastError();
}

template <typename Vec>
cudaError_t unpack_with(const core::UnpackPlan& plan, const void* src, void* dst,
                        int64_t out_rows, int64_t row_bytes, cudaStream_t stream) {
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const LaunchShape ls = launch_shape(out_rows, vecs);
  unpack_kernel<Vec><<<ls.grid, kBlock, 0, stream>>>(plan, static_cast<const Vec*>(src),
                                                     static_cast<Vec*>(dst), out_rows, vecs,
                                                     ls.tpr);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pack(const core::PackPlan& plan, const void* src, void* dst, int64_t* positions,
                        int64_t out_rows, int64_t row_bytes, cudaStream_t stream) {
  if (out_rows == 0) return cudaSuccess;
  // row_bytes may be 0 (an empty feature shape): positions are still written.
  switch (row_bytes > 0 ? vector_bytes(src, dst, row_bytes) : 16) {
    case 16: return pack_with<uint4>(plan, src, dst, positions, out_rows, row_bytes, stream);
    case 8: return pack_with<uint2>(plan, src, dst, positions, out_rows, row_bytes, stream);
    case 4: return pack_with<uint32_t>(plan, src, dst, positions, out_rows, row_bytes, stream);
    case 2: return pack_with<unsigned short>(plan, src, dst, positions, out_rows, row_bytes, stream);
    default: return pack_with<char>(plan, src, dst, positions, out_rows, row_bytes, stream);
  }
}

cudaError_t launch_unpack(const core::UnpackPlan& plan, const void* src, void* dst,
                          int64_t out_rows, int64_t row_bytes, cudaStream_t stream) {
  if (out_rows == 0 || row_bytes == 0) return cudaSuccess;
  switch (vector_bytes(src, dst, row_bytes)) {
    case 16: return unpack_with<uint4>(plan, src, dst, out_rows, row_bytes, stream);
    case 8: return unpack_with<uint2>(plan, src, dst, out_rows, row_bytes, stream);
    case 4: return unpack_with<uint32_t>(plan, src, dst, out_rows, row_bytes, stream);
    case 2: return unpack_with<unsigned short>(plan, src, dst, out_rows, row_bytes, stream);
    default: return unpack_with<char>(plan, src, dst, out_rows, row_bytes, stream);
  }
}

}  // namespace cuda
}  // namespace verl_ops
