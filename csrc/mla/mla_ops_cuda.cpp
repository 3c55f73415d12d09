// CUDA backends of mla_forward_padded / mla_backward_padded.
//
// padded: V is zero-padded to Dqk by one kernel and the call goes to the varlen FlashAttention
//   kernels inside torch (aten::_flash_attention_forward / _backward). The output is returned as
//   the [.., :Dv] view of FlashAttention's [T, H, Dqk] output (no trim copy); the backward
//   recovers that padded output from the view's storage, pads grad_out (and V again, which
//   is cheaper than keeping a padded copy alive between forward and backward) in one launch,
//   and returns grad_v as the first Dv columns of FlashAttention's padded dV.
// native: cuDNN's SDPA, which takes Dv != Dqk, in its dense form (forward: the AOTI shim of
//   aten::_scaled_dot_product_cudnn_attention, which is _cudnn_attention_forward without
//   cum_seq; backward: aten::_cudnn_attention_backward): on a zero-copy [B, H, S, D] view of
//   uniform THD batches, and on right-padded copies of ragged causal self-attention batches (one
//   pack launch per input, one unpack launch per output, through the THD kernels). The dense
//   form keeps its cuDNN graph in a cache keyed by shape; torch's ragged (cum_seq) form rebuilds
//   the whole cuDNN graph on every call in torch 2.11 (its cache lookup never inserts), which is
//   where its ~40 ms per call comes from, so it is deliberately not used here.
// varlen: cuDNN's SDPA on the packed THD rows themselves (ragged offsets, a padding mask from the
//   per-sequence lengths, Dv != Dqk), through graphs of the cuDNN frontend kept in a plan cache
//   keyed by bucketed shapes (csrc/mla/cudnn/mla_cudnn_varlen.h). No padded copies, no host read of the
//   lengths: one metadata launch turns cu_seqlens into lengths and element offsets on the device.
//   Compiled only where setup.py found the frontend (VERL_OPS_WITH_CUDNN_FE). The forward for
//   Dqk 192 / Dv 128 on compute capability 9.0 runs the own SM90 kernel instead
//   (csrc/mla/sm90/mla_sm90_fwd.cu; VERL_OPS_VARLEN_FORWARD=cudnn keeps cuDNN's).
// reference: float32 / float64 inputs under every backend code (FlashAttention, cuDNN and the
//   SM90 kernels take float16 / bfloat16 only): the CPU reference's math on the GPU, accumulated in
//   the input's type, one warp per output row, no padded copies (csrc/mla/cuda/mla_reference_kernels.h).
//
// Stable ABI (target 2.9): aten ops go through the dispatcher (st::call_aten) with Tensor / int /
// float / bool / optional arguments only (and, at 2.9 to 2.11, only ops whose returns read the same
// types backwards: see cudnn_forward); int[] and Scalar arguments do not convert at 2.9, so
// view / reshape / permute / as_strided are AOTI shim reinterpretations of our own intermediates
// (reinterpret / reshape below), arange is a cumsum, where takes a 0-dim tensor, and the lengths
// of the ragged backward come from aten::diff.
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cuda.h>

#include "cuda/mla_kernels.h"
#include "cuda/mla_reference_kernels.h"
#ifdef VERL_OPS_WITH_CUDNN_FE
#include "cudnn/mla_cudnn_varlen.h"
#include "sm90/mla_sm90_bwd.h"
#include "sm90/mla_sm90_fwd.h"
#endif
#include "mla_ops.h"
#include "../ops/thd_ops.h"

namespace verl_ops {
namespace ops {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kContiguousLayout = 1;  // cp_layout of the THD pack / unpack

// The guard, argument checks and backend of a CUDA call (the checks first: a tensor on the wrong
// device gets our message).
struct CudaCall {
  MlaCall c;
  st::DeviceGuard guard;

  CudaCall(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
           const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv, int64_t max_seqlen_q,
           int64_t max_seqlen_kv, bool causal, const std::optional<double>& softmax_scale,
           int64_t backend, const MlaBackwardInputs* backward)
      : c(prepare_mla(op, MlaDevice::kCuda, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                      max_seqlen_kv, causal, softmax_scale, backend, backward)),
        guard(st::guard_index(q)) {}
};

// B * S == T for q and kv (resolve_mla_backend's test, without int64 wrap-around).
bool uniform_batch(const MlaSizes& s, int64_t max_seqlen_q, int64_t max_seqlen_kv) {
  using Wide = __int128;
  return Wide{s.batch} * max_seqlen_q == s.tq && Wide{s.batch} * max_seqlen_kv == s.tk;
}

// Every tensor return of a dispatcher call, owned (the handles are new references; the ones
// not kept are released with the vector).
template <size_t N>
std::vector<Tensor> tensor_returns(const std::array<StableIValue, N>& stack,
                                   std::initializer_list<size_t> slots) {
  std::vector<Tensor> out;
  out.reserve(slots.size());
  for (size_t i : slots) out.push_back(st::to_tensor(stack[i]));
  return out;
}

// t's storage, at t's storage offset, with the given sizes and strides (elements): the AOTI
// shim's as_strided (the dispatcher takes no int[] at 2.9). Not a tracked view (no autograd or
// version-counter link), so only for our own intermediates: never returned as an alias of an
// input.
Tensor reinterpret(const Tensor& t, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& strides) {
  AtenTensorHandle ret = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()),
                                                        sizes.data(), strides.data(), 0, &ret));
  return Tensor(ret);
}

