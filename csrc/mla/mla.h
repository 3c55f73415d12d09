// Index rules of variable-length attention for MLA head dims (docs/mla.md#semantics), shared by the
// CPU reference kernels, the CUDA pad kernel and the CUDA float32 / float64 kernels.
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

// An offset clamped into [0, rows]. CUDA offsets are not checked on the host (no sync): kernels
// that read rows through them clamp every offset, so bad offsets can shrink or empty a sequence
// but never send a read or write outside the tensors. Valid offsets are unchanged.
VERL_HD int64_t clamp_offset(int32_t v, int64_t rows) {
  return v < 0 ? 0 : (static_cast<int64_t>(v) > rows ? rows : static_cast<int64_t>(v));
}

// The sequence of row `row` of [rows] rows split by the offsets cu [num_seqs + 1] (num_seqs >= 1),
// its first row and length, both clamped into the rows. `covered` is false when no sequence holds
// the row, which valid offsets never give (they cover every row), bad ones may.
struct RowSequence {
  int64_t seq, begin, len;
  bool covered;
};

VERL_HD RowSequence row_sequence(const int32_t* cu, int64_t num_seqs, int64_t rows, int64_t row) {
  const int64_t seq = upper_segment(cu, num_seqs, row);
  const int64_t begin = clamp_offset(cu[seq], rows), end = clamp_offset(cu[seq + 1], rows);
  return {seq, begin, end > begin ? end - begin : 0, begin <= row && row < end};
}

// The sequence's part [begin, begin + len) of the other side's rows (keys for a query's sequence,
// queries for a key's), clamped into them.
VERL_HD void sequence_rows(const int32_t* cu, int64_t seq, int64_t rows, int64_t* begin,
                           int64_t* len) {
  const int64_t b = clamp_offset(cu[seq], rows), e = clamp_offset(cu[seq + 1], rows);
  *begin = b;
  *len = e > b ? e - b : 0;
}

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
