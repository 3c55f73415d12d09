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

// What one local row of the packed buffer holds: token `token` of sequence `seq` (-1: a zero
// row) and the position id written next to it.
struct RowValue {
  int64_t seq;
  int64_t token;
  int64_t position;
};

VERL_HD int64_t padded_length(const int32_t* cu_padded, int64_t seq) {
  return static_cast<int64_t>(cu_padded[seq + 1]) - cu_padded[seq];
}

VERL_HD int64_t valid_length(const int32_t* cu, int64_t seq) {
  return static_cast<int64_t>(cu[seq + 1]) - cu[seq];
}

// Padding-row rule (verl's preprocess_thd_engine, 0.9.1): a padding row holds zero and position
// id 0, except the rows of a zigzag first chunk (cp > 1), whose position ids count on through
// the padding (verl writes that chunk's positions as one arange).
VERL_HD RowValue plain_row_value(const PackPlan& p, int32_t rank, int64_t row) {
  const RowSource rs = local_row_to_position(p.cu_seqlens_padded, p.spec, rank, row);
  if (rs.seq < 0) return RowValue{-1, -1, 0};
  const int64_t len = valid_length(p.cu_seqlens, rs.seq);
  if (rs.pos < len) return RowValue{rs.seq, rs.pos, rs.pos};
  const bool first_chunk = p.spec.layout == CpLayout::kZigzag && p.spec.cp_size > 1 &&
                           2 * rs.pos < padded_length(p.cu_seqlens_padded, rs.seq);
  return RowValue{rs.seq, -1, first_chunk ? rs.pos : 0};
}

// roll=True (labels): verl's rule per branch.
// * contiguous layout (any cp): position p < len holds token (p+1) % len with position id
//   (p+1) % len; padding rows stay zero / 0.
// * zigzag, cp == 1: the whole local buffer is rolled by one row (values and position ids), so
//   row k holds what row (k+1) % rows holds unrolled: the last row of a sequence reads the next
//   sequence's first row (the buffer's last row reads its first row).
// * zigzag, cp > 1: padded position q holds token q+1 of the sequence zero-padded to its padded
//   length (so the last valid position reads a zero unless the sequence fills its padding), and
//   rank 0's last row of the sequence wraps to token 0. Position ids are rolled inside each
//   chunk; the last row of the first chunk keeps its own position id, the last row of the second
//   chunk keeps its unrolled one (0 on rank 0). When the next sequence is empty (padded length
//   0) the last local row of the sequence is zero with its unrolled position id.
VERL_HD RowValue rolled_row_value(const PackPlan& p, int32_t rank, int64_t row) {
  const ShardSpec& s = p.spec;
  if (s.layout == CpLayout::kZigzag && s.cp_size == 1) {
    if (s.local_rows <= 0) return RowValue{-1, -1, 0};
    return plain_row_value(p, rank, (row + 1) % s.local_rows);
  }
  const RowSource rs = local_row_to_position(p.cu_seqlens_padded, s, rank, row);
  if (rs.seq < 0) return RowValue{-1, -1, 0};
  const int64_t len = valid_length(p.cu_seqlens, rs.seq);
  if (s.layout == CpLayout::kContiguous) {
    if (rs.pos >= len) return RowValue{rs.seq, -1, 0};
    const int64_t t = rs.pos + 1 < len ? rs.pos + 1 : 0;
    return RowValue{rs.seq, t, t};
  }
  const int64_t padded = padded_length(p.cu_seqlens_padded, rs.seq);
  const int64_t chunk = padded / (2 * s.cp_size);
  const int64_t j = row - p.cu_seqlens_padded[rs.seq] / s.cp_size;
  const int64_t unrolled_second = rs.pos < len ? rs.pos : 0;
  if (j == 2 * chunk - 1) {
    if (rs.seq + 1 < s.num_seqs && padded_length(p.cu_seqlens_padded, rs.seq + 1) == 0) {
      return RowValue{rs.seq, -1, unrolled_second};
    }
    if (rank == 0) return RowValue{rs.seq, len > 0 ? 0 : -1, 0};
    return RowValue{rs.seq, rs.pos + 1 < len ? rs.pos + 1 : -1, unrolled_second};
  }
  const int64_t q = rs.pos + 1;
  const int64_t token = q < len ? q : -1;
  if (j < chunk - 1) return RowValue{rs.seq, token, q};
  if (j == chunk - 1) return RowValue{rs.seq, token, rs.pos};
  return RowValue{rs.seq, token, q < len ? q : 0};
}

