// IEEE binary16 ("half", safetensors F16) -> float on the host. Exact: every half is a float.
// Subnormals (exponent 0) are m·2^-24, exponent 31 is inf (m = 0) or NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {

using f16_t = uint16_t;  // raw bits of a binary16

inline float F16ToFloat(f16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: m·2^-24, exact in float.
    const float v = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &v, sizeof(bits));
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace tandem
