#include "log_probs_ops.h"

#include "../cpu/log_probs_kernels.h"

namespace verl_ops {
namespace ops {

namespace {


// The stride between t's rows (all but the last dim, walked in order) where one stride walks them
// all, else -1. Size-1 dims place nothing: only the other leading dims must nest (each one's stride
// the next one's times its size); the row stride is the innermost of them (any value when there is
// at most one row).
int64_t uniform_row_stride(const Tensor& t) {
  const int64_t last = t.dim() - 1;
  if (t.size(last) > 1 && t.stride(last) != 1) return -1;
  int64_t inner = -1;  // the next leading dim of size > 1 inwards of d; at the end, the innermost one
  int64_t innermost = -1;
  for (int64_t d = last - 1; d >= 0; --d) {
    if (t.size(d) <= 1) continue;
    if (inner >= 0 && t.stride(d) != t.stride(inner) * t.size(inner)) return -1;
    if (innermost < 0) innermost = d;
    inner = d;
  }
  return innermost < 0 ? t.size(last) : t.stride(innermost);
}

}  // namespace

LogProbCall prepare_log_probs(const char* op, const Tensor& logits, const Tensor& labels, int64_t vocab_start) {
  VERL_CHECK(logits.dim() >= 1, op, ": logits must be [*, vocab], got ", st::shape_of(logits));
  LogProbCall c;
  c.dtype = st::float_code(op, "logits", logits.scalar_type());
  const int64_t vocab = logits.size(logits.dim() - 1);
  VERL_CHECK(vocab > 0, op, ": logits' last dim (the vocabulary slice) must be > 0, got ", st::shape_of(logits));
  VERL_CHECK(vocab_start >= 0, op, ": vocab_start must be >= 0, got ", vocab_start);
  c.row_shape.assign(static_cast<size_t>(logits.dim() - 1), 0);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < logits.dim(); ++d) {
    c.row_shape[static_cast<size_t>(d)] = logits.size(d);
    rows *= logits.size(d);
  }
  bool same = labels.dim() == logits.dim() - 1;
  for (int64_t d = 0; same && d < labels.dim(); ++d) same = labels.size(d) == logits.size(d);
  VERL_CHECK(same, op, ": labels must have logits' shape less its last dim, got labels ", st::shape_of(labels),
             " and logits ", st::shape_of(logits));
  VERL_CHECK(labels.scalar_type() == st::kLong || labels.scalar_type() == st::kInt, op,
             ": labels must be int64 or int32, got ", st::dtype_name(labels.scalar_type()));
  VERL_CHECK(st::same_device(labels, logits), op, ": labels is on ", st::device_of(labels), " but logits is on ",
             st::device_of(logits));
  int64_t row_stride = uniform_row_stride(logits);
  c.logits = logits;
  if (row_stride < 0) {  // rows one stride cannot walk: a contiguous copy
    c.logits = st::empty(logits, st::sizes_of(logits), logits.scalar_type());
    st::copy_into(c.logits, logits);
    row_stride = vocab;
  }
  c.labels = st::contiguous(labels);
  c.label_bits = labels.scalar_type() == st::kLong ? 64 : 32;
  c.problem.rows = rows;
  c.problem.vocab = vocab;
  c.problem.row_stride = row_stride;
  c.problem.vocab_start = vocab_start;
  return c;
}

void check_log_probs_stats(const char* op, const LogProbCall& c, const Tensor& grad, const Tensor& logits_max,
                           const Tensor& sum_exp) {
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"grad_log_probs", &grad},
                                {"logits_max", &logits_max}, {"sum_exp", &sum_exp}}) {
    bool same = t->dim() == static_cast<int64_t>(c.row_shape.size());
    for (int64_t d = 0; same && d < t->dim(); ++d) same = t->size(d) == c.row_shape[static_cast<size_t>(d)];
    VERL_CHECK(same, op, ": ", name, " must have labels' shape ", st::shape_of(c.labels), ", got ",
               st::shape_of(*t));
    VERL_CHECK(t->scalar_type() == st::kFloat, op, ": ", name, " must be float32, got ",
               st::dtype_name(t->scalar_type()));
    VERL_CHECK(st::same_device(*t, c.logits), op, ": ", name, " is on ", st::device_of(*t), " but logits is on ",
               st::device_of(c.logits));
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> vocab_log_probs_forward_cpu(const Tensor& logits, const Tensor& labels,
                                                                       int64_t vocab_start) {
  const char* op = "vocab_log_probs_forward";
  const LogProbCall c = prepare_log_probs(op, logits, labels, vocab_start);
  Tensor lp = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor mx = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor se = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  Tensor ll = st::output(op, "labels", logits, c.row_shape, st::kFloat);
  cpu::log_probs_forward(c.problem, c.dtype, c.logits.data_ptr(), c.labels.data_ptr(), c.label_bits,
                         st::ptr<float>(lp), st::ptr<float>(mx), st::ptr<float>(se), st::ptr<float>(ll));
  return {lp, mx, se, ll};
}

Tensor vocab_log_probs_backward_cpu(const Tensor& grad, const Tensor& logits, const Tensor& labels,
                                    const Tensor& logits_max, const Tensor& sum_exp, int64_t vocab_start) {
  const char* op = "vocab_log_probs_backward";
  const LogProbCall c = prepare_log_probs(op, logits, labels, vocab_start);
  check_log_probs_stats(op, c, grad, logits_max, sum_exp);
  const Tensor g = st::contiguous(grad), mx = st::contiguous(logits_max), se = st::contiguous(sum_exp);
  Tensor out = st::output(op, "logits", logits, st::sizes_of(logits), logits.scalar_type());
  cpu::log_probs_backward(c.problem, c.dtype, st::ptr<float>(g), c.logits.data_ptr(), c.labels.data_ptr(),
                          c.label_bits, st::ptr<float>(mx), st::ptr<float>(se), out.data_ptr());
  return out;
}

}  // namespace ops
}  // namespace verl_ops
