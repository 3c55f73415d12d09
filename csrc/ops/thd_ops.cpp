#include "thd_ops.h"

#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "../cpu/thd_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

core::CpLayout parse_layout(const char* op, const std::string& cp_layout) {
  if (cp_layout == "zigzag") return core::CpLayout::kZigzag;
  if (cp_layout == "contiguous") return core::CpLayout::kContiguous;
  TORCH_CHECK(false, op, ": cp_layout must be 'zigzag' or 'contiguous', got '", cp_layout, "'");
}

void check_offsets_tensor(const char* op, const char* name, const at::Tensor& t,
                          const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) >= 1, op, ": ", name,
              " must be 1-D with B + 1 >= 1 entries, got shape ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(),
              " but the data is on ", like.device());
}

void check_cp(const char* op, int64_t cp_size, int64_t cp_rank) {
  TORCH_CHECK(cp_size >= 1, op, ": cp_size must be >= 1, got ", cp_size);
  TORCH_CHECK(cp_rank >= -1 && cp_rank < cp_size, op, ": cp_rank must be in [0, cp_size=",
              cp_size, ") (or -1 for all ranks), got ", cp_rank);
}

// Full consistency of a layout against itself and the data; host tensors only (reading device
// memory here would be a host synchronisation; device layouts come from ThdLayout, which ran
// these same checks on its host copy when it was built).
void check_host_layout(const char* op, const at::Tensor& cu, const at::Tensor& cu_padded,
                       int64_t cp_size, core::CpLayout layout, int64_t local_rows) {
  const int64_t B = cu.size(0) - 1;
  const int32_t* c = cu.data_ptr<int32_t>();
  const int32_t* cp = cu_padded.data_ptr<int32_t>();
  TORCH_CHECK(c[0] == 0, op, ": cu_seqlens must start at 0, got ", c[0]);
  TORCH_CHECK(cp[0] == 0, op, ": cu_seqlens_padded must start at 0, got ", cp[0]);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = static_cast<int64_t>(c[i + 1]) - c[i];
    const int64_t padded = static_cast<int64_t>(cp[i + 1]) - cp[i];
    TORCH_CHECK(len >= 0, op, ": cu_seqlens must be non-decreasing, got ", c[i], " then ",
                c[i + 1], " at index ", i);
    TORCH_CHECK(padded >= len, op, ": cu_seqlens_padded gives sequence ", i, " ", padded,
                " rows, fewer than its ", len, " tokens");
    if (layout == core::CpLayout::kZigzag && cp_size > 1) {
      TORCH_CHECK(padded % (2 * cp_size) == 0, op, ": zigzag with cp_size=", cp_size,
                  " needs every padded length to be a multiple of 2*cp_size, sequence ", i,
                  " has ", padded);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(cp[B]) == cp_size * local_rows, op,
              ": cu_seqlens_padded[-1]=", cp[B], " must equal cp_size * local_rows = ", cp_size,
              " * ", local_rows);
}

void check_host_mask(const char* op, const at::Tensor& mask_csum, const at::Tensor& cu) {
  const int64_t B = mask_csum.size(0), S = mask_csum.size(1);
  const int32_t* m = S > 0 ? mask_csum.data_ptr<int32_t>() : nullptr;
  const int32_t* c = cu.data_ptr<int32_t>();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t count = S > 0 ? m[i * S + S - 1] : 0;
    TORCH_CHECK(count == c[i + 1] - c[i], op, ": attention_mask row ", i, " has ", count,
                " valid tokens but the layout says ", c[i + 1] - c[i]);
  }
}

core::ShardSpec make_spec(const at::Tensor& cu, int64_t local_rows, int64_t cp_size,
                          core::CpLayout layout) {
  return core::ShardSpec{cu.size(0) - 1, local_rows, static_cast<int32_t>(cp_size), layout};
}

at::Tensor check_mask(const char* op, const at::Tensor& mask, const at::Tensor& data,
                      int64_t batch, bool data_is_padded_values) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": attention_mask must be bool, got ",
              mask.scalar_type());
  TORCH_CHECK(mask.dim() == 2, op, ": attention_mask must be [B, S], got shape ", mask.sizes());
  TORCH_CHECK(mask.device() == data.device(), op, ": attention_mask is on ", mask.device(),
              " but the data is on ", data.device());
  TORCH_CHECK(mask.size(0) == batch, op, ": attention_mask has ", mask.size(0),
              " rows but the layout has ", batch, " sequences");
  if (data_is_padded_values) {
    TORCH_CHECK(data.dim() >= 2 && data.size(0) == mask.size(0) && data.size(1) == mask.size(1),
                op, ": padded input must be [B, S, *F] matching attention_mask ", mask.sizes(),
                ", got ", data.sizes());
  }
  return at::cumsum(mask, 1, at::kInt);
}