// reshape: the row-major reinterpretation of t, made contiguous first when it is not.
Tensor reshape(const char* op, const Tensor& t, const std::vector<int64_t>& sizes) {
  const Tensor c = st::contiguous(t);
  std::vector<int64_t> strides(sizes.size());
  int64_t n = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = n;
    n = st::checked_mul(op, "a reshape's size", n, sizes[i]);
  }
  VERL_CHECK(n == c.numel(), op, ": internal: cannot reshape ", st::shape_of(t), " to ", n,
             " elements");
  return reinterpret(c, sizes, strides);
}

// [T, H, src_cols] tensors (unit inner stride) -> contiguous [T, H, dst_cols], zero tail, in one
// launch.
std::vector<Tensor> pad_last_dim(const char* op, const std::vector<Tensor>& srcs,
                                 int64_t dst_cols) {
  VERL_CHECK(!srcs.empty() && static_cast<int>(srcs.size()) <= cuda::kMaxPadJobs, op,
             ": internal: bad number of tensors to pad");
  std::vector<Tensor> keep, outs;
  cuda::PadJob jobs[cuda::kMaxPadJobs];
  const int64_t src_cols = srcs[0].size(2);
  for (size_t i = 0; i < srcs.size(); ++i) {
    const Tensor s = srcs[i].stride(2) == 1 ? srcs[i] : st::contiguous(srcs[i]);
    VERL_CHECK(s.size(2) == src_cols && s.scalar_type() == srcs[0].scalar_type(), op,
               ": internal: tensors to pad differ in head dim or dtype");
    const Tensor d = st::empty(s, {s.size(0), s.size(1), dst_cols}, s.scalar_type());
    jobs[i] = cuda::PadJob{s.data_ptr(), d.data_ptr(),
                           core::PadGeometry{s.size(0), s.size(1), s.stride(0), s.stride(1)}};
    keep.push_back(s);
    outs.push_back(d);
  }
  const int64_t elem_bytes = st::element_size(srcs[0]);
  const cudaStream_t stream = st::current_stream(srcs[0]);
  st::check_launch(op, cuda::launch_pad_last_dim(jobs, static_cast<int>(srcs.size()), src_cols,
                                                 dst_cols, elem_bytes, stream));
  return outs;
}

// The padded backend returns out as the [.., :Dv] view of FlashAttention's [T, H, Dqk] output.
// When `out` still is that view, the full padded output is read back from its storage instead of
// being rebuilt. Only the first Dv columns of the padded grad_out are non-zero, so FlashAttention's
// backward reads the tail of out only through products with zeros. The storage's size comes from
// the AOTI shim (aoti_torch_get_storage_size, the storage's nbytes): the [T, H, Dqk] rows must
// lie inside it.
std::optional<Tensor> padded_out_of_view(const Tensor& out, int64_t dqk) {
  const int64_t t = out.size(0), h = out.size(1);
  if (t == 0 || out.stride(2) != 1 || out.stride(1) != dqk || out.stride(0) != h * dqk) {
    return std::nullopt;
  }
  int64_t storage_bytes = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_storage_size(out.get(), &storage_bytes));
  using Wide = __int128;
  const Wide needed = (Wide{st::storage_offset(out)} + Wide{t} * h * dqk) *
                      st::element_size(out);
  if (Wide{storage_bytes} < needed) return std::nullopt;
  return reinterpret(out, {t, h, dqk}, {h * dqk, dqk, 1});
}

// FlashAttention's (unused without dropout) rng state arguments.
Tensor flash_rng_state(const Tensor& like) { return st::empty(like, {2}, st::ScalarType::UInt64); }

Tensor flash_unused(const Tensor& like) { return st::empty(like, {}, st::ScalarType::UInt64); }

// [T, H, D] rows (contiguous) of a uniform batch as cuDNN's dense [B, H, S, D] (a view; T = B * S).
Tensor as_bhsd(const char* op, const Tensor& t, int64_t batch, int64_t seqlen) {
  return torch::stable::transpose(reshape(op, t, {batch, seqlen, t.size(1), t.size(2)}), 1, 2);
}

// [B, H, S, D] -> contiguous [B * S, H, D] rows.
Tensor from_bhsd(const Tensor& t4) {
  return st::contiguous(st::flatten(torch::stable::transpose(t4, 1, 2), 0, 1));
}

// Ragged batches on the dense native path: [T, H, D] rows <-> right-padded [B, S, H, D] rows.
struct DenseRows {
  Tensor cu;        // the batch's int32 offsets [B + 1]
  Tensor cu_dense;  // b * S: every sequence padded to S rows
  int64_t batch = 0, seqlen = 0;
};

DenseRows dense_rows(const char* op, const Tensor& cu, int64_t batch, int64_t seqlen) {
  st::int32_arg(op, "B * max_seqlen_q (the native backend's padded rows)",
                st::checked_mul(op, "B * max_seqlen_q", batch, seqlen));
  // b * S for b in [0, B] as the inclusive cumsum of [0, S, S, ...] (aten::arange takes Scalar
  // arguments, which the dispatcher does not convert at 2.9).
  Tensor steps = st::empty(cu, {batch + 1}, st::kInt);
  torch::stable::fill_(steps, static_cast<double>(seqlen));
  Tensor first = torch::stable::narrow(steps, 0, 0, 1);
  torch::stable::zero_(first);
  Tensor cu_dense = st::to_tensor(st::call_aten("aten::cumsum", "", steps, int64_t{0},
                                                std::optional<st::ScalarType>(st::kInt))[0]);
  return {cu, cu_dense, batch, seqlen};
}

