#include "mla_ops.h"

#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "../cpu/mla_kernels.h"

namespace verl_ops {
namespace ops {

namespace {

std::string msg(const char* op, const std::string& rest) { return std::string(op) + ": " + rest; }

std::string sym(const c10::SymInt& x) { return c10::str(x); }

void check_float_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3, msg(op, std::string(name) + " must be 3-D [T, H, D], got " +
                                        std::to_string(t.dim()) + " dims"));
  TORCH_CHECK(t.is_floating_point(),
              msg(op, std::string(name) + " must be floating point, got " + c10::str(t.scalar_type())));
}

void check_offsets(const char* op, const char* name, const at::Tensor& cu, const at::Tensor& q) {
  TORCH_CHECK(cu.scalar_type() == at::kInt,
              msg(op, std::string(name) + " must be int32, got " + c10::str(cu.scalar_type())));
  TORCH_CHECK(cu.dim() == 1, msg(op, std::string(name) + " must be 1-D [B + 1], got " +
                                         std::to_string(cu.dim()) + " dims"));
  TORCH_CHECK(cu.device() == q.device(),
              msg(op, std::string(name) + " is on " + c10::str(cu.device()) +
                          " but q is on another device: " + c10::str(q.device())));
}

// Host-side consistency of offsets with the data (CPU tensors only: a read of device memory
// here would be a host synchronisation; FlashAttention does not check them either).
void check_host_offsets(const char* op, const char* name, const at::Tensor& cu, int64_t rows,
                        int64_t max_seqlen, const char* max_name) {
  const at::Tensor c = cu.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  const int64_t b = c.size(0) - 1;
  TORCH_CHECK(p[0] == 0, msg(op, std::string(name) + " must start at 0, got " + std::to_string(p[0])));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = static_cast<int64_t>(p[i + 1]) - p[i];
    TORCH_CHECK(len >= 0, msg(op, std::string(name) + " must be non-decreasing, got " +
                                      std::to_string(p[i]) + " then " + std::to_string(p[i + 1]) +
                                      " at index " + std::to_string(i)));
    TORCH_CHECK(len <= max_seqlen,
                msg(op, "sequence " + std::to_string(i) + " has " + std::to_string(len) +
                            " tokens, more than " + max_name + "=" + std::to_string(max_seqlen)));
  }
  TORCH_CHECK(static_cast<int64_t>(p[b]) == rows,
              msg(op, std::string(name) + "[-1]=" + std::to_string(p[b]) +
                          " must equal the number of rows " + std::to_string(rows)));
}

bool sym_true(const c10::SymBool& b) { return b.guard_bool(__FILE__, __LINE__); }

// Shapes where the native (unpadded) path measured faster than the padded one; "auto" uses it
// there (benchmarks/RESULTS.md, H200, bf16, causal 192/128: native 2.1-2.5x faster forward and
// 1.8-2.1x forward+backward from 16 x 1024 tokens x 16 heads up; at 2 x 1024 x 16 the backward
// is host-bound and the padded path wins).
struct AutoNativeRule {
  int64_t dqk, dv;
  int64_t min_seqlen;       // uniform batches whose sequences are at least this long
  int64_t min_rows_heads;   // and at least this many query rows x query heads
};
constexpr std::array<AutoNativeRule, 1> kAutoNative{{{192, 128, 1024, 16 * 1024 * 16}}};

}  // namespace

