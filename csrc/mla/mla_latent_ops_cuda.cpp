// mla_latent_forward / mla_latent_backward on CUDA: the SM90 kernels (csrc/mla/sm90/) reading q, q_pe,
// k, k_pe and v through tensor maps of their own, so MLA's operands are never concatenated and k_pe
// (one head) is never copied into every head. See docs/mla.md#latent-parts.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "mla_latent_ops.h"
#include "mla_ops.h"
#include "sm90/mla_sm90_bwd.h"
#include "sm90/mla_sm90_fwd.h"

namespace verl_ops {
namespace ops {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

struct LatentSizes {
  int64_t tq, tk, hq, hk, batch;
  bool self_attention;
};

void check_part(const char* op, const char* name, const Tensor& t, int64_t d, const Tensor& q) {
  VERL_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D [T, H, ", d, "], got ", t.dim(), " dims");
  VERL_CHECK(t.size(2) == d, op, ": ", name, " must have ", d,
             " columns (MLA's head dims: q and k 128 + 64 rope, v 128), got ", t.size(2));
  VERL_CHECK(st::same_device(t, q), op, ": ", name, " is on ", st::device_of(t), " but q is on ",
             st::device_of(q));
  VERL_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " is ", st::dtype_name(t.scalar_type()),
             " but q is ", st::dtype_name(q.scalar_type()));
  VERL_CHECK(t.size(2) == 1 || t.stride(2) == 1, op, ": ", name, " must have inner stride 1, got ",
             t.stride(2));
}

void check_cu(const char* op, const char* name, const Tensor& cu, const Tensor& q) {
  VERL_CHECK(cu.scalar_type() == st::kInt, op, ": ", name, " must be int32, got ",
             st::dtype_name(cu.scalar_type()));
  VERL_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": ", name, " must be 1-D [B + 1]");
  VERL_CHECK(st::same_device(cu, q), op, ": ", name, " is on ", st::device_of(cu), " but q is on ",
             st::device_of(q));
}

LatentSizes check_latent(const char* op, const Tensor& q, const Tensor& q_pe, const Tensor& k,
                         const Tensor& k_pe, const Tensor& v, const Tensor& cu_q, const Tensor& cu_kv,
                         int64_t max_seqlen_q, int64_t max_seqlen_kv, const std::optional<double>& softmax_scale) {
  VERL_CHECK(!softmax_scale.has_value() || std::isfinite(*softmax_scale), op,
             ": softmax_scale must be a finite float or None, got ", softmax_scale.value_or(0.0));
  VERL_CHECK(!q.is_cpu(), op, ": q must be on a CUDA device (the CPU kernel is registered apart)");
  VERL_CHECK(q.scalar_type() == st::kBFloat16 || q.scalar_type() == st::kHalf, op,
             ": q must be float16 or bfloat16 on CUDA, got ", st::dtype_name(q.scalar_type()));
  check_part(op, "q", q, 128, q);
  check_part(op, "q_pe", q_pe, 64, q);
  check_part(op, "k", k, 128, q);
  check_part(op, "k_pe", k_pe, 64, q);
  check_part(op, "v", v, 128, q);
  check_cu(op, "cu_seqlens_q", cu_q, q);
  check_cu(op, "cu_seqlens_kv", cu_kv, q);
  LatentSizes s{q.size(0), k.size(0), q.size(1), k.size(1), cu_q.size(0) - 1, false};
  VERL_CHECK(q_pe.size(0) == s.tq && q_pe.size(1) == s.hq, op, ": q_pe must be [", s.tq, ", ", s.hq,
             ", 64] like q's rows and heads, got ", st::shape_of(q_pe));
  VERL_CHECK(v.size(0) == s.tk && v.size(1) == s.hk, op, ": v must be [", s.tk, ", ", s.hk,
             ", 128] like k's rows and heads, got ", st::shape_of(v));
  VERL_CHECK(k_pe.size(0) == s.tk && (k_pe.size(1) == 1 || k_pe.size(1) == s.hk), op, ": k_pe must be [",
             s.tk, ", 1, 64] (shared by every kv head) or [", s.tk, ", ", s.hk, ", 64], got ",
             st::shape_of(k_pe));
  VERL_CHECK(s.hq >= 1 && s.hk >= 1 && s.hq % s.hk == 0, op, ": q's heads (", s.hq,
             ") must be a positive multiple of k's (", s.hk, ")");
  VERL_CHECK(cu_kv.size(0) - 1 == s.batch, op, ": cu_seqlens_q and cu_seqlens_kv must have the same length, got ",
             cu_q.size(0), " and ", cu_kv.size(0));
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  VERL_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= kInt32Max, op, ": max_seqlen_q must be in [0, ", kInt32Max,
             "], got ", max_seqlen_q);
  VERL_CHECK(max_seqlen_kv >= 0 && max_seqlen_kv <= kInt32Max, op, ": max_seqlen_kv must be in [0, ", kInt32Max,
             "], got ", max_seqlen_kv);
  constexpr int64_t kInt32Rows = std::numeric_limits<int32_t>::max();
  VERL_CHECK(s.tq < kInt32Rows && s.tk < kInt32Rows, op, ": at most 2^31 - 2 rows (TMA coordinates), got ",
             s.tq, " and ", s.tk);
  VERL_CHECK(cuda::sm90_kernels_device(q.get_device_index()), op,
             ": needs the SM90 kernels (a build for sm_90a, on a compute capability 9.0 device) on ",
             st::device_of(q), "; verl_ops.mla_latent_attention falls back to the concatenated operands elsewhere");
  s.self_attention = shares_offsets(cu_q, cu_kv) && s.tq == s.tk && max_seqlen_q == max_seqlen_kv;
  return s;
}