template <typename Sizes>
int64_t row_bytes_of(const Sizes& sizes, int64_t skip, const at::Tensor& t) {
  int64_t n = 1;
  for (size_t d = static_cast<size_t>(skip); d < sizes.size(); ++d) n *= sizes[d];
  return n * static_cast<int64_t>(t.element_size());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> thd_layout(const at::Tensor& lengths, int64_t tp_size,
                                              int64_t cp_size, const std::string& cp_layout,
                                              bool fp8_padding,
                                              std::optional<int64_t> min_local_rows,
                                              std::optional<int64_t> pad_to_length_bucket) {
  constexpr const char* op = "thd_layout";
  TORCH_CHECK(lengths.device().is_cpu(), op, ": lengths must be a CPU tensor, got ",
              lengths.device());
  TORCH_CHECK(lengths.dim() == 1, op, ": lengths must be 1-D, got shape ", lengths.sizes());
  TORCH_CHECK(!lengths.is_floating_point() && !lengths.is_complex() &&
                  lengths.scalar_type() != at::kBool,
              op, ": lengths must be an integer tensor, got ", lengths.scalar_type());
  TORCH_CHECK(tp_size >= 1, op, ": tp_size must be >= 1, got ", tp_size);
  TORCH_CHECK(cp_size >= 1, op, ": cp_size must be >= 1, got ", cp_size);
  core::LayoutParams p;
  p.tp_size = tp_size;
  p.cp_size = cp_size;
  p.layout = parse_layout(op, cp_layout);
  p.fp8_padding = fp8_padding;
  if (min_local_rows.has_value()) {
    TORCH_CHECK(*min_local_rows >= 0, op, ": min_local_rows must be >= 0, got ", *min_local_rows);
    p.min_local_rows = *min_local_rows;
  }
  if (pad_to_length_bucket.has_value()) {
    TORCH_CHECK(*pad_to_length_bucket > 0, op,
                ": pad_to_length_bucket must be a positive integer, got ", *pad_to_length_bucket);
    p.pad_to_length_bucket = *pad_to_length_bucket;
  }
  const at::Tensor len64 = lengths.to(at::kLong).contiguous();
  const int64_t B = len64.size(0);
  const int64_t* l = len64.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    if (l[i] < 0) {
      const std::string msg = std::string(op) + ": lengths must be >= 0, got " + std::to_string(l[i]) +
                              " at index " + std::to_string(i);
      TORCH_CHECK(false, msg);
    }
  }
  std::vector<int64_t> padded(static_cast<size_t>(B));
  if (!core::compute_padded_lengths(l, B, p, padded.data())) {
    const std::string msg = std::string(op) + ": the padded sizes overflow int64 (tp_size=" +
                            std::to_string(tp_size) + ", cp_size=" + std::to_string(cp_size) +
                            ", min_local_rows / pad_to_length_bucket too large); totals must fit int32";
    TORCH_CHECK(false, msg);
  }
  TORCH_CHECK(B > 0 || p.min_local_rows <= 0, op,
              ": min_local_rows needs at least one sequence to pad, got an empty batch");

  at::Tensor cu = at::zeros({B + 1}, lengths.options().dtype(at::kInt));
  at::Tensor cu_padded = at::zeros({B + 1}, lengths.options().dtype(at::kInt));
  int32_t* c = cu.data_ptr<int32_t>();
  int32_t* cp = cu_padded.data_ptr<int32_t>();
  int64_t acc = 0, acc_padded = 0;
  for (int64_t i = 0; i < B; ++i) {
    acc += l[i];
    acc_padded += padded[static_cast<size_t>(i)];
    if (acc_padded > INT32_MAX) {
      const std::string msg = std::string(op) + ": padded total " + std::to_string(acc_padded) +
                              " does not fit the int32 cu_seqlens_padded";
      TORCH_CHECK(false, msg);
    }
    if (p.layout == core::CpLayout::kZigzag && cp_size > 1) {
      const int64_t padded_i = padded[static_cast<size_t>(i)];
      if (padded_i % (2 * cp_size) != 0) {
        const std::string msg = std::string(op) + ": zigzag with cp_size=" + std::to_string(cp_size) +
                                " needs every padded length to be a multiple of 2*cp_size, but the" +
                                " padding rules (min_local_rows / pad_to_length_bucket) give sequence " +
                                std::to_string(i) + " " + std::to_string(padded_i) + " rows";
        TORCH_CHECK(false, msg);
      }
    }
    c[i + 1] = static_cast<int32_t>(acc);
    cp[i + 1] = static_cast<int32_t>(acc_padded);
  }
  if (acc_padded % cp_size != 0) {
    const std::string msg = std::string(op) + ": padded total " + std::to_string(acc_padded) +
                            " is not divisible by cp_size=" + std::to_string(cp_size);
    TORCH_CHECK(false, msg);
  }
  return {cu, cu_padded};
}