MlaSizes check_mla_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                        const at::Tensor& cu_seqlens_kv, const c10::SymInt& max_seqlen_q,
                        const c10::SymInt& max_seqlen_kv,
                        const std::optional<double>& softmax_scale) {
  check_float_tensor(op, "q", q);
  check_float_tensor(op, "k", k);
  check_float_tensor(op, "v", v);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              msg(op, "q, k and v must have one dtype, got q " + c10::str(q.scalar_type()) +
                          ", k " + c10::str(k.scalar_type()) + ", v " + c10::str(v.scalar_type())));
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              msg(op, "q, k and v must be on one device, got q on " + c10::str(q.device()) +
                          ", k on " + c10::str(k.device()) + ", v on " + c10::str(v.device())));
  check_offsets(op, "cu_seqlens_q", cu_seqlens_q, q);
  check_offsets(op, "cu_seqlens_kv", cu_seqlens_kv, q);
  MlaSizes s{q.sym_size(0), k.sym_size(0), q.sym_size(1), k.sym_size(1),
             q.sym_size(2), v.sym_size(2), cu_seqlens_q.sym_size(0) - 1};
  TORCH_SYM_CHECK(cu_seqlens_q.sym_size(0).sym_ge(1),
                  msg(op, "cu_seqlens_q must have B + 1 >= 1 entries"));
  TORCH_SYM_CHECK(cu_seqlens_kv.sym_size(0).sym_eq(cu_seqlens_q.sym_size(0)),
                  msg(op, "cu_seqlens_kv must have as many entries as cu_seqlens_q (" +
                              sym(cu_seqlens_q.sym_size(0)) + "), got " +
                              sym(cu_seqlens_kv.sym_size(0))));
  TORCH_SYM_CHECK(k.sym_size(2).sym_eq(s.dqk),
                  msg(op, "k must have q's head dim " + sym(s.dqk) + ", got " + sym(k.sym_size(2))));
  TORCH_SYM_CHECK(s.dv.sym_le(s.dqk),
                  msg(op, "v's head dim (Dv=" + sym(s.dv) + ") must be <= the q/k head dim (Dqk=" +
                              sym(s.dqk) + ")"));
  TORCH_SYM_CHECK(s.dv.sym_ge(1), msg(op, "v's head dim must be >= 1"));
  TORCH_SYM_CHECK(v.sym_size(0).sym_eq(s.tk),
                  msg(op, "k and v must have the same number of rows, got " + sym(s.tk) + " and " +
                              sym(v.sym_size(0))));
  TORCH_SYM_CHECK(v.sym_size(1).sym_eq(s.hk),
                  msg(op, "k and v must have the same number of heads, got " + sym(s.hk) + " and " +
                              sym(v.sym_size(1))));
  TORCH_SYM_CHECK(s.hk.sym_ge(1), msg(op, "k must have at least one head"));
  TORCH_SYM_CHECK((s.hq % s.hk).sym_eq(0),
                  msg(op, "the number of q heads (" + sym(s.hq) +
                              ") must be a multiple of the number of k/v heads (" + sym(s.hk) + ")"));
  TORCH_SYM_CHECK(max_seqlen_q.sym_ge(0), msg(op, "max_seqlen_q must be >= 0, got " + sym(max_seqlen_q)));
  TORCH_SYM_CHECK(max_seqlen_kv.sym_ge(0),
                  msg(op, "max_seqlen_kv must be >= 0, got " + sym(max_seqlen_kv)));
  if (softmax_scale.has_value()) {
    TORCH_CHECK(std::isfinite(*softmax_scale),
                msg(op, "softmax_scale must be finite, got " + std::to_string(*softmax_scale)));
  }
  return s;
}

void check_mla_backward_args(const char* op, const at::Tensor& grad_out, const at::Tensor& out,
                             const at::Tensor& softmax_lse, const at::Tensor& q, const MlaSizes& s) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"grad_out", grad_out},
                                std::pair<const char*, const at::Tensor&>{"out", out}}) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == q.scalar_type() && t.device() == q.device(),
                msg(op, std::string(name) + " must be a 3-D [Tq, Hq, Dv] tensor of q's dtype and device"));
    TORCH_SYM_CHECK(t.sym_size(0).sym_eq(s.tq) & t.sym_size(1).sym_eq(s.hq) & t.sym_size(2).sym_eq(s.dv),
                    msg(op, std::string(name) + " must be [Tq, Hq, Dv] = [" + sym(s.tq) + ", " +
                                sym(s.hq) + ", " + sym(s.dv) + "]"));
  }
  const auto lse_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(softmax_lse.dim() == 2 && softmax_lse.scalar_type() == lse_dtype &&
                  softmax_lse.device() == q.device(),
              msg(op, "softmax_lse must be a 2-D [Hq, Tq] tensor of dtype " + c10::str(lse_dtype) +
                          " on q's device"));
  TORCH_SYM_CHECK(softmax_lse.sym_size(0).sym_eq(s.hq) & softmax_lse.sym_size(1).sym_eq(s.tq),
                  msg(op, "softmax_lse must be [Hq, Tq] = [" + sym(s.hq) + ", " + sym(s.tq) + "]"));
}

