#include "rope_ops.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "cpu/rope_kernels.h"

namespace verl_ops {
namespace ops {

namespace {


// Whether two elements of t share memory (an expanded or overlapping view): the dims of size > 1,
// ordered by stride, each need a positive stride past the extent of the ones inside it.
bool overlaps_itself(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return true;
    extent = stride * (size - 1) + extent;
  }
  return false;
}

}  // namespace

RopeCall prepare_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                      bool interleaved, bool backward, bool in_place) {
  const char* kOp = in_place ? "mla_rope_" : "mla_rope";
  const char* x_name = backward ? "grad" : "x";
  VERL_CHECK(x.dim() == 3, kOp, ": ", x_name, " must be [rows, heads, dim], got ", st::shape_of(x));
  const int64_t dim = x.size(2);
  VERL_CHECK(dim % 2 == 0 && dim > 0, kOp, ": the rope dim (", x_name, ".size(2)) must be even and > 0, got ", dim);
  RopeCall c;
  c.dtype = st::float_code(kOp, "x", x.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"cos", &cos}, {"sin", &sin}}) {
    VERL_CHECK(t->dim() == 2 && t->size(1) == dim, kOp, ": ", name, " must be [table_rows, ", dim, "], got ",
               st::shape_of(*t));
    VERL_CHECK(t->scalar_type() == x.scalar_type(), kOp, ": ", name, " must have ", x_name, "'s dtype ",
               st::dtype_name(x.scalar_type()), ", got ", st::dtype_name(t->scalar_type()));
    VERL_CHECK(st::same_device(*t, x), kOp, ": ", name, " is on ", st::device_of(*t), " but ", x_name, " is on ",
               st::device_of(x));
  }
  VERL_CHECK(cos.size(0) == sin.size(0), kOp, ": cos and sin must have the same rows, got ", cos.size(0), " and ",
             sin.size(0));
  VERL_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), kOp, ": positions must be [",
             x.size(0), "] (one per row of ", x_name, "), got ", st::shape_of(positions));
  VERL_CHECK(positions.scalar_type() == st::kLong, kOp, ": positions must be int64, got ",
             st::dtype_name(positions.scalar_type()));
  VERL_CHECK(st::same_device(positions, x), kOp, ": positions is on ", st::device_of(positions), " but ", x_name,
             " is on ", st::device_of(x));
  // Inner stride 1; rows and heads may be strided (a slice of a wider projection output).
  c.x = x.size(2) > 1 && x.stride(2) != 1 ? st::contiguous(x) : x;
  c.cos = st::contiguous(cos);
  c.sin = st::contiguous(sin);
  c.positions = st::contiguous(positions);
  c.problem.rows = x.size(0);
  c.problem.heads = x.size(1);
  c.problem.dim = dim;
  c.problem.row_stride = c.x.stride(0);
  c.problem.head_stride = c.x.stride(1);
  c.problem.table_rows = cos.size(0);
  c.problem.interleaved = interleaved;
  c.problem.backward = backward;
  if (positions.is_cpu()) {
    const int64_t* pos = st::ptr<int64_t>(c.positions);
    for (int64_t r = 0; r < c.problem.rows; ++r) {
      VERL_CHECK(pos[r] >= 0 && pos[r] < c.problem.table_rows, kOp, ": positions[", r, "]=", pos[r],
                 " is outside the ", c.problem.table_rows, " rows of cos / sin");
    }
  }
  if (in_place) {
    VERL_CHECK(!overlaps_itself(x), kOp, ": x must not overlap itself (an expanded or overlapping view: its ",
               "elements are written), got shape ", st::shape_of(x), " with strides [", x.stride(0), ", ",
               x.stride(1), ", ", x.stride(2), "]");
  }
  if (in_place && c.x.data_ptr() == x.data_ptr()) {
    c.out = x;  // written in place where the kernel can (else into a buffer, copied back)
  } else {
    c.out = st::output(kOp, x_name, x, {x.size(0), x.size(1), dim}, x.scalar_type());
  }
  c.problem.out_row_stride = c.out.stride(0);
  c.problem.out_head_stride = c.out.stride(1);
  return c;
}

Tensor rope_buffer(RopeCall& c) {
  c.out = st::empty(c.x, {c.problem.rows, c.problem.heads, c.problem.dim}, c.x.scalar_type());
  c.problem.out_row_stride = c.problem.heads * c.problem.dim;
  c.problem.out_head_stride = c.problem.dim;
  return c.out;
}

Tensor mla_rope_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                    bool interleaved, bool backward) {
  const RopeCall c = prepare_rope(x, cos, sin, positions, interleaved, backward, false);
  cpu::mla_rope(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(), c.sin.data_ptr(),
                st::ptr<int64_t>(c.positions), c.out.data_ptr());
  return c.out;
}

// In place: the CPU kernel writes a buffer, copied back into x.
void mla_rope_inplace_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                          bool interleaved, bool backward) {
  RopeCall c = prepare_rope(x, cos, sin, positions, interleaved, backward, true);
  if (c.problem.rows * c.problem.heads == 0) return;
  rope_buffer(c);
  cpu::mla_rope(c.problem, c.dtype, c.x.data_ptr(), c.cos.data_ptr(), c.sin.data_ptr(),
                st::ptr<int64_t>(c.positions), c.out.data_ptr());
  st::copy_into(x, c.out);
}

}  // namespace ops
}  // namespace verl_ops