// Pack [T, *F] rows into [B * S, *F] (zeros in padding rows); also the rows' positions.
std::tuple<Tensor, Tensor> pack_dense(const DenseRows& d, const Tensor& rows) {
  return preprocess_thd_cuda(rows, d.cu, d.cu_dense, d.batch * d.seqlen, 1, 0, kContiguousLayout,
                             false, std::nullopt);
}

// [T, H, D] -> [B, H, S, D] view of a right-padded copy.
Tensor to_dense(const char* op, const DenseRows& d, const Tensor& x) {
  const Tensor packed = std::get<0>(pack_dense(d, x));  // [B * S, H, D], contiguous
  return torch::stable::transpose(reshape(op, packed, {d.batch, d.seqlen, x.size(1), x.size(2)}),
                                  1, 2);
}

// [B, H, S, D] -> the valid rows [T, H, D].
Tensor from_dense(const DenseRows& d, const Tensor& x4, int64_t rows) {
  const Tensor r = st::flatten(torch::stable::transpose(x4, 1, 2), 0, 1);
  return postprocess_thd_cuda(r, d.cu, d.cu_dense, rows, 1, 0, kContiguousLayout, false,
                              std::nullopt);
}

// The offsets FlashAttention reads, clamped into the rows (launch_clamp_offsets): one launch for
// both, into one buffer of 2 * (B + 1) words.
std::tuple<Tensor, Tensor> flash_offsets(const char* op, const Tensor& cu_q, const Tensor& cu_kv,
                                         const MlaSizes& s, cudaStream_t stream) {
  const int64_t n = cu_q.size(0);
  Tensor both = st::empty(cu_q, {2 * n}, st::kInt);
  Tensor out_q = torch::stable::narrow(both, 0, 0, n), out_kv = torch::stable::narrow(both, 0, n, n);
  st::check_launch(op, cuda::launch_clamp_offsets(st::ptr<int32_t>(cu_q), st::ptr<int32_t>(out_q), s.tq,
                                                  st::ptr<int32_t>(cu_kv), st::ptr<int32_t>(out_kv), s.tk, n,
                                                  stream));
  return {out_q, out_kv};
}

void check_flash_head_dim(const char* op, int64_t dqk) {
  VERL_CHECK(dqk % 8 == 0 && dqk <= 256, op,
             ": the padded (FlashAttention) backend needs Dqk a multiple of 8 and <= 256, got ",
             dqk);
}

// cuDNN attention in its dense form: (output, logsumexp [B, H, S(, 1)]). Through the AOTI shim of
// aten::_scaled_dot_product_cudnn_attention (which is aten::_cudnn_attention_forward with the
// sequence lengths of the dense shapes), not through the dispatcher: aoti_torch_call_dispatcher
// converts the i-th return with the type of return i but the value of return n-1-i, which breaks
// on the SymInt returns of both cuDNN forward ops (torch 2.9 to 2.11).
std::tuple<Tensor, Tensor> cudnn_forward(const Tensor& q4, const Tensor& k4, const Tensor& v4,
                                         bool causal, double scale) {
  // output, logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset, debug_attn_mask
  std::array<AtenTensorHandle, 7> h{};
  int64_t max_q = 0, max_k = 0;
  double scale_arg = scale;
  const AOTITorchError err = aoti_torch_cuda__scaled_dot_product_cudnn_attention(
      q4.get(), k4.get(), v4.get(), /*attn_bias=*/nullptr, /*compute_log_sumexp=*/1,
      /*dropout_p=*/0.0, causal ? 1 : 0, /*return_debug_mask=*/0, &scale_arg, &h[0], &h[1], &h[2],
      &h[3], &max_q, &max_k, &h[4], &h[5], &h[6]);
  std::vector<Tensor> owned;  // every returned handle, released with the vector
  for (AtenTensorHandle t : h) {
    if (t != nullptr) owned.emplace_back(t);
  }
  TORCH_ERROR_CODE_CHECK(err);
  return {owned[0], owned[1]};
}

// aten::_cudnn_attention_backward in its dense form: (grad_q, grad_k, grad_v) [B, H, S, D].
std::vector<Tensor> cudnn_backward(const Tensor& grad_out4, const Tensor& q4, const Tensor& k4,
                                   const Tensor& v4, const Tensor& out4, const Tensor& lse4,
                                   int64_t sq, int64_t skv, bool causal, double scale) {
  const Tensor seed = st::empty(q4, {}, st::kLong);
  const Tensor offset = st::empty(q4, {}, st::kLong);
  const Tensor none;  // undefined: attn_bias, cum_seq_q, cum_seq_k
  // (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
  //  cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale)
  const auto r = st::call_aten<16>("aten::_cudnn_attention_backward", "", grad_out4, q4, k4, v4,
                                   out4, lse4, seed, offset, none, none, none, sq, skv, 0.0,
                                   causal, std::optional<double>(scale));
  return tensor_returns(r, {0, 1, 2});
}

// ---- reference kernels (float32 / float64) ---------------------------------------------------

// The kernels' view of a call: contiguous offsets (kept alive by the caller) and the sizes.
cuda::MlaReferenceProblem reference_problem(const Tensor& cu_q, const Tensor& cu_kv,
                                            const MlaSizes& s, bool causal, double scale) {
  return {st::ptr<int32_t>(cu_q), st::ptr<int32_t>(cu_kv), s.batch, s.tq, s.tk, s.hq, s.hk,
          s.dqk, s.dv, causal, scale};
}

