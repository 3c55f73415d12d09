#include "thd_ops.h"

#include <string>
#include <vector>

#include "../cpu/thd_kernels.h"
#include "offset_checks.h"

namespace verl_ops {
namespace ops {

namespace {

// A host layout against the local rows of the data (offset_checks.h for the rest).
void check_host_layout(const char* op, const Tensor& cu, const Tensor& cu_padded, int64_t cp_size,
                       core::CpLayout layout, int64_t local_rows) {
  const int64_t padded_total = check_host_offsets(op, cu, cu_padded, cp_size, layout);
  const int64_t total = st::checked_mul(op, "cp_size * local_rows", cp_size, local_rows);
  VERL_CHECK(padded_total == total, op, ": cu_seqlens_padded[-1]=", padded_total,
             " must equal cp_size * local_rows = ", cp_size, " * ", local_rows);
}

Tensor check_mask(const char* op, const Tensor& mask, const Tensor& data, int64_t batch,
                  bool data_is_padded_values) {
  check_mask_arg(op, mask, batch, data);
  if (data_is_padded_values) {
    VERL_CHECK(data.dim() >= 2 && data.size(0) == mask.size(0) && data.size(1) == mask.size(1), op,
               ": padded input must be [B, S, *F] matching attention_mask ", st::shape_of(mask),
               ", got ", st::shape_of(data));
  }
  return st::cumsum_int32(mask);
}

core::ShardSpec make_spec(const Tensor& cu, int64_t local_rows, int64_t cp_size, core::CpLayout layout) {
  return core::ShardSpec{cu.size(0) - 1, local_rows, static_cast<int32_t>(cp_size), layout};
}

// The arguments pack and unpack check alike: the CP layout and ranks (-1: all ranks), the offsets
// on the data's device.
core::CpLayout check_cp_args(const char* op, const Tensor& cu_seqlens, const Tensor& cu_seqlens_padded,
                             const Tensor& data, int64_t cp_size, int64_t cp_rank, int64_t cp_layout) {
  const core::CpLayout layout = st::cp_layout_arg(op, cp_layout);
  st::check_cp(op, cp_size, cp_rank, /*allow_all=*/true);
  check_offset_pair(op, cu_seqlens, cu_seqlens_padded, data);
  return layout;
}

// The fields PackPlan and UnpackPlan share, pointing into the call's contiguous offsets and (padded
// data: S = seq_capacity columns) its mask's prefix counts.
template <typename Call>
void set_layout_plan(Call& call, bool padded, int64_t seq_capacity, int64_t local_rows, int64_t cp_size,
                     core::CpLayout layout, int64_t cp_rank, bool roll) {
  call.plan.cu_seqlens = st::ptr<int32_t>(call.cu);
  call.plan.cu_seqlens_padded = st::ptr<int32_t>(call.cu_padded);
  call.plan.mask_csum = padded ? st::ptr<int32_t>(call.mask_csum) : nullptr;
  call.plan.seq_capacity = padded ? seq_capacity : 0;
  call.plan.spec = make_spec(call.cu, local_rows, cp_size, layout);
  call.plan.cp_rank = static_cast<int32_t>(cp_rank);
  call.plan.roll = roll;
}

// `x` (named `name` in errors), a 1-D CPU tensor of any integer dtype, as contiguous int64.
Tensor host_int64(const char* op, const char* name, const Tensor& x) {
  VERL_CHECK(x.is_cpu(), op, ": ", name, " must be a CPU tensor, got ", st::device_of(x));
  VERL_CHECK(x.dim() == 1, op, ": ", name, " must be 1-D, got shape ", st::shape_of(x));
  VERL_CHECK(st::is_integral(x.scalar_type()), op, ": ", name,
             " must be an integer tensor (uint8, int8, int16, int32 or int64), got ", st::dtype_name(x.scalar_type()));
  return st::contiguous(st::to_dtype(x, st::kLong));
}

// lengths of any integer dtype -> int64 host values.
std::vector<int64_t> host_lengths(const char* op, const Tensor& lengths) {
  const Tensor l64 = host_int64(op, "lengths", lengths);
  const int64_t* l = st::ptr<int64_t>(l64);
  std::vector<int64_t> out(l, l + l64.size(0));
  for (size_t i = 0; i < out.size(); ++i) {
    VERL_CHECK(out[i] >= 0, op, ": lengths must be >= 0, got ", out[i], " at index ", i);
    VERL_CHECK(out[i] <= INT32_MAX, op, ": lengths must be <= ", INT32_MAX, " (the offsets are int32), got ",
               out[i], " at index ", i);
  }
  return out;
}

}  // namespace

namespace {

core::LayoutParams layout_params(const char* op, int64_t tp_size, int64_t cp_size, int64_t cp_layout,
                                 bool fp8_padding, std::optional<int64_t> min_local_rows,
                                 std::optional<int64_t> pad_to_length_bucket) {
  core::LayoutParams p;
  p.tp_size = st::int32_arg(op, "tp_size", tp_size, 1);
  p.cp_size = st::int32_arg(op, "cp_size", cp_size, 1);
  p.layout = st::cp_layout_arg(op, cp_layout);
  p.fp8_padding = fp8_padding;
  if (min_local_rows.has_value()) p.min_local_rows = st::int32_arg(op, "min_local_rows", *min_local_rows);
  if (pad_to_length_bucket.has_value()) {
    VERL_CHECK(*pad_to_length_bucket > 0, op, ": pad_to_length_bucket must be a positive integer, got ",
               *pad_to_length_bucket);
    p.pad_to_length_bucket = st::int32_arg(op, "pad_to_length_bucket", *pad_to_length_bucket, 1);
  }
  return p;
}

// Sums and extremes of a layout, as fill_layout computes them.
struct LayoutTotals {
  int64_t total = 0, total_padded = 0, max_padded = 0, max_len = 0, min_len = 0;
};

// verl's rules on checked lengths l[0..B) (each in [0, 2**31 - 1]): writes the int32 offsets
// c / cp [B + 1]; errors name `op`.
LayoutTotals fill_layout(const char* op, const int64_t* l, int64_t B, const core::LayoutParams& p,
                         int32_t* c, int32_t* cp) {
  std::vector<int64_t> padded(static_cast<size_t>(B));
  VERL_CHECK(core::compute_padded_lengths(l, B, p, padded.data()), op,
             ": the padded sizes overflow int64 (tp_size=", p.tp_size, ", cp_size=", p.cp_size,
             ", min_local_rows / pad_to_length_bucket too large); totals must fit int32");
  VERL_CHECK(B > 0 || p.min_local_rows <= 0, op,
             ": min_local_rows needs at least one sequence to pad, got an empty batch");
  const int64_t cp_size = p.cp_size;
  LayoutTotals t;
  t.min_len = B > 0 ? l[0] : 0;
  c[0] = 0;
  cp[0] = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t padded_i = padded[static_cast<size_t>(i)];
    t.total += l[i];
    t.total_padded += padded_i;
    VERL_CHECK(t.total_padded <= INT32_MAX, op, ": padded total ", t.total_padded,
               " does not fit the int32 cu_seqlens_padded");
    VERL_CHECK(p.layout != core::CpLayout::kZigzag || cp_size == 1 || padded_i % (2 * cp_size) == 0,
               op, ": zigzag with cp_size=", cp_size,
               " needs every padded length to be a multiple of 2*cp_size, but the padding rules "
               "(min_local_rows / pad_to_length_bucket) give sequence ",
               i, " ", padded_i, " rows");
    c[i + 1] = static_cast<int32_t>(t.total);
    cp[i + 1] = static_cast<int32_t>(t.total_padded);
    t.max_padded = padded_i > t.max_padded ? padded_i : t.max_padded;
    t.max_len = l[i] > t.max_len ? l[i] : t.max_len;
    t.min_len = l[i] < t.min_len ? l[i] : t.min_len;
  }
  VERL_CHECK(t.total_padded % cp_size == 0, op, ": padded total ", t.total_padded,
             " is not divisible by cp_size=", cp_size);
  return t;
}

}  // namespace

std::tuple<Tensor, Tensor> thd_layout(const Tensor& lengths, int64_t tp_size, int64_t cp_size,
                                      int64_t cp_layout, bool fp8_padding,
                                      std::optional<int64_t> min_local_rows,
                                      std::optional<int64_t> pad_to_length_bucket) {
  constexpr const char* op = "thd_layout";
  const core::LayoutParams p =
      layout_params(op, tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket);
  const std::vector<int64_t> l = host_lengths(op, lengths);
  const int64_t B = static_cast<int64_t>(l.size());
  Tensor cu = st::empty(lengths, {B + 1}, st::kInt);
  Tensor cu_padded = st::empty(lengths, {B + 1}, st::kInt);
  fill_layout(op, l.data(), B, p, st::ptr<int32_t>(cu), st::ptr<int32_t>(cu_padded));
  return {cu, cu_padded};
}

std::tuple<Tensor, Tensor> thd_layout_info(const Tensor& x, bool x_is_offsets, int64_t tp_size,
                                           int64_t cp_size, int64_t cp_layout, bool fp8_padding,
                                           std::optional<int64_t> min_local_rows,
                                           std::optional<int64_t> pad_to_length_bucket) {
  constexpr const char* op = "thd_layout_info";
  const core::LayoutParams p =
      layout_params(op, tp_size, cp_size, cp_layout, fp8_padding, min_local_rows, pad_to_length_bucket);
  const Tensor x64 = host_int64(op, x_is_offsets ? "offsets" : "lengths", x);
  VERL_CHECK(!x_is_offsets || x.size(0) >= 1, op, ": offsets must have B + 1 >= 1 entries, got 0");
  const int64_t* v = st::ptr<int64_t>(x64);
  const int64_t B = x_is_offsets ? x.size(0) - 1 : x.size(0);

  Tensor info = st::empty(x, {kLayoutInfoHead + B}, st::kLong);
  int64_t* inf = st::ptr<int64_t>(info);
  int64_t* l = inf + kLayoutInfoHead;
  inf[0] = -1;
  inf[1] = 0;
  for (int64_t i = 0; i < B; ++i) {
    int64_t n = v[i];
    // Offsets far apart: a difference beyond int64 is out of range either way (saturated).
    if (x_is_offsets && __builtin_sub_overflow(v[i + 1], v[i], &n)) n = v[i + 1] > v[i] ? INT64_MAX : INT64_MIN;
    l[i] = n;
    if (inf[0] < 0 && (n < 0 || n > INT32_MAX)) {
      inf[0] = i;
      inf[1] = n;
    }
  }
  Tensor offsets = st::empty(x, {2, B + 1}, st::kInt);
  if (inf[0] >= 0) {  // the caller raises its own message for the bad length
    for (int64_t j = 2; j < kLayoutInfoHead; ++j) inf[j] = 0;
    return {offsets, info};
  }
  int32_t* c = st::ptr<int32_t>(offsets);
  const LayoutTotals t = fill_layout(op, l, B, p, c, c + (B + 1));
  inf[2] = t.total;
  inf[3] = t.total_padded;
  inf[4] = t.max_padded;
  inf[5] = t.max_len;
  inf[6] = t.min_len;
  return {offsets, info};
}

PackCall prepare_pack(const Tensor& values, const Tensor& cu_seqlens,
                      const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t cp_size,
                      int64_t cp_rank, int64_t cp_layout, bool roll,
                      const std::optional<Tensor>& attention_mask) {
  constexpr const char* op = "preprocess_thd";
  const core::CpLayout layout =
      check_cp_args(op, cu_seqlens, cu_seqlens_padded, values, cp_size, cp_rank, cp_layout);
  VERL_CHECK(local_rows >= 0, op, ": local_rows must be >= 0, got ", local_rows);
  const int64_t B = cu_seqlens.size(0) - 1;
  const bool padded_input = attention_mask.has_value();
  VERL_CHECK(values.dim() >= (padded_input ? 2 : 1), op, ": values must be ",
             padded_input ? "[B, S, *F]" : "[total_tokens, *F]", ", got shape ", st::shape_of(values));

  PackCall call;
  call.values = st::contiguous(values);
  call.cu = st::contiguous(cu_seqlens);
  call.cu_padded = st::contiguous(cu_seqlens_padded);
  call.out_rows = st::checked_mul(op, "the output rows", cp_rank < 0 ? cp_size : 1, local_rows);
  st::checked_mul(op, "cp_size * local_rows", cp_size, local_rows);
  if (padded_input) call.mask_csum = check_mask(op, *attention_mask, values, B, true);
  if (values.is_cpu()) {
    check_host_layout(op, call.cu, call.cu_padded, cp_size, layout, local_rows);
    if (padded_input) {
      check_host_mask(op, call.mask_csum, call.cu);
    } else {
      const int32_t total = st::ptr<int32_t>(call.cu)[B];
      VERL_CHECK(total == values.size(0), op, ": values has ", values.size(0),
                 " rows but cu_seqlens[-1] = ", total);
    }
  }
  const int64_t skip = padded_input ? 2 : 1;
  std::vector<int64_t> out_shape;
  if (cp_rank < 0) out_shape.push_back(cp_size);
  out_shape.push_back(local_rows);
  for (int64_t d = skip; d < values.dim(); ++d) out_shape.push_back(values.size(d));
  call.row_bytes = st::row_bytes(op, values, skip);
  st::checked_mul(op, "the output size (local_rows rows)", call.out_rows, call.row_bytes);
  call.packed = st::output(op, "local_rows", values, out_shape, values.scalar_type());
  call.positions = st::output(
      op, "local_rows", values, std::vector<int64_t>(out_shape.begin(), out_shape.begin() + (cp_rank < 0 ? 2 : 1)), st::kLong);

  set_layout_plan(call, padded_input, padded_input ? values.size(1) : 0, local_rows, cp_size, layout, cp_rank, roll);
  call.plan.src_rows = padded_input ? values.size(0) * values.size(1) : values.size(0);
  return call;
}

UnpackCall prepare_unpack(const Tensor& packed, const Tensor& cu_seqlens,
                          const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                          int64_t cp_rank, int64_t cp_layout, bool roll,
                          const std::optional<Tensor>& attention_mask) {
  constexpr const char* op = "postprocess_thd";
  const core::CpLayout layout =
      check_cp_args(op, cu_seqlens, cu_seqlens_padded, packed, cp_size, cp_rank, cp_layout);
  const int64_t B = cu_seqlens.size(0) - 1;
  const int64_t skip = cp_rank < 0 ? 2 : 1;
  VERL_CHECK(packed.dim() >= skip, op, ": packed must be ",
             cp_rank < 0 ? "[cp_size, local_rows, *F] (all ranks)" : "[local_rows, *F]",
             ", got shape ", st::shape_of(packed));
  if (cp_rank < 0) {
    VERL_CHECK(packed.size(0) == cp_size, op, ": packed holds ", packed.size(0),
               " shards but cp_size is ", cp_size);
  }
  const int64_t local_rows = packed.size(skip - 1);
  st::checked_mul(op, "cp_size * local_rows", cp_size, local_rows);
  const bool padded_output = attention_mask.has_value();

  UnpackCall call;
  call.packed = st::contiguous(packed);
  call.cu = st::contiguous(cu_seqlens);
  call.cu_padded = st::contiguous(cu_seqlens_padded);
  if (padded_output) {
    call.mask_csum = check_mask(op, *attention_mask, packed, B, false);
  } else {
    VERL_CHECK(total_tokens >= 0, op, ": total_tokens must be >= 0, got ", total_tokens);
  }
  if (packed.is_cpu()) {
    check_host_layout(op, call.cu, call.cu_padded, cp_size, layout, local_rows);
    if (padded_output) {
      check_host_mask(op, call.mask_csum, call.cu);
    } else {
      const int32_t total = st::ptr<int32_t>(call.cu)[B];
      VERL_CHECK(total == total_tokens, op, ": total_tokens=", total_tokens,
                 " but cu_seqlens[-1] = ", total);
    }
  }
  std::vector<int64_t> out_shape;
  if (padded_output) {
    out_shape = {attention_mask->size(0), attention_mask->size(1)};
  } else {
    out_shape = {total_tokens};
  }
  for (int64_t d = skip; d < packed.dim(); ++d) out_shape.push_back(packed.size(d));
  call.row_bytes = st::row_bytes(op, packed, skip);
  call.out_rows = padded_output ? st::checked_mul(op, "B * S", out_shape[0], out_shape[1]) : total_tokens;
  st::checked_mul(op, "the output size", call.out_rows, call.row_bytes);
  call.out =
      st::output(op, padded_output ? "attention_mask" : "total_tokens", packed, out_shape, packed.scalar_type());

  set_layout_plan(call, padded_output, padded_output ? attention_mask->size(1) : 0, local_rows, cp_size, layout,
                  cp_rank, roll);
  call.plan.packed_rows = (cp_rank < 0 ? cp_size : 1) * local_rows;
  return call;
}

std::tuple<Tensor, Tensor> preprocess_thd_cpu(const Tensor& values, const Tensor& cu_seqlens,
                                              const Tensor& cu_seqlens_padded, int64_t local_rows,
                                              int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                              bool roll, const std::optional<Tensor>& attention_mask) {
  PackCall call = prepare_pack(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size, cp_rank,
                               cp_layout, roll, attention_mask);
  const char* src = static_cast<const char*>(call.values.data_ptr());
  char* dst = static_cast<char*>(call.packed.data_ptr());
  int64_t* positions = st::ptr<int64_t>(call.positions);
  cpu::for_row_ranges(call.out_rows, call.row_bytes, [&](int64_t lo, int64_t hi) {
    cpu::pack_rows(call.plan, src, dst, positions, call.row_bytes, lo, hi);
  });
  return {call.packed, call.positions};
}

Tensor postprocess_thd_cpu(const Tensor& packed, const Tensor& cu_seqlens,
                           const Tensor& cu_seqlens_padded, int64_t total_tokens, int64_t cp_size,
                           int64_t cp_rank, int64_t cp_layout, bool roll,
                           const std::optional<Tensor>& attention_mask) {
  UnpackCall call = prepare_unpack(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size,
                                   cp_rank, cp_layout, roll, attention_mask);
  const char* src = static_cast<const char*>(call.packed.data_ptr());
  char* dst = static_cast<char*>(call.out.data_ptr());
  cpu::for_row_ranges(call.out_rows, call.row_bytes, [&](int64_t lo, int64_t hi) {
    cpu::unpack_rows(call.plan, src, dst, call.row_bytes, lo, hi);
  });
  return call.out;
}

}  // namespace ops
}  // namespace verl_ops
