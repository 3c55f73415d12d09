#include "jagged_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/thd_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

[[noreturn]] void fail(const std::string& msg) { TORCH_CHECK(false, msg); }

std::string num(int64_t v) { return std::to_string(v); }

// Shape / dtype / device checks; SymInt-aware so the Meta kernel shares them. `data_name` is the
// op's name for its data argument ("values" or "grad").
void check_index_args(const std::string& op, const char* data_name, const at::Tensor& values,
                      const at::Tensor& src_starts, const at::Tensor& cu_out) {
  if (values.dim() < 1) fail(op + ": " + data_name + " must be [rows, *F], got a 0-d tensor");
  if (src_starts.scalar_type() != at::kLong) {
    fail(op + ": src_starts must be int64, got " + c10::str(src_starts.scalar_type()));
  }
  if (src_starts.dim() != 1) fail(op + ": src_starts must be 1-D, got " + num(src_starts.dim()) + " dims");
  if (cu_out.scalar_type() != at::kInt) {
    fail(op + ": cu_seqlens_out must be int32, got " + c10::str(cu_out.scalar_type()));
  }
  if (cu_out.dim() != 1) fail(op + ": cu_seqlens_out must be 1-D, got " + num(cu_out.dim()) + " dims");
  if (cu_out.sym_size(0) != src_starts.sym_size(0) + 1) {
    fail(op + ": cu_seqlens_out must have len(src_starts) + 1 entries, got " + c10::str(cu_out.sym_size(0)) +
         " for " + c10::str(src_starts.sym_size(0)) + " sequences");
  }
  if (src_starts.device() != values.device()) {
    fail(op + ": src_starts is on " + c10::str(src_starts.device()) + " but " + data_name + " is on " +
         c10::str(values.device()));
  }
  if (cu_out.device() != values.device()) {
    fail(op + ": cu_seqlens_out is on " + c10::str(cu_out.device()) + " but " + data_name + " is on " +
         c10::str(values.device()));
  }
}

// Value checks on host index tensors: offsets start at 0, are non-decreasing and end at the
// gathered side's row count; every span lies inside the pool; scatter spans are disjoint.
void check_host_indices(const std::string& op, const int32_t* cu, const int64_t* st, int64_t n,
                        int64_t gathered_rows, int64_t pool_rows, const char* pool_name, bool scatter) {
  if (cu[0] != 0) fail(op + ": cu_seqlens_out must start at 0, got " + num(cu[0]));
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t len = static_cast<int64_t>(cu[j + 1]) - cu[j];
    if (len < 0) {
      fail(op + ": cu_seqlens_out must be non-decreasing, got " + num(cu[j]) + " then " + num(cu[j + 1]) +
           " at index " + num(j));
    }
    if (st[j] < 0 || st[j] > pool_rows - len) {
      fail(op + ": src_starts[" + num(j) + "]=" + num(st[j]) + " with length " + num(len) +
           " is outside the " + num(pool_rows) + " rows of " + pool_name);
    }
    if (len > 0) spans.emplace_back(st[j], st[j] + len);
  }
  if (cu[n] != gathered_rows) {
    fail(op + ": cu_seqlens_out[-1]=" + num(cu[n]) + " but the gathered side has " + num(gathered_rows) +
         " rows");
  }
  if (scatter) {
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k) {
      if (spans[k].first < spans[k - 1].second) {
        fail(op + ": src_starts select overlapping rows (" + num(spans[k].first) + " is inside the span [" +
             num(spans[k - 1].first) + ", " + num(spans[k - 1].second) +
             ")); the scatter needs each row at most once");
      }
    }
  }
}

template <typename Shape>
Shape with_rows(typename Shape::value_type rows, const Shape& sizes) {
  Shape s{std::move(rows)};
  for (size_t d = 1; d < sizes.size(); ++d) s.push_back(sizes[d]);
  return s;
}

