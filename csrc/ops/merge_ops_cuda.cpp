// CUDA implementations of dynamic_cp_merge's header and index: the same checks as the CPU path,
// one launch each on the current stream, nothing read on the host.
#include "../core/merge_layout.h"
#include "../cuda/merge_kernels.h"
#include "merge_ops.h"

namespace verl_ops {
namespace ops {

Tensor merge_header_cuda(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                         int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                         int64_t local_cp_size) {
  const st::DeviceGuard guard(st::guard_index(lengths));
  const HeaderCall call = prepare_merge_header(lengths, sample_ids, num_samples, rows, dtype_hash, feature_hash,
                                              row_bytes, key_hash, local_cp_size);
  const Tensor &len = call.lengths, &ids = call.sample_ids;
  st::check_launch("dynamic_cp_merge_header",
                   cuda::launch_merge_header(call.meta, len.data_ptr(), len.scalar_type() == st::kLong,
                                             ids.data_ptr(), ids.scalar_type() == st::kLong, len.size(0),
                                             num_samples, st::ptr<int64_t>(call.out), st::current_stream(lengths)));
  return call.out;
}

std::tuple<Tensor, Tensor> merge_index_cuda(const Tensor& header, int64_t num_samples, bool validate) {
  const st::DeviceGuard guard(st::guard_index(header));
  auto [buf, cu] = prepare_merge_index(header, num_samples);
  const Tensor hdr = st::contiguous(header);
  st::check_launch("dynamic_cp_merge_index",
                   cuda::launch_merge_index(st::ptr<const int64_t>(hdr), hdr.size(0), num_samples, validate,
                                            st::ptr<int64_t>(buf), st::ptr<int32_t>(cu),
                                            st::current_stream(header)));
  return {buf, cu};
}

}  // namespace ops
}  // namespace verl_ops
