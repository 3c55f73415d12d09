#include "router_ops.h"

#include <ATen/Parallel.h>

#include <atomic>

#include "../cpu/router_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

constexpr const char* kRecord = "router_topk_record";
constexpr const char* kScatter = "router_topk_scatter";
// Keeps every per-tile index of the CUDA kernels (tile rows x L x K) within int32.
constexpr int64_t kMaxIndicesPerToken = int64_t{1} << 22;
// Keeps at least one overflow slot per CUDA launch (128 layers each).
constexpr int64_t kMaxLayers = int64_t{1} << 16;

[[noreturn]] void fail(const std::string& msg) {
  TORCH_CHECK(false, msg);
  __builtin_unreachable();
}

std::string num(int64_t v) { return std::to_string(v); }

std::string dtype_name(at::ScalarType t) { return std::string(c10::toString(t)); }

template <typename Sizes>
std::string shape_of(const Sizes& s) {
  return c10::str(s);
}

bool index_dtype(at::ScalarType t, core::IndexDtype* out) {
  switch (t) {
    case at::kByte: *out = core::IndexDtype::kUInt8; return true;
    case at::kChar: *out = core::IndexDtype::kInt8; return true;
    case at::kShort: *out = core::IndexDtype::kInt16; return true;
    case at::kInt: *out = core::IndexDtype::kInt32; return true;
    case at::kLong: *out = core::IndexDtype::kInt64; return true;
    default: return false;
  }
}

core::IndexDtype require_index_dtype(const std::string& op, const std::string& name, at::ScalarType t) {
  core::IndexDtype d;
  if (!index_dtype(t, &d)) {
    fail(op + ": " + name + " must be an integer tensor (uint8, int8, int16, int32 or int64), got " +
         dtype_name(t));
  }
  return d;
}

core::CpLayout parse_cp_layout(const std::string& op, const std::string& cp_layout) {
  if (cp_layout == "zigzag") return core::CpLayout::kZigzag;
  if (cp_layout == "contiguous") return core::CpLayout::kContiguous;
  fail(op + ": cp_layout must be 'zigzag' or 'contiguous', got '" + cp_layout + "'");
}

void check_offsets(const std::string& op, const std::string& name, const at::Tensor& t,
                   const at::Device& device) {
  if (t.scalar_type() != at::kInt) fail(op + ": " + name + " must be int32, got " + dtype_name(t.scalar_type()));
  if (t.dim() != 1 || t.sym_size(0) < 1) {
    fail(op + ": " + name + " must be 1-D with B + 1 >= 1 entries, got shape " + shape_of(t.sym_sizes()));
  }
  if (t.device() != device) {
    fail(op + ": " + name + " is on " + c10::str(t.device()) + " but the data is on " + c10::str(device));
  }
}

// Consistency of a host layout with itself and with the rows it must cover (device layouts are
// checked by ThdLayout on its host copy when built: reading them here would synchronise).
void check_host_layout(const std::string& op, const at::Tensor& cu, const at::Tensor& cu_padded,
                       int64_t cp_size, core::CpLayout layout, int64_t total_padded) {
  const int64_t B = cu.size(0) - 1;
  const int32_t* c = cu.data_ptr<int32_t>();
  const int32_t* p = cu_padded.data_ptr<int32_t>();
  if (c[0] != 0) fail(op + ": cu_seqlens must start at 0, got " + num(c[0]));
  if (p[0] != 0) fail(op + ": cu_seqlens_padded must start at 0, got " + num(p[0]));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = static_cast<int64_t>(c[i + 1]) - c[i];
    const int64_t padded = static_cast<int64_t>(p[i + 1]) - p[i];
    if (len < 0) fail(op + ": cu_seqlens must be non-decreasing, got " + num(c[i]) + " then " + num(c[i + 1]) + " at index " + num(i));
    if (padded < len) {
      fail(op + ": cu_seqlens_padded gives sequence " + num(i) + " " + num(padded) + " rows, fewer than its " + num(len) + " tokens");
    }
    if (layout == core::CpLayout::kZigzag && cp_size > 1 && padded % (2 * cp_size) != 0) {
      fail(op + ": zigzag with cp_size=" + num(cp_size) + " needs every padded length to be a multiple of 2*cp_size, sequence " +
           num(i) + " has " + num(padded));
    }
  }
  if (static_cast<int64_t>(p[B]) != total_padded) {
    fail(op + ": cu_seqlens_padded[-1]=" + num(p[B]) + " does not match the " + num(total_padded) + " packed rows of the data");
  }
}