// A part as TMA reads it: inner stride 1, the other strides multiples of 8 elements, a 16-byte
// aligned base; anything else is copied to contiguous rows first.
Tensor tma_ready(const Tensor& t) {
  bool ok = t.stride(2) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  if (t.size(0) > 1) ok = ok && t.stride(0) > 0 && t.stride(0) % 8 == 0;
  if (t.size(1) > 1) ok = ok && t.stride(1) > 0 && t.stride(1) % 8 == 0;
  return ok ? t : st::contiguous(t);
}

cuda::Sm90Rows rows_of(const Tensor& t) {
  const int64_t heads = t.size(1);
  const int64_t head_stride = heads > 1 ? t.stride(1) : t.size(2);
  // A single row's stride is never stepped over (TMA still wants a multiple of 16 bytes).
  const int64_t row_stride = t.size(0) > 1 ? t.stride(0) : (heads * head_stride + 7) / 8 * 8;
  return {t.data_ptr(), row_stride, head_stride, heads};
}

struct LatentInputs {
  Tensor q, q_pe, k, k_pe, v, cu_q, cu_kv, workspace;
};

template <class Args>
LatentInputs latent_inputs(Args& a, const Tensor& q, const Tensor& q_pe, const Tensor& k, const Tensor& k_pe,
                           const Tensor& v, const Tensor& cu_q, const Tensor& cu_kv, const LatentSizes& s,
                           bool causal, double scale, int64_t workspace_ints) {
  LatentInputs in{tma_ready(q), tma_ready(q_pe), tma_ready(k), tma_ready(k_pe), tma_ready(v),
                  st::contiguous(cu_q), st::contiguous(cu_kv), st::empty(q, {workspace_ints}, st::kInt)};
  a.in.q = rows_of(in.q);
  a.in.q_pe = rows_of(in.q_pe);
  a.in.k = rows_of(in.k);
  a.in.k_pe = rows_of(in.k_pe);
  a.in.v = rows_of(in.v);
  a.cu_q = st::ptr<int32_t>(in.cu_q);
  a.cu_kv = st::ptr<int32_t>(in.cu_kv);
  a.workspace = st::ptr<int32_t>(in.workspace);
  a.batch = s.batch;
  a.tq = s.tq;
  a.tk = s.tk;
  a.hq = s.hq;
  a.hk = s.hk;
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.bottom_right = causal && !s.self_attention;
  a.half = q.scalar_type() == st::kHalf;
  return in;
}

}  // namespace

