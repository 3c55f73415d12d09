// Log-probabilities of labels under a softmax over the vocabulary (docs/ops.md#vocab_log_probs):
// Megatron-Core's vocab_parallel_cross_entropy, negated (verl's vocab_parallel_log_probs_from_logits),
// in one pass over the logits forward and one backward, computed in float32 as Megatron computes.
//
// Row r of logits [R, V] (this rank's vocabulary slice [start, start + V)), label t = labels[r]:
//   m = max_v x[v];  s = sum_v exp(x[v] - m);  in = start <= t < start + V
//   label_logit = in ? x[t - start] : 0
//   log_prob    = -(log(s) - (in ? x[t - start] - m : 0))          (one slice: the whole vocabulary)
// Backward, g = the log-prob's gradient (the loss' is -g):
//   grad_x[v] = (exp(x[v] - m) / s - (in && v == t - start ? 1 : 0)) * -g
// With several slices the caller combines m, s and label_logit across them first (max, rescaled sum).
#pragma once

#include <cmath>
#include <cstdint>

#include "thd_layout.h"  // VERL_HD

namespace verl_ops {
namespace core {

struct LogProbProblem {
  int64_t rows, vocab;   // logits [rows, vocab]
  int64_t row_stride;    // of the logits, in elements (inner stride 1)
  int64_t vocab_start;   // the slice's first vocabulary id
};

// The label's index in the slice, or -1 where it lies outside (no overflow: vocab_start >= 0).
VERL_HD int64_t slice_index(int64_t label, const LogProbProblem& p) {
  return (label >= p.vocab_start && label - p.vocab_start < p.vocab) ? label - p.vocab_start : -1;
}

// The row's log-prob from its max m, sum of exponentials s and the label's logit xt (in: the label
// lies in the slice), in Megatron's order: -(log(s) - (xt - m)).
VERL_HD float row_log_prob(float m, float s, bool in, float xt) {
  const float predicted = in ? xt - m : 0.0f;
  return -(logf(s) - predicted);
}

}  // namespace core
}  // namespace verl_ops
