#include "jagged_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../cpu/thd_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

void check_index_args(const char* op, const at::Tensor& values, const at::Tensor& src_starts,
                      const at::Tensor& cu_out) {
  TORCH_CHECK(values.dim() >= 1, op, ": values must be [rows, *F], got shape ", values.sym_sizes());
  TORCH_CHECK(src_starts.scalar_type() == at::kLong && src_starts.dim() == 1, op,
              ": src_starts must be a 1-D int64 tensor, got ", src_starts.scalar_type(), " ",
              src_starts.sym_sizes());
  TORCH_CHECK(cu_out.scalar_type() == at::kInt && cu_out.dim() == 1, op,
              ": cu_seqlens_out must be a 1-D int32 tensor, got ", cu_out.scalar_type(), " ",
              cu_out.sym_sizes());
  TORCH_CHECK(cu_out.sym_size(0) == src_starts.sym_size(0) + 1, op,
              ": cu_seqlens_out must have len(src_starts) + 1 entries, got ", cu_out.sym_size(0),
              " for ", src_starts.sym_size(0), " sequences");
  TORCH_CHECK(src_starts.device() == values.device() && cu_out.device() == values.device(), op,
              ": src_starts, cu_seqlens_out and values must be on one device, got ",
              src_starts.device(), ", ", cu_out.device(), ", ", values.device());
}

std::vector<int64_t> shape_with_rows(int64_t rows, const at::Tensor& like) {
  std::vector<int64_t> s{rows};
  for (int64_t d = 1; d < like.dim(); ++d) s.push_back(like.size(d));
  return s;
}

}  // namespace

JaggedCall prepare_jagged(const char* op, const at::Tensor& values, const at::Tensor& src_starts,
                          const at::Tensor& cu_seqlens_out, int64_t total, bool scatter,
                          at::Tensor* out) {
  check_index_args(op, values, src_starts, cu_seqlens_out);
  TORCH_CHECK(total >= 0, op, ": ", scatter ? "total_in" : "total_out", " must be >= 0, got ", total);
  JaggedCall call;
  call.src = values.contiguous();
  call.src_starts = src_starts.contiguous();
  call.cu_out = cu_seqlens_out.contiguous();
  const int64_t n = src_starts.size(0);
  // Rows of the tensor the sequences are taken from (gather) or put back into (scatter).
  const int64_t pool_rows = scatter ? total : values.size(0);
  const int64_t gathered_rows = scatter ? values.size(0) : total;
  if (values.device().is_cpu()) {
    const int32_t* cu = call.cu_out.data_ptr<int32_t>();
    const int64_t* st = call.src_starts.data_ptr<int64_t>();
    TORCH_CHECK(cu[0] == 0, op, ": cu_seqlens_out must start at 0, got ", cu[0]);
    TORCH_CHECK(cu[n] == gathered_rows, op, ": cu_seqlens_out[-1]=", cu[n], " but the gathered side has ",
                gathered_rows, " rows");
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t len = static_cast<int64_t>(cu[j + 1]) - cu[j];
      TORCH_CHECK(len >= 0, op, ": cu_seqlens_out must be non-decreasing, got ", cu[j], " then ",
                  cu[j + 1], " at index ", j);
      TORCH_CHECK(st[j] >= 0 && st[j] + len <= pool_rows, op, ": src_starts[", j, "]=", st[j],
                  " with length ", len, " is outside the ", pool_rows, " source rows");
      if (len > 0) spans.emplace_back(st[j], st[j] + len);
    }
    if (scatter) {
      std::sort(spans.begin(), spans.end());
      for (size_t k = 1; k < spans.size(); ++k) {
        TORCH_CHECK(spans[k].first >= spans[k - 1].second, op,
                    ": src_starts select overlapping rows; the scatter needs each row at most once");
      }
    }
  }
  *out = scatter ? at::zeros(shape_with_rows(total, values), values.options())
                 : at::empty(shape_with_rows(total, values), values.options());
  call.plan.src_starts = call.src_starts.data_ptr<int64_t>();
  call.plan.cu_out = call.cu_out.data_ptr<int32_t>();
  call.plan.num_out_seqs = n;
  call.plan.src_rows = pool_rows;
  call.row_bytes = values.dim() == 0 ? 0 : (values.numel() / std::max<int64_t>(values.size(0), 1)) *
                                               static_cast<int64_t>(values.element_size());
  if (values.size(0) == 0) {
    int64_t per_row = 1;
    for (int64_t d = 1; d < values.dim(); ++d) per_row *= values.size(d);
    call.row_bytes = per_row * static_cast<int64_t>(values.element_size());
  }
  return call;
}

at::Tensor jagged_gather_cpu(const at::Tensor& values, const at::Tensor& src_starts,
                             const at::Tensor& cu_seqlens_out, int64_t total_out) {
  at::Tensor out;
  JaggedCall c = prepare_jagged("jagged_gather", values, src_starts, cu_seqlens_out, total_out, false, &out);
  const char* src = static_cast<const char*>(c.src.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, total_out, 2048, [&](int64_t b, int64_t e) {
    cpu::jagged_gather_rows(c.plan, src, dst, c.row_bytes, b, e);
  });
  return out;
}

at::Tensor jagged_scatter_cpu(const at::Tensor& grad, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, int64_t total_in) {
  at::Tensor out;
  JaggedCall c = prepare_jagged("jagged_scatter", grad, src_starts, cu_seqlens_out, total_in, true, &out);
  const char* src = static_cast<const char*>(c.src.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, grad.size(0), 2048, [&](int64_t b, int64_t e) {
    cpu::jagged_scatter_rows(c.plan, src, dst, c.row_bytes, b, e);
  });
  return out;
}

static at::Tensor jagged_meta(const char* op, const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_out, c10::SymInt rows) {
  check_index_args(op, values, src_starts, cu_out);
  std::vector<c10::SymInt> shape{std::move(rows)};
  const auto sizes = values.sym_sizes();
  for (int64_t d = 1; d < values.dim(); ++d) shape.push_back(sizes[d]);
  return at::empty_symint(shape, values.options());
}

at::Tensor jagged_gather_meta(const at::Tensor& values, const at::Tensor& src_starts,
                              const at::Tensor& cu_seqlens_out, c10::SymInt total_out) {
  return jagged_meta("jagged_gather", values, src_starts, cu_seqlens_out, std::move(total_out));
}

at::Tensor jagged_scatter_meta(const at::Tensor& grad, const at::Tensor& src_starts,
                               const at::Tensor& cu_seqlens_out, c10::SymInt total_in) {
  return jagged_meta("jagged_scatter", grad, src_starts, cu_seqlens_out, std::move(total_in));
}

}  // namespace ops
}  // namespace verl_ops
