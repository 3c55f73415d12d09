#include "router_kernels.h"

#include <cstring>

namespace verl_ops {
namespace cpu {

namespace {

template <typename T>
int64_t record_rows(const core::RouterRecordPlan& plan, const core::LayerSlice* layers,
                    int64_t num_layers, int64_t topk, int16_t* out, int64_t row_begin,
                    int64_t row_end, int64_t* bad_value) {
  int64_t bad = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t s = core::router_record_source_row(plan, r);
    int16_t* dst = out + r * num_layers * topk;
    if (s < 0) {
      std::memset(dst, 0, static_cast<size_t>(num_layers * topk) * sizeof(int16_t));
      continue;
    }
    for (int64_t l = 0; l < num_layers; ++l) {
      const T* src = static_cast<const T*>(layers[l].ptr) + s * layers[l].row_stride;
      const int64_t cs = layers[l].col_stride;
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t v = static_cast<int64_t>(src[k * cs]);
        if (core::fits_int16(v)) {
          dst[l * topk + k] = static_cast<int16_t>(v);
        } else {
          if (bad == 0) *bad_value = v;
          ++bad;
          dst[l * topk + k] = core::kOutOfRangeIndex;
        }
      }
    }
  }
  return bad;
}

template <typename T>
void scatter_rows(const core::RouterScatterPlan& plan, const T* routes, int64_t num_layers,
                  int64_t topk, const bool* replay_in, int64_t* targets, bool* replay_out,
                  int64_t rows, int64_t row_begin, int64_t row_end) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const int64_t s = core::router_scatter_source_row(plan, t);
    if (replay_out != nullptr) replay_out[t] = s >= 0 && replay_in[s];
    for (int64_t l = 0; l < num_layers; ++l) {
      int64_t* dst = targets + (l * rows + t) * topk;
      if (s < 0) {
        std::memset(dst, 0, static_cast<size_t>(topk) * sizeof(int64_t));
        continue;
      }
      const T* src = routes + (s * num_layers + l) * topk;
      for (int64_t k = 0; k < topk; ++k) dst[k] = static_cast<int64_t>(src[k]);
    }
  }
}

}  // namespace

int64_t router_record_rows(const core::RouterRecordPlan& plan, const core::LayerSlice* layers,
                           int64_t num_layers, int64_t topk, core::IndexDtype dtype, int16_t* out,
                           int64_t row_begin, int64_t row_end, int64_t* bad_value) {
  switch (dtype) {
    case core::IndexDtype::kUInt8:
      return record_rows<uint8_t>(plan, layers, num_layers, topk, out, row_begin, row_end, bad_value);
    case core::IndexDtype::kInt8:
      return record_rows<int8_t>(plan, layers, num_layers, topk, out, row_begin, row_end, bad_value);
    case core::IndexDtype::kInt16:
      return record_rows<int16_t>(plan, layers, num_layers, topk, out, row_begin, row_end, bad_value);
    case core::IndexDtype::kInt32:
      return record_rows<int32_t>(plan, layers, num_layers, topk, out, row_begin, row_end, bad_value);
    case core::IndexDtype::kInt64:
      return record_rows<int64_t>(plan, layers, num_layers, topk, out, row_begin, row_end, bad_value);
  }
  return 0;
}

void router_scatter_rows(const core::RouterScatterPlan& plan, const void* routes,
                         core::IndexDtype dtype, int64_t num_layers, int64_t topk,
                         const bool* replay_in, int64_t* targets, bool* replay_out, int64_t rows,
                         int64_t row_begin, int64_t row_end) {
  switch (dtype) {
    case core::IndexDtype::kUInt8:
      return scatter_rows(plan, static_cast<const uint8_t*>(routes), num_layers, topk, replay_in,
                          targets, replay_out, rows, row_begin, row_end);
    case core::IndexDtype::kInt8:
      return scatter_rows(plan, static_cast<const int8_t*>(routes), num_layers, topk, replay_in,
                          targets, replay_out, rows, row_begin, row_end);
    case core::IndexDtype::kInt16:
      return scatter_rows(plan, static_cast<const int16_t*>(routes), num_layers, topk, replay_in,
                          targets, replay_out, rows, row_begin, row_end);
    case core::IndexDtype::kInt32:
      return scatter_rows(plan, static_cast<const int32_t*>(routes), num_layers, topk, replay_in,
                          targets, replay_out, rows, row_begin, row_end);
    case core::IndexDtype::kInt64:
      return scatter_rows(plan, static_cast<const int64_t*>(routes), num_layers, topk, replay_in,
                          targets, replay_out, rows, row_begin, row_end);
  }
}

}  // namespace cpu
}  // namespace verl_ops
