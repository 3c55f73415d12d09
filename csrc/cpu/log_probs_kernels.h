// CPU kernels of vocab_log_probs_forward / _backward (core/log_probs.h).
#pragma once

#include <cstdint>

#include "../core/log_probs.h"

namespace verl_ops {
namespace cpu {

// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16 (the logits'; the math is float32). labels are
// int64 (label_bits 64) or int32; outputs float32 [rows].
void log_probs_forward(const core::LogProbProblem& p, int dtype, const void* logits, const void* labels,
                       int label_bits, float* log_probs, float* logits_max, float* sum_exp, float* label_logit);
// grad_logits contiguous [rows, vocab] in the logits' dtype.
void log_probs_backward(const core::LogProbProblem& p, int dtype, const float* grad, const void* logits,
                        const void* labels, int label_bits, const float* logits_max, const float* sum_exp,
                        void* grad_logits);

}  // namespace cpu
}  // namespace verl_ops
