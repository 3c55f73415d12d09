#include "jagged_ops.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "../cpu/thd_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

// Shape / dtype / device checks. `data_name` is the op's name for its data argument ("values" or
// "grad").
void check_index_args(const char* op, const char* data_name, const Tensor& values,
                      const Tensor& src_starts, const Tensor& cu_out) {
  VERL_CHECK(values.dim() >= 1, op, ": ", data_name, " must be [rows, *F], got a 0-d tensor");
  VERL_CHECK(src_starts.scalar_type() == st::kLong, op, ": src_starts must be int64, got ",
             st::dtype_name(src_starts.scalar_type()));
  VERL_CHECK(src_starts.dim() == 1, op, ": src_starts must be 1-D, got ", src_starts.dim(), " dims");
  VERL_CHECK(cu_out.scalar_type() == st::kInt, op, ": cu_seqlens_out must be int32, got ",
             st::dtype_name(cu_out.scalar_type()));
  VERL_CHECK(cu_out.dim() == 1, op, ": cu_seqlens_out must be 1-D, got ", cu_out.dim(), " dims");
  VERL_CHECK(cu_out.size(0) == src_starts.size(0) + 1, op,
             ": cu_seqlens_out must have len(src_starts) + 1 entries, got ", cu_out.size(0), " for ",
             src_starts.size(0), " sequences");
  VERL_CHECK(st::same_device(src_starts, values), op, ": src_starts is on ", st::device_of(src_starts),
             " but ", data_name, " is on ", st::device_of(values));
  VERL_CHECK(st::same_device(cu_out, values), op, ": cu_seqlens_out is on ", st::device_of(cu_out),
             " but ", data_name, " is on ", st::device_of(values));
}

// Value checks on host index tensors: offsets start at 0, are non-decreasing and end at the
// gathered side's row count; every span lies inside the pool; scatter spans are disjoint.
void check_host_indices(const char* op, const int32_t* cu, const int64_t* st_, int64_t n,
                        int64_t gathered_rows, int64_t pool_rows, const char* pool_name, bool scatter) {
  VERL_CHECK(cu[0] == 0, op, ": cu_seqlens_out must start at 0, got ", cu[0]);
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t len = static_cast<int64_t>(cu[j + 1]) - cu[j];
    VERL_CHECK(len >= 0, op, ": cu_seqlens_out must be non-decreasing, got ", cu[j], " then ",
               cu[j + 1], " at index ", j);
    VERL_CHECK(st_[j] >= 0 && st_[j] <= pool_rows - len, op, ": src_starts[", j, "]=", st_[j],
               " with length ", len, " is outside the ", pool_rows, " rows of ", pool_name);
    if (len > 0) spans.emplace_back(st_[j], st_[j] + len);
  }
  VERL_CHECK(cu[n] == gathered_rows, op, ": cu_seqlens_out[-1]=", cu[n], " but the gathered side has ",
             gathered_rows, " rows");
  if (scatter) {
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k) {
      VERL_CHECK(spans[k].first >= spans[k - 1].second, op, ": src_starts select overlapping rows (",
                 spans[k].first, " is inside the span [", spans[k - 1].first, ", ", spans[k - 1].second,
                 ")); the scatter needs each row at most once");
    }
  }
}

Tensor jagged_rows_cpu(const char* op, bool scatter, const Tensor& values, const Tensor& src_starts,
                       const Tensor& cu_out, int64_t total) {
  const JaggedCall c = prepare_jagged(op, values, src_starts, cu_out, total, scatter);
  if (c.row_bytes == 0) return c.out;
  const char* src = static_cast<const char*>(c.src.data_ptr());
  char* dst = static_cast<char*>(c.out.data_ptr());
  if (scatter) {
    cpu::jagged_scatter_rows(c.plan, src, dst, c.row_bytes, 0, c.gathered_rows);
  } else {
    cpu::for_row_ranges(c.gathered_rows, c.row_bytes, [&](int64_t lo, int64_t hi) {
      cpu::jagged_gather_rows(c.plan, src, dst, c.row_bytes, lo, hi);
    });
  }
  return c.out;
}

}  // namespace

JaggedCall prepare_jagged(const char* op, const Tensor& values, const Tensor& src_starts,
                          const Tensor& cu_seqlens_out, int64_t total, bool scatter) {
  const char* data_name = scatter ? "grad" : "values";
  check_index_args(op, data_name, values, src_starts, cu_seqlens_out);
  VERL_CHECK(total >= 0, op, ": ", scatter ? "total_in" : "total_out", " must be >= 0, got ", total);
  JaggedCall call;
  call.src = st::contiguous(values);
  call.src_starts = st::contiguous(src_starts);
  call.cu_out = st::contiguous(cu_seqlens_out);
  const int64_t n = src_starts.size(0);
  // The pool is the tensor the sequences are taken from (gather) or put back into (scatter).
  const int64_t pool_rows = scatter ? total : values.size(0);
  call.gathered_rows = scatter ? values.size(0) : total;
  if (values.is_cpu()) {
    check_host_indices(op, st::ptr<int32_t>(call.cu_out), st::ptr<int64_t>(call.src_starts), n,
                       call.gathered_rows, pool_rows, scatter ? "the output (total_in)" : "values", scatter);
  }
  // Device index tensors are not read here (that would be a host synchronisation); the kernel
  // treats a span that leaves the pool as zero rows (gather) or drops it (scatter).
  std::vector<int64_t> shape = st::sizes_of(values);
  shape[0] = total;
  call.row_bytes = st::row_bytes(op, values, 1);
  st::checked_mul(op, "the output size", total, call.row_bytes);
  call.out = st::output(op, scatter ? "total_in" : "total_out", values, shape, values.scalar_type(),
                        /*zero=*/scatter);
  call.plan.src_starts = st::ptr<int64_t>(call.src_starts);
  call.plan.cu_out = st::ptr<int32_t>(call.cu_out);
  call.plan.num_out_seqs = n;
  call.plan.src_rows = pool_rows;
  return call;
}

Tensor jagged_gather_cpu(const Tensor& values, const Tensor& src_starts, const Tensor& cu_seqlens_out,
                         int64_t total_out) {
  return jagged_rows_cpu("jagged_gather", false, values, src_starts, cu_seqlens_out, total_out);
}

Tensor jagged_scatter_cpu(const Tensor& grad, const Tensor& src_starts, const Tensor& cu_seqlens_out,
                          int64_t total_in) {
  return jagged_rows_cpu("jagged_scatter", true, grad, src_starts, cu_seqlens_out, total_in);
}

}  // namespace ops
}  // namespace verl_ops
