// mla_forward_padded / mla_backward_padded: variable-length (THD) attention for MLA head dims
// (Dv <= Dqk), OPS.md section 6. Argument checks, backend choice, output layout; CPU and Meta
// implementations here, CUDA in mla_ops_cuda.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace verl_ops {
namespace ops {

enum class MlaBackend { kPadded, kNative };

// Sizes of a checked call (symbolic under torch.compile).
struct MlaSizes {
  c10::SymInt tq, tk, hq, hk, dqk, dv, batch;
};

// Shape / dtype / device checks shared by every implementation (no data reads).
MlaSizes check_mla_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                        const at::Tensor& cu_seqlens_kv, const c10::SymInt& max_seqlen_q,
                        const c10::SymInt& max_seqlen_kv,
                        const std::optional<double>& softmax_scale);

// The backend a call runs on. A function of the shapes only, so the Meta kernel knows the output
// layout: "padded" returns out (and grad_v) as a [.., :Dv] view of a [T, H, Dqk] buffer when
// Dv < Dqk; "native" returns contiguous tensors.
// same_offsets: q and kv use one cu_seqlens tensor (self-attention, as Megatron passes it),
// which lets the native backend take ragged causal batches (see shares_offsets).
MlaBackend resolve_mla_backend(const char* op, const std::string& backend, const MlaSizes& s,
                               const c10::SymInt& max_seqlen_q, const c10::SymInt& max_seqlen_kv,
                               bool causal, bool same_offsets);

// True when a and b are the same offsets: one tensor, or views of one storage at one offset with
// one shape (so real, Meta and fake tensors all answer alike, without reading values).
bool shares_offsets(const at::Tensor& a, const at::Tensor& b);

double mla_softmax_scale(const std::optional<double>& softmax_scale, int64_t dqk);

// [rows, heads, cols] in the layout of `backend` (a narrowed [rows, heads, full_cols] buffer for
// the padded backend when cols < full_cols).
at::Tensor mla_alloc_rows(MlaBackend backend, const c10::SymInt& rows, const c10::SymInt& heads,
                          const c10::SymInt& cols, const c10::SymInt& full_cols,
                          const at::TensorOptions& options);

std::tuple<at::Tensor, at::Tensor> mla_forward_padded_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend);

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend);

std::tuple<at::Tensor, at::Tensor> mla_forward_padded_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_kv,
    bool causal, std::optional<double> softmax_scale, const std::string& backend);

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_kv,
    bool causal, std::optional<double> softmax_scale, const std::string& backend);

// Checks of the backward's extra inputs (grad_out, out, softmax_lse) against the forward sizes.
void check_mla_backward_args(const char* op, const at::Tensor& grad_out, const at::Tensor& out,
                             const at::Tensor& softmax_lse, const at::Tensor& q, const MlaSizes& s);

#ifdef VERL_OPS_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> mla_forward_padded_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend);

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend);
#endif

}  // namespace ops
}  // namespace verl_ops
