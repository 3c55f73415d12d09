#include "mla_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "cpu/mla_kernels.h"
#ifdef VERL_OPS_WITH_CUDNN_FE
#include "cudnn/mla_cudnn_varlen.h"
#include "sm90/mla_sm90_bwd.h"
#include "sm90/mla_sm90_fwd.h"
#endif

namespace verl_ops {
namespace ops {

namespace {

// c10::isFloatingType (the float8 types pass here and are rejected by the device dtype check).
bool is_floating_point(st::ScalarType t) {
  using S = st::ScalarType;
  return t == S::Half || t == S::BFloat16 || t == S::Float || t == S::Double ||
         t == S::Float8_e5m2 || t == S::Float8_e4m3fn || t == S::Float8_e5m2fnuz ||
         t == S::Float8_e4m3fnuz || t == S::Float8_e8m0fnu;
}

void check_float_tensor(const char* op, const char* name, const Tensor& t) {
  VERL_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D [T, H, D], got ", t.dim(), " dims");
  VERL_CHECK(is_floating_point(t.scalar_type()), op, ": ", name, " must be floating point, got ",
             st::dtype_name(t.scalar_type()));
}

void check_offsets(const char* op, const char* name, const Tensor& cu, const Tensor& q) {
  VERL_CHECK(cu.scalar_type() == st::kInt, op, ": ", name, " must be int32, got ",
             st::dtype_name(cu.scalar_type()));
  VERL_CHECK(cu.dim() == 1, op, ": ", name, " must be 1-D [B + 1], got ", cu.dim(), " dims");
  VERL_CHECK(st::same_device(cu, q), op, ": ", name, " is on ", st::device_of(cu),
             " but q is on another device: ", st::device_of(q));
}

// Host-side consistency of offsets with the data (CPU tensors only: a read of device memory
// here would be a host synchronisation; FlashAttention does not check them either).
void check_host_offsets(const char* op, const char* name, const Tensor& cu, int64_t rows,
                        int64_t max_seqlen, const char* max_name) {
  const Tensor c = st::contiguous(cu);
  const int32_t* p = st::ptr<int32_t>(c);
  const int64_t b = c.size(0) - 1;
  VERL_CHECK(p[0] == 0, op, ": ", name, " must start at 0, got ", p[0]);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = static_cast<int64_t>(p[i + 1]) - p[i];
    VERL_CHECK(len >= 0, op, ": ", name, " must be non-decreasing, got ", p[i], " then ", p[i + 1],
               " at index ", i);
    VERL_CHECK(len <= max_seqlen, op, ": sequence ", i, " has ", len, " tokens, more than ",
               max_name, "=", max_seqlen);
  }
  VERL_CHECK(static_cast<int64_t>(p[b]) == rows, op, ": ", name, "[-1]=", p[b],
             " must equal the number of rows ", rows);
}

// Shapes where the native (unpadded) path measured faster than the padded one; "auto" uses it
// there (benchmarks/LOG.md, H200, bf16, causal 192/128: native 2.1-2.5x faster forward and
// 1.8-2.1x forward+backward from 16 x 1024 tokens x 16 heads up; at 2 x 1024 x 16 the backward
// is host-bound and the padded path wins). verl_ops/_fake.py (_AUTO_NATIVE) mirrors this table.
struct AutoNativeRule {
  int64_t dqk, dv;
  int64_t min_seqlen;       // uniform batches whose sequences are at least this long
  int64_t min_rows_heads;   // and at least this many query rows x query heads
};
constexpr std::array<AutoNativeRule, 1> kAutoNative{{{192, 128, 1024, 16 * 1024 * 16}}};

// Head dims where "auto" sends batches that are not uniform (ragged lengths, or q / kv lengths
// that differ) to the varlen backend, on devices where varlen_auto holds (the build has the
// backend and the device is one it was measured on: Hopper). The padded path pays for the V
// padding and torch's FlashAttention-2, the native path for dense padding of every sequence to
// max_seqlen; varlen pays for neither (FlashAttention-4's varlen kernel, the same kind
// of kernel, ran 2.5x the padded path on RL-ragged batches). min_rows_heads: query rows x query
// heads below which the fixed cost of a cuDNN launch sequence is not worth it (to be set from
// GPU measurements; 0 = every ragged batch). verl_ops/_fake.py (_AUTO_VARLEN) mirrors this table.
struct AutoVarlenRule {
  int64_t dqk, dv;
  int64_t min_rows_heads;
};
constexpr std::array<AutoVarlenRule, 5> kAutoVarlen{
    {{192, 128, 0}, {64, 64, 0}, {128, 128, 0}, {192, 192, 0}, {256, 256, 0}}};

}  // namespace

MlaSizes check_mla_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                        int64_t max_seqlen_q, int64_t max_seqlen_kv,
                        const std::optional<double>& softmax_scale) {
  check_float_tensor(op, "q", q);
  check_float_tensor(op, "k", k);
  check_float_tensor(op, "v", v);
  VERL_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
             ": q, k and v must have one dtype, got q ", st::dtype_name(q.scalar_type()), ", k ",
             st::dtype_name(k.scalar_type()), ", v ", st::dtype_name(v.scalar_type()));
  VERL_CHECK(st::same_device(k, q) && st::same_device(v, q), op,
             ": q, k and v must be on one device, got q on ", st::device_of(q), ", k on ",
             st::device_of(k), ", v on ", st::device_of(v));
  check_offsets(op, "cu_seqlens_q", cu_seqlens_q, q);
  check_offsets(op, "cu_seqlens_kv", cu_seqlens_kv, q);
  const MlaSizes s{q.size(0), k.size(0), q.size(1), k.size(1),
                   q.size(2), v.size(2), cu_seqlens_q.size(0) - 1};
  VERL_CHECK(cu_seqlens_q.size(0) >= 1, op, ": cu_seqlens_q must have B + 1 >= 1 entries");
  VERL_CHECK(cu_seqlens_kv.size(0) == cu_seqlens_q.size(0), op,
             ": cu_seqlens_kv must have as many entries as cu_seqlens_q (", cu_seqlens_q.size(0),
             "), got ", cu_seqlens_kv.size(0));
  VERL_CHECK(k.size(2) == s.dqk, op, ": k must have q's head dim ", s.dqk, ", got ", k.size(2));
  VERL_CHECK(s.dv <= s.dqk, op, ": v's head dim (Dv=", s.dv,
             ") must be <= the q/k head dim (Dqk=", s.dqk, ")");
  VERL_CHECK(s.dv >= 1, op, ": v's head dim must be >= 1");
  VERL_CHECK(v.size(0) == s.tk, op, ": k and v must have the same number of rows, got ", s.tk,
             " and ", v.size(0));
  VERL_CHECK(v.size(1) == s.hk, op, ": k and v must have the same number of heads, got ", s.hk,
             " and ", v.size(1));
  VERL_CHECK(s.hk >= 1, op, ": k must have at least one head");
  VERL_CHECK(s.hq % s.hk == 0, op, ": the number of q heads (", s.hq,
             ") must be a multiple of the number of k/v heads (", s.hk, ")");
  // The attention kernels hold sequence lengths in int32.
  st::int32_arg(op, "max_seqlen_q", max_seqlen_q);
  st::int32_arg(op, "max_seqlen_kv", max_seqlen_kv);
  if (softmax_scale.has_value()) {
    VERL_CHECK(std::isfinite(*softmax_scale), op, ": softmax_scale must be finite, got ",
               std::to_string(*softmax_scale));
  }
  return s;
}