// [B, S] bool mask -> int32 inclusive prefix counts; on the host also the per-row counts.
at::Tensor mask_csum_of(const std::string& op, const at::Tensor& mask, int64_t batch,
                        const at::Device& device, const at::Tensor& cu) {
  if (mask.scalar_type() != at::kBool) fail(op + ": attention_mask must be bool, got " + dtype_name(mask.scalar_type()));
  if (mask.dim() != 2) fail(op + ": attention_mask must be [B, S], got shape " + shape_of(mask.sizes()));
  if (mask.device() != device) fail(op + ": attention_mask is on " + c10::str(mask.device()) + " but the data is on " + c10::str(device));
  if (mask.size(0) != batch) fail(op + ": attention_mask has " + num(mask.size(0)) + " rows but the layout has " + num(batch) + " sequences");
  at::Tensor csum = at::cumsum(mask, 1, at::kInt);
  if (device.is_cpu() && mask.size(1) > 0) {
    const int64_t S = mask.size(1);
    const int32_t* m = csum.data_ptr<int32_t>();
    const int32_t* c = cu.data_ptr<int32_t>();
    for (int64_t i = 0; i < batch; ++i) {
      if (m[i * S + S - 1] != c[i + 1] - c[i]) {
        fail(op + ": attention_mask row " + num(i) + " has " + num(m[i * S + S - 1]) + " valid tokens but the layout says " +
             num(c[i + 1] - c[i]));
      }
    }
  } else if (device.is_cpu()) {
    const int32_t* c = cu.data_ptr<int32_t>();
    for (int64_t i = 0; i < batch; ++i) {
      if (c[i + 1] != c[i]) fail(op + ": attention_mask row " + num(i) + " has 0 valid tokens but the layout says " + num(c[i + 1] - c[i]));
    }
  }
  return csum;
}

core::ShardSpec spec_of(int64_t batch, int64_t local_rows, int64_t cp_size, core::CpLayout layout) {
  return core::ShardSpec{batch, local_rows, static_cast<int32_t>(cp_size), layout};
}

// The L layer views of `indices` (a list of [T, K], or one [L, T, K]); returns (T, K) sizes via
// out-params and checks that every layer agrees. Works on symbolic sizes for the meta kernel.
struct IndicesShape {
  bool stacked;
  int64_t num_layers;
};

