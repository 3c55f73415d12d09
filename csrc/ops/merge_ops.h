// dynamic_cp_merge's two internal steps as ops (layouts in core/merge_layout.h): the header a rank
// contributes to the merge's first all-gather, and the reorder index of the gathered header. Each
// is one launch on CUDA (no host read), so the merge's host path is a few calls instead of a dozen
// small tensor ops.
#pragma once

#include "stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

// header [9 + 2B] int64 on lengths' device.
Tensor merge_header_cpu(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                        int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                        int64_t local_cp_size);
// (buf int64 [index size], cu int32 [B + 1]) on header's device.
std::tuple<Tensor, Tensor> merge_index_cpu(const Tensor& header, int64_t num_samples, bool validate);
#ifdef VERL_OPS_WITH_CUDA
Tensor merge_header_cuda(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                         int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                         int64_t local_cp_size);
std::tuple<Tensor, Tensor> merge_index_cuda(const Tensor& header, int64_t num_samples, bool validate);
#endif

// A header call after its checks: the output allocated, the inputs made contiguous, and the
// meta words in header order (core/merge_layout.h), the status word 0.
struct HeaderCall {
  Tensor out, lengths, sample_ids;
  int64_t meta[9];  // core::kMergeMeta (merge_layout.h is not included here: it undefines VERL_HD)
};

// Shared argument checks; each returns the output(s), allocated.
HeaderCall prepare_merge_header(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                                int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                                int64_t local_cp_size);
std::tuple<Tensor, Tensor> prepare_merge_index(const Tensor& header, int64_t num_samples);

}  // namespace ops
}  // namespace verl_ops
