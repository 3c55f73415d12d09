// vocab_log_probs_forward / _backward: log-probabilities of labels under a softmax over (a slice
// of) the vocabulary, in one pass (core/log_probs.h, docs/ops.md#vocab_log_probs).
#pragma once

#include "../core/log_probs.h"
#include "stable.h"

namespace verl_ops {
namespace ops {

using st::Tensor;

struct LogProbCall {
  core::LogProbProblem problem;
  Tensor logits, labels;           // logits with inner stride 1 and uniformly strided rows
  std::vector<int64_t> row_shape;  // labels' shape: logits.shape[:-1]
  int dtype = 0;                   // 0 float32, 1 float64, 2 float16, 3 bfloat16
  int label_bits = 64;
};

// Checks logits [*, V] and labels [*] (int64 / int32); `op` names the op in errors.
LogProbCall prepare_log_probs(const char* op, const Tensor& logits, const Tensor& labels, int64_t vocab_start);
// ... and the backward's grad_log_probs, logits_max, sum_exp (float32, labels' shape).
void check_log_probs_stats(const char* op, const LogProbCall& c, const Tensor& grad, const Tensor& logits_max,
                           const Tensor& sum_exp);

std::tuple<Tensor, Tensor, Tensor, Tensor> vocab_log_probs_forward_cpu(const Tensor& logits, const Tensor& labels,
                                                                       int64_t vocab_start);
Tensor vocab_log_probs_backward_cpu(const Tensor& grad, const Tensor& logits, const Tensor& labels,
                                    const Tensor& logits_max, const Tensor& sum_exp, int64_t vocab_start);
#ifdef VERL_OPS_WITH_CUDA
std::tuple<Tensor, Tensor, Tensor, Tensor> vocab_log_probs_forward_cuda(const Tensor& logits, const Tensor& labels,
                                                                        int64_t vocab_start);
Tensor vocab_log_probs_backward_cuda(const Tensor& grad, const Tensor& logits, const Tensor& labels,
                                     const Tensor& logits_max, const Tensor& sum_exp, int64_t vocab_start);
#endif

}  // namespace ops
}  // namespace verl_ops