std::tuple<Tensor, Tensor> reference_forward(const char* op, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& cu_seqlens_q,
                                             const Tensor& cu_seqlens_kv, const MlaSizes& s,
                                             bool causal, double scale) {
  const Tensor qc = st::contiguous(q), kc = st::contiguous(k), vc = st::contiguous(v);
  const Tensor cu_q = st::contiguous(cu_seqlens_q), cu_kv = st::contiguous(cu_seqlens_kv);
  const st::ScalarType dt = q.scalar_type();
  Tensor out = st::empty(q, {s.tq, s.hq, s.dv}, dt);
  Tensor lse = st::empty(q, {s.hq, s.tq}, dt);  // float32 / float64: mla_lse_dtype(q)
  const cuda::MlaReferenceProblem p = reference_problem(cu_q, cu_kv, s, causal, scale);
  const cudaStream_t stream = st::current_stream(q);
  if (dt == st::kDouble) {
    st::check_launch(op, cuda::launch_mla_reference_forward<double>(
                             p, st::ptr<double>(qc), st::ptr<double>(kc), st::ptr<double>(vc),
                             st::ptr<double>(out), st::ptr<double>(lse), stream));
  } else {
    st::check_launch(op, cuda::launch_mla_reference_forward<float>(
                             p, st::ptr<float>(qc), st::ptr<float>(kc), st::ptr<float>(vc),
                             st::ptr<float>(out), st::ptr<float>(lse), stream));
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> reference_backward(
    const char* op, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, const MlaSizes& s, bool causal, double scale) {
  const Tensor qc = st::contiguous(q), kc = st::contiguous(k), vc = st::contiguous(v);
  const Tensor oc = st::contiguous(out), gc = st::contiguous(grad_out);
  const Tensor lse = st::contiguous(softmax_lse);
  const Tensor cu_q = st::contiguous(cu_seqlens_q), cu_kv = st::contiguous(cu_seqlens_kv);
  const st::ScalarType dt = q.scalar_type();
  // Every element of dq / dk / dv is written by the kernels (zeros where no query sees a key).
  Tensor dq = st::empty(q, {s.tq, s.hq, s.dqk}, dt);
  Tensor dk = st::empty(k, {s.tk, s.hk, s.dqk}, dt);
  Tensor dv = st::empty(v, {s.tk, s.hk, s.dv}, dt);
  Tensor delta = st::empty(q, {s.hq, s.tq}, dt);
  const cuda::MlaReferenceProblem p = reference_problem(cu_q, cu_kv, s, causal, scale);
  const cudaStream_t stream = st::current_stream(q);
  if (dt == st::kDouble) {
    st::check_launch(op, cuda::launch_mla_reference_backward<double>(
                             p, st::ptr<double>(qc), st::ptr<double>(kc), st::ptr<double>(vc),
                             st::ptr<double>(oc), st::ptr<double>(gc), st::ptr<double>(lse),
                             st::ptr<double>(delta), st::ptr<double>(dq), st::ptr<double>(dk),
                             st::ptr<double>(dv), stream));
  } else {
    st::check_launch(op, cuda::launch_mla_reference_backward<float>(
                             p, st::ptr<float>(qc), st::ptr<float>(kc), st::ptr<float>(vc),
                             st::ptr<float>(oc), st::ptr<float>(gc), st::ptr<float>(lse),
                             st::ptr<float>(delta), st::ptr<float>(dq), st::ptr<float>(dk),
                             st::ptr<float>(dv), stream));
  }
  return {dq, dk, dv};
}

// ---- varlen backend -------------------------------------------------------------------------

#ifdef VERL_OPS_WITH_CUDNN_FE

// One call's plan, per-call metadata (lengths and ragged offsets, computed on the device) and
// stream. `self_attention`: q and kv share their offsets, so every query sees a key and every key
// a query (no fix-up of empty rows, and the causal diagonal needs no bottom-right alignment).
struct VarlenCall {
  cuda::VarlenProblem bucket;
  std::shared_ptr<const cuda::VarlenPlan> plan;
  Tensor metadata;
  cuda::VarlenMetadata meta;
  cudaStream_t stream = nullptr;
  bool self_attention = false;
  Tensor cu_q, cu_kv;
};

VarlenCall prepare_varlen(const char* op, bool backward, const Tensor& q,
                          const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                          const MlaSizes& s, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                          bool causal, double scale) {
  VERL_CHECK(s.dqk % 8 == 0 && s.dv % 8 == 0 && s.dqk <= 256, op,
             ": backend='varlen' (cuDNN) needs head dims that are multiples of 8 and at most 256, "
             "got Dqk=", s.dqk, ", Dv=", s.dv);
  VarlenCall c;
  c.cu_q = st::contiguous(cu_seqlens_q);
  c.cu_kv = st::contiguous(cu_seqlens_kv);
  c.self_attention = shares_offsets(cu_seqlens_q, cu_seqlens_kv) && s.tq == s.tk &&
                     max_seqlen_q == max_seqlen_kv;
  cuda::VarlenProblem p;
  p.device = q.get_device_index();
  p.dtype = q.scalar_type() == st::kHalf ? cuda::VarlenDtype::kHalf : cuda::VarlenDtype::kBFloat16;
  p.backward = backward;
  p.causal = causal;
  p.bottom_right = causal && !c.self_attention;
  p.batch = s.batch;
  p.hq = s.hq;
  p.hk = s.hk;
  p.dqk = s.dqk;
  p.dv = s.dv;
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_kv = max_seqlen_kv;
  p.total_q = s.tq;
  p.total_kv = s.tk;
  p.scale = scale;
  c.bucket = cuda::varlen_bucket(p);
  st::int32_arg(op, "the varlen backend's bucketed batch size", c.bucket.batch);
  c.stream = st::current_stream(q);
  c.plan = cuda::varlen_plan(op, c.bucket, c.stream);
  c.metadata = st::empty(
      q, {static_cast<int64_t>(cuda::varlen_metadata_bytes(c.bucket.batch))}, st::kByte);
  c.meta = cuda::varlen_metadata_at(c.metadata.data_ptr(), c.bucket.batch);
  st::check_launch(op, cuda::launch_varlen_metadata(st::ptr<int32_t>(c.cu_q),
                                                    st::ptr<int32_t>(c.cu_kv), s.batch,
                                                    c.bucket.batch, s.tq, s.tk, s.hq, s.hk, s.dqk, s.dv,
                                                    c.meta, cuda::varlen_order(), c.stream));
  return c;
}

// The plan's workspace (kept alive by the returned tensor until the call's launches are queued;
// the caching allocator orders its reuse on the stream).
std::tuple<Tensor, void*> varlen_workspace(const VarlenCall& c, const Tensor& like) {
  const int64_t bytes = cuda::varlen_workspace_bytes(c.plan.get());
  Tensor ws = st::empty(like, {bytes > 0 ? bytes : 1}, st::kByte);
  return {ws, bytes > 0 ? ws.data_ptr() : nullptr};
}

// What the SM90 kernels' arguments (Sm90FwdArgs, Sm90BwdArgs) share: the rows of q / k / v and the
// offsets as the kernels read them, a workspace of workspace_ints int32, the sizes, the scale and
// the mask. The returned tensors keep those buffers alive until the launch is queued.
struct Sm90Inputs {
  Tensor q, k, v, cu_q, cu_kv, workspace;
};
template <class Args>
Sm90Inputs sm90_inputs(Args& a, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv, const MlaSizes& s,
                       int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal, double scale,
                       int64_t workspace_ints) {
  Sm90Inputs in{st::aligned_rows(q), st::aligned_rows(k), st::aligned_rows(v),
                st::contiguous(cu_seqlens_q), st::contiguous(cu_seqlens_kv),
                st::empty(q, {workspace_ints}, st::kInt)};
  const bool self_attention = shares_offsets(cu_seqlens_q, cu_seqlens_kv) && s.tq == s.tk &&
                              max_seqlen_q == max_seqlen_kv;
  a.in = cuda::sm90_dense_parts(in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(), s.hq, s.hk);
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
  a.bottom_right = causal && !self_attention;
  a.half = q.scalar_type() == st::kHalf;
  return in;
}

std::tuple<Tensor, Tensor> varlen_forward(const char* op, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& cu_seqlens_q,
                                          const Tensor& cu_seqlens_kv, const MlaSizes& s,
                                          int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                                          double scale) {
  constexpr int64_t kInt32Rows = std::numeric_limits<int32_t>::max();
  if (s.dqk == 192 && s.dv == 128 && s.tq < kInt32Rows && s.tk < kInt32Rows &&
      cuda::sm90_forward_device(q.get_device_index())) {
    // MLA's head dims on Hopper (rows addressed by TMA's int32 coordinates): the own SM90 kernel
    // (csrc/mla/sm90/mla_sm90_fwd.cu), which writes the same outputs as cuDNN's forward (every row of
    // every sequence, +inf log-sum-exp where a row sees no key), so cuDNN's backward reads them
    // unchanged. No plan, no host read.
    Tensor out = st::empty(q, {s.tq, s.hq, s.dv}, q.scalar_type());
    Tensor stats = st::empty(q, {s.tq, s.hq}, st::kFloat);
    cuda::Sm90FwdArgs a{};
    const Sm90Inputs in = sm90_inputs(a, q, k, v, cu_seqlens_q, cu_seqlens_kv, s, max_seqlen_q,
                                      max_seqlen_kv, causal, scale,
                                      cuda::sm90_forward_workspace_ints(s.batch));
    a.out = out.data_ptr();
    a.lse = st::ptr<float>(stats);
    a.max_seqlen_q = max_seqlen_q;
    st::check_launch(op, cuda::launch_sm90_forward(a, st::current_stream(q)));
    return {out, st::contiguous(torch::stable::transpose(stats, 0, 1))};
  }
  const VarlenCall c = prepare_varlen(op, false, q, cu_seqlens_q, cu_seqlens_kv, s, max_seqlen_q,
                                      max_seqlen_kv, causal, scale);
  const Tensor qc = st::aligned_rows(q), kc = st::aligned_rows(k), vc = st::aligned_rows(v);
  Tensor out = st::empty(q, {s.tq, s.hq, s.dv}, q.scalar_type());
  Tensor stats = st::empty(q, {s.tq, s.hq}, st::kFloat);  // [Tq, Hq]: cuDNN's ragged layout
  const auto [ws, ws_ptr] = varlen_workspace(c, q);
  cuda::VarlenForwardArgs a;
  a.q = qc.data_ptr();
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.out = out.data_ptr();
  a.stats = st::ptr<float>(stats);
  a.meta = c.meta;
  cuda::varlen_forward(op, c.plan.get(), a, ws_ptr, c.stream);
  if (!c.self_attention) {
    st::check_launch(op, cuda::launch_varlen_empty_rows_forward(
                             st::ptr<int32_t>(c.cu_q), st::ptr<int32_t>(c.cu_kv), s.batch, causal,
                             s.tq, s.hq, s.dv, out.data_ptr(), st::ptr<float>(stats), c.stream));
  }
  return {out, st::contiguous(torch::stable::transpose(stats, 0, 1))};
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward(
    const char* op, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, const MlaSizes& s, int64_t max_seqlen_q, int64_t max_seqlen_kv,
    bool causal, double scale) {
  constexpr int64_t kInt32Rows = std::numeric_limits<int32_t>::max();
  if (s.dqk == 192 && s.dv == 128 && s.tq < kInt32Rows && s.tk < kInt32Rows &&
      cuda::sm90_backward_device(q.get_device_index())) {
    // MLA's head dims on Hopper (unless VERL_OPS_VARLEN_BACKWARD=cudnn): the own SM90 backward
    // (csrc/mla/sm90/mla_sm90_bwd.cu). It reads the
    // forward's output and log-sum-exp as they are (either forward's), writes every dq row and
    // the dk / dv rows of every sequence (zeros where no query sees a key), needs no plan and no
    // host read. Its workspace: dq's fp32 accumulator and lse / D per head and row.
    const Tensor oc = st::aligned_rows(out), gc = st::aligned_rows(grad_out);
    const Tensor lse = st::contiguous(softmax_lse);  // [Hq, Tq]
    Tensor dq = st::empty(q, {s.tq, s.hq, s.dqk}, q.scalar_type());
    Tensor dk = st::empty(k, {s.tk, s.hk, s.dqk}, k.scalar_type());
    Tensor dv = st::empty(v, {s.tk, s.hk, s.dv}, v.scalar_type());
    Tensor accum = st::empty(q, {s.tq, s.hq, s.dqk}, st::kFloat);
    Tensor lse_d = st::empty(q, {s.hq, s.tq, 2}, st::kFloat);
    cuda::Sm90BwdArgs a{};
    const Sm90Inputs in = sm90_inputs(a, q, k, v, cu_seqlens_q, cu_seqlens_kv, s, max_seqlen_q,
                                      max_seqlen_kv, causal, scale,
                                      cuda::sm90_backward_workspace_ints(s.batch));
    a.out = oc.data_ptr();
    a.dout = gc.data_ptr();
    a.lse = st::ptr<float>(lse);
    a.lse_row_stride = 1;
    a.lse_head_stride = s.tq;
    a.dq = dq.data_ptr();
    a.dk = {dk.data_ptr(), s.hk * s.dqk, s.dqk};
    a.dk_pe = {static_cast<char*>(dk.data_ptr()) + 128 * 2, s.hk * s.dqk, s.dqk};
    a.dv = {dv.data_ptr(), s.hk * s.dv, s.dv};
    a.dq_accum = st::ptr<float>(accum);
    a.lse_d = reinterpret_cast<float2*>(st::ptr<float>(lse_d));
    st::check_launch(op, cuda::launch_sm90_backward(a, st::current_stream(q)));
    return {dq, dk, dv};
  }
  const VarlenCall c = prepare_varlen(op, true, q, cu_seqlens_q, cu_seqlens_kv, s, max_seqlen_q,
                                      max_seqlen_kv, causal, scale);
  const Tensor qc = st::aligned_rows(q), kc = st::aligned_rows(k), vc = st::aligned_rows(v);
  const Tensor oc = st::aligned_rows(out), gc = st::aligned_rows(grad_out);
  const Tensor stats = st::aligned_rows(torch::stable::transpose(softmax_lse, 0, 1));  // [Tq, Hq]
  Tensor dq = st::empty(q, {s.tq, s.hq, s.dqk}, q.scalar_type());
  Tensor dk = st::empty(k, {s.tk, s.hk, s.dqk}, k.scalar_type());
  Tensor dv = st::empty(v, {s.tk, s.hk, s.dv}, v.scalar_type());
  const auto [ws, ws_ptr] = varlen_workspace(c, q);
  cuda::VarlenBackwardArgs a;
  a.q = qc.data_ptr();
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.out = oc.data_ptr();
  a.grad_out = gc.data_ptr();
  a.stats = st::ptr<float>(stats);
  a.grad_q = dq.data_ptr();
  a.grad_k = dk.data_ptr();
  a.grad_v = dv.data_ptr();
  a.meta = c.meta;
  cuda::varlen_backward(op, c.plan.get(), a, ws_ptr, c.stream);
  if (!c.self_attention) {
    st::check_launch(op, cuda::launch_varlen_empty_rows_backward(
                             st::ptr<int32_t>(c.cu_q), st::ptr<int32_t>(c.cu_kv), s.batch, causal,
                             s.tq, s.tk, s.hq, s.hk, s.dqk, s.dv, dq.data_ptr(), dk.data_ptr(),
                             dv.data_ptr(), c.stream));
  }
  return {dq, dk, dv};
}

#else  // !VERL_OPS_WITH_CUDNN_FE

[[noreturn]] void varlen_missing(const char* op) {
  st::fail(op,
           ": backend='varlen' is not in this build of verl_ops: it is compiled only when the cuDNN "
           "frontend headers are found at build time (pip install nvidia-cudnn-frontend, then "
           "rebuild verl_ops, e.g. pip install --no-build-isolation -e .; setup.py prints whether it "
           "found them). Use backend='auto', 'padded' or 'native' meanwhile");
}

std::tuple<Tensor, Tensor> varlen_forward(const char* op, const Tensor&, const Tensor&,
                                          const Tensor&, const Tensor&, const Tensor&,
                                          const MlaSizes&, int64_t, int64_t, bool, double) {
  varlen_missing(op);
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward(const char* op, const Tensor&, const Tensor&,
                                                   const Tensor&, const Tensor&, const Tensor&,
                                                   const Tensor&, const Tensor&, const Tensor&,
                                                   const MlaSizes&, int64_t, int64_t, bool,
                                                   double) {
  varlen_missing(op);
}

#endif  // VERL_OPS_WITH_CUDNN_FE

}  // namespace

std::tuple<Tensor, Tensor> mla_forward_padded_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, int64_t backend) {
  constexpr const char* op = "mla_forward_padded";
  const CudaCall call(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                      causal, softmax_scale, backend, nullptr);
  const MlaSizes& s = call.c.s;
  const double scale = call.c.scale;
  if (s.tq == 0 || s.tk == 0 || s.batch == 0) {
    // No query, or nothing to attend to: zero output, +inf log-sum-exp (FlashAttention's value
    // for a row without keys).
    Tensor out = mla_alloc_rows(call.c.backend, q, s.tq, s.hq, s.dv, s.dqk, q.scalar_type());
    torch::stable::zero_(out);
    Tensor lse = st::empty(q, {s.hq, s.tq}, mla_lse_dtype(q));
    torch::stable::fill_(lse, kInf);
    return {out, lse};
  }
  if (call.c.backend == MlaBackend::kReference) {
    return reference_forward(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, s, causal, scale);
  }
  if (call.c.backend == MlaBackend::kVarlen) {
    return varlen_forward(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, s, max_seqlen_q,
                          max_seqlen_kv, causal, scale);
  }
  const Tensor qc = st::contiguous(q), kc = st::contiguous(k);
  const Tensor cu_q = st::contiguous(cu_seqlens_q), cu_kv = st::contiguous(cu_seqlens_kv);
  if (call.c.backend == MlaBackend::kPadded) {
    check_flash_head_dim(op, s.dqk);
    const auto [fq, fkv] = flash_offsets(op, cu_q, cu_kv, s, st::current_stream(q));
    const Tensor vp = s.dv == s.dqk ? st::contiguous(v) : pad_last_dim(op, {v}, s.dqk)[0];
    // (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    //  return_debug_mask, *, scale, window_size_left, window_size_right, seqused_k,
    //  alibi_slopes) -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)
    const auto r = st::call_aten<15>(
        "aten::_flash_attention_forward", "", qc, kc, vp, std::optional<Tensor>(fq),
        std::optional<Tensor>(fkv), max_seqlen_q, max_seqlen_kv, 0.0, causal, false,
        std::optional<double>(scale), std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    std::vector<Tensor> res = tensor_returns(r, {0, 1, 2, 3, 4});
    Tensor o = res[0];
    return {s.dv == s.dqk ? st::contiguous(o) : torch::stable::narrow(o, 2, 0, s.dv), res[1]};
  }
  const int64_t batch = s.batch, sq = max_seqlen_q, skv = max_seqlen_kv;
  if (!uniform_batch(s, max_seqlen_q, max_seqlen_kv)) {
    // Ragged causal self-attention (resolve_mla_backend checked it): right-padded dense copies.
    const DenseRows d = dense_rows(op, cu_q, batch, sq);
    const auto [o4, lse4] = cudnn_forward(to_dense(op, d, qc), to_dense(op, d, kc),
                                          to_dense(op, d, v), causal, scale);
    // [B, H, S] -> [B * S, H] rows -> the valid rows [Tq, H] -> [H, Tq].
    const Tensor lse_bhs = reshape(op, lse4, {batch, s.hq, sq});
    const Tensor lse_rows =
        reshape(op, torch::stable::transpose(lse_bhs, 1, 2), {batch * sq, s.hq});
    const Tensor lse = postprocess_thd_cuda(st::to_dtype(lse_rows, st::kFloat), d.cu, d.cu_dense,
                                            s.tq, 1, 0, kContiguousLayout, false, std::nullopt);
    return {from_dense(d, o4, s.tq), st::contiguous(torch::stable::transpose(lse, 0, 1))};
  }
  const auto [o4, lse4] =
      cudnn_forward(as_bhsd(op, qc, batch, sq), as_bhsd(op, kc, batch, skv),
                    as_bhsd(op, st::contiguous(v), batch, skv), causal, scale);
  // cuDNN's log-sum-exp is [B, H, S(, 1)]; ours is [H, T].
  const Tensor lse = reshape(
      op, torch::stable::transpose(reshape(op, lse4, {batch, s.hq, sq}), 0, 1), {s.hq, s.tq});
  return {from_bhsd(o4), st::to_dtype(lse, st::kFloat)};
}

std::tuple<Tensor, Tensor, Tensor> mla_backward_padded_cuda(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& softmax_lse, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal, std::optional<double> softmax_scale,
    int64_t backend) {
  constexpr const char* op = "mla_backward_padded";
  const MlaBackwardInputs bwd{grad_out, out, softmax_lse};
  const CudaCall call(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                      causal, softmax_scale, backend, &bwd);
  const MlaSizes& s = call.c.s;
  const double scale = call.c.scale;
  if (s.tq == 0 || s.tk == 0 || s.batch == 0) {
    Tensor grad_v = mla_alloc_rows(call.c.backend, v, s.tk, s.hk, s.dv, s.dqk, v.scalar_type());
    torch::stable::zero_(grad_v);
    return {st::zeros(q, {s.tq, s.hq, s.dqk}, q.scalar_type()),
            st::zeros(k, {s.tk, s.hk, s.dqk}, k.scalar_type()), grad_v};
  }
  if (call.c.backend == MlaBackend::kReference) {
    return reference_backward(op, grad_out, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv,
                              s, causal, scale);
  }
  if (call.c.backend == MlaBackend::kVarlen) {
    return varlen_backward(op, grad_out, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_kv, s,
                           max_seqlen_q, max_seqlen_kv, causal, scale);
  }
  const Tensor qc = st::contiguous(q), kc = st::contiguous(k);
  const Tensor cu_q = st::contiguous(cu_seqlens_q), cu_kv = st::contiguous(cu_seqlens_kv);
  if (call.c.backend == MlaBackend::kPadded) {
    check_flash_head_dim(op, s.dqk);
    const auto [fq, fkv] = flash_offsets(op, cu_q, cu_kv, s, st::current_stream(q));
    Tensor vp, dout, out_full;
    if (s.dv == s.dqk) {
      vp = st::contiguous(v);
      dout = st::contiguous(grad_out);
      out_full = st::contiguous(out);
    } else {
      const std::optional<Tensor> recovered = padded_out_of_view(out, s.dqk);
      const std::vector<Tensor> padded = recovered.has_value()
                                             ? pad_last_dim(op, {v, grad_out}, s.dqk)
                                             : pad_last_dim(op, {v, grad_out, out}, s.dqk);
      vp = padded[0];
      dout = padded[1];
      out_full = recovered.has_value() ? *recovered : padded[2];
    }
    // (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    //  dropout_p, is_causal, rng_state, unused, *, scale, window_size_left, window_size_right)
    const auto r = st::call_aten<17>(
        "aten::_flash_attention_backward", "", dout, qc, kc, vp, out_full,
        st::contiguous(softmax_lse), fq, fkv, max_seqlen_q, max_seqlen_kv, 0.0, causal,
        flash_rng_state(q), flash_unused(q), std::optional<double>(scale), std::nullopt,
        std::nullopt);
    std::vector<Tensor> grads = tensor_returns(r, {0, 1, 2});
    Tensor dvp = grads[2];
    return {st::contiguous(grads[0]), st::contiguous(grads[1]),
            s.dv == s.dqk ? st::contiguous(dvp) : torch::stable::narrow(dvp, 2, 0, s.dv)};
  }
  const int64_t batch = s.batch, sq = max_seqlen_q, skv = max_seqlen_kv;
  if (!uniform_batch(s, max_seqlen_q, max_seqlen_kv)) {
    // Ragged causal self-attention: padding query rows get a zero output gradient and an
    // infinite log-sum-exp (probabilities exactly 0), so they add nothing to any gradient.
    const DenseRows d = dense_rows(op, cu_q, batch, sq);
    const auto [lse_packed, positions] =
        pack_dense(d, st::contiguous(torch::stable::transpose(softmax_lse, 0, 1)));  // [B*S, H]
    // lengths [B, 1]; valid [B, S, 1]: the row's position inside its sequence < its length.
    const Tensor lengths = st::unsqueeze(
        st::to_tensor(st::call_aten("aten::diff", "", cu_q, int64_t{1}, int64_t{0}, std::nullopt,
                                    std::nullopt)[0]),
        1);
    const Tensor valid = st::unsqueeze(
        st::to_tensor(st::call_aten("aten::lt", "Tensor", reshape(op, positions, {batch, sq}),
                                    lengths)[0]),
        2);
    Tensor inf = st::empty(softmax_lse, {}, softmax_lse.scalar_type());
    torch::stable::fill_(inf, kInf);
    const Tensor lse_bsh = st::to_tensor(st::call_aten(
        "aten::where", "self", valid, reshape(op, lse_packed, {batch, sq, s.hq}), inf)[0]);
    const Tensor lse4 =
        st::unsqueeze(st::contiguous(torch::stable::transpose(lse_bsh, 1, 2)), 3);
    const std::vector<Tensor> g =
        cudnn_backward(to_dense(op, d, grad_out), to_dense(op, d, qc), to_dense(op, d, kc),
                       to_dense(op, d, v), to_dense(op, d, out), lse4, sq, sq, causal, scale);
    return {from_dense(d, g[0], s.tq), from_dense(d, g[1], s.tk), from_dense(d, g[2], s.tk)};
  }
  const Tensor lse_hbs = reshape(op, softmax_lse, {s.hq, batch, sq});
  const Tensor lse4 =
      st::unsqueeze(st::contiguous(torch::stable::transpose(lse_hbs, 0, 1)), 3);
  const std::vector<Tensor> g = cudnn_backward(
      as_bhsd(op, st::contiguous(grad_out), batch, sq), as_bhsd(op, qc, batch, sq),
      as_bhsd(op, kc, batch, skv), as_bhsd(op, st::contiguous(v), batch, skv),
      as_bhsd(op, st::contiguous(out), batch, sq), lse4, sq, skv, causal, scale);
  return {from_bhsd(g[0]), from_bhsd(g[1]), from_bhsd(g[2])};
}

}  // namespace ops
}  // namespace verl_ops
