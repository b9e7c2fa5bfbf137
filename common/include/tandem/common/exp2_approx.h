// A branch-free 2^x for f32 loops the compiler vectorises: the softmax kernels of the CPU node
// (cpu_attention) and of the cpu backend (gpu_worker/backend/cpu) share it.
#pragma once

#include <bit>
#include <cstdint>

namespace tandem {

// 2^x with ~2 ulp relative error (Cephes exp2f: x = n + f, |f| <= 1/2, degree-6 polynomial),
// branch-free so that loops vectorise. x < -126 (including -inf) gives exactly 0, which masked
// scores rely on; x > 127 saturates at 2^127.
inline float Exp2Approx(float x) {
  const float xc = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc + magic;
  const float fn = t - magic;
  const int32_t n = static_cast<int32_t>(std::bit_cast<uint32_t>(t) - 0x4B400000u);
  const float f = xc - fn;
  float y = 1.535336188319500e-4f;
  y = y * f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  y = y * f + 1.0f;
  const float r = y * std::bit_cast<float>(static_cast<uint32_t>(n + 127) << 23);
  return x < -126.0f ? 0.0f : r;
}

}  // namespace tandem