void check_mla_backward_args(const char* op, const Tensor& grad_out, const Tensor& out,
                             const Tensor& softmax_lse, const Tensor& q, const MlaSizes& s) {
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"grad_out", grad_out},
                                std::pair<const char*, const Tensor&>{"out", out}}) {
    VERL_CHECK(t.dim() == 3 && t.scalar_type() == q.scalar_type() && st::same_device(t, q), op,
               ": ", name, " must be a 3-D [Tq, Hq, Dv] tensor of q's dtype and device");
    VERL_CHECK(t.size(0) == s.tq && t.size(1) == s.hq && t.size(2) == s.dv, op, ": ", name,
               " must be [Tq, Hq, Dv] = [", s.tq, ", ", s.hq, ", ", s.dv, "]");
  }
  const st::ScalarType lse_dtype = mla_lse_dtype(q);
  VERL_CHECK(softmax_lse.dim() == 2 && softmax_lse.scalar_type() == lse_dtype &&
                 st::same_device(softmax_lse, q),
             op, ": softmax_lse must be a 2-D [Hq, Tq] tensor of dtype ", st::dtype_name(lse_dtype),
             " on q's device");
  VERL_CHECK(softmax_lse.size(0) == s.hq && softmax_lse.size(1) == s.tq, op,
             ": softmax_lse must be [Hq, Tq] = [", s.hq, ", ", s.tq, "]");
}

