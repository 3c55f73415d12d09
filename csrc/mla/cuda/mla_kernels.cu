// Zero-padding of the head dim (V [T, H, Dv] -> [T, H, Dqk]) for the padded attention path.
//
// A block covers whole rows: with R = blockDim / vecs_per_row rows per step every thread owns
// one (row, vector) slot and moves 16 bytes (or the widest width that divides the row sizes,
// strides and base addresses) per step; rows wider than a block loop over their vectors.
// blockIdx.y picks the tensor, so V, grad_out and out are padded by a single launch.
#include "mla_kernels.h"

#include <algorithm>

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kBlock = 256;

struct PadLaunch {
  PadJob job[kMaxPadJobs];
};

template <typename Vec>
__global__ void __launch_bounds__(kBlock) pad_kernel(PadLaunch jobs, int64_t src_vecs,
                                                     int64_t dst_vecs) {
  const PadJob& j = jobs.job[blockIdx.y];
  const int64_t rows = j.g.tokens * j.g.heads;
  int64_t rows_per_step = 1, row_in_step = 0, col0 = threadIdx.x, col_step = kBlock;
  if (dst_vecs <= kBlock) {
    rows_per_step = kBlock / dst_vecs;
    row_in_step = threadIdx.x / dst_vecs;
    col0 = threadIdx.x - row_in_step * dst_vecs;
    col_step = dst_vecs;
    if (row_in_step >= rows_per_step) return;
  }
  const Vec* __restrict__ src = static_cast<const Vec*>(j.src);
  Vec* __restrict__ dst = static_cast<Vec*>(j.dst);
  Vec zero;
  char* zb = reinterpret_cast<char*>(&zero);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec)); ++i) zb[i] = 0;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_step + row_in_step; row < rows;
       row += static_cast<int64_t>(gridDim.x) * rows_per_step) {
    const Vec* s = src + core::pad_source_offset(j.g, row);
    Vec* d = dst + row * dst_vecs;
    for (int64_t c = col0; c < dst_vecs; c += col_step) d[c] = c < src_vecs ? s[c] : zero;
  }
}

bool divides(int64_t w, int64_t x) { return x % w == 0; }

__device__ __forceinline__ int32_t clamp_offset(int32_t v, int64_t rows) {
  return static_cast<int32_t>(v < 0 ? int64_t{0} : (v > rows ? rows : static_cast<int64_t>(v)));
}

__global__ void __launch_bounds__(kBlock)
    clamp_offsets_kernel(const int32_t* __restrict__ cu_q, int32_t* __restrict__ out_q, int64_t rows_q,
                         const int32_t* __restrict__ cu_kv, int32_t* __restrict__ out_kv, int64_t rows_kv,
                         int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlock) {
    out_q[i] = clamp_offset(cu_q[i], rows_q);
    out_kv[i] = clamp_offset(cu_kv[i], rows_kv);
  }
}

}  // namespace

cudaError_t launch_clamp_offsets(const int32_t* cu_q, int32_t* out_q, int64_t rows_q, const int32_t* cu_kv,
                                 int32_t* out_kv, int64_t rows_kv, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kBlock - 1) / kBlock, 1024);
  clamp_offsets_kernel<<<static_cast<int>(blocks), kBlock, 0, stream>>>(cu_q, out_q, rows_q, cu_kv, out_kv,
                                                                        rows_kv, n);
  return cudaGetLastError();
}

cudaError_t launch_pad_last_dim(const PadJob* jobs, int num_jobs, int64_t src_cols,
                                int64_t dst_cols, int64_t elem_bytes, cudaStream_t stream) {
  if (num_jobs <= 0 || num_jobs > kMaxPadJobs || src_cols > dst_cols) return cudaErrorInvalidValue;
  int64_t max_rows = 0;
  for (int i = 0; i < num_jobs; ++i) max_rows = std::max(max_rows, jobs[i].g.tokens * jobs[i].g.heads);
  if (max_rows == 0 || dst_cols == 0) return cudaSuccess;
  // Widest vector dividing every row size, stride and base address.
  int64_t w = 16;
  for (; w > 1; w >>= 1) {
    bool ok = divides(w, src_cols * elem_bytes) && divides(w, dst_cols * elem_bytes);
    for (int i = 0; i < num_jobs && ok; ++i) {
      ok = divides(w, jobs[i].g.src_token_stride * elem_bytes) &&
           divides(w, jobs[i].g.src_head_stride * elem_bytes) &&
           divides(w, static_cast<int64_t>(reinterpret_cast<uintptr_t>(jobs[i].src))) &&
           divides(w, static_cast<int64_t>(reinterpret_cast<uintptr_t>(jobs[i].dst)));
    }
    if (ok) break;
  }
  PadLaunch launch{};
  for (int i = 0; i < num_jobs; ++i) {
    launch.job[i] = jobs[i];
    launch.job[i].g.src_token_stride = jobs[i].g.src_token_stride * elem_bytes / w;
    launch.job[i].g.src_head_stride = jobs[i].g.src_head_stride * elem_bytes / w;
  }
  const int64_t src_vecs = src_cols * elem_bytes / w, dst_vecs = dst_cols * elem_bytes / w;
  const int64_t rows_per_block = dst_vecs <= kBlock ? kBlock / dst_vecs : 1;
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((max_rows + rows_per_block - 1) / rows_per_block, static_cast<int64_t>(sms) * 16));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(num_jobs));
  switch (w) {
    case 16: pad_kernel<uint4><<<grid, kBlock, 0, stream>>>(launch, src_vecs, dst_vecs); break;
    case 8: pad_kernel<uint2><<<grid, kBlock, 0, stream>>>(launch, src_vecs, dst_vecs); break;
    case 4: pad_kernel<uint32_t><<<grid, kBlock, 0, stream>>>(launch, src_vecs, dst_vecs); break;
    case 2: pad_kernel<unsigned short><<<grid, kBlock, 0, stream>>>(launch, src_vecs, dst_vecs); break;
    default: pad_kernel<unsigned char><<<grid, kBlock, 0, stream>>>(launch, src_vecs, dst_vecs); break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace verl_ops