std::tuple<at::Tensor, at::Tensor> thd_layout_meta(const at::Tensor& lengths, int64_t tp_size,
                                                   int64_t cp_size, const std::string& cp_layout,
                                                   bool fp8_padding,
                                                   std::optional<int64_t> min_local_rows,
                                                   std::optional<int64_t> pad_to_length_bucket) {
  (void)tp_size, (void)cp_size, (void)fp8_padding, (void)min_local_rows, (void)pad_to_length_bucket;
  parse_layout("thd_layout", cp_layout);
  TORCH_CHECK(lengths.dim() == 1, "thd_layout: lengths must be 1-D, got shape ", lengths.sym_sizes());
  const auto n = lengths.sym_size(0) + 1;
  const auto opts = lengths.options().dtype(at::kInt);
  return {at::empty_symint({n}, opts), at::empty_symint({n}, opts)};
}

PackCall prepare_pack(const at::Tensor& values, const at::Tensor& cu_seqlens,
                      const at::Tensor& cu_seqlens_padded, int64_t local_rows, int64_t cp_size,
                      int64_t cp_rank, const std::string& cp_layout, bool roll,
                      const std::optional<at::Tensor>& attention_mask, at::Tensor* packed,
                      at::Tensor* positions) {
  constexpr const char* op = "preprocess_thd";
  const core::CpLayout layout = parse_layout(op, cp_layout);
  check_cp(op, cp_size, cp_rank);
  check_offsets_tensor(op, "cu_seqlens", cu_seqlens, values);
  check_offsets_tensor(op, "cu_seqlens_padded", cu_seqlens_padded, values);
  TORCH_CHECK(cu_seqlens.size(0) == cu_seqlens_padded.size(0), op,
              ": cu_seqlens and cu_seqlens_padded must have the same length, got ",
              cu_seqlens.size(0), " and ", cu_seqlens_padded.size(0));
  TORCH_CHECK(local_rows >= 0, op, ": local_rows must be >= 0, got ", local_rows);
  const int64_t B = cu_seqlens.size(0) - 1;
  const bool padded_input = attention_mask.has_value();
  TORCH_CHECK(values.dim() >= (padded_input ? 2 : 1), op, ": values must be ",
              padded_input ? "[B, S, *F]" : "[total_tokens, *F]", ", got shape ", values.sizes());

  PackCall call;
  call.values = values.contiguous();
  call.cu = cu_seqlens.contiguous();
  call.cu_padded = cu_seqlens_padded.contiguous();
  const at::Tensor& cu = call.cu;
  const at::Tensor& cu_padded = call.cu_padded;
  if (padded_input) call.mask_csum = check_mask(op, *attention_mask, values, B, true);
  if (values.device().is_cpu()) {
    check_host_layout(op, cu, cu_padded, cp_size, layout, local_rows);
    if (padded_input) {
      check_host_mask(op, call.mask_csum, cu);
    } else {
      TORCH_CHECK(cu.data_ptr<int32_t>()[B] == values.size(0), op, ": values has ",
                  values.size(0), " rows but cu_seqlens[-1] = ", cu.data_ptr<int32_t>()[B]);
    }
  }
  const int64_t skip = padded_input ? 2 : 1;
  std::vector<int64_t> out_shape;
  if (cp_rank < 0) out_shape.push_back(cp_size);
  out_shape.push_back(local_rows);
  for (int64_t d = skip; d < values.dim(); ++d) out_shape.push_back(values.size(d));
  *packed = at::empty(out_shape, values.options());
  *positions = at::empty(at::IntArrayRef(out_shape.data(), cp_rank < 0 ? 2 : 1),
                         values.options().dtype(at::kLong));

  call.plan.cu_seqlens = cu.data_ptr<int32_t>();
  call.plan.cu_seqlens_padded = cu_padded.data_ptr<int32_t>();
  call.plan.mask_csum = padded_input ? call.mask_csum.data_ptr<int32_t>() : nullptr;
  call.plan.seq_capacity = padded_input ? values.size(1) : 0;
  call.plan.src_rows = padded_input ? values.size(0) * values.size(1) : values.size(0);
  call.plan.spec = make_spec(cu, local_rows, cp_size, layout);
  call.plan.cp_rank = static_cast<int32_t>(cp_rank);
  call.plan.roll = roll;
  call.out_rows = (cp_rank < 0 ? cp_size : 1) * local_rows;
  call.row_bytes = row_bytes_of(values.sizes(), skip, values);
  return call;
}