bool shares_offsets(const Tensor& a, const Tensor& b) {
  if (a.get() == b.get()) return true;
  if (a.data_ptr() != b.data_ptr() || a.scalar_type() != b.scalar_type() || a.dim() != b.dim()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != b.size(d) || a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

MlaBackend resolve_mla_backend(const char* op, int64_t backend, const MlaSizes& s,
                               int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                               bool same_offsets, bool varlen_auto, bool varlen_uniform,
                               bool reference) {
  VERL_CHECK(backend == kMlaBackendAuto || backend == kMlaBackendPadded ||
                 backend == kMlaBackendNative || backend == kMlaBackendVarlen,
             op, ": backend must be 0 (auto), 1 (padded), 2 (native) or 3 (varlen), got ", backend);
  // FlashAttention, cuDNN and the SM90 kernels take float16 / bfloat16 only: float32 / float64 on
  // CUDA (e.g. a float32 model being debugged) run the reference kernels whatever was asked.
  if (reference) return MlaBackend::kReference;
  if (backend == kMlaBackendPadded) return MlaBackend::kPadded;
  // varlen takes every batch shape: ragged, unequal q / kv lengths, grouped heads (head-dim limits
  // are cuDNN's, checked on the device).
  if (backend == kMlaBackendVarlen) return MlaBackend::kVarlen;
  // The native path (cuDNN SDPA, which takes Dv != Dqk) runs dense [B, H, S, D] attention:
  // - a uniform batch (every sequence max_seqlen long; with max_seqlen >= every length,
  //   B * max_seqlen == T holds exactly then) is a zero-copy view of the THD rows;
  // - a ragged batch is copied into right-padded [B, max_seqlen] rows (zeros in the padding).
  //   That is exact for causal self-attention (q and kv share cu_seqlens): a valid query i only
  //   sees keys <= i, all valid; padding queries get zero output gradient and an infinite
  //   log-sum-exp, so they add nothing to dK / dV.
  // Products in __int128: B * max_seqlen of arbitrary int64 arguments must not wrap.
  using Wide = __int128;
  const bool uniform =
      Wide{s.batch} * max_seqlen_q == s.tq && Wide{s.batch} * max_seqlen_kv == s.tk;
  const bool same_heads = s.hq == s.hk;
  const bool same_len = max_seqlen_q == max_seqlen_kv;
  const bool mask_ok = !causal || same_len;
  const bool ragged_ok = causal && same_offsets && same_len && s.tq == s.tk;
  // cuDNN rejects s_q = s_kv = 1; a batch of single tokens is trivial for the padded path.
  if (max_seqlen_q <= 1 && max_seqlen_kv <= 1) return MlaBackend::kPadded;
  if (backend == kMlaBackendAuto && varlen_auto && !uniform) {
    for (const AutoVarlenRule& r : kAutoVarlen) {
      if (s.dqk == r.dqk && s.dv == r.dv && Wide{s.tq} * s.hq >= r.min_rows_heads) {
        return MlaBackend::kVarlen;
      }
    }
  }
  // Uniform batches at MLA's head dims where varlen runs the own SM90 kernels: ahead of native
  // (1.08-1.21x forward, 1.04-1.09x forward+backward, same run) and padded (2x and more) on every
  // uniform batch measured (H200, benchmarks/LOG.md 2026-11-26).
  if (backend == kMlaBackendAuto && varlen_auto && varlen_uniform && uniform && s.dqk == 192 &&
      s.dv == 128) {
    return MlaBackend::kVarlen;
  }
  if (backend == kMlaBackendNative) {
    VERL_CHECK(uniform || ragged_ok, op,
               ": backend='native' needs a uniform batch (every sequence of length max_seqlen, "
               "i.e. B * max_seqlen_q == Tq and B * max_seqlen_kv == Tk) or, for a ragged batch, "
               "causal self-attention with one cu_seqlens tensor for q and kv; use "
               "backend='padded' or 'auto' otherwise");
    VERL_CHECK(same_heads, op, ": backend='native' needs as many k/v heads as q heads");
    VERL_CHECK(mask_ok, op,
               ": backend='native' with causal=True needs max_seqlen_q == max_seqlen_kv");
    return MlaBackend::kNative;
  }
  // Ragged batches pay for the padding rows' attention: at a fill T / (B * max_seqlen) of at
  // least 3/4 the dense work is at most 1/fill^2 < 1.8x the ragged work (Cauchy-Schwarz), below
  // the native path's measured ~2x advantage.
  const bool dense_enough = uniform || Wide{s.tq} * 4 >= Wide{s.batch} * max_seqlen_q * 3;
  if (same_heads && (uniform ? mask_ok : ragged_ok) && dense_enough) {
    for (const AutoNativeRule& r : kAutoNative) {
      if (s.dqk == r.dqk && s.dv == r.dv && max_seqlen_q >= r.min_seqlen &&
          Wide{s.tq} * s.hq >= r.min_rows_heads) {
        return MlaBackend::kNative;
      }
    }
  }
  return MlaBackend::kPadded;
}

st::ScalarType mla_lse_dtype(const Tensor& q) {
  return q.scalar_type() == st::kDouble ? st::kDouble : st::kFloat;
}

double mla_softmax_scale(const std::optional<double>& softmax_scale, int64_t dqk) {
  return softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(dqk));
}

Tensor mla_alloc_rows(MlaBackend backend, const Tensor& like, int64_t rows, int64_t heads,
                      int64_t cols, int64_t full_cols, st::ScalarType dtype) {
  if (backend == MlaBackend::kPadded && cols < full_cols) {
    Tensor buf = st::empty(like, {rows, heads, full_cols}, dtype);
    return torch::stable::narrow(buf, 2, 0, cols);
  }
  return st::empty(like, {rows, heads, cols}, dtype);
}

MlaCall prepare_mla(const char* op, MlaDevice device, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
                    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                    const std::optional<double>& softmax_scale, int64_t backend,
                    const MlaBackwardInputs* backward) {
  MlaCall c;
  c.s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       softmax_scale);
  const st::ScalarType dt = q.scalar_type();
  if (device == MlaDevice::kCuda) {
    VERL_CHECK(dt == st::kFloat || dt == st::kDouble || dt == st::kHalf || dt == st::kBFloat16, op,
               ": q must be float16, bfloat16, float32 or float64 on CUDA, got ",
               st::dtype_name(dt));
  } else {
    VERL_CHECK(dt == st::kFloat || dt == st::kDouble || dt == st::kHalf || dt == st::kBFloat16, op,
               ": q must be float16, bfloat16, float32 or float64 on the CPU, got ",
               st::dtype_name(dt));
  }
  if (backward != nullptr) {
    check_mla_backward_args(op, backward->grad_out, backward->out, backward->softmax_lse, q, c.s);
  }
  // auto may pick varlen only on CUDA devices it was measured on, in builds that have it; and
  // send uniform 192 / 128 batches there too where varlen runs the own SM90 kernels (the flags
  // mla_cache_info reports; verl_ops/_fake.py reads them from it).
  bool varlen_auto = false, varlen_uniform = false;
#ifdef VERL_OPS_WITH_CUDNN_FE
  varlen_auto = device == MlaDevice::kCuda && cuda::varlen_auto_device(q.get_device_index()) &&
                cuda::varlen_cudnn_version() >= cuda::kVarlenAutoMinCudnn;
  varlen_uniform = varlen_auto && cuda::sm90_forward_enabled() && cuda::sm90_backward_enabled();
#endif
  const bool reference = device == MlaDevice::kCuda && (dt == st::kFloat || dt == st::kDouble);
  c.backend = resolve_mla_backend(op, backend, c.s, max_seqlen_q, max_seqlen_kv, causal,
                                  shares_offsets(cu_seqlens_q, cu_seqlens_kv), varlen_auto,
                                  varlen_uniform, reference);
  c.scale = mla_softmax_scale(softmax_scale, c.s.dqk);
  return c;
}

