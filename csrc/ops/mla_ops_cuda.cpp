// CUDA backends of mla_forward_padded / mla_backward_padded.
//
// padded: V is zero-padded to Dqk by one kernel and the call goes to the varlen FlashAttention
//   kernels inside torch (aten::_flash_attention_forward / _backward). The output is returned as
//   the [.., :Dv] view of FlashAttention's [T, H, Dqk] output (no trim copy); the backward
//   recovers that padded output from the view's storage, pads grad_out (and V again, which
//   is cheaper than keeping a padded copy alive between forward and backward) in one launch,
//   and returns grad_v as the first Dv columns of FlashAttention's padded dV.
// native: cuDNN's SDPA, which takes Dv != Dqk, through aten::_cudnn_attention_forward /
//   _backward in their dense form: on a zero-copy [B, H, S, D] view of uniform THD batches, and
//   on right-padded copies of ragged causal self-attention batches (one pack launch per input,
//   one unpack launch per output, through the THD kernels). The
//   dense form keeps its cuDNN graph in a cache keyed by shape; torch's ragged (cum_seq) form
//   rebuilds the whole cuDNN graph on every call in torch 2.11 (its cache lookup never inserts),
//   which is where its ~40 ms per call comes from, so it is deliberately not used here.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <limits>
#include <vector>

#include "../cuda/mla_kernels.h"
#include "mla_ops.h"
#include "thd_ops.h"

