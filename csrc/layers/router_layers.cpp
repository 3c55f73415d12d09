// The second library, verl_ops._C_layers: router_topk_record over a list of per-layer tensors.
//
// List arguments (Tensor[]) need the stable ABI of torch 2.10, so this piece is built with
// TORCH_TARGET_VERSION = 2.10 into its own library, loaded only under torch >= 2.10; the main
// library stays at 2.9. It reads the L layers through a pointer table (no stack copy) and shares
// every check and kernel with router_topk_record.
#include "../ops/router_ops.h"

namespace verl_ops {
namespace ops {

RecordLayers record_layers_of(const std::vector<Tensor>& indices) {
  constexpr const char* op = "router_topk_record";
  VERL_CHECK(!indices.empty(), op, ": indices must hold at least one layer, got an empty list");
  const Tensor& first = indices[0];
  VERL_CHECK(first.dim() == 2, op, ": indices[0] must be [T_local_sp, K] (or pass one [L, T_local_sp, K] tensor), got shape ",
             st::shape_of(first));
  RecordLayers r = record_layers_of(torch::stable::unsqueeze(first, 0));  // dtype and K checks of one layer
  r.slices.clear();
  for (size_t l = 0; l < indices.size(); ++l) {
    const Tensor& t = indices[l];
    VERL_CHECK(t.dim() == 2, op, ": indices[", l, "] must be [T_local_sp, K] (or pass one [L, T_local_sp, K] tensor), got shape ",
               st::shape_of(t));
    VERL_CHECK(t.scalar_type() == first.scalar_type(), op, ": indices[", l, "] is ", st::dtype_name(t.scalar_type()),
               " but indices[0] is ", st::dtype_name(first.scalar_type()), "; every layer must have the same dtype");
    VERL_CHECK(st::same_device(t, first), op, ": indices[", l, "] is on ", st::device_of(t), " but indices[0] is on ",
               st::device_of(first));
    VERL_CHECK(t.size(1) == first.size(1), op, ": indices[", l, "] has top-k ", t.size(1), " but indices[0] has ",
               first.size(1), "; K must be the same in every layer");
    VERL_CHECK(t.size(0) == first.size(0), op, ": indices[", l, "] has ", t.size(0), " rows but indices[0] has ",
               first.size(0), "; every layer records the same tokens");
    r.slices.push_back(core::LayerSlice{t.data_ptr(), t.stride(0), t.stride(1)});
  }
  // The L * K bounds of the whole list.
  record_layers_of(torch::stable::new_empty(first, {static_cast<int64_t>(indices.size()), 0, first.size(1)}));
  return r;
}

namespace {

std::tuple<Tensor, Tensor> record_layers_cpu(const std::vector<Tensor>& indices, const std::optional<Tensor>& cu_seqlens,
                                             const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                             const std::optional<Tensor>& attention_mask) {
  return router_record_cpu(record_layers_of(indices), cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
}

#ifdef VERL_OPS_WITH_CUDA
std::tuple<Tensor, Tensor> record_layers_cuda(const std::vector<Tensor>& indices, const std::optional<Tensor>& cu_seqlens,
                                              const std::optional<Tensor>& cu_seqlens_padded, int64_t total_tokens,
                                              const std::optional<Tensor>& attention_mask) {
  return router_record_cuda(record_layers_of(indices), cu_seqlens, cu_seqlens_padded, total_tokens, attention_mask);
}
#endif

}  // namespace
}  // namespace ops
}  // namespace verl_ops

STABLE_TORCH_LIBRARY_FRAGMENT(verl_ops, m) {
  // router_topk_record with the L layers as a list of [T, K] tensors (any integer dtype, any
  // strides), read in place.
  m.def(
      "router_topk_record_layers(Tensor[] indices, Tensor? cu_seqlens=None, Tensor? cu_seqlens_padded=None, "
      "SymInt total_tokens=0, Tensor? attention_mask=None) -> (Tensor routes, Tensor overflow)");
}

STABLE_TORCH_LIBRARY_IMPL(verl_ops, CPU, m) {
  m.impl("router_topk_record_layers", TORCH_BOX(&verl_ops::ops::record_layers_cpu));
}

#ifdef VERL_OPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(verl_ops, CUDA, m) {
  m.impl("router_topk_record_layers", TORCH_BOX(&verl_ops::ops::record_layers_cuda));
}
#endif
