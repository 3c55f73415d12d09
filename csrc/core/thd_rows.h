// Per-row source resolution for the pack / unpack kernels: given an output row, which input
// row (if any) feeds it. Shared verbatim by the CPU loop and the CUDA kernel.
#pragma once

#include "thd_layout.h"

namespace verl_ops {
namespace core {

// Pack: global padded THD rows of one or all ranks <- tokens of the input batch.
struct PackPlan {
  const int32_t* cu_seqlens;         // [B + 1] valid-token offsets
  const int32_t* cu_seqlens_padded;  // [B + 1] padded offsets
  const int32_t* mask_csum;          // [B, S] inclusive prefix count of the mask, or null (jagged)
  int64_t seq_capacity;              // S for padded input
  int64_t src_rows;                  // rows of the input (total tokens, or B * S)
  ShardSpec spec;
  int32_t cp_rank;                   // >= 0: only this rank's rows; -1: all ranks, rank-major
  bool roll;
};

// Returns the input row for output row `out_row` (or -1 for a zero row) and the row's
// position inside its padded sequence.
VERL_HD int64_t pack_source_row(const PackPlan& p, int64_t out_row, int64_t* position) {
  int32_t rank = p.cp_rank;
  int64_t row = out_row;
  if (rank < 0) {
    rank = static_cast<int32_t>(out_row / p.spec.local_rows);
    row = out_row - static_cast<int64_t>(rank) * p.spec.local_rows;
  }
  const RowSource rs = local_row_to_position(p.cu_seqlens_padded, p.spec, rank, row);
  *position = rs.seq < 0 ? 0 : rs.pos;
  if (rs.seq < 0) return -1;
  const int64_t len = static_cast<int64_t>(p.cu_seqlens[rs.seq + 1]) - p.cu_seqlens[rs.seq];
  if (rs.pos >= len) return -1;
  const int64_t q = source_position(rs.pos, len, p.roll);
  int64_t src;
  if (p.mask_csum == nullptr) {
    src = static_cast<int64_t>(p.cu_seqlens[rs.seq]) + q;
  } else {
    const int64_t s = select_kth(p.mask_csum + rs.seq * p.seq_capacity, p.seq_capacity, q);
    if (s >= p.seq_capacity) return -1;  // mask holds fewer tokens than the layout says
    src = rs.seq * p.seq_capacity + s;
  }
  return (src >= 0 && src < p.src_rows) ? src : -1;
}

// Unpack: tokens of the output batch <- packed rows of one or all ranks.
struct UnpackPlan {
  const int32_t* cu_seqlens;
  const int32_t* cu_seqlens_padded;
  const int32_t* mask_csum;  // [B, S] or null (jagged output)
  int64_t seq_capacity;      // S for padded output
  int64_t packed_rows;       // rows present in the packed input (local_rows, or cp * local_rows)
  ShardSpec spec;
  int32_t cp_rank;  // >= 0: only this rank's shard is present (others read as zero); -1: all
  bool roll;
};

VERL_HD int64_t unpack_source_row(const UnpackPlan& p, int64_t out_row) {
  const int64_t B = p.spec.num_seqs;
  if (B <= 0) return -1;
  int64_t seq, q;
  if (p.mask_csum == nullptr) {
    if (out_row >= p.cu_seqlens[B]) return -1;
    seq = upper_segment(p.cu_seqlens, B, out_row);
    q = out_row - p.cu_seqlens[seq];
  } else {
    seq = out_row / p.seq_capacity;
    const int64_t s = out_row - seq * p.seq_capacity;
    const int32_t c = p.mask_csum[out_row];
    const int32_t prev = s > 0 ? p.mask_csum[out_row - 1] : 0;
    if (c == prev) return -1;  // masked out
    q = c - 1;
  }
  const int64_t len = static_cast<int64_t>(p.cu_seqlens[seq + 1]) - p.cu_seqlens[seq];
  if (q >= len) return -1;  // mask holds more tokens than the layout says
  const int64_t pos = reading_position(q, len, p.roll);
  const RowLocation loc = position_to_local_row(p.cu_seqlens_padded, p.spec, seq, pos);
  if (loc.rank < 0) return -1;
  int64_t src;
  if (p.cp_rank >= 0) {
    if (loc.rank != p.cp_rank) return -1;
    src = loc.row;
  } else {
    src = static_cast<int64_t>(loc.rank) * p.spec.local_rows + loc.row;
  }
  return (src >= 0 && src < p.packed_rows) ? src : -1;
}

}  // namespace core
}  // namespace verl_ops

namespace verl_ops {
namespace core {

// Jagged row gather: output sequence j is rows [src_starts[j], src_starts[j] + len_j) of the
// input, len_j = cu_out[j+1] - cu_out[j]. Used to select a subset of a batch (dynamic CP split)
// and to put gathered outputs back in sample order (dynamic CP merge).
struct JaggedGatherPlan {
  const int64_t* src_starts;  // [n_out]; negative: the sequence comes out zero
  const int32_t* cu_out;      // [n_out + 1]
  int64_t num_out_seqs;
  int64_t src_rows;
};

VERL_HD int64_t jagged_source_row(const JaggedGatherPlan& p, int64_t out_row) {
  if (p.num_out_seqs <= 0 || out_row >= p.cu_out[p.num_out_seqs]) return -1;
  const int64_t j = upper_segment(p.cu_out, p.num_out_seqs, out_row);
  if (p.src_starts[j] < 0) return -1;
  const int64_t src = p.src_starts[j] + (out_row - p.cu_out[j]);
  return src < p.src_rows ? src : -1;
}

}  // namespace core
}  // namespace verl_ops