UnpackCall prepare_unpack(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                          const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                          int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                          bool roll, const std::optional<at::Tensor>& attention_mask,
                          at::Tensor* out) {
  constexpr const char* op = "postprocess_thd";
  const core::CpLayout layout = parse_layout(op, cp_layout);
  check_cp(op, cp_size, cp_rank);
  check_offsets_tensor(op, "cu_seqlens", cu_seqlens, packed);
  check_offsets_tensor(op, "cu_seqlens_padded", cu_seqlens_padded, packed);
  TORCH_CHECK(cu_seqlens.size(0) == cu_seqlens_padded.size(0), op,
              ": cu_seqlens and cu_seqlens_padded must have the same length, got ",
              cu_seqlens.size(0), " and ", cu_seqlens_padded.size(0));
  const int64_t B = cu_seqlens.size(0) - 1;
  const int64_t skip = cp_rank < 0 ? 2 : 1;
  TORCH_CHECK(packed.dim() >= skip, op, ": packed must be ",
              cp_rank < 0 ? "[cp_size, local_rows, *F] (all ranks)" : "[local_rows, *F]",
              ", got shape ", packed.sizes());
  if (cp_rank < 0) {
    TORCH_CHECK(packed.size(0) == cp_size, op, ": packed holds ", packed.size(0),
                " shards but cp_size is ", cp_size);
  }
  const int64_t local_rows = packed.size(skip - 1);
  const bool padded_output = attention_mask.has_value();

  UnpackCall call;
  call.packed = packed.contiguous();
  call.cu = cu_seqlens.contiguous();
  call.cu_padded = cu_seqlens_padded.contiguous();
  const at::Tensor& cu = call.cu;
  const at::Tensor& cu_padded = call.cu_padded;
  if (padded_output) {
    call.mask_csum = check_mask(op, *attention_mask, packed, B, false);
  } else {
    TORCH_CHECK(total_tokens >= 0, op, ": total_tokens must be >= 0, got ", total_tokens);
  }
  if (packed.device().is_cpu()) {
    check_host_layout(op, cu, cu_padded, cp_size, layout, local_rows);
    if (padded_output) {
      check_host_mask(op, call.mask_csum, cu);
    } else {
      TORCH_CHECK(cu.data_ptr<int32_t>()[B] == total_tokens, op, ": total_tokens=", total_tokens,
                  " but cu_seqlens[-1] = ", cu.data_ptr<int32_t>()[B]);
    }
  }
  std::vector<int64_t> out_shape;
  if (padded_output) {
    out_shape = {attention_mask->size(0), attention_mask->size(1)};
  } else {
    out_shape = {total_tokens};
  }
  for (int64_t d = skip; d < packed.dim(); ++d) out_shape.push_back(packed.size(d));
  *out = at::empty(out_shape, packed.options());

  call.plan.cu_seqlens = cu.data_ptr<int32_t>();
  call.plan.cu_seqlens_padded = cu_padded.data_ptr<int32_t>();
  call.plan.mask_csum = padded_output ? call.mask_csum.data_ptr<int32_t>() : nullptr;
  call.plan.seq_capacity = padded_output ? attention_mask->size(1) : 0;
  call.plan.packed_rows = (cp_rank < 0 ? cp_size : 1) * local_rows;
  call.plan.spec = make_spec(cu, local_rows, cp_size, layout);
  call.plan.cp_rank = static_cast<int32_t>(cp_rank);
  call.plan.roll = roll;
  call.out_rows = padded_output ? out_shape[0] * out_shape[1] : total_tokens;
  call.row_bytes = row_bytes_of(packed.sizes(), skip, packed);
  return call;
}

