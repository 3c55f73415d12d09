// CPU row kernels: raw pointers and sizes, no ATen.
#pragma once

#include <cstdint>
#include <functional>

#include "../core/thd_rows.h"

namespace verl_ops {
namespace cpu {

// Writes output rows [row_begin, row_end) of a pack; `positions` may be null.
void pack_rows(const core::PackPlan& plan, const char* src, char* dst, int64_t* positions,
               int64_t row_bytes, int64_t row_begin, int64_t row_end);

// Writes output rows [row_begin, row_end) of an unpack.
void unpack_rows(const core::UnpackPlan& plan, const char* src, char* dst, int64_t row_bytes,
                 int64_t row_begin, int64_t row_end);

// Jagged gather of output rows [row_begin, row_end).
void jagged_gather_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                        int64_t row_bytes, int64_t row_begin, int64_t row_end);

// Adjoint of the gather: input rows [row_begin, row_end) of `src` (shaped like the gather's
// output) go to the rows they were gathered from; `dst` must be zeroed beforehand.
void jagged_scatter_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                         int64_t row_bytes, int64_t row_begin, int64_t row_end);

// Runs f(row_begin, row_end) over [0, rows) split into consecutive ranges, one per thread, where
// the output (rows * row_bytes) is large enough: at least 1 MiB per thread, on up to
// min(torch.get_num_threads(), 8) threads (on torch 2.9, whose stable ABI cannot ask: min(the
// CPUs of the process's affinity mask, OMP_NUM_THREADS if set, 8)); VERL_OPS_CPU_THREADS=N sets that count
// instead (read once). The row copies are memory-bound, and one thread reaches about half of
// what two do (torch's own copies run on its intra-op threads). For the kernels above whose
// output rows are written by one range only (pack, unpack, gather; not the scatter).
void for_row_ranges(int64_t rows, int64_t row_bytes, const std::function<void(int64_t, int64_t)>& f);

// The thread count for_row_ranges uses for `bytes` of output.
int copy_threads(int64_t bytes);

}  // namespace cpu
}  // namespace verl_ops