std::tuple<Tensor, Tensor> mla_latent_forward_cuda(const Tensor& q, const Tensor& q_pe, const Tensor& k,
                                                   const Tensor& k_pe, const Tensor& v, const Tensor& cu_seqlens_q,
                                                   const Tensor& cu_seqlens_kv, int64_t max_seqlen_q,
                                                   int64_t max_seqlen_kv, bool causal,
                                                   std::optional<double> softmax_scale) {
  constexpr const char* op = "mla_latent_forward";
  const st::DeviceGuard guard(st::guard_index(q));
  const LatentSizes s =
      check_latent(op, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                   softmax_scale);
  const double scale = mla_softmax_scale(softmax_scale, 192);
  Tensor out = st::empty(q, {s.tq, s.hq, 128}, q.scalar_type());
  Tensor stats = st::empty(q, {s.tq, s.hq}, st::kFloat);  // returned as its [Hq, Tq] transpose (a view)
  if (s.tq == 0 || s.tk == 0 || s.batch == 0 || !s.self_attention) {
    // Rows that see no key (all of them without keys; possible where q and kv have their own
    // offsets) get a zero output and +inf log-sum-exp; the kernel writes every other row.
    torch::stable::zero_(out);
    torch::stable::fill_(stats, kInfinity);
  }
  if (s.tq > 0 && s.tk > 0 && s.batch > 0) {
    cuda::Sm90FwdArgs a{};
    const LatentInputs in = latent_inputs(a, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, s, causal, scale,
                                          cuda::sm90_forward_workspace_ints(s.batch));
    a.out = out.data_ptr();
    a.lse = st::ptr<float>(stats);
    a.max_seqlen_q = max_seqlen_q;
    st::check_launch(op, cuda::launch_sm90_forward(a, st::current_stream(q)));
  }
  return {out, torch::stable::transpose(stats, 0, 1)};
}

std::tuple<Tensor, Tensor, Tensor> mla_latent_backward_cuda(
    const Tensor& grad_out, const Tensor& q, const Tensor& q_pe, const Tensor& k, const Tensor& k_pe,
    const Tensor& v, const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale) {
  constexpr const char* op = "mla_latent_backward";
  const st::DeviceGuard guard(st::guard_index(q));
  const LatentSizes s =
      check_latent(op, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                   softmax_scale);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"grad_out", grad_out}, {"out", out}}) {
    VERL_CHECK(t.dim() == 3 && t.size(0) == s.tq && t.size(1) == s.hq && t.size(2) == 128, op, ": ", name,
               " must be [", s.tq, ", ", s.hq, ", 128], got ", st::shape_of(t));
    VERL_CHECK(st::same_device(t, q) && t.scalar_type() == q.scalar_type(), op, ": ", name,
               " must be on q's device in q's dtype");
  }
  VERL_CHECK(softmax_lse.dim() == 2 && softmax_lse.size(0) == s.hq && softmax_lse.size(1) == s.tq &&
                 softmax_lse.scalar_type() == st::kFloat && st::same_device(softmax_lse, q),
             op, ": softmax_lse must be float32 [", s.hq, ", ", s.tq, "] on q's device, got ",
             st::shape_of(softmax_lse), " ", st::dtype_name(softmax_lse.scalar_type()));
  const double scale = mla_softmax_scale(softmax_scale, 192);
  Tensor dq = st::empty(q, {s.tq, s.hq, 192}, q.scalar_type());
  Tensor dkv = st::empty(k, {s.tk, s.hk, 256}, k.scalar_type());
  Tensor dk_pe = st::empty(k, {s.tk, s.hk, 64}, k.scalar_type());
  if (s.tq == 0 || s.tk == 0 || s.batch == 0) {
    torch::stable::zero_(dq);
    torch::stable::zero_(dkv);
    torch::stable::zero_(dk_pe);
    return {dq, dkv, dk_pe};
  }
  // (the backward's pre kernel reads O and dO as 16-byte vectors, and dO through a tensor map)
  const Tensor oc = st::aligned_rows(out), gc = st::aligned_rows(grad_out);
  Tensor accum = st::empty(q, {s.tq, s.hq, 192}, st::kFloat);
  Tensor lse_d = st::empty(q, {s.hq, s.tq, 2}, st::kFloat);
  cuda::Sm90BwdArgs a{};
  const LatentInputs in = latent_inputs(a, q, q_pe, k, k_pe, v, cu_seqlens_q, cu_seqlens_kv, s, causal, scale,
                                        cuda::sm90_backward_workspace_ints(s.batch));
  a.out = oc.data_ptr();
  a.dout = gc.data_ptr();
  a.lse = st::ptr<float>(softmax_lse);
  a.lse_row_stride = softmax_lse.stride(1);
  a.lse_head_stride = softmax_lse.stride(0);
  a.dq = dq.data_ptr();
  a.dk = {dkv.data_ptr(), s.hk * 256, 256};
  a.dk_pe = {dk_pe.data_ptr(), s.hk * 64, 64};
  a.dv = {static_cast<char*>(dkv.data_ptr()) + 128 * 2, s.hk * 256, 256};
  a.dq_accum = st::ptr<float>(accum);
  a.lse_d = reinterpret_cast<float2*>(st::ptr<float>(lse_d));
  st::check_launch(op, cuda::launch_sm90_backward(a, st::current_stream(q)));
  return {dq, dkv, dk_pe};
}

}  // namespace ops
}  // namespace verl_ops
