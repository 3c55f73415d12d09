// dynamic_cp_merge's header and reorder index, each in one launch (the Python path issued a dozen
// small tensor ops for them, each costing more host time than its kernel).
#include "merge_kernels.h"

#include <climits>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../core/merge_layout.h"

namespace verl_ops {
namespace cuda {

namespace {

constexpr int kHeaderBlock = 256;
constexpr int kIndexBlock = 512;

struct MinOp {
  __device__ long long operator()(long long a, long long b) const { return a < b ? a : b; }
};

struct Meta {
  int64_t w[core::kMergeMeta];
};

__global__ void merge_header_kernel(Meta meta, const void* lengths, bool lengths_64, const void* ids,
                                    bool ids_64, int64_t n, int64_t B, int64_t* out) {
  const int64_t total = core::kMergeMeta + 2 * B;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t v;
    if (i < core::kMergeMeta) {
      v = meta.w[i];
    } else if (i < core::kMergeMeta + B) {
      const int64_t k = i - core::kMergeMeta;
      v = k >= n ? 0
                 : (lengths_64 ? static_cast<const int64_t*>(lengths)[k]
                               : static_cast<int64_t>(static_cast<const int32_t*>(lengths)[k]));
    } else {
      const int64_t k = i - core::kMergeMeta - B;
      v = k >= n ? -1
                 : (ids_64 ? static_cast<const int64_t*>(ids)[k]
                           : static_cast<int64_t>(static_cast<const int32_t*>(ids)[k]));
    }
    out[i] = v;
  }
}

// One block. Phases, separated by barriers: (1) the buffer's fill and the meta words; (2) per
// group, a block-wide exclusive scan of its lengths gives each sequence's first row, scattered with
// the length to the sequence's sample slot; (3) a scan of the merged lengths gives the int32
// offsets, and a reduction the check words (or the merged total).
__global__ void __launch_bounds__(kIndexBlock)
    merge_index_kernel(const int64_t* hdr, int64_t G, int64_t B, bool validate, int64_t* buf, int32_t* cu) {
  using Scan = cub::BlockScan<long long, kIndexBlock>;
  using Scan32 = cub::BlockScan<unsigned int, kIndexBlock>;
  using Reduce = cub::BlockReduce<long long, kIndexBlock>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Scan32::TempStorage scan32;
    typename Reduce::TempStorage reduce;
  } tmp;
  const core::MergeIndexLayout L(G, B);
  const int64_t W = core::kMergeMeta + 2 * B;
  const int tid = static_cast<int>(threadIdx.x);

  const int64_t fill = validate ? -1 : 0;
  for (int64_t i = tid; i < L.size; i += kIndexBlock) buf[i] = fill;
  __syncthreads();
  for (int64_t i = tid; i < G * core::kMergeMeta; i += kIndexBlock) {
    buf[L.meta_at + i] = hdr[(i / core::kMergeMeta) * W + i % core::kMergeMeta];
  }
  int64_t max_rows = 0;
  for (int64_t g = 0; g < G; ++g) max_rows = max(max_rows, hdr[g * W + core::kMergeRows]);

  for (int64_t g = 0; g < G; ++g) {
    const int64_t* row = hdr + g * W;
    long long carry = row[core::kMergeStatus];  // 0 in an accepted row
    const int64_t base = g * max_rows;
    for (int64_t k0 = 0; k0 < B; k0 += kIndexBlock) {
      const int64_t k = k0 + tid;
      const long long len = k < B ? row[core::kMergeMeta + k] : 0;
      long long before, chunk;
      Scan(tmp.scan).ExclusiveSum(len, before, chunk);
      if (k < B) {
        const int64_t id = row[core::kMergeMeta + B + k];
        const int64_t slot = (id < 0 || id >= B) ? B : id;  // out of range: the spare word
        buf[L.merged_at + slot] = len;
        buf[L.src_at + slot] = base + carry + before;
      }
      carry += chunk;
      __syncthreads();
    }
    if (validate && tid == 0) buf[g] = carry == row[core::kMergeRows] ? 1 : 0;
  }
  __syncthreads();

  // int32 offsets from the word before the merged lengths (the last group's status), wrapping as
  // an int32 cumsum does (the host rejects totals over INT32_MAX).
  unsigned int run = static_cast<unsigned int>(buf[L.merged_at - 1]);
  if (tid == 0) cu[0] = static_cast<int32_t>(run);
  long long lo_len = LLONG_MAX, lo_src = LLONG_MAX, sum = 0;
  for (int64_t k0 = 0; k0 < B; k0 += kIndexBlock) {
    const int64_t k = k0 + tid;
    const long long len = k < B ? buf[L.merged_at + k] : 0;
    unsigned int incl, chunk;
    Scan32(tmp.scan32).InclusiveSum(static_cast<unsigned int>(len), incl, chunk);
    if (k < B) {
      cu[k + 1] = static_cast<int32_t>(run + incl);
      lo_len = min(lo_len, len);
      lo_src = min(lo_src, static_cast<long long>(buf[L.src_at + k]));
      sum += len;
    }
    run += chunk;
    __syncthreads();
  }
  if (B == 0) return;
  if (validate) {
    const long long a = Reduce(tmp.reduce).Reduce(lo_len, MinOp());
    __syncthreads();
    const long long b = Reduce(tmp.reduce).Reduce(lo_src, MinOp());
    if (tid == 0) {
      buf[G] = a;
      buf[G + 1] = b;
    }
  } else {
    const long long s = Reduce(tmp.reduce).Sum(sum);
    if (tid == 0) buf[G] = s;
  }
}

}  // namespace

cudaError_t launch_merge_header(const int64_t* meta, const void* lengths, bool lengths_64,
                                const void* ids, bool ids_64, int64_t n, int64_t B, int64_t* out,
                                cudaStream_t stream) {
  Meta m;
  for (int i = 0; i < core::kMergeMeta; ++i) m.w[i] = meta[i];
  const int64_t total = core::kMergeMeta + 2 * B;
  const int64_t blocks = std::min<int64_t>((total + kHeaderBlock - 1) / kHeaderBlock, 1024);
  merge_header_kernel<<<static_cast<unsigned>(blocks), kHeaderBlock, 0, stream>>>(m, lengths, lengths_64,
                                                                                  ids, ids_64, n, B, out);
  return cudaGetLastError();
}

cudaError_t launch_merge_index(const int64_t* hdr, int64_t G, int64_t B, bool validate, int64_t* buf,
                               int32_t* cu, cudaStream_t stream) {
  merge_index_kernel<<<1, kIndexBlock, 0, stream>>>(hdr, G, B, validate, buf, cu);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace verl_ops