Tensor mla_cache_info(const Tensor& like, int64_t capacity) {
  VERL_CHECK(like.is_cpu(), "mla_cache_info: like must be a CPU tensor, got one on ",
             st::device_of(like));
  VERL_CHECK(capacity >= -1, "mla_cache_info: capacity must be -1 (unchanged), 0 (no limit) or a "
             "number of plans, got ", capacity);
  Tensor info = st::zeros(like, {kMlaCacheInfoFields}, st::kLong);
#ifdef VERL_OPS_WITH_CUDNN_FE
  if (capacity >= 0) cuda::varlen_set_cache_capacity(capacity);
  const cuda::VarlenCacheStats s = cuda::varlen_cache_stats();
  int64_t* p = st::ptr<int64_t>(info);
  p[0] = 1;
  p[1] = s.size;
  p[2] = s.hits;
  p[3] = s.misses;
  p[4] = s.builds;
  p[5] = s.failures;
  p[6] = s.evictions;
  p[7] = s.capacity;
  p[8] = s.failed_buckets;
  p[9] = cuda::varlen_cudnn_version();
  p[10] = cuda::sm90_forward_enabled() ? 1 : 0;
  p[11] = cuda::sm90_backward_enabled() ? 1 : 0;
#endif
  return info;
}

// ---------------------------------------------------------------------------------------------
// CPU: the reference math (float32 accumulation; float64 for float64 inputs). The stable ABI has
// no parallel_for at 2.9, so the work items run serially.