IndicesShape check_indices(at::TensorList indices) {
  const std::string op = kRecord;
  if (indices.empty()) fail(op + ": indices must hold at least one layer, got an empty list");
  const at::Tensor& first = indices[0];
  require_index_dtype(op, "indices", first.scalar_type());
  if (indices.size() == 1 && first.dim() == 3) return IndicesShape{true, 0};
  for (size_t l = 0; l < indices.size(); ++l) {
    const at::Tensor& t = indices[l];
    const std::string name = "indices[" + num(static_cast<int64_t>(l)) + "]";
    if (t.dim() != 2) {
      fail(op + ": " + name + " must be [T_local_sp, K] (or pass one [L, T_local_sp, K] tensor), got shape " + shape_of(t.sym_sizes()));
    }
    if (t.scalar_type() != first.scalar_type()) {
      fail(op + ": " + name + " is " + dtype_name(t.scalar_type()) + " but indices[0] is " + dtype_name(first.scalar_type()) +
           "; every layer must have the same dtype");
    }
    if (t.device() != first.device()) {
      fail(op + ": " + name + " is on " + c10::str(t.device()) + " but indices[0] is on " + c10::str(first.device()));
    }
    if (t.sym_size(1) != first.sym_size(1)) {
      fail(op + ": " + name + " has top-k " + c10::str(t.sym_size(1)) + " but indices[0] has " + c10::str(first.sym_size(1)) +
           "; K must be the same in every layer");
    }
    if (t.sym_size(0) != first.sym_size(0)) {
      fail(op + ": " + name + " has " + c10::str(t.sym_size(0)) + " rows but indices[0] has " + c10::str(first.sym_size(0)) +
           "; every layer records the same tokens");
    }
  }
  return IndicesShape{false, static_cast<int64_t>(indices.size())};
}

}  // namespace

RouterRecordCall prepare_router_record(at::TensorList indices,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       const std::optional<at::Tensor>& cu_seqlens_padded,
                                       int64_t total_tokens,
                                       const std::optional<at::Tensor>& attention_mask,
                                       at::Tensor* routes, at::Tensor* overflow) {
  const std::string op = kRecord;
  const IndicesShape shape = check_indices(indices);
  const at::Tensor& first = indices[0];
  RouterRecordCall call;
  call.dtype = require_index_dtype(op, "indices", first.scalar_type());
  int64_t rows_in;
  const int64_t elem = static_cast<int64_t>(first.element_size());
  if (shape.stacked) {
    call.num_layers = first.size(0);
    rows_in = first.size(1);
    call.topk = first.size(2);
    const char* base = static_cast<const char*>(first.data_ptr());
    for (int64_t l = 0; l < call.num_layers; ++l) {
      call.layers.push_back(core::LayerSlice{base == nullptr ? nullptr : base + l * first.stride(0) * elem, first.stride(1), first.stride(2)});
    }
  } else {
    call.num_layers = shape.num_layers;
    rows_in = first.size(0);
    call.topk = first.size(1);
    for (const at::Tensor& t : indices) call.layers.push_back(core::LayerSlice{t.data_ptr(), t.stride(0), t.stride(1)});
  }
  if (call.num_layers < 1) fail(op + ": indices must hold at least one layer, got shape " + shape_of(first.sizes()));
  if (call.num_layers > kMaxLayers) {
    fail(op + ": indices hold " + num(call.num_layers) + " layers, more than the " + num(kMaxLayers) + " the kernels support");
  }
  if (call.topk > (int64_t{1} << 20)) {
    fail(op + ": indices have top-k K=" + num(call.topk) + ", more than the 1048576 the kernels support");
  }
  if (call.num_layers * call.topk > kMaxIndicesPerToken) {
    fail(op + ": indices hold L * K = " + num(call.num_layers * call.topk) + " indices per token, more than the " +
         num(kMaxIndicesPerToken) + " the kernels support");
  }

  const bool fused = cu_seqlens.has_value() || cu_seqlens_padded.has_value();
  if (fused != (cu_seqlens.has_value() && cu_seqlens_padded.has_value())) {
    fail(op + ": cu_seqlens and cu_seqlens_padded must be given together (fused unpack) or both omitted");
  }
  if (!fused && attention_mask.has_value()) fail(op + ": attention_mask needs cu_seqlens and cu_seqlens_padded");
  std::vector<int64_t> out_shape;
  call.plan.fused = fused;
  call.plan.unpack = core::UnpackPlan{};
  if (!fused) {
    out_shape = {rows_in, call.num_layers, call.topk};
    call.out_rows = rows_in;
  } else {
    const at::Device device = first.device();
    check_offsets(op, "cu_seqlens", *cu_seqlens, device);
    check_offsets(op, "cu_seqlens_padded", *cu_seqlens_padded, device);
    if (cu_seqlens->size(0) != cu_seqlens_padded->size(0)) {
      fail(op + ": cu_seqlens and cu_seqlens_padded must have the same length, got " + num(cu_seqlens->size(0)) + " and " +
           num(cu_seqlens_padded->size(0)));
    }
    const int64_t B = cu_seqlens->size(0) - 1;
    call.cu = cu_seqlens->contiguous();
    call.cu_padded = cu_seqlens_padded->contiguous();
    if (device.is_cpu()) {
      check_host_layout(op, call.cu, call.cu_padded, 1, core::CpLayout::kZigzag, rows_in);
    }
    if (attention_mask.has_value()) {
      call.mask_csum = mask_csum_of(op, *attention_mask, B, device, call.cu);
      out_shape = {attention_mask->size(0), attention_mask->size(1), call.num_layers, call.topk};
      call.out_rows = out_shape[0] * out_shape[1];
    } else {
      if (total_tokens < 0) fail(op + ": total_tokens must be >= 0, got " + num(total_tokens));
      if (device.is_cpu() && call.cu.data_ptr<int32_t>()[B] != total_tokens) {
        fail(op + ": total_tokens=" + num(total_tokens) + " but cu_seqlens[-1] = " + num(call.cu.data_ptr<int32_t>()[B]));
      }
      out_shape = {total_tokens, call.num_layers, call.topk};
      call.out_rows = total_tokens;
    }
    core::UnpackPlan& u = call.plan.unpack;
    u.cu_seqlens = call.cu.data_ptr<int32_t>();
    u.cu_seqlens_padded = call.cu_padded.data_ptr<int32_t>();
    u.mask_csum = attention_mask.has_value() ? call.mask_csum.data_ptr<int32_t>() : nullptr;
    u.seq_capacity = attention_mask.has_value() ? attention_mask->size(1) : 0;
    u.packed_rows = rows_in;
    u.spec = spec_of(B, rows_in, 1, core::CpLayout::kZigzag);
    u.cp_rank = 0;
    u.roll = false;
  }
  *routes = at::empty(out_shape, first.options().dtype(at::kShort));
  // CPU raises on overflow and leaves this zero; the CUDA kernel writes every slot itself.
  *overflow = first.is_cpu() ? at::zeros({core::kOverflowSlots}, first.options().dtype(at::kInt))
                             : at::empty({core::kOverflowSlots}, first.options().dtype(at::kInt));
  return call;
}

