// CPU router replay kernels: raw pointers and sizes, no ATen.
#pragma once

#include <cstdint>

#include "../core/router_rows.h"

namespace verl_ops {
namespace cpu {

// Writes output rows [row_begin, row_end) of `out` ([rows, L, K] int16, row-major) from the L
// layer slices (`layers[l]`, dtype `dtype`). Returns how many values did not fit int16 (those
// are stored as core::kOutOfRangeIndex) and, when there was one, the first such value in
// `bad_value`.
int64_t router_record_rows(const core::RouterRecordPlan& plan, const core::LayerSlice* layers,
                           int64_t num_layers, int64_t topk, core::IndexDtype dtype, int16_t* out,
                           int64_t row_begin, int64_t row_end, int64_t* bad_value);

// Writes local rows [row_begin, row_end) of `targets` ([L, rows, K] int64) from `routes`
// ([token rows, L, K] contiguous, dtype `dtype`); padding rows are zero. When `replay_in` is
// given ([token rows] bool), `replay_out[row]` is the flag of the token feeding the row (false
// for padding rows).
void router_scatter_rows(const core::RouterScatterPlan& plan, const void* routes,
                         core::IndexDtype dtype, int64_t num_layers, int64_t topk,
                         const bool* replay_in, int64_t* targets, bool* replay_out, int64_t rows,
                         int64_t row_begin, int64_t row_end);

}  // namespace cpu
}  // namespace verl_ops