// Returns the input row for output row `out_row` (or -1 for a zero row) and the position id of
// the row (verl's, padding rows included).
VERL_HD int64_t pack_source_row(const PackPlan& p, int64_t out_row, int64_t* position) {
  int32_t rank = p.cp_rank;
  int64_t row = out_row;
  if (rank < 0) {
    rank = static_cast<int32_t>(out_row / p.spec.local_rows);
    row = out_row - static_cast<int64_t>(rank) * p.spec.local_rows;
  }
  const RowValue v = p.roll ? rolled_row_value(p, rank, row) : plain_row_value(p, rank, row);
  *position = v.position;
  if (v.seq < 0 || v.token < 0) return -1;
  int64_t src;
  if (p.mask_csum == nullptr) {
    src = static_cast<int64_t>(p.cu_seqlens[v.seq]) + v.token;
  } else {
    const int64_t s = select_kth(p.mask_csum + v.seq * p.seq_capacity, p.seq_capacity, v.token);
    if (s >= p.seq_capacity) return -1;  // mask holds fewer tokens than the layout says
    src = v.seq * p.seq_capacity + s;
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

// The local row that holds token q of sequence `seq` after pack (inverse of the rules above);
// rank -1 when no row holds it (a roll whose next sequence is empty drops one token per rank).
// kMayRoll = false compiles the roll rules out (callers whose plans never roll: the router record
// kernel, whose registers the rules would otherwise spill).
template <bool kMayRoll = true>
VERL_HD RowLocation reading_row(const UnpackPlan& p, int64_t seq, int64_t q, int64_t len) {
  const ShardSpec& s = p.spec;
  if (!kMayRoll || !p.roll) return position_to_local_row(p.cu_seqlens_padded, s, seq, q);
  if (s.layout == CpLayout::kContiguous) {
    return position_to_local_row(p.cu_seqlens_padded, s, seq, q == 0 ? len - 1 : q - 1);
  }
  if (s.cp_size == 1) {
    if (q > 0) return position_to_local_row(p.cu_seqlens_padded, s, seq, q - 1);
    const int64_t total = p.cu_seqlens_padded[s.num_seqs];
    const int64_t g = p.cu_seqlens_padded[seq] > 0 ? p.cu_seqlens_padded[seq] - 1 : total - 1;
    return g >= 0 ? RowLocation{0, g} : RowLocation{-1, 0};
  }
  const int64_t padded = static_cast<int64_t>(p.cu_seqlens_padded[seq + 1]) - p.cu_seqlens_padded[seq];
  const int64_t chunk = padded / (2 * s.cp_size);
  const int64_t pos = q == 0 ? padded - 1 : q - 1;
  if (chunk > 0 && 2 * pos >= padded && (pos + 1) % chunk == 0 && seq + 1 < s.num_seqs &&
      p.cu_seqlens_padded[seq + 2] == p.cu_seqlens_padded[seq + 1]) {
    return RowLocation{-1, 0};
  }
  return position_to_local_row(p.cu_seqlens_padded, s, seq, pos);
}

template <bool kMayRoll = true>
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
  const RowLocation loc = reading_row<kMayRoll>(p, seq, q, len);
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
  // (offsets that do not start at 0, unchecked on the device, put rows before cu_out[0] in
  // sequence 0 at negative offsets: those read as zero, as rows past the pool do)
  const int64_t src = p.src_starts[j] + (out_row - p.cu_out[j]);
  return (src >= 0 && src < p.src_rows) ? src : -1;
}

}  // namespace core
}  // namespace verl_ops