std::tuple<at::Tensor, at::Tensor> router_topk_record_cpu(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, int64_t total_tokens,
    const std::optional<at::Tensor>& attention_mask) {
  at::Tensor routes, overflow;
  RouterRecordCall call = prepare_router_record(indices, cu_seqlens, cu_seqlens_padded, total_tokens,
                                                attention_mask, &routes, &overflow);
  if (call.out_rows == 0 || call.topk == 0) return {routes, overflow};
  int16_t* out = routes.data_ptr<int16_t>();
  std::atomic<int64_t> bad_count{0};
  std::atomic<int64_t> bad_value{0};
  at::parallel_for(0, call.out_rows, 512, [&](int64_t begin, int64_t end) {
    int64_t value = 0;
    const int64_t n = cpu::router_record_rows(call.plan, call.layers.data(), call.num_layers, call.topk,
                                              call.dtype, out, begin, end, &value);
    if (n > 0 && bad_count.fetch_add(n) == 0) bad_value.store(value);
  });
  if (bad_count.load() > 0) {
    fail(std::string(kRecord) + ": indices hold " + num(bad_count.load()) + " value(s) outside the int16 range [-32768, 32767] (e.g. " +
         num(bad_value.load()) + "); router replay stores expert ids as int16");
  }
  return {routes, overflow};
}

