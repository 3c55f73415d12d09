// Index rules of variable-length attention for MLA head dims (docs/mla.md#semantics), shared by the
// CPU reference kernels and the CUDA pad kernel.
#pragma once

#include <cstdint>

#include "../core/thd_layout.h"

namespace verl_ops {
namespace core {

// Keys [0, key_end) of a sequence are visible to its query i. Causal masks follow
// FlashAttention's convention for unequal lengths: the diagonal is aligned to the bottom-right
// corner, so query i of lq sees keys j <= i + lk - lq. A query that sees no key (possible when
// lq > lk) has key_end = 0: its output is zero and its log-sum-exp is +inf.
VERL_HD int64_t attention_key_end(int64_t i, int64_t lq, int64_t lk, bool causal) {
  if (!causal) return lk;
  const int64_t end = i + lk - lq + 1;
  return end < 0 ? 0 : (end > lk ? lk : end);
}

// Grouped-query attention (FlashAttention's convention): consecutive query heads share a
// key/value head, query head h reads kv head h / (hq / hk).
VERL_HD int64_t kv_head_of(int64_t h, int64_t hq, int64_t hk) { return h / (hq / hk); }

// Zero-padding of the last dim of [tokens, heads, src_cols] rows to dst_cols (contiguous dst).
// Source rows may be strided (token and head strides in elements, unit inner stride).
struct PadGeometry {
  int64_t tokens, heads;
  int64_t src_token_stride, src_head_stride;
};

VERL_HD int64_t pad_source_offset(const PadGeometry& g, int64_t row) {
  const int64_t t = row / g.heads;
  return t * g.src_token_stride + (row - t * g.heads) * g.src_head_stride;
}

}  // namespace core
}  // namespace verl_ops