namespace {

struct CpuCall {
  MlaCall call;
  cpu::MlaProblem problem;
  Tensor cu_q, cu_kv;
  st::ScalarType acc;
};

CpuCall prepare_cpu(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv, int64_t max_seqlen_q,
                    int64_t max_seqlen_kv, bool causal, const std::optional<double>& softmax_scale,
                    int64_t backend, const MlaBackwardInputs* backward) {
  CpuCall c{prepare_mla(op, MlaDevice::kCpu, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                        max_seqlen_kv, causal, softmax_scale, backend, backward),
            {}, st::contiguous(cu_seqlens_q), st::contiguous(cu_seqlens_kv), mla_lse_dtype(q)};
  check_host_offsets(op, "cu_seqlens_q", c.cu_q, q.size(0), max_seqlen_q, "max_seqlen_q");
  check_host_offsets(op, "cu_seqlens_kv", c.cu_kv, k.size(0), max_seqlen_kv, "max_seqlen_kv");
  const MlaSizes& s = c.call.s;
  c.problem = cpu::MlaProblem{st::ptr<int32_t>(c.cu_q), st::ptr<int32_t>(c.cu_kv), s.batch, s.hq,
                              s.hk, s.dqk, s.dv, causal, c.call.scale};
  return c;
}

// A contiguous copy in the accumulation dtype (the tensor itself when it already is one).
Tensor to_acc(const Tensor& t, st::ScalarType acc) {
  return st::contiguous(st::to_dtype(t, acc));
}

}  // namespace