bool shares_offsets(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_same(b)) return true;
  if (!a.has_storage() || !b.has_storage() || !a.storage().is_alias_of(b.storage())) return false;
  return a.sym_storage_offset() == b.sym_storage_offset() && a.sym_sizes() == b.sym_sizes() &&
         a.sym_strides() == b.sym_strides() && a.scalar_type() == b.scalar_type();
}

MlaBackend resolve_mla_backend(const char* op, const std::string& backend, const MlaSizes& s,
                               const c10::SymInt& max_seqlen_q, const c10::SymInt& max_seqlen_kv,
                               bool causal, bool same_offsets) {
  TORCH_CHECK(backend == "auto" || backend == "padded" || backend == "native",
              msg(op, "backend must be 'auto', 'padded' or 'native', got '" + backend + "'"));
  if (backend == "padded") return MlaBackend::kPadded;
  // The native path (cuDNN SDPA, which takes Dv != Dqk) runs dense [B, H, S, D] attention:
  // - a uniform batch (every sequence max_seqlen long; with max_seqlen >= every length,
  //   B * max_seqlen == T holds exactly then) is a zero-copy view of the THD rows;
  // - a ragged batch is copied into right-padded [B, max_seqlen] rows (zeros in the padding).
  //   That is exact for causal self-attention (q and kv share cu_seqlens): a valid query i only
  //   sees keys <= i, all valid; padding queries get zero output gradient and an infinite
  //   log-sum-exp, so they add nothing to dK / dV.
  const bool uniform = sym_true((s.batch * max_seqlen_q).sym_eq(s.tq)) &&
                       sym_true((s.batch * max_seqlen_kv).sym_eq(s.tk));
  const bool same_heads = sym_true(s.hq.sym_eq(s.hk));
  const bool same_len = sym_true(max_seqlen_q.sym_eq(max_seqlen_kv));
  const bool mask_ok = !causal || same_len;
  const bool ragged_ok = causal && same_offsets && same_len && sym_true(s.tq.sym_eq(s.tk));
  // cuDNN rejects s_q = s_kv = 1; a batch of single tokens is trivial for the padded path.
  if (sym_true(max_seqlen_q.sym_le(1)) && sym_true(max_seqlen_kv.sym_le(1))) return MlaBackend::kPadded;
  if (backend == "native") {
    TORCH_CHECK(uniform || ragged_ok,
                msg(op, "backend='native' needs a uniform batch (every sequence of length max_seqlen, "
                        "i.e. B * max_seqlen_q == Tq and B * max_seqlen_kv == Tk) or, for a ragged batch, "
                        "causal self-attention with one cu_seqlens tensor for q and kv; use "
                        "backend='padded' or 'auto' otherwise"));
    TORCH_CHECK(same_heads, msg(op, "backend='native' needs as many k/v heads as q heads"));
    TORCH_CHECK(mask_ok, msg(op, "backend='native' with causal=True needs max_seqlen_q == max_seqlen_kv"));
    return MlaBackend::kNative;
  }
  // Ragged batches pay for the padding rows' attention: at a fill T / (B * max_seqlen) of at
  // least 3/4 the dense work is at most 1/fill^2 < 1.8x the ragged work (Cauchy-Schwarz), below
  // the native path's measured ~2x advantage.
  const bool dense_enough = uniform || sym_true((s.tq * 4).sym_ge(s.batch * max_seqlen_q * 3));
  if (same_heads && (uniform ? mask_ok : ragged_ok) && dense_enough) {
    for (const AutoNativeRule& r : kAutoNative) {
      if (sym_true(s.dqk.sym_eq(r.dqk)) && sym_true(s.dv.sym_eq(r.dv)) &&
          sym_true(max_seqlen_q.sym_ge(r.min_seqlen)) &&
          sym_true((s.tq * s.hq).sym_ge(r.min_rows_heads))) {
        return MlaBackend::kNative;
      }
    }
  }
  return MlaBackend::kPadded;
}

