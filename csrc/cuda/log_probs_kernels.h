// CUDA kernels of vocab_log_probs_forward / _backward (core/log_probs.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../core/log_probs.h"

namespace verl_ops {
namespace cuda {

// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16 (the logits'; the math is float32). labels int64
// (label_bits 64) or int32. One block per row, two passes over it (max, then the sum of exponentials),
// 16-byte loads where the rows are aligned.
cudaError_t launch_log_probs_forward(const core::LogProbProblem& p, int dtype, const void* logits,
                                     const void* labels, int label_bits, float* log_probs, float* logits_max,
                                     float* sum_exp, float* label_logit, cudaStream_t stream);
// grad_logits contiguous [rows, vocab] in the logits' dtype.
cudaError_t launch_log_probs_backward(const core::LogProbProblem& p, int dtype, const float* grad,
                                      const void* logits, const void* labels, int label_bits,
                                      const float* logits_max, const float* sum_exp, void* grad_logits,
                                      cudaStream_t stream);

}  // namespace cuda
}  // namespace verl_ops
