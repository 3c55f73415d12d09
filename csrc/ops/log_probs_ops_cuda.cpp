#include "../cuda/log_probs_kernels.h"
#include "log_probs_ops.h"

namespace verl_ops {
namespace ops {

// One launch each on the current stream; labels are not read on the host.
std::tuple<Tensor, Tensor, Tensor, Tensor> vocab_log_probs_forward_cuda(const Tensor& logits, const Tensor& labels,
                                                                        int64_t vocab_start) {
  const char* op = "vocab_log_probs_forward";
  const st::DeviceGuard guard(st::guard_index(logits));
  const LogProbCall c = prepare_log_probs(op, logits, labels, vocab_start);
  Tensor lp = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor mx = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor se = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor ll = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  st::check_launch(op, cuda::launch_log_probs_forward(c.problem, c.dtype, c.logits.data_ptr(), c.labels.data_ptr(),
                                                      c.label_bits, st::ptr<float>(lp), st::ptr<float>(mx),
                                                      st::ptr<float>(se), st::ptr<float>(ll),
                                                      st::current_stream(logits)));
  return {lp, mx, se, ll};
}

Tensor vocab_log_probs_backward_cuda(const Tensor& grad, const Tensor& logits, const Tensor& labels,
                                     const Tensor& logits_max, const Tensor& sum_exp, int64_t vocab_start) {
  const char* op = "vocab_log_probs_backward";
  const st::DeviceGuard guard(st::guard_index(logits));
  const LogProbCall c = prepare_log_probs(op, logits, labels, vocab_start);
  check_log_probs_stats(op, c, grad, logits_max, sum_exp);
  const Tensor g = st::contiguous(grad), mx = st::contiguous(logits_max), se = st::contiguous(sum_exp);
  Tensor out = st::output(op, "logits", logits, st::sizes_of(logits), logits.scalar_type());
  st::check_launch(op, cuda::launch_log_probs_backward(c.problem, c.dtype, st::ptr<float>(g), c.logits.data_ptr(),
                                                       c.labels.data_ptr(), c.label_bits, st::ptr<float>(mx),
                                                       st::ptr<float>(se), out.data_ptr(),
                                                       st::current_stream(logits)));
  return out;
}

}  // namespace ops
}  // namespace verl_ops