double mla_softmax_scale(const std::optional<double>& softmax_scale, int64_t dqk) {
  return softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(dqk));
}

at::Tensor mla_alloc_rows(MlaBackend backend, const c10::SymInt& rows, const c10::SymInt& heads,
                          const c10::SymInt& cols, const c10::SymInt& full_cols,
                          const at::TensorOptions& options) {
  if (backend == MlaBackend::kPadded && sym_true(cols.sym_lt(full_cols))) {
    return at::empty_symint({rows, heads, full_cols}, options).narrow_symint(2, 0, cols);
  }
  return at::empty_symint({rows, heads, cols}, options);
}

// ---------------------------------------------------------------------------------------------
// CPU: the reference math (float32 accumulation; float64 for float64 inputs).

namespace {

struct CpuCall {
  MlaSizes s;
  MlaBackend backend;
  cpu::MlaProblem problem;
  at::Tensor cu_q, cu_kv;
  at::ScalarType acc;
};

CpuCall prepare_cpu(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_kv,
                    int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
                    const std::optional<double>& softmax_scale, const std::string& backend) {
  CpuCall c;
  c.s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       softmax_scale);
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16,
              msg(op, "q must be float16, bfloat16, float32 or float64 on the CPU, got " + c10::str(dt)));
  c.backend = resolve_mla_backend(op, backend, c.s, max_seqlen_q, max_seqlen_kv, causal,
                                  shares_offsets(cu_seqlens_q, cu_seqlens_kv));
  c.cu_q = cu_seqlens_q.contiguous();
  c.cu_kv = cu_seqlens_kv.contiguous();
  check_host_offsets(op, "cu_seqlens_q", c.cu_q, q.size(0), max_seqlen_q, "max_seqlen_q");
  check_host_offsets(op, "cu_seqlens_kv", c.cu_kv, k.size(0), max_seqlen_kv, "max_seqlen_kv");
  c.acc = dt == at::kDouble ? at::kDouble : at::kFloat;
  c.problem = cpu::MlaProblem{c.cu_q.data_ptr<int32_t>(), c.cu_kv.data_ptr<int32_t>(),
                              c.cu_q.size(0) - 1,         q.size(1),
                              k.size(1),                  q.size(2),
                              v.size(2),                  causal,
                              mla_softmax_scale(softmax_scale, q.size(2))};
  return c;
}

