// Router replay (docs/router_replay.md): which row feeds which, for the record (merge) and replay
// (scatter) kernels. Shared verbatim by the CPU loops and the CUDA kernels.
//
// Record: every MoE layer l recorded top-k indices for this rank's sequence-parallel rows,
// `[T_sp, K]` each. The record kernel reads the L layer tensors directly (one pointer per layer)
// and writes `[rows, L, K]` int16; a row is either the local row itself (before the TP / CP
// gathers) or, when nothing needs gathering (tp = cp = 1), the valid token that the unpack
// would put there (one launch from the layers to the per-sequence result).
//
// Replay: the inverse. Local row t of TP rank p is row p * T_sp + t of the CP rank's THD rows
// (Megatron's sequence-parallel split: T_sp = local_rows / tp contiguous chunks); the pack
// resolver gives the token feeding it, and the kernel writes `[L, T_sp, K]` int64 targets.
#pragma once

#include "thd_rows.h"

namespace verl_ops {
namespace core {

// Integer dtypes the router kernels read.
enum class IndexDtype : int32_t { kUInt8 = 0, kInt8 = 1, kInt16 = 2, kInt32 = 3, kInt64 = 4 };

// One layer's recorded indices: element (row, k) is at ptr + (row * row_stride + k * col_stride)
// elements. Any strides: the kernels read the caller's tensors as they are.
struct LayerSlice {
  const void* ptr;
  int64_t row_stride;
  int64_t col_stride;
};

struct RouterRecordPlan {
  UnpackPlan unpack;  // used when fused
  bool fused;         // false: output row r <- local row r
};

VERL_HD int64_t router_record_source_row(const RouterRecordPlan& p, int64_t out_row) {
  return p.fused ? unpack_source_row</*kMayRoll=*/false>(p.unpack, out_row) : out_row;
}

struct RouterScatterPlan {
  PackPlan pack;            // cp_rank >= 0: rows of this CP rank
  int64_t rows_per_tp_rank; // T_sp = local_rows / tp_size
  int64_t tp_rank;
};

// Token row (of the jagged / padded routes) feeding local sequence-parallel row `row`, or -1.
VERL_HD int64_t router_scatter_source_row(const RouterScatterPlan& p, int64_t row) {
  int64_t position = 0;
  return pack_source_row(p.pack, p.tp_rank * p.rows_per_tp_rank + row, &position);
}

VERL_HD bool fits_int16(int64_t v) { return v >= -32768 && v <= 32767; }

// The CUDA record kernel reports ids outside the int16 range in an int32 flag tensor of this many
// slots: every block writes its own slots (all of them, zero or one), so the tensor needs no
// zeroing launch before the kernel. Any non-zero slot means an overflow.
constexpr int64_t kOverflowSlots = 4096;

// Stored in place of an index outside the int16 range when the range error is reported lazily
// (CUDA): never a valid expert id.
constexpr int16_t kOutOfRangeIndex = -1;

}  // namespace core
}  // namespace verl_ops
