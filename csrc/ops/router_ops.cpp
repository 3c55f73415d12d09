#include "router_ops.h"

#include <string>

#include "../cpu/router_kernels.h"
#include "offset_checks.h"

namespace verl_ops {
namespace ops {

namespace {

constexpr const char* kRecord = "router_topk_record";
constexpr const char* kScatter = "router_topk_scatter";
// Keeps every per-tile index of the CUDA kernels (tile rows x L x K) within int32.
constexpr int64_t kMaxIndicesPerToken = int64_t{1} << 22;
// Keeps at least one overflow slot per CUDA launch (128 layers each).
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr int64_t kMaxTopk = int64_t{1} << 20;

bool index_dtype(st::ScalarType t, core::IndexDtype* out) {
  switch (t) {
    case st::kByte: *out = core::IndexDtype::kUInt8; return true;
    case st::kChar: *out = core::IndexDtype::kInt8; return true;
    case st::kShort: *out = core::IndexDtype::kInt16; return true;
    case st::kInt: *out = core::IndexDtype::kInt32; return true;
    case st::kLong: *out = core::IndexDtype::kInt64; return true;
    default: return false;
  }
}

core::IndexDtype require_index_dtype(const char* op, const char* name, st::ScalarType t) {
  core::IndexDtype d;
  VERL_CHECK(index_dtype(t, &d), op, ": ", name,
             " must be an integer tensor (uint8, int8, int16, int32 or int64), got ", st::dtype_name(t));
  return d;
}

// A host layout against the rows of the data it must cover (offset_checks.h for the rest).
void check_host_layout(const char* op, const Tensor& cu, const Tensor& cu_padded, int64_t cp_size,
                       core::CpLayout layout, int64_t total_padded) {
  const int64_t padded_total = check_host_offsets(op, cu, cu_padded, cp_size, layout);
  VERL_CHECK(padded_total == total_padded, op, ": cu_seqlens_padded[-1]=", padded_total, " does not match the ",
             total_padded, " packed rows of the data");
}

// [B, S] bool mask -> int32 inclusive prefix counts; on the host also the per-row counts.
Tensor mask_csum_of(const char* op, const Tensor& mask, int64_t batch, const Tensor& data, const Tensor& cu) {
  check_mask_arg(op, mask, batch, data);
  Tensor csum = st::cumsum_int32(mask);
  if (data.is_cpu()) check_host_mask(op, csum, cu);
  return csum;
}

core::ShardSpec spec_of(int64_t batch, int64_t local_rows, int64_t cp_size, core::CpLayout layout) {
  return core::ShardSpec{batch, local_rows, static_cast<int32_t>(cp_size), layout};
}

void check_layer_counts(const char* op, const char* name, int64_t num_layers, int64_t topk) {
  VERL_CHECK(num_layers >= 1, op, ": ", name, " must hold at least one layer");
  VERL_CHECK(num_layers <= kMaxLayers, op, ": ", name, " hold ", num_layers, " layers, more than the ", kMaxLayers,
             " the kernels support");
  VERL_CHECK(topk <= kMaxTopk, op, ": ", name, " have top-k K=", topk, ", more than the ", kMaxTopk,
             " the kernels support");
  VERL_CHECK(num_layers * topk <= kMaxIndicesPerToken, op, ": ", name, " hold L * K = ", num_layers * topk,
             " indices per token, more than the ", kMaxIndicesPerToken, " the kernels support");
}

}  // namespace

RecordLayers record_layers_of(const Tensor& indices) {
  const char* op = kRecord;
  RecordLayers r;
  r.dtype = require_index_dtype(op, "indices", indices.scalar_type());
  VERL_CHECK(indices.dim() == 3, op, ": indices must be [L, T_local_sp, K], got shape ", st::shape_of(indices));
  const int64_t num_layers = indices.size(0);
  r.rows = indices.size(1);
  r.topk = indices.size(2);
  check_layer_counts(op, "indices", num_layers, r.topk);
  const int64_t elem = st::element_size(indices);
  const char* base = static_cast<const char*>(indices.data_ptr());
  for (int64_t l = 0; l < num_layers; ++l) {
    r.slices.push_back(core::LayerSlice{base == nullptr ? nullptr : base + l * indices.stride(0) * elem,
                                        indices.stride(1), indices.stride(2)});
  }
  r.owner = indices;
  return r;
}

RouterRecordCall prepare_router_record(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                       const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                       const std::optional<Tensor>& attention_mask) {
  const char* op = kRecord;
  const Tensor& first = layers.owner;
  const int64_t num_layers = static_cast<int64_t>(layers.slices.size());
  const bool fused = cu_seqlens.has_value() || cu_seqlens_padded.has_value();
  VERL_CHECK(fused == (cu_seqlens.has_value() && cu_seqlens_padded.has_value()), op,
             ": cu_seqlens and cu_seqlens_padded must be given together (fused unpack) or both omitted");
  VERL_CHECK(fused || !attention_mask.has_value(), op, ": attention_mask needs cu_seqlens and cu_seqlens_padded");
  RouterRecordCall call;
  std::vector<int64_t> out_shape;
  call.plan.fused = fused;
  call.plan.unpack = core::UnpackPlan{};
  if (!fused) {
    out_shape = {layers.rows, num_layers, layers.topk};
    call.out_rows = layers.rows;
  } else {
    check_offset_pair(op, *cu_seqlens, *cu_seqlens_padded, first);
    const int64_t B = cu_seqlens->size(0) - 1;
    call.cu = st::contiguous(*cu_seqlens);
    call.cu_padded = st::contiguous(*cu_seqlens_padded);
    if (first.is_cpu()) check_host_layout(op, call.cu, call.cu_padded, 1, core::CpLayout::kZigzag, layers.rows);
    if (attention_mask.has_value()) {
      call.mask_csum = mask_csum_of(op, *attention_mask, B, first, call.cu);
      out_shape = {attention_mask->size(0), attention_mask->size(1), num_layers, layers.topk};
      call.out_rows = st::checked_mul(op, "B * S", out_shape[0], out_shape[1]);
    } else {
      VERL_CHECK(total_tokens >= 0, op, ": total_tokens must be >= 0, got ", total_tokens);
      VERL_CHECK(!first.is_cpu() || st::ptr<int32_t>(call.cu)[B] == total_tokens, op, ": total_tokens=", total_tokens,
                 " but cu_seqlens[-1] = ", first.is_cpu() ? st::ptr<int32_t>(call.cu)[B] : 0);
      out_shape = {total_tokens, num_layers, layers.topk};
      call.out_rows = total_tokens;
    }
    core::UnpackPlan& u = call.plan.unpack;
    u.cu_seqlens = st::ptr<int32_t>(call.cu);
    u.cu_seqlens_padded = st::ptr<int32_t>(call.cu_padded);
    u.mask_csum = attention_mask.has_value() ? st::ptr<int32_t>(call.mask_csum) : nullptr;
    u.seq_capacity = attention_mask.has_value() ? attention_mask->size(1) : 0;
    u.packed_rows = layers.rows;
    u.spec = spec_of(B, layers.rows, 1, core::CpLayout::kZigzag);
    u.cp_rank = 0;
    u.roll = false;
  }
  st::checked_mul(op, "the output size", st::checked_mul(op, "the output size", call.out_rows, num_layers),
                  layers.topk * 2);
  call.routes = st::output(op, "total_tokens / attention_mask", first, out_shape, st::kShort);
  // CPU raises on overflow and leaves this zero; the CUDA kernel writes every slot itself.
  call.overflow = first.is_cpu() ? st::zeros(first, {core::kOverflowSlots}, st::kInt)
                                 : st::empty(first, {core::kOverflowSlots}, st::kInt);
  return call;
}

std::tuple<Tensor, Tensor> router_record_cpu(const RecordLayers& layers, const std::optional<Tensor>& cu_seqlens,
                                             const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                             const std::optional<Tensor>& attention_mask) {
  RouterRecordCall call = prepare_router_record(layers, cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
  if (call.out_rows == 0 || layers.topk == 0) return {call.routes, call.overflow};
  int64_t bad_value = 0;
  const int64_t bad = cpu::router_record_rows(call.plan, layers.slices.data(), static_cast<int64_t>(layers.slices.size()),
                                              layers.topk, layers.dtype, st::ptr<int16_t>(call.routes), 0,
                                              call.out_rows, &bad_value);
  VERL_CHECK(bad == 0, kRecord, ": indices hold ", bad, " value(s) outside the int16 range [-32768, 32767] (e.g. ",
             bad_value, "); router replay stores expert ids as int16");
  return {call.routes, call.overflow};
}

std::tuple<Tensor, Tensor> router_topk_record_cpu(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                  const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                                  const std::optional<Tensor>& attention_mask) {
  return router_record_cpu(record_layers_of(indices), cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
}

RouterScatterCall prepare_router_scatter(const Tensor& routes, const Tensor& cu_seqlens, const Tensor& cu_seqlens_padded,
                                         int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size,
                                         int64_t cp_rank, int64_t cp_layout, const std::optional<Tensor>& attention_mask,
                                         const std::optional<Tensor>& replay_mask) {
  const char* op = kScatter;
  RouterScatterCall call;
  const core::CpLayout layout = st::cp_layout_arg(op, cp_layout);
  call.dtype = require_index_dtype(op, "routes", routes.scalar_type());
  st::int32_arg(op, "tp_size", tp_size, 1);
  VERL_CHECK(tp_rank >= 0 && tp_rank < tp_size, op, ": tp_rank must be in [0, tp_size=", tp_size, "), got ", tp_rank);
  st::check_cp(op, cp_size, cp_rank, /*allow_all=*/false);
  VERL_CHECK(local_rows >= 0, op, ": local_rows must be >= 0, got ", local_rows);
  const int64_t total_padded = st::checked_mul(op, "cp_size * local_rows", cp_size, local_rows);
  VERL_CHECK(local_rows % tp_size == 0, op, ": local_rows=", local_rows, " is not divisible by tp_size=", tp_size,
             "; the sequence-parallel split needs equal chunks (layout align must include tp_size)");
  const bool padded = attention_mask.has_value();
  VERL_CHECK(routes.dim() == (padded ? 4 : 3), op, ": routes must be ",
             padded ? "[B, S, L, K] (with attention_mask)" : "[total_tokens, L, K]", ", got shape ",
             st::shape_of(routes));
  check_offset_pair(op, cu_seqlens, cu_seqlens_padded, routes);
  // The arguments' devices, dtypes and shapes before any value is read: a replay mask on the wrong
  // device is named as such, whatever else is wrong with the layout's values.
  if (padded) check_on_data_device(op, "attention_mask", *attention_mask, routes);
  if (replay_mask.has_value()) {
    const Tensor& r = *replay_mask;
    VERL_CHECK(r.scalar_type() == st::kBool, op, ": replay_mask must be bool, got ", st::dtype_name(r.scalar_type()));
    VERL_CHECK(st::same_device(r, routes), op, ": replay_mask is on ", st::device_of(r), " but routes are on ",
               st::device_of(routes));
    const bool ok = padded ? (r.dim() == 2 && r.size(0) == routes.size(0) && r.size(1) == routes.size(1))
                           : (r.dim() == 1 && r.size(0) == routes.size(0));
    VERL_CHECK(ok, op, ": replay_mask must be ", padded ? "[B, S] like attention_mask" : "[total_tokens] like the routes' rows",
               ", got shape ", st::shape_of(r));
    call.replay = st::contiguous(r);
  }
  const int64_t B = cu_seqlens.size(0) - 1;
  call.cu = st::contiguous(cu_seqlens);
  call.cu_padded = st::contiguous(cu_seqlens_padded);
  if (routes.is_cpu()) check_host_layout(op, call.cu, call.cu_padded, cp_size, layout, total_padded);
  int64_t token_rows = routes.size(0);
  if (padded) {
    const Tensor& m = *attention_mask;
    VERL_CHECK(m.dim() == 2 && routes.size(0) == m.size(0) && routes.size(1) == m.size(1), op, ": padded routes ",
               st::shape_of(routes), " must be [B, S, L, K] matching attention_mask ", st::shape_of(m));
    call.mask_csum = mask_csum_of(op, m, B, routes, call.cu);
    token_rows = st::checked_mul(op, "B * S", routes.size(0), routes.size(1));
  } else {
    VERL_CHECK(!routes.is_cpu() || st::ptr<int32_t>(call.cu)[B] == routes.size(0), op, ": routes has ", routes.size(0),
               " token rows but cu_seqlens[-1] = ", routes.is_cpu() ? st::ptr<int32_t>(call.cu)[B] : 0);
  }
  call.routes = st::contiguous(routes);
  call.num_layers = routes.size(-2);
  call.topk = routes.size(-1);
  VERL_CHECK(call.num_layers <= kMaxTopk && call.topk <= kMaxTopk, op, ": routes have L=", call.num_layers,
             " layers and K=", call.topk, " indices per layer; each must be at most ", kMaxTopk);
  VERL_CHECK(call.num_layers * call.topk <= kMaxIndicesPerToken, op, ": routes hold L * K = ",
             call.num_layers * call.topk, " indices per token, more than the ", kMaxIndicesPerToken,
             " the kernels support");
  call.rows = local_rows / tp_size;
  st::checked_mul(op, "the output size", st::checked_mul(op, "the output size", call.rows, call.num_layers),
                  call.topk * 8);
  call.targets = st::output(op, "local_rows", routes, {call.num_layers, call.rows, call.topk}, st::kLong);
  call.replay_out =
      st::output(op, "local_rows", routes, {replay_mask.has_value() ? call.rows : 0}, st::kBool);

  core::PackPlan& p = call.plan.pack;
  p.cu_seqlens = st::ptr<int32_t>(call.cu);
  p.cu_seqlens_padded = st::ptr<int32_t>(call.cu_padded);
  p.mask_csum = padded ? st::ptr<int32_t>(call.mask_csum) : nullptr;
  p.seq_capacity = padded ? routes.size(1) : 0;
  p.src_rows = token_rows;
  p.spec = spec_of(B, local_rows, cp_size, layout);
  p.cp_rank = static_cast<int32_t>(cp_rank);
  p.roll = false;
  call.plan.rows_per_tp_rank = call.rows;
  call.plan.tp_rank = tp_rank;
  return call;
}

std::tuple<Tensor, Tensor> router_topk_scatter_cpu(const Tensor& routes, const Tensor& cu_seqlens,
                                                   const Tensor& cu_seqlens_padded, int64_t local_rows, int64_t tp_size,
                                                   int64_t tp_rank, int64_t cp_size, int64_t cp_rank, int64_t cp_layout,
                                                   const std::optional<Tensor>& attention_mask,
                                                   const std::optional<Tensor>& replay_mask) {
  RouterScatterCall call = prepare_router_scatter(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size, tp_rank,
                                                  cp_size, cp_rank, cp_layout, attention_mask, replay_mask);
  const bool* rin = replay_mask.has_value() ? st::ptr<bool>(call.replay) : nullptr;
  bool* rout = replay_mask.has_value() ? st::ptr<bool>(call.replay_out) : nullptr;
  cpu::router_scatter_rows(call.plan, call.routes.data_ptr(), call.dtype, call.num_layers, call.topk, rin,
                           st::ptr<int64_t>(call.targets), rout, call.rows, 0, call.rows);
  return {call.targets, call.replay_out};
}

}  // namespace ops
}  // namespace verl_ops
