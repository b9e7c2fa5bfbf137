// A branch-free 2^x for f32 loops the compiler vectorises (private to cpu_attention: the
// softmax kernels of sparse_attention.cc and paged_attention.cc).
#pragma once

#include <bit>
#include <cstdint>

namespace tandem::cpu_attention::internal {

// 2^x (Cephes exp2f: x = n + f, |f| <= 1/2, degree-6 polynomial, ~2 ulp), branch-free so that
// loops vectorise. x below -126 gives 2^-126-ish instead of a denormal: negligible next to the
// row's largest term, which is 1.
inline float Exp2Approx(float x) {
  x = x > -126.0f ? x : -126.0f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x + magic;
  const float fn = t - magic;
  const int32_t n = static_cast<int32_t>(std::bit_cast<uint32_t>(t) - 0x4B400000u);
  const float f = x - fn;
  float y = 1.535336188319500e-4f;
  y = y * f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  y = y * f + 1.0f;
  return y * std::bit_cast<float>(static_cast<uint32_t>(n + 127) << 23);
}

}  // namespace tandem::cpu_attention::internal
