#include "merge_ops.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "../core/merge_layout.h"

namespace verl_ops {
namespace ops {

static_assert(sizeof(HeaderCall::meta) == core::kMergeMeta * sizeof(int64_t), "HeaderCall::meta holds the meta words");

namespace {

constexpr const char* kHeaderOp = "dynamic_cp_merge_header";
constexpr const char* kIndexOp = "dynamic_cp_merge_index";

int64_t load(const Tensor& t, int64_t i) {
  return t.scalar_type() == st::kLong ? st::ptr<const int64_t>(t)[i]
                                      : static_cast<int64_t>(st::ptr<const int32_t>(t)[i]);
}

}  // namespace

HeaderCall prepare_merge_header(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                                int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                                int64_t local_cp_size) {
  const char* op = kHeaderOp;
  VERL_CHECK(num_samples >= 0 && num_samples <= INT32_MAX, op, ": num_samples must be in [0, ", INT32_MAX,
             "], got ", num_samples);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"lengths", &lengths},
                                {"sample_ids", &sample_ids}}) {
    VERL_CHECK(t->dim() == 1 && (t->scalar_type() == st::kLong || t->scalar_type() == st::kInt), op, ": ",
               name, " must be a 1-D int32/int64 tensor, got ", st::dtype_name(t->scalar_type()), " ",
               st::shape_of(*t));
  }
  VERL_CHECK(lengths.size(0) == sample_ids.size(0) && lengths.size(0) <= num_samples, op, ": lengths (",
             lengths.size(0), ") and sample_ids (", sample_ids.size(0),
             ") must have one entry per output sequence, at most num_samples=", num_samples);
  VERL_CHECK(st::same_device(lengths, sample_ids), op, ": sample_ids is on ", st::device_of(sample_ids),
             " but lengths is on ", st::device_of(lengths));
  HeaderCall call{st::output(op, "num_samples", lengths, {core::kMergeMeta + 2 * num_samples}, st::kLong),
                  st::contiguous(lengths),
                  st::contiguous(sample_ids), {}};
  const int64_t meta[core::kMergeMeta] = {lengths.size(0), rows,        dtype_hash,  feature_hash, row_bytes,
                                          key_hash,        num_samples, local_cp_size, 0};
  std::copy(meta, meta + core::kMergeMeta, call.meta);
  return call;
}

std::tuple<Tensor, Tensor> prepare_merge_index(const Tensor& header, int64_t num_samples) {
  const char* op = kIndexOp;
  VERL_CHECK(num_samples >= 0 && num_samples <= INT32_MAX, op, ": num_samples must be in [0, ", INT32_MAX,
             "], got ", num_samples);
  VERL_CHECK(header.scalar_type() == st::kLong && header.dim() == 2 && header.size(0) >= 1 &&
                 header.size(1) == core::kMergeMeta + 2 * num_samples,
             op, ": header must be int64 [groups >= 1, 9 + 2 * num_samples = ",
             core::kMergeMeta + 2 * num_samples, "], got ", st::dtype_name(header.scalar_type()), " ",
             st::shape_of(header));
  const core::MergeIndexLayout L(header.size(0), num_samples);
  return {st::output(op, "num_samples", header, {L.size}, st::kLong),
          st::output(op, "num_samples", header, {num_samples + 1}, st::kInt)};
}

Tensor merge_header_cpu(const Tensor& lengths, const Tensor& sample_ids, int64_t num_samples, int64_t rows,
                        int64_t dtype_hash, int64_t feature_hash, int64_t row_bytes, int64_t key_hash,
                        int64_t local_cp_size) {
  const HeaderCall call = prepare_merge_header(lengths, sample_ids, num_samples, rows, dtype_hash, feature_hash,
                                              row_bytes, key_hash, local_cp_size);
  const Tensor &len = call.lengths, &ids = call.sample_ids;
  const int64_t n = len.size(0), B = num_samples;
  int64_t* o = st::ptr<int64_t>(call.out);
  std::copy(call.meta, call.meta + core::kMergeMeta, o);
  for (int64_t k = 0; k < B; ++k) {
    o[core::kMergeMeta + k] = k < n ? load(len, k) : 0;
    o[core::kMergeMeta + B + k] = k < n ? load(ids, k) : -1;
  }
  return call.out;
}

std::tuple<Tensor, Tensor> merge_index_cpu(const Tensor& header, int64_t num_samples, bool validate) {
  auto [buf_t, cu_t] = prepare_merge_index(header, num_samples);
  const Tensor hdr_t = st::contiguous(header);
  const int64_t G = hdr_t.size(0), B = num_samples, W = core::kMergeMeta + 2 * B;
  const core::MergeIndexLayout L(G, B);
  const int64_t* hdr = st::ptr<const int64_t>(hdr_t);
  int64_t* buf = st::ptr<int64_t>(buf_t);
  int32_t* cu = st::ptr<int32_t>(cu_t);
  std::fill(buf, buf + L.size, validate ? -1 : 0);
  int64_t max_rows = 0;
  for (int64_t g = 0; g < G; ++g) {
    std::copy(hdr + g * W, hdr + g * W + core::kMergeMeta, buf + L.meta_at + g * core::kMergeMeta);
    max_rows = std::max(max_rows, hdr[g * W + core::kMergeRows]);
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* row = hdr + g * W;
    // (wrapping sums: garbage in, a rejected header out, never undefined behaviour)
    uint64_t run = static_cast<uint64_t>(row[core::kMergeStatus]);
    for (int64_t k = 0; k < B; ++k) {
      const int64_t id = row[core::kMergeMeta + B + k];
      const int64_t slot = (id < 0 || id >= B) ? B : id;
      buf[L.merged_at + slot] = row[core::kMergeMeta + k];
      buf[L.src_at + slot] = static_cast<int64_t>(static_cast<uint64_t>(g * max_rows) + run);
      run += static_cast<uint64_t>(row[core::kMergeMeta + k]);
    }
    if (validate) buf[g] = static_cast<int64_t>(run) == row[core::kMergeRows] ? 1 : 0;
  }
  uint32_t c = static_cast<uint32_t>(buf[L.merged_at - 1]);
  cu[0] = static_cast<int32_t>(c);
  int64_t lo_len = LLONG_MAX, lo_src = LLONG_MAX;
  uint64_t sum = 0;
  for (int64_t k = 0; k < B; ++k) {
    const int64_t len = buf[L.merged_at + k];
    c += static_cast<uint32_t>(len);
    cu[k + 1] = static_cast<int32_t>(c);
    lo_len = std::min(lo_len, len);
    lo_src = std::min(lo_src, buf[L.src_at + k]);
    sum += static_cast<uint64_t>(len);
  }
  if (B > 0) {
    if (validate) {
      buf[G] = lo_len;
      buf[G + 1] = lo_src;
    } else {
      buf[G] = static_cast<int64_t>(sum);
    }
  }
  return {buf_t, cu_t};
}

}  // namespace ops
}  // namespace verl_ops