std::tuple<Tensor, Tensor> mla_forward_padded_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
    const Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, int64_t backend) {
  constexpr const char* op = "mla_forward_padded";
  const CpuCall c = prepare_cpu(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                max_seqlen_kv, causal, softmax_scale, backend, nullptr);
  const cpu::MlaProblem& p = c.problem;
  const Tensor qa = to_acc(q, c.acc), ka = to_acc(k, c.acc), va = to_acc(v, c.acc);
  const Tensor out_acc = st::empty(q, {q.size(0), p.hq, p.dv}, c.acc);
  const Tensor lse = st::empty(q, {p.hq, q.size(0)}, c.acc);
  const int64_t items = p.num_seqs * p.hq;
  if (c.acc == st::kDouble) {
    cpu::mla_forward_items<double>(p, st::ptr<double>(qa), st::ptr<double>(ka),
                                   st::ptr<double>(va), st::ptr<double>(out_acc),
                                   st::ptr<double>(lse), 0, items);
  } else {
    cpu::mla_forward_items<float>(p, st::ptr<float>(qa), st::ptr<float>(ka), st::ptr<float>(va),
                                  st::ptr<float>(out_acc), st::ptr<float>(lse), 0, items);
  }
  Tensor out = mla_alloc_rows(c.call.backend, q, q.size(0), p.hq, p.dv, p.dqk, q.scalar_type());
  st::copy_into(out, out_acc);
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> mla_backward_padded_cpu(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& softmax_lse, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_kv,
    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal, std::optional<double> softmax_scale,
    int64_t backend) {
  constexpr const char* op = "mla_backward_padded";
  const MlaBackwardInputs bwd{grad_out, out, softmax_lse};
  const CpuCall c = prepare_cpu(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                max_seqlen_kv, causal, softmax_scale, backend, &bwd);
  const cpu::MlaProblem& p = c.problem;
  const Tensor qa = to_acc(q, c.acc), ka = to_acc(k, c.acc), va = to_acc(v, c.acc),
               oa = to_acc(out, c.acc), ga = to_acc(grad_out, c.acc),
               la = to_acc(softmax_lse, c.acc);
  const Tensor dq = st::zeros(qa, st::sizes_of(qa), c.acc);
  const Tensor dk = st::zeros(ka, st::sizes_of(ka), c.acc);
  const Tensor dv = st::zeros(va, st::sizes_of(va), c.acc);
  const int64_t items = p.num_seqs * p.hk;
  if (c.acc == st::kDouble) {
    cpu::mla_backward_items<double>(p, st::ptr<double>(qa), st::ptr<double>(ka),
                                    st::ptr<double>(va), st::ptr<double>(oa),
                                    st::ptr<double>(ga), st::ptr<double>(la),
                                    st::ptr<double>(dq), st::ptr<double>(dk),
                                    st::ptr<double>(dv), 0, items);
  } else {
    cpu::mla_backward_items<float>(p, st::ptr<float>(qa), st::ptr<float>(ka), st::ptr<float>(va),
                                   st::ptr<float>(oa), st::ptr<float>(ga), st::ptr<float>(la),
                                   st::ptr<float>(dq), st::ptr<float>(dk), st::ptr<float>(dv), 0,
                                   items);
  }
  Tensor grad_v = mla_alloc_rows(c.call.backend, v, k.size(0), p.hk, p.dv, p.dqk, v.scalar_type());
  st::copy_into(grad_v, dv);
  // dq / dk are fresh contiguous tensors: converted (a contiguous copy) unless q is the
  // accumulation dtype already.
  return {st::to_dtype(dq, q.scalar_type()), st::to_dtype(dk, k.scalar_type()), grad_v};
}

}  // namespace ops
}  // namespace verl_ops
