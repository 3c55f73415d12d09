#include "log_probs_kernels.h"

#include <cmath>
#include <cstring>

#include "bfloat16.h"
#include <limits>

namespace verl_ops {
namespace cpu {

namespace {

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }
template <>
inline float widen<uint16_t>(uint16_t v) { return bf16_to_float(v); }

template <typename T>
inline T narrow(float v) { return static_cast<T>(v); }
template <>
inline uint16_t narrow<uint16_t>(float v) { return float_to_bf16(v); }

inline int64_t label_at(const void* labels, int bits, int64_t r) {
  return bits == 64 ? static_cast<const int64_t*>(labels)[r] : static_cast<const int32_t*>(labels)[r];
}

template <typename T>
void forward_rows(const core::LogProbProblem& p, const void* logits_, const void* labels, int bits, float* lp,
                  float* mx, float* se, float* ll) {
  const T* logits = static_cast<const T*>(logits_);
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = logits + r * p.row_stride;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < p.vocab; ++v) {
      const float f = widen(x[v]);
      m = (f > m || std::isnan(f)) ? f : m;
    }
    float s = 0.0f;
    for (int64_t v = 0; v < p.vocab; ++v) s += std::exp(widen(x[v]) - m);
    const int64_t t = core::slice_index(label_at(labels, bits, r), p);
    const bool in = t >= 0;
    const float xt = in ? widen(x[t]) : 0.0f;
    mx[r] = m;
    se[r] = s;
    ll[r] = xt;
    lp[r] = core::row_log_prob(m, s, in, xt);
  }
}

template <typename T>
void backward_rows(const core::LogProbProblem& p, const float* grad, const void* logits_, const void* labels,
                   int bits, const float* mx, const float* se, void* out_) {
  const T* logits = static_cast<const T*>(logits_);
  T* out = static_cast<T*>(out_);
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = logits + r * p.row_stride;
    T* o = out + r * p.vocab;
    const float g = -grad[r];
    const float m = mx[r], s = se[r];
    const int64_t t = core::slice_index(label_at(labels, bits, r), p);
    for (int64_t v = 0; v < p.vocab; ++v) {
      float sm = std::exp(widen(x[v]) - m) / s;
      if (v == t) sm -= 1.0f;
      o[v] = narrow<T>(sm * g);
    }
  }
}

}  // namespace

void log_probs_forward(const core::LogProbProblem& p, int dtype, const void* logits, const void* labels,
                       int label_bits, float* log_probs, float* logits_max, float* sum_exp, float* label_logit) {
  switch (dtype) {
    case 0: return forward_rows<float>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit);
    case 1: return forward_rows<double>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit);
    case 2:
      return forward_rows<_Float16>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit);
    default:
      return forward_rows<uint16_t>(p, logits, labels, label_bits, log_probs, logits_max, sum_exp, label_logit);
  }
}

void log_probs_backward(const core::LogProbProblem& p, int dtype, const float* grad, const void* logits,
                        const void* labels, int label_bits, const float* logits_max, const float* sum_exp,
                        void* grad_logits) {
  switch (dtype) {
    case 0: return backward_rows<float>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits);
    case 1: return backward_rows<double>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits);
    case 2: return backward_rows<_Float16>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits);
    default: return backward_rows<uint16_t>(p, grad, logits, labels, label_bits, logits_max, sum_exp, grad_logits);
  }
}

}  // namespace cpu
}  // namespace verl_ops