std::tuple<at::Tensor, at::Tensor> router_topk_record_meta(
    at::TensorList indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& cu_seqlens_padded, c10::SymInt total_tokens,
    const std::optional<at::Tensor>& attention_mask) {
  const std::string op = kRecord;
  const IndicesShape shape = check_indices(indices);
  const at::Tensor& first = indices[0];
  c10::SymInt rows_in, num_layers, topk;
  if (shape.stacked) {
    num_layers = first.sym_size(0);
    rows_in = first.sym_size(1);
    topk = first.sym_size(2);
  } else {
    num_layers = c10::SymInt(shape.num_layers);
    rows_in = first.sym_size(0);
    topk = first.sym_size(1);
  }
  const bool fused = cu_seqlens.has_value() || cu_seqlens_padded.has_value();
  if (fused != (cu_seqlens.has_value() && cu_seqlens_padded.has_value())) {
    fail(op + ": cu_seqlens and cu_seqlens_padded must be given together (fused unpack) or both omitted");
  }
  if (!fused && attention_mask.has_value()) fail(op + ": attention_mask needs cu_seqlens and cu_seqlens_padded");
  std::vector<c10::SymInt> out_shape;
  if (!fused) {
    out_shape = {rows_in, num_layers, topk};
  } else {
    check_offsets(op, "cu_seqlens", *cu_seqlens, first.device());
    check_offsets(op, "cu_seqlens_padded", *cu_seqlens_padded, first.device());
    if (attention_mask.has_value()) {
      if (attention_mask->dim() != 2) fail(op + ": attention_mask must be [B, S], got shape " + shape_of(attention_mask->sym_sizes()));
      out_shape = {attention_mask->sym_size(0), attention_mask->sym_size(1), num_layers, topk};
    } else {
      out_shape = {total_tokens, num_layers, topk};
    }
  }
  return {at::empty_symint(out_shape, first.options().dtype(at::kShort)),
          at::empty({core::kOverflowSlots}, first.options().dtype(at::kInt))};
}

