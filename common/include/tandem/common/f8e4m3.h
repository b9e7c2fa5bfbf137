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
  if (std::isnan(f)) return 0x7f;
  const f8e4m3_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kF8E4M3Max) return sign | 0x7e;  // saturate (0x7e = 448)
  // The spacing of representable values at a's binade: 2^(e-3) for normals (e >= -6), 2^-9 for
  // subnormals; round a to a multiple of it, ties to even (nearbyint under the default mode).
  int e = 0;
  std::frexp(a, &e);  // a = m·2^e, m in [0.5, 1): the binade's exponent is e - 1
  const int step_exp = std::max(e - 1, -6) - 3;
  const float units = std::nearbyint(std::ldexp(a, -step_exp));  // a / step, rounded
  a = std::ldexp(units, step_exp);
  if (a >= kF8E4M3Max) return sign | 0x7e;
  if (a == 0.0f) return sign;
  std::frexp(a, &e);
  const int exponent = e - 1 + 7;                                            // biased
  if (exponent <= 0) return sign | static_cast<f8e4m3_t>(std::ldexp(a, 9));  // subnormal
  const int mantissa = static_cast<int>(std::ldexp(a, -(e - 1) + 3)) - 8;
  return sign | static_cast<f8e4m3_t>((exponent << 3) | mantissa);
}

}  // namespace tandem