namespace verl_ops {
namespace ops {

namespace {

std::string msg(const char* op, const std::string& rest) { return std::string(op) + ": " + rest; }

void check_cuda_dtype(const char* op, const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              msg(op, "q must be float16 or bfloat16 on CUDA, got " + c10::str(q.scalar_type())));
}

// [T, H, src_cols] tensors (unit inner stride) -> contiguous [T, H, dst_cols], zero tail, in one
// launch.
std::vector<at::Tensor> pad_last_dim(const char* op, const std::vector<at::Tensor>& srcs,
                                     int64_t dst_cols) {
  TORCH_CHECK(!srcs.empty() && static_cast<int>(srcs.size()) <= cuda::kMaxPadJobs,
              msg(op, "internal: bad number of tensors to pad"));
  std::vector<at::Tensor> keep, outs;
  cuda::PadJob jobs[cuda::kMaxPadJobs];
  const int64_t src_cols = srcs[0].size(2);
  for (size_t i = 0; i < srcs.size(); ++i) {
    at::Tensor s = srcs[i].stride(2) == 1 ? srcs[i] : srcs[i].contiguous();
    TORCH_CHECK(s.size(2) == src_cols && s.scalar_type() == srcs[0].scalar_type(),
                msg(op, "internal: tensors to pad differ in head dim or dtype"));
    at::Tensor d = at::empty({s.size(0), s.size(1), dst_cols}, s.options());
    jobs[i] = cuda::PadJob{s.data_ptr(), d.data_ptr(),
                           core::PadGeometry{s.size(0), s.size(1), s.stride(0), s.stride(1)}};
    keep.push_back(s);
    outs.push_back(d);
  }
  const cudaError_t err =
      cuda::launch_pad_last_dim(jobs, static_cast<int>(srcs.size()), src_cols, dst_cols,
                                srcs[0].element_size(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, msg(op, std::string("pad kernel launch failed: ") + cudaGetErrorString(err)));
  return outs;
}

// The padded backend returns out as the [.., :Dv] view of FlashAttention's [T, H, Dqk] output.
// When `out` still is that view, the full padded output is read back from its storage instead of
// being rebuilt. Only the first Dv columns of the padded grad_out are non-zero, so FlashAttention's
// backward reads the tail of out only through products with zeros.
std::optional<at::Tensor> padded_out_of_view(const at::Tensor& out, int64_t dqk) {
  const int64_t t = out.size(0), h = out.size(1);
  if (t == 0 || out.stride(2) != 1 || out.stride(1) != dqk || out.stride(0) != h * dqk) {
    return std::nullopt;
  }
  const int64_t needed = (out.storage_offset() + t * h * dqk) * static_cast<int64_t>(out.element_size());
  if (static_cast<int64_t>(out.storage().nbytes()) < needed) return std::nullopt;
  return out.as_strided({t, h, dqk}, {h * dqk, dqk, 1}, out.storage_offset());
}

at::Tensor flash_rng_state(const at::Tensor& like) {
  return at::empty({2}, like.options().dtype(at::kUInt64));
}

at::Tensor flash_unused(const at::Tensor& like) {
  return at::empty({}, like.options().dtype(at::kUInt64));
}

// [T, H, D] rows of a uniform batch as cuDNN's dense [B, H, S, D] (a view; T = B * S).
at::Tensor as_bhsd(const at::Tensor& t, int64_t batch, int64_t seqlen) {
  return t.view({batch, seqlen, t.size(1), t.size(2)}).transpose(1, 2);
}

at::Tensor from_bhsd(const at::Tensor& t4, int64_t rows) {
  return t4.transpose(1, 2).reshape({rows, t4.size(1), t4.size(3)}).contiguous();
}

// Ragged batches on the dense native path: [T, H, D] rows <-> right-padded [B, S, H, D] rows.
struct DenseRows {
  at::Tensor cu;        // the batch's int32 offsets [B + 1]
  at::Tensor cu_dense;  // b * S: every sequence padded to S rows
  int64_t batch = 0, seqlen = 0;
};

DenseRows dense_rows(const at::Tensor& cu, int64_t batch, int64_t seqlen) {
  return {cu, at::arange(0, (batch + 1) * seqlen, seqlen, cu.options()), batch, seqlen};
}

// Pack [T, *F] rows into [B * S, *F] (zeros in padding rows); also this rows' positions.
std::tuple<at::Tensor, at::Tensor> pack_dense(const DenseRows& d, const at::Tensor& rows2d) {
  return preprocess_thd_cuda(rows2d, d.cu, d.cu_dense, d.batch * d.seqlen, 1, 0, "contiguous",
                             false, std::nullopt);
}

// [T, H, D] -> [B, H, S, D] view of a right-padded copy.
at::Tensor to_dense(const DenseRows& d, const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  const int64_t h = xc.size(1), dd = xc.size(2);
  at::Tensor packed = std::get<0>(pack_dense(d, xc.view({xc.size(0), h * dd})));
  return packed.view({d.batch, d.seqlen, h, dd}).transpose(1, 2);
}

// [B, H, S, D] -> the valid rows [T, H, D].
at::Tensor from_dense(const DenseRows& d, const at::Tensor& x4, int64_t rows) {
  const int64_t h = x4.size(1), dd = x4.size(3);
  const at::Tensor r = x4.transpose(1, 2).reshape({d.batch * d.seqlen, h * dd});
  return postprocess_thd_cuda(r, d.cu, d.cu_dense, rows, 1, 0, "contiguous", false, std::nullopt)
      .view({rows, h, dd});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mla_forward_padded_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_forward_padded";
  const c10::cuda::CUDAGuard guard(q.device());
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const MlaSizes s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                    max_seqlen_kv, softmax_scale);
  check_cuda_dtype(op, q);
  const MlaBackend b = resolve_mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                                           shares_offsets(cu_seqlens_q, cu_seqlens_kv));
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), dqk = q.size(2), dv = v.size(2);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const double scale = mla_softmax_scale(softmax_scale, dqk);
  at::Tensor out = mla_alloc_rows(b, tq, hq, dv, dqk, q.options());
  if (tq == 0 || tk == 0 || batch == 0) {
    // No query, or nothing to attend to: zero output, +inf log-sum-exp (FlashAttention's value
    // for a row without keys).
    out.zero_();
    return {out, at::full({hq, tq}, std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat))};
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_kv = cu_seqlens_kv.contiguous();
  if (b == MlaBackend::kPadded) {
    TORCH_CHECK(dqk % 8 == 0 && dqk <= 256,
                msg(op, "the padded (FlashAttention) backend needs Dqk a multiple of 8 and <= 256, got " +
                            std::to_string(dqk)));
    const at::Tensor vp = dv == dqk ? v.contiguous() : pad_last_dim(op, {v}, dqk)[0];
    auto res = at::_flash_attention_forward(qc, kc, vp, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv,
                                            0.0, causal, false, scale);
    at::Tensor o = std::get<0>(res);
    return {dv == dqk ? o.contiguous() : o.narrow(2, 0, dv), std::get<1>(res)};
  }
  const int64_t sq = max_seqlen_q, skv = max_seqlen_kv;
  const bool uniform = batch * sq == tq && batch * skv == tk;
  if (!uniform) {
    // Ragged causal self-attention (resolve_mla_backend checked it): right-padded dense copies.
    const DenseRows d = dense_rows(cu_q, batch, sq);
    auto res = at::_cudnn_attention_forward(to_dense(d, qc), to_dense(d, kc), to_dense(d, v), std::nullopt,
                                            std::nullopt, std::nullopt, sq, sq,
                                            /*compute_log_sumexp=*/true, 0.0, causal, false, scale);
    const at::Tensor lse_rows = std::get<1>(res).reshape({batch, hq, sq}).transpose(1, 2).reshape({batch * sq, hq});
    const at::Tensor lse = postprocess_thd_cuda(lse_rows.to(at::kFloat), d.cu, d.cu_dense, tq, 1, 0,
                                                "contiguous", false, std::nullopt);
    return {from_dense(d, std::get<0>(res), tq), lse.t().contiguous()};
  }
  auto res = at::_cudnn_attention_forward(as_bhsd(qc, batch, sq), as_bhsd(kc, batch, skv),
                                          as_bhsd(v.contiguous(), batch, skv), std::nullopt,
                                          std::nullopt, std::nullopt, sq, skv,
                                          /*compute_log_sumexp=*/true, 0.0, causal, false, scale);
  // cuDNN's log-sum-exp is [B, H, S(, 1)]; ours is [H, T].
  const at::Tensor lse4 = std::get<1>(res);
  at::Tensor lse = lse4.reshape({batch, hq, sq}).permute({1, 0, 2}).reshape({hq, tq}).contiguous();
  return {from_bhsd(std::get<0>(res), tq), lse.to(at::kFloat)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_backward_padded";
  const c10::cuda::CUDAGuard guard(q.device());
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const MlaSizes s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                    max_seqlen_kv, softmax_scale);
  check_cuda_dtype(op, q);
  check_mla_backward_args(op, grad_out, out, softmax_lse, q, s);
  const MlaBackend b = resolve_mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                                           shares_offsets(cu_seqlens_q, cu_seqlens_kv));
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), hk = k.size(1), dqk = q.size(2),
                dv = v.size(2);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const double scale = mla_softmax_scale(softmax_scale, dqk);
  if (tq == 0 || tk == 0 || batch == 0) {
    at::Tensor grad_v = mla_alloc_rows(b, tk, hk, dv, dqk, v.options());
    grad_v.zero_();
    return {at::zeros({tq, hq, dqk}, q.options()), at::zeros({tk, hk, dqk}, k.options()), grad_v};
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_kv = cu_seqlens_kv.contiguous();
  if (b == MlaBackend::kPadded) {
    TORCH_CHECK(dqk % 8 == 0 && dqk <= 256,
                msg(op, "the padded (FlashAttention) backend needs Dqk a multiple of 8 and <= 256, got " +
                            std::to_string(dqk)));
    at::Tensor vp, dout, out_full;
    if (dv == dqk) {
      vp = v.contiguous();
      dout = grad_out.contiguous();
      out_full = out.contiguous();
    } else {
      std::optional<at::Tensor> recovered = padded_out_of_view(out, dqk);
      std::vector<at::Tensor> padded =
          recovered.has_value() ? pad_last_dim(op, {v, grad_out}, dqk) : pad_last_dim(op, {v, grad_out, out}, dqk);
      vp = padded[0];
      dout = padded[1];
      out_full = recovered.has_value() ? *recovered : padded[2];
    }
    auto grads = at::_flash_attention_backward(dout, qc, kc, vp, out_full, softmax_lse.contiguous(),
                                               cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, 0.0, causal,
                                               flash_rng_state(q), flash_unused(q), scale);
    at::Tensor dvp = std::get<2>(grads);
    return {std::get<0>(grads).contiguous(), std::get<1>(grads).contiguous(),
            dv == dqk ? dvp.contiguous() : dvp.narrow(2, 0, dv)};
  }
  const int64_t sq = max_seqlen_q, skv = max_seqlen_kv;
  const at::Tensor no_tensor;
  const at::Tensor seed = at::empty({}, q.options().dtype(at::kLong));
  const at::Tensor offset = at::empty({}, q.options().dtype(at::kLong));
  const bool uniform = batch * sq == tq && batch * skv == tk;
  if (!uniform) {
    // Ragged causal self-attention: padding query rows get a zero output gradient and an
    // infinite log-sum-exp (probabilities exactly 0), so they add nothing to any gradient.
    const DenseRows d = dense_rows(cu_q, batch, sq);
    auto packed_lse = pack_dense(d, softmax_lse.t().contiguous());
    const at::Tensor lengths = (cu_q.narrow(0, 1, batch) - cu_q.narrow(0, 0, batch)).unsqueeze(1);
    const at::Tensor valid = (std::get<1>(packed_lse).view({batch, sq}) < lengths).unsqueeze(-1);
    const at::Tensor lse4 = at::where(valid, std::get<0>(packed_lse).view({batch, sq, hq}),
                                      std::numeric_limits<float>::infinity())
                                .permute({0, 2, 1})
                                .contiguous()
                                .unsqueeze(-1);
    auto grads = at::_cudnn_attention_backward(
        to_dense(d, grad_out), to_dense(d, qc), to_dense(d, kc), to_dense(d, v), to_dense(d, out), lse4,
        seed, offset, no_tensor, no_tensor, no_tensor, sq, sq, 0.0, causal, scale);
    return {from_dense(d, std::get<0>(grads), tq), from_dense(d, std::get<1>(grads), tk),
            from_dense(d, std::get<2>(grads), tk)};
  }
  const at::Tensor lse4 =
      softmax_lse.reshape({hq, batch, sq}).permute({1, 0, 2}).contiguous().unsqueeze(-1);
  auto grads = at::_cudnn_attention_backward(
      as_bhsd(grad_out.contiguous(), batch, sq), as_bhsd(qc, batch, sq), as_bhsd(kc, batch, skv),
      as_bhsd(v.contiguous(), batch, skv), as_bhsd(out.contiguous(), batch, sq), lse4, seed, offset,
      no_tensor, no_tensor, no_tensor, sq, skv, 0.0, causal, scale);
  return {from_bhsd(std::get<0>(grads), tq), from_bhsd(std::get<1>(grads), tk),
          from_bhsd(std::get<2>(grads), tk)};
}

}  // namespace ops
}  // namespace verl_ops