RouterScatterCall prepare_router_scatter(const at::Tensor& routes, const at::Tensor& cu_seqlens,
                                         const at::Tensor& cu_seqlens_padded, int64_t local_rows,
                                         int64_t tp_size, int64_t tp_rank, int64_t cp_size,
                                         int64_t cp_rank, const std::string& cp_layout,
                                         const std::optional<at::Tensor>& attention_mask,
                                         const std::optional<at::Tensor>& replay_mask,
                                         at::Tensor* targets, at::Tensor* replay_out) {
  const std::string op = kScatter;
  RouterScatterCall call;
  const core::CpLayout layout = parse_cp_layout(op, cp_layout);
  call.dtype = require_index_dtype(op, "routes", routes.scalar_type());
  if (tp_size < 1) fail(op + ": tp_size must be >= 1, got " + num(tp_size));
  if (tp_rank < 0 || tp_rank >= tp_size) fail(op + ": tp_rank must be in [0, tp_size=" + num(tp_size) + "), got " + num(tp_rank));
  if (cp_size < 1) fail(op + ": cp_size must be >= 1, got " + num(cp_size));
  if (cp_rank < 0 || cp_rank >= cp_size) fail(op + ": cp_rank must be in [0, cp_size=" + num(cp_size) + "), got " + num(cp_rank));
  if (local_rows < 0) fail(op + ": local_rows must be >= 0, got " + num(local_rows));
  if (local_rows % tp_size != 0) {
    fail(op + ": local_rows=" + num(local_rows) + " is not divisible by tp_size=" + num(tp_size) +
         "; the sequence-parallel split needs equal chunks (layout align must include tp_size)");
  }
  const bool padded = attention_mask.has_value();
  if (padded ? routes.dim() != 4 : routes.dim() != 3) {
    fail(op + ": routes must be " + (padded ? "[B, S, L, K] (with attention_mask)" : "[total_tokens, L, K]") + ", got shape " +
         shape_of(routes.sizes()));
  }
  const at::Device device = routes.device();
  check_offsets(op, "cu_seqlens", cu_seqlens, device);
  check_offsets(op, "cu_seqlens_padded", cu_seqlens_padded, device);
  if (cu_seqlens.size(0) != cu_seqlens_padded.size(0)) {
    fail(op + ": cu_seqlens and cu_seqlens_padded must have the same length, got " + num(cu_seqlens.size(0)) + " and " +
         num(cu_seqlens_padded.size(0)));
  }
  const int64_t B = cu_seqlens.size(0) - 1;
  call.cu = cu_seqlens.contiguous();
  call.cu_padded = cu_seqlens_padded.contiguous();
  if (device.is_cpu()) check_host_layout(op, call.cu, call.cu_padded, cp_size, layout, cp_size * local_rows);
  const int64_t token_rows = padded ? routes.size(0) * routes.size(1) : routes.size(0);
  if (padded) {
    if (routes.size(0) != attention_mask->size(0) || attention_mask->dim() != 2 || routes.size(1) != attention_mask->size(1)) {
      fail(op + ": padded routes " + shape_of(routes.sizes()) + " must be [B, S, L, K] matching attention_mask " +
           shape_of(attention_mask->sizes()));
    }
    call.mask_csum = mask_csum_of(op, *attention_mask, B, device, call.cu);
  } else if (device.is_cpu() && call.cu.data_ptr<int32_t>()[B] != routes.size(0)) {
    fail(op + ": routes has " + num(routes.size(0)) + " token rows but cu_seqlens[-1] = " + num(call.cu.data_ptr<int32_t>()[B]));
  }
  if (replay_mask.has_value()) {
    const at::Tensor& r = *replay_mask;
    if (r.scalar_type() != at::kBool) fail(op + ": replay_mask must be bool, got " + dtype_name(r.scalar_type()));
    if (r.device() != device) fail(op + ": replay_mask is on " + c10::str(r.device()) + " but routes are on " + c10::str(device));
    const bool ok = padded ? (r.dim() == 2 && r.size(0) == routes.size(0) && r.size(1) == routes.size(1))
                           : (r.dim() == 1 && r.size(0) == routes.size(0));
    if (!ok) {
      fail(op + ": replay_mask must be " + (padded ? "[B, S] like attention_mask" : "[total_tokens] like the routes' rows") +
           ", got shape " + shape_of(r.sizes()));
    }
    call.replay = r.contiguous();
  }
  call.routes = routes.contiguous();
  call.num_layers = routes.size(-2);
  call.topk = routes.size(-1);
  if (call.num_layers > (int64_t{1} << 20) || call.topk > (int64_t{1} << 20)) {
    fail(op + ": routes have L=" + num(call.num_layers) + " layers and K=" + num(call.topk) +
         " indices per layer; each must be at most 1048576");
  }
  if (call.num_layers * call.topk > kMaxIndicesPerToken) {
    fail(op + ": routes hold L * K = " + num(call.num_layers * call.topk) + " indices per token, more than the " +
         num(kMaxIndicesPerToken) + " the kernels support");
  }
  call.rows = local_rows / tp_size;
  *targets = at::empty({call.num_layers, call.rows, call.topk}, routes.options().dtype(at::kLong));
  *replay_out = at::empty({replay_mask.has_value() ? call.rows : 0}, routes.options().dtype(at::kBool));

  core::PackPlan& p = call.plan.pack;
  p.cu_seqlens = call.cu.data_ptr<int32_t>();
  p.cu_seqlens_padded = call.cu_padded.data_ptr<int32_t>();
  p.mask_csum = padded ? call.mask_csum.data_ptr<int32_t>() : nullptr;
  p.seq_capacity = padded ? routes.size(1) : 0;
  p.src_rows = token_rows;
  p.spec = spec_of(B, local_rows, cp_size, layout);
  p.cp_rank = static_cast<int32_t>(cp_rank);
  p.roll = false;
  call.plan.rows_per_tp_rank = call.rows;
  call.plan.tp_rank = tp_rank;
  return call;
}

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_cpu(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    int64_t local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask) {
  at::Tensor targets, replay_out;
  RouterScatterCall call = prepare_router_scatter(routes, cu_seqlens, cu_seqlens_padded, local_rows, tp_size, tp_rank,
                                                  cp_size, cp_rank, cp_layout, attention_mask, replay_mask, &targets,
                                                  &replay_out);
  const void* src = call.routes.data_ptr();
  const bool* rin = call.replay.defined() ? call.replay.data_ptr<bool>() : nullptr;
  bool* rout = call.replay.defined() ? replay_out.data_ptr<bool>() : nullptr;
  int64_t* dst = targets.data_ptr<int64_t>();
  at::parallel_for(0, call.rows, 512, [&](int64_t begin, int64_t end) {
    cpu::router_scatter_rows(call.plan, src, call.dtype, call.num_layers, call.topk, rin, dst, rout, call.rows, begin, end);
  });
  return {targets, replay_out};
}

