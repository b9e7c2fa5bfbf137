// float8 e4m3 ("e4m3fn", the FP8 of Hopper tensor cores and of FP8 checkpoints: safetensors
// F8_E4M3, torch.float8_e4m3fn) <-> float on the host. 1 sign, 4 exponent (bias 7), 3 mantissa
// bits; no infinities; 0x7f / 0xff are NaN; the largest finite magnitude is 448, the smallest
// subnormal 2^-9. Decoding is exact; encoding rounds to nearest-even and saturates finite values
// beyond 448 to ±448 (as torch's and the cuda __nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)
// do), NaN stays NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

using f8e4m3_t = uint8_t;  // raw bits of a float8 e4m3fn

constexpr float kF8E4M3Max = 448.0f;

inline float F8E4M3ToFloat(f8e4m3_t x) {
  const float sign = (x & 0x80u) != 0 ? -1.0f : 1.0f;
  const int exponent = (x >> 3) & 0xf;
  const int mantissa = x & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // subnormal
  return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
}

inline f8e4m3_t FloatToF8E4M3(float f) {
  // On the float's bits (about 2 ns, so quantizing a model at load is quick): the same codes as
  // rounding |f| to a multiple of its binade's e4m3 spacing with nearbyint (checked for every
  // float; tests/common/f8e4m3_test.cc keeps that definition as its reference).
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const f8e4m3_t sign = static_cast<f8e4m3_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7f;          // NaN
  if (abs_bits >= 0x43e00000u) return sign | 0x7e;  // >= 448 or inf: saturate (0x7e = 448)
  if (abs_bits < 0x3c800000u) {
    // Below 2^-6, the smallest normal: the subnormal codes m·2^-9 (m = 8 is 2^-6 itself, code
    // 0x08). |f|·2^9 is exact; nearbyint rounds it to nearest-even under the default mode.
    float a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    return sign | static_cast<f8e4m3_t>(std::nearbyint(a * 512.0f));
  }
  // A normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to
  // even; a carry out of the mantissa moves to the next binade, and nothing below 448 reaches
  // 0x7f (NaN).
  uint32_t r = abs_bits - (120u << 23);
  r += 0x7ffffu + ((r >> 20) & 1u);
  return sign | static_cast<f8e4m3_t>(r >> 20);
}

}  // namespace tandem