at::Tensor jagged_rows_cpu(const char* op, bool scatter, const at::Tensor& values,
                           const at::Tensor& src_starts, const at::Tensor& cu_out, int64_t total) {
  at::Tensor out;
  const JaggedCall c = prepare_jagged(op, values, src_starts, cu_out, total, scatter, &out);
  const char* src = static_cast<const char*>(c.src.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  if (c.row_bytes == 0) return out;
  // Both directions walk the gather's output rows; the scatter writes each pool row at most once
  // (disjoint spans), so chunks never collide.
  at::parallel_for(0, c.gathered_rows, 2048, [&](int64_t b, int64_t e) {
    if (scatter) {
      cpu::jagged_scatter_rows(c.plan, src, dst, c.row_bytes, b, e);
    } else {
      cpu::jagged_gather_rows(c.plan, src, dst, c.row_bytes, b, e);
    }
  });
  return out;
}

at::Tensor jagged_meta(const char* op, const char* data_name, const at::Tensor& values,
                       const at::Tensor& src_starts, const at::Tensor& cu_out, c10::SymInt rows) {
  check_index_args(op, data_name, values, src_starts, cu_out);
  std::vector<c10::SymInt> sizes(values.sym_sizes().begin(), values.sym_sizes().end());
  return at::empty_symint(with_rows(std::move(rows), sizes), values.options());
}

}  // namespace

JaggedCall prepare_jagged(const char* op_name, const at::Tensor& values, const at::Tensor& src_starts,
                          const at::Tensor& cu_seqlens_out, int64_t total, bool scatter,
                          at::Tensor* out) {
  const std::string op(op_name);
  const char* data_name = scatter ? "grad" : "values";
  check_index_args(op, data_name, values, src_starts, cu_seqlens_out);
  if (total < 0) fail(op + ": " + (scatter ? "total_in" : "total_out") + " must be >= 0, got " + num(total));
  JaggedCall call;
  call.src = values.contiguous();
  call.src_starts = src_starts.contiguous();
  call.cu_out = cu_seqlens_out.contiguous();
  const int64_t n = src_starts.size(0);
  // The pool is the tensor the sequences are taken from (gather) or put back into (scatter).
  const int64_t pool_rows = scatter ? total : values.size(0);
  call.gathered_rows = scatter ? values.size(0) : total;
  if (values.device().is_cpu()) {
    check_host_indices(op, call.cu_out.data_ptr<int32_t>(), call.src_starts.data_ptr<int64_t>(), n,
                       call.gathered_rows, pool_rows, scatter ? "the output (total_in)" : "values", scatter);
  }
  // Device index tensors are not read here (that would be a host synchronisation); the kernel
  // treats a span that leaves the pool as zero rows (gather) or drops it (scatter).
  const std::vector<int64_t> shape = with_rows(total, values.sizes().vec());
  *out = scatter ? at::zeros(shape, values.options()) : at::empty(shape, values.options());
  call.plan.src_starts = call.src_starts.data_ptr<int64_t>();
  call.plan.cu_out = call.cu_out.data_ptr<int32_t>();
  call.plan.num_out_seqs = n;
  call.plan.src_rows = pool_rows;
  int64_t per_row = 1;
  for (int64_t d = 1; d < values.dim(); ++d) per_row *= values.size(d);
  call.row_bytes = per_row * static_cast<int64_t>(values.element_size());
  return call;
}

at::Tensor jagged_gather_cpu(const at::Tensor& values, const at::Tensor& src_starts,
                             const at::Tensor& cu_seqlens_out, int64_t total_out) {
  return jagged_rows_cpu("jagged_gather", false, values, src_starts, cu_seqlens_out, total_out);
}

at::Tensor jagged_scatter_cpu(const at::Tensor& grad, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_in) {
  return jagged_rows_cpu("jagged_scatter", true, grad, src_starts, cu_seqlens_out, total_in);
}

at::Tensor jagged_gather_meta(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, c10::SymInt total_out) {
  return jagged_meta("jagged_gather", "values", values, src_starts, cu_seqlens_out, std::move(total_out));
}

at::Tensor jagged_scatter_meta(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, c10::SymInt total_in) {
  return jagged_meta("jagged_scatter", "grad", grad, src_starts, cu_seqlens_out, std::move(total_in));
}

}  // namespace ops
}  // namespace verl_ops