std::tuple<at::Tensor, at::Tensor> router_topk_scatter_meta(
    const at::Tensor& routes, const at::Tensor& cu_seqlens, const at::Tensor& cu_seqlens_padded,
    c10::SymInt local_rows, int64_t tp_size, int64_t tp_rank, int64_t cp_size, int64_t cp_rank,
    const std::string& cp_layout, const std::optional<at::Tensor>& attention_mask,
    const std::optional<at::Tensor>& replay_mask) {
  const std::string op = kScatter;
  parse_cp_layout(op, cp_layout);
  require_index_dtype(op, "routes", routes.scalar_type());
  if (tp_size < 1) fail(op + ": tp_size must be >= 1, got " + num(tp_size));
  if (tp_rank < 0 || tp_rank >= tp_size) fail(op + ": tp_rank must be in [0, tp_size=" + num(tp_size) + "), got " + num(tp_rank));
  if (cp_size < 1) fail(op + ": cp_size must be >= 1, got " + num(cp_size));
  if (cp_rank < 0 || cp_rank >= cp_size) fail(op + ": cp_rank must be in [0, cp_size=" + num(cp_size) + "), got " + num(cp_rank));
  const bool padded = attention_mask.has_value();
  if (padded ? routes.dim() != 4 : routes.dim() != 3) {
    fail(op + ": routes must be " + (padded ? "[B, S, L, K] (with attention_mask)" : "[total_tokens, L, K]") + ", got shape " +
         shape_of(routes.sym_sizes()));
  }
  check_offsets(op, "cu_seqlens", cu_seqlens, routes.device());
  check_offsets(op, "cu_seqlens_padded", cu_seqlens_padded, routes.device());
  for (const auto* m : {&attention_mask, &replay_mask}) {
    const std::string name = m == &attention_mask ? "attention_mask" : "replay_mask";
    if (!m->has_value()) continue;
    if ((*m)->scalar_type() != at::kBool) fail(op + ": " + name + " must be bool, got " + dtype_name((*m)->scalar_type()));
    if ((*m)->device() != routes.device()) {
      fail(op + ": " + name + " is on " + c10::str((*m)->device()) + " but routes are on " + c10::str(routes.device()));
    }
  }
  const c10::SymInt rows = local_rows / tp_size;
  const auto opts = routes.options();
  at::Tensor targets = at::empty_symint({routes.sym_size(-2), rows, routes.sym_size(-1)}, opts.dtype(at::kLong));
  at::Tensor replay_out = replay_mask.has_value() ? at::empty_symint({rows}, opts.dtype(at::kBool))
                                                  : at::empty({0}, opts.dtype(at::kBool));
  return {targets, replay_out};
}

}  // namespace ops
}  // namespace verl_ops
