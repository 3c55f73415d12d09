// CPU row kernels: raw pointers and sizes, no ATen.
#pragma once

#include <cstdint>

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

}  // namespace cpu
}  // namespace verl_ops