std::tuple<at::Tensor, at::Tensor> preprocess_thd_cpu(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout, bool roll,
    const std::optional<at::Tensor>& attention_mask) {
  at::Tensor packed, positions;
  PackCall call = prepare_pack(values, cu_seqlens, cu_seqlens_padded, local_rows, cp_size, cp_rank,
                               cp_layout, roll, attention_mask, &packed, &positions);
  const char* src = static_cast<const char*>(call.values.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, call.out_rows, 2048, [&](int64_t begin, int64_t end) {
    cpu::pack_rows(call.plan, src, dst, pos, call.row_bytes, begin, end);
  });
  return {packed, positions};
}

at::Tensor postprocess_thd_cpu(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                               const at::Tensor& cu_seqlens_padded, int64_t total_tokens,
                               int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                               bool roll, const std::optional<at::Tensor>& attention_mask) {
  at::Tensor out;
  UnpackCall call = prepare_unpack(packed, cu_seqlens, cu_seqlens_padded, total_tokens, cp_size,
                                   cp_rank, cp_layout, roll, attention_mask, &out);
  const char* src = static_cast<const char*>(call.packed.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, call.out_rows, 2048, [&](int64_t begin, int64_t end) {
    cpu::unpack_rows(call.plan, src, dst, call.row_bytes, begin, end);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> preprocess_thd_meta(
    const at::Tensor& values, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    c10::SymInt local_rows, int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
    bool roll, const std::optional<at::Tensor>& attention_mask) {
  constexpr const char* op = "preprocess_thd";
  (void)roll;
  parse_layout(op, cp_layout);
  check_cp(op, cp_size, cp_rank);
  check_offsets_tensor(op, "cu_seqlens", cu_seqlens, values);
  check_offsets_tensor(op, "cu_seqlens_padded", cu_seqlens_padded, values);
  const int64_t skip = attention_mask.has_value() ? 2 : 1;
  TORCH_CHECK(values.dim() >= skip, op, ": values has too few dimensions: ", values.sym_sizes());
  std::vector<c10::SymInt> shape;
  if (cp_rank < 0) shape.emplace_back(cp_size);
  shape.push_back(local_rows);
  const auto sizes = values.sym_sizes();
  for (int64_t d = skip; d < values.dim(); ++d) shape.push_back(sizes[d]);
  at::Tensor packed = at::empty_symint(shape, values.options());
  at::Tensor positions = at::empty_symint(c10::SymIntArrayRef(shape.data(), cp_rank < 0 ? 2 : 1),
                                          values.options().dtype(at::kLong));
  return {packed, positions};
}

at::Tensor postprocess_thd_meta(const at::Tensor& packed, const at::Tensor& cu_seqlens,
                                const at::Tensor& cu_seqlens_padded, c10::SymInt total_tokens,
                                int64_t cp_size, int64_t cp_rank, const std::string& cp_layout,
                                bool roll, const std::optional<at::Tensor>& attention_mask) {
  constexpr const char* op = "postprocess_thd";
  (void)roll;
  parse_layout(op, cp_layout);
  check_cp(op, cp_size, cp_rank);
  check_offsets_tensor(op, "cu_seqlens", cu_seqlens, packed);
  check_offsets_tensor(op, "cu_seqlens_padded", cu_seqlens_padded, packed);
  const int64_t skip = cp_rank < 0 ? 2 : 1;
  TORCH_CHECK(packed.dim() >= skip, op, ": packed has too few dimensions: ", packed.sym_sizes());
  std::vector<c10::SymInt> shape;
  if (attention_mask.has_value()) {
    const auto ms = attention_mask->sym_sizes();
    shape.push_back(ms[0]);
    shape.push_back(ms[1]);
  } else {
    shape.push_back(total_tokens);
  }
  const auto sizes = packed.sym_sizes();
  for (int64_t d = skip; d < packed.dim(); ++d) shape.push_back(sizes[d]);
  return at::empty_symint(shape, packed.options());
}

}  // namespace ops
}  // namespace verl_ops
