// Element-wise loops of the cpu backend (private to backend/cpu): dtype conversions, the base-2
// exponential and the row reductions of softmax. The library is built without -march and runs on
// other x86 hosts than the build, so the loops in cpu_vector_kernels.cc are compiled for
// AVX-512, AVX2 and baseline x86-64 (GCC target_clones, chosen at load time by CPU features).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "tandem/common/exp2_approx.h"

namespace tandem::gpu_worker::cpu {

using ::tandem::Exp2Approx;        // tandem/common/exp2_approx.h
using ::tandem::Exp2ApproxLanes;

// IEEE binary16 <-> binary32 (round to nearest even; overflow gives inf; NaN stays NaN).
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m · 2^-24
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);
    return sign != 0 ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

inline uint16_t FloatToF16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)
    return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: subnormal half; v · 2^24 is exact, rint rounds to even
    const float v = std::bit_cast<float>(ax);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t r = ax - ((127u - 15u) << 23);  // rebias the exponent
  r += 0xfffu + ((r >> 13) & 1u);          // round the 13 dropped mantissa bits to nearest even
  return static_cast<uint16_t>(sign | (r >> 13));
}

// dst[i] = float(src[i]) for bf16 bits src.
void Bf16ToF32(const uint16_t* src, float* dst, int64_t n);
// dst[i] = bf16(src[i]), round to nearest even (NaN stays NaN), as tandem::FloatToBf16.
void F32ToBf16(const float* src, uint16_t* dst, int64_t n);
// dst[i] = float(bf16(src[i])): the value F32ToBf16 then Bf16ToF32 give, in one pass.
void RoundToBf16(const float* src, float* dst, int64_t n);

// max_i x[i] (-inf for n = 0).
float RowMax(const float* x, int64_t n);
// x[i] = 2^(x[i] - m) in place; returns the sum. m must be finite.
float Exp2RowInPlace(float* x, int64_t n, float m);
// col[i] += 2^(x[i] - m). m must be finite.
void Exp2AddToColumns(const float* x, int64_t n, float m, float* col);
// Σ_i 2^((x[i] - offset) · scale).
float SumExp2Shifted(const float* x, int64_t n, float offset, float scale);
// x[i] *= c.
void ScaleRow(float* x, int64_t n, float c);
// dst[i] = src[i] · c.
void ScaleCopy(const float* src, int64_t n, float c, float* dst);
// Causal mask of one score row: x[i] = -inf unless 0 <= slot_pos[i] <= q_pos.
void MaskRow(float* x, int64_t n, const int32_t* slot_pos, int32_t q_pos);
// Σ_i x[i]^2.
float SumSquares(const float* x, int64_t n);
// out[i] = x[i] · inv_rms · w[i].
void ScaleByWeights(const float* x, const float* w, float inv_rms, int64_t n, float* out);
// out[i] = silu(gate[i]) · up[i], silu(x) = x / (1 + e^-x).
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

}  // namespace tandem::gpu_worker::cpu
