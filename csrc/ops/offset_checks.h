// Checks of the THD offsets (cu_seqlens, cu_seqlens_padded) and of the attention mask that the THD
// and router ops share.
// Inline: verl_ops._C_layers compiles router_ops.cpp without thd_ops.cpp.
#pragma once

#include <cstdint>

#include "../core/thd_layout.h"
#include "stable.h"

namespace verl_ops {
namespace ops {

// `name` on the data's device (the one device check of the offsets and the masks).
inline void check_on_data_device(const char* op, const char* name, const st::Tensor& t, const st::Tensor& data) {
  VERL_CHECK(st::same_device(t, data), op, ": ", name, " is on ", st::device_of(t), " but the data is on ",
             st::device_of(data));
}

// An offsets tensor: int32 [B + 1] on the data's device.
inline void check_offsets(const char* op, const char* name, const st::Tensor& t, const st::Tensor& data) {
  VERL_CHECK(t.scalar_type() == st::kInt, op, ": ", name, " must be int32, got ", st::dtype_name(t.scalar_type()));
  VERL_CHECK(t.dim() == 1 && t.size(0) >= 1, op, ": ", name, " must be 1-D with B + 1 >= 1 entries, got shape ",
             st::shape_of(t));
  check_on_data_device(op, name, t, data);
}

inline void check_offset_pair(const char* op, const st::Tensor& cu, const st::Tensor& cu_padded,
                              const st::Tensor& data) {
  check_offsets(op, "cu_seqlens", cu, data);
  check_offsets(op, "cu_seqlens_padded", cu_padded, data);
  VERL_CHECK(cu.size(0) == cu_padded.size(0), op, ": cu_seqlens and cu_seqlens_padded must have the same length, got ",
             cu.size(0), " and ", cu_padded.size(0));
}

// A host layout's consistency with itself: both offsets start at 0, the lengths are non-decreasing
// offsets, each padded length holds its tokens and, under zigzag with cp_size > 1, is a multiple
// of 2 * cp_size. Returns cu_seqlens_padded[-1], which the caller checks against the rows of its
// data. Host tensors only: device layouts are checked by ThdLayout on its host copy when built
// (reading them here would synchronise).
inline int64_t check_host_offsets(const char* op, const st::Tensor& cu, const st::Tensor& cu_padded, int64_t cp_size,
                                 core::CpLayout layout) {
  const int64_t B = cu.size(0) - 1;
  const int32_t* c = st::ptr<int32_t>(cu);
  const int32_t* p = st::ptr<int32_t>(cu_padded);
  VERL_CHECK(c[0] == 0, op, ": cu_seqlens must start at 0, got ", c[0]);
  VERL_CHECK(p[0] == 0, op, ": cu_seqlens_padded must start at 0, got ", p[0]);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = static_cast<int64_t>(c[i + 1]) - c[i];
    const int64_t padded = static_cast<int64_t>(p[i + 1]) - p[i];
    VERL_CHECK(len >= 0, op, ": cu_seqlens must be non-decreasing, got ", c[i], " then ", c[i + 1], " at index ", i);
    VERL_CHECK(padded >= len, op, ": cu_seqlens_padded gives sequence ", i, " ", padded, " rows, fewer than its ", len,
               " tokens");
    VERL_CHECK(layout != core::CpLayout::kZigzag || cp_size == 1 || padded % (2 * cp_size) == 0, op,
               ": zigzag with cp_size=", cp_size, " needs every padded length to be a multiple of 2*cp_size, sequence ",
               i, " has ", padded);
  }
  return p[B];
}

// attention_mask: bool [B, S] on the data's device, one row per sequence of the layout.
inline void check_mask_arg(const char* op, const st::Tensor& mask, int64_t batch, const st::Tensor& data) {
  VERL_CHECK(mask.scalar_type() == st::kBool, op, ": attention_mask must be bool, got ",
             st::dtype_name(mask.scalar_type()));
  VERL_CHECK(mask.dim() == 2, op, ": attention_mask must be [B, S], got shape ", st::shape_of(mask));
  check_on_data_device(op, "attention_mask", mask, data);
  VERL_CHECK(mask.size(0) == batch, op, ": attention_mask has ", mask.size(0), " rows but the layout has ", batch,
             " sequences");
}

// A host mask (as its inclusive prefix counts, [B, S] int32) against a host layout: row i holds
// sequence i's tokens.
inline void check_host_mask(const char* op, const st::Tensor& mask_csum, const st::Tensor& cu) {
  const int64_t B = mask_csum.size(0), S = mask_csum.size(1);
  const int32_t* m = st::ptr<int32_t>(mask_csum);
  const int32_t* c = st::ptr<int32_t>(cu);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t count = S > 0 ? m[i * S + S - 1] : 0;
    VERL_CHECK(count == c[i + 1] - c[i], op, ": attention_mask row ", i, " has ", count,
               " valid tokens but the layout says ", c[i + 1] - c[i]);
  }
}

}  // namespace ops
}  // namespace verl_ops
