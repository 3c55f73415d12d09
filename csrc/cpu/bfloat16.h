// bfloat16 on the CPU kernels' side: the upper half of a float32, rounded to nearest even (NaN stays
// NaN), as torch rounds it. The CPU kernels keep bfloat16 data as uint16_t bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace verl_ops {
namespace cpu {

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace cpu
}  // namespace verl_ops
