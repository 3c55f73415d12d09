#include "mla_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../mla.h"

namespace verl_ops {
namespace cpu {

namespace {
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
}  // namespace

template <typename T>
void mla_forward_items(const MlaProblem& p, const T* q, const T* k, const T* v, T* out, T* lse,
                       int64_t item_begin, int64_t item_end) {
  const int64_t tq = p.cu_seqlens_q[p.num_seqs];
  std::vector<T> score;
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t s = item / p.hq, h = item % p.hq;
    const int64_t g = core::kv_head_of(h, p.hq, p.hk);
    const int64_t q0 = p.cu_seqlens_q[s], lq = p.cu_seqlens_q[s + 1] - q0;
    const int64_t k0 = p.cu_seqlens_kv[s], lk = p.cu_seqlens_kv[s + 1] - k0;
    score.resize(static_cast<size_t>(std::max<int64_t>(lk, 1)));
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = q0 + i;
      const T* qi = q + (row * p.hq + h) * p.dqk;
      T* oi = out + (row * p.hq + h) * p.dv;
      std::fill(oi, oi + p.dv, T(0));
      const int64_t end = core::attention_key_end(i, lq, lk, p.causal);
      if (end == 0) {
        lse[h * tq + row] = std::numeric_limits<T>::infinity();
        continue;
      }
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < end; ++j) {
        score[j] = static_cast<T>(p.scale) * dot(qi, k + ((k0 + j) * p.hk + g) * p.dqk, p.dqk);
        m = std::max(m, score[j]);
      }
      T sum = 0;
      for (int64_t j = 0; j < end; ++j) {
        score[j] = std::exp(score[j] - m);
        sum += score[j];
      }
      for (int64_t j = 0; j < end; ++j) {
        const T w = score[j] / sum;
        const T* vj = v + ((k0 + j) * p.hk + g) * p.dv;
        for (int64_t d = 0; d < p.dv; ++d) oi[d] += w * vj[d];
      }
      lse[h * tq + row] = m + std::log(sum);
    }
  }
}

template <typename T>
void mla_backward_items(const MlaProblem& p, const T* q, const T* k, const T* v, const T* out,
                        const T* dout, const T* lse, T* dq, T* dk, T* dv, int64_t item_begin,
                        int64_t item_end) {
  const int64_t tq = p.cu_seqlens_q[p.num_seqs];
  const int64_t group = p.hq / p.hk;
  const T scale = static_cast<T>(p.scale);
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int64_t s = item / p.hk, g = item % p.hk;
    const int64_t q0 = p.cu_seqlens_q[s], lq = p.cu_seqlens_q[s + 1] - q0;
    const int64_t k0 = p.cu_seqlens_kv[s], lk = p.cu_seqlens_kv[s + 1] - k0;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        const int64_t row = q0 + i;
        const int64_t end = core::attention_key_end(i, lq, lk, p.causal);
        if (end == 0) continue;
        const int64_t qo = (row * p.hq + h);
        const T* qi = q + qo * p.dqk;
        const T* doi = dout + qo * p.dv;
        T* dqi = dq + qo * p.dqk;
        const T delta = dot(doi, out + qo * p.dv, p.dv);
        const T l = lse[h * tq + row];
        for (int64_t j = 0; j < end; ++j) {
          const int64_t ko = (k0 + j) * p.hk + g;
          const T* kj = k + ko * p.dqk;
          const T* vj = v + ko * p.dv;
          const T pij = std::exp(scale * dot(qi, kj, p.dqk) - l);
          const T ds = pij * (dot(doi, vj, p.dv) - delta);
          T* dkj = dk + ko * p.dqk;
          T* dvj = dv + ko * p.dv;
          for (int64_t d = 0; d < p.dqk; ++d) {
            dqi[d] += scale * ds * kj[d];
            dkj[d] += scale * ds * qi[d];
          }
          for (int64_t d = 0; d < p.dv; ++d) dvj[d] += pij * doi[d];
        }
      }
    }
  }
}

template void mla_forward_items<float>(const MlaProblem&, const float*, const float*, const float*,
                                       float*, float*, int64_t, int64_t);
template void mla_forward_items<double>(const MlaProblem&, const double*, const double*,
                                        const double*, double*, double*, int64_t, int64_t);
template void mla_backward_items<float>(const MlaProblem&, const float*, const float*, const float*,
                                        const float*, const float*, const float*, float*, float*,
                                        float*, int64_t, int64_t);
template void mla_backward_items<double>(const MlaProblem&, const double*, const double*,
                                         const double*, const double*, const double*,
                                         const double*, double*, double*, double*, int64_t,
                                         int64_t);

}  // namespace cpu
}  // namespace verl_ops
