// bfloat16 <-> float conversion on the host. bf16 is the upper half of an IEEE binary32; the
// conversion rounds to nearest-even, and NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {

using bf16_t = uint16_t;  // raw bits of a bfloat16

inline float Bf16ToFloat(bf16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline bf16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<bf16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding_bias) >> 16);
}

}  // namespace tandem
