#include "thd_kernels.h"

#include <cstring>

namespace verl_ops {
namespace cpu {

namespace {
inline void copy_or_zero(char* dst, const char* src, int64_t src_row, int64_t row_bytes) {
  if (src_row >= 0) {
    std::memcpy(dst, src + src_row * row_bytes, static_cast<size_t>(row_bytes));
  } else {
    std::memset(dst, 0, static_cast<size_t>(row_bytes));
  }
}
}  // namespace

void pack_rows(const core::PackPlan& plan, const char* src, char* dst, int64_t* positions,
               int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    int64_t pos = 0;
    const int64_t s = core::pack_source_row(plan, r, &pos);
    if (positions != nullptr) positions[r] = pos;
    copy_or_zero(dst + r * row_bytes, src, s, row_bytes);
  }
}

void unpack_rows(const core::UnpackPlan& plan, const char* src, char* dst, int64_t row_bytes,
                 int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    copy_or_zero(dst + r * row_bytes, src, core::unpack_source_row(plan, r), row_bytes);
  }
}

void jagged_gather_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                        int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    copy_or_zero(dst + r * row_bytes, src, core::jagged_source_row(plan, r), row_bytes);
  }
}

void jagged_scatter_rows(const core::JaggedGatherPlan& plan, const char* src, char* dst,
                         int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t d = core::jagged_source_row(plan, r);
    if (d >= 0) std::memcpy(dst + d * row_bytes, src + r * row_bytes, static_cast<size_t>(row_bytes));
  }
}

}  // namespace cpu
}  // namespace verl_ops