int64_t grain(int64_t rows_per_item, int64_t cols) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows_per_item * cols));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mla_forward_padded_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_forward_padded";
  CpuCall c = prepare_cpu(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                          causal, softmax_scale, backend);
  const cpu::MlaProblem& p = c.problem;
  const at::Tensor qa = q.to(c.acc).contiguous(), ka = k.to(c.acc).contiguous(),
                   va = v.to(c.acc).contiguous();
  at::Tensor out_acc = at::empty({q.size(0), p.hq, p.dv}, qa.options());
  at::Tensor lse = at::empty({p.hq, q.size(0)}, qa.options());
  const int64_t items = p.num_seqs * p.hq;
  const int64_t avg_rows = p.num_seqs > 0 ? q.size(0) / p.num_seqs + 1 : 1;
  AT_DISPATCH_FLOATING_TYPES(c.acc, "mla_forward_padded_cpu", [&] {
    at::parallel_for(0, items, grain(avg_rows, avg_rows), [&](int64_t b, int64_t e) {
      cpu::mla_forward_items<scalar_t>(p, qa.data_ptr<scalar_t>(), ka.data_ptr<scalar_t>(),
                                       va.data_ptr<scalar_t>(), out_acc.data_ptr<scalar_t>(),
                                       lse.data_ptr<scalar_t>(), b, e);
    });
  });
  at::Tensor out = mla_alloc_rows(c.backend, q.size(0), p.hq, p.dv, p.dqk, q.options());
  out.copy_(out_acc);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, int64_t max_seqlen_q, int64_t max_seqlen_kv, bool causal,
    std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_backward_padded";
  CpuCall c = prepare_cpu(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                          causal, softmax_scale, backend);
  check_mla_backward_args(op, grad_out, out, softmax_lse, q, c.s);
  const cpu::MlaProblem& p = c.problem;
  const at::Tensor qa = q.to(c.acc).contiguous(), ka = k.to(c.acc).contiguous(),
                   va = v.to(c.acc).contiguous(), oa = out.to(c.acc).contiguous(),
                   ga = grad_out.to(c.acc).contiguous(), la = softmax_lse.to(c.acc).contiguous();
  at::Tensor dq = at::zeros_like(qa), dk = at::zeros_like(ka), dv = at::zeros_like(va);
  const int64_t items = p.num_seqs * p.hk;
  const int64_t avg_rows = p.num_seqs > 0 ? q.size(0) / p.num_seqs + 1 : 1;
  AT_DISPATCH_FLOATING_TYPES(c.acc, "mla_backward_padded_cpu", [&] {
    at::parallel_for(0, items, grain(avg_rows, avg_rows), [&](int64_t b, int64_t e) {
      cpu::mla_backward_items<scalar_t>(p, qa.data_ptr<scalar_t>(), ka.data_ptr<scalar_t>(),
                                        va.data_ptr<scalar_t>(), oa.data_ptr<scalar_t>(),
                                        ga.data_ptr<scalar_t>(), la.data_ptr<scalar_t>(),
                                        dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                        dv.data_ptr<scalar_t>(), b, e);
    });
  });
  at::Tensor grad_v = mla_alloc_rows(c.backend, k.size(0), p.hk, p.dv, p.dqk, v.options());
  grad_v.copy_(dv);
  return {dq.to(q.scalar_type()).contiguous(), dk.to(k.scalar_type()).contiguous(), grad_v};
}

// ---------------------------------------------------------------------------------------------
// Meta: shapes, dtypes and the backend's output layout.

std::tuple<at::Tensor, at::Tensor> mla_forward_padded_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_kv,
    bool causal, std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_forward_padded";
  const MlaSizes s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                    max_seqlen_kv, softmax_scale);
  const MlaBackend b = resolve_mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                                           shares_offsets(cu_seqlens_q, cu_seqlens_kv));
  at::Tensor out = mla_alloc_rows(b, s.tq, s.hq, s.dv, s.dqk, q.options());
  at::Tensor lse = at::empty_symint({s.hq, s.tq},
                                    q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_backward_padded_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_kv, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_kv,
    bool causal, std::optional<double> softmax_scale, const std::string& backend) {
  constexpr const char* op = "mla_backward_padded";
  const MlaSizes s = check_mla_args(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                    max_seqlen_kv, softmax_scale);
  check_mla_backward_args(op, grad_out, out, softmax_lse, q, s);
  const MlaBackend b = resolve_mla_backend(op, backend, s, max_seqlen_q, max_seqlen_kv, causal,
                                           shares_offsets(cu_seqlens_q, cu_seqlens_kv));
  return {at::empty_symint({s.tq, s.hq, s.dqk}, q.options()),
          at::empty_symint({s.tk, s.hk, s.dqk}, k.options()),
          mla_alloc_rows(b, s.tk, s.hk, s.dv, s.dqk, v.options())};
}

}  // namespace ops
}  // namespace verl_ops
