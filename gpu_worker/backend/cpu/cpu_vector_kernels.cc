#include "cpu_vector_kernels.h"

#include <cstring>
#include <limits>
#include <numbers>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TANDEM_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_CPU_CLONES
#endif

namespace tandem::gpu_worker::cpu {
namespace {

// bf16(f) as the low 16 bits: round to nearest even; NaN stays a (quiet) NaN. Inlined into the
// vectorised loops of F32ToBf16 and RoundToBf16, so both round alike.
inline uint32_t Bf16Bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return nan ? ((u >> 16) | 0x40u) : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// The 2^x loops run on 8-lane GCC vectors with Exp2ApproxLanes, then a scalar tail: GCC 12
// vectorised the scalar Exp2Approx loops only in the AVX-512 clone (with masks); the AVX2 clone
// stayed scalar ("control flow in loop", `#pragma omp simd` included). 8 lanes are a ymm in the
// v3 and v4 clones and two xmm in the default one. Always inlined, so no vector crosses a call.
#pragma GCC diagnostic ignored "-Wpsabi"
using V8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline __attribute__((always_inline)) V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline __attribute__((always_inline)) void Store8(float* p, V8 v) {
  std::memcpy(p, &v, sizeof(v));
}
inline __attribute__((always_inline)) float Sum8(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

}  // namespace

TANDEM_CPU_CLONES
void Bf16ToF32(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
}

TANDEM_CPU_CLONES
void RoundToBf16(const float* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(Bf16Bits(src[i]) << 16);
}

TANDEM_CPU_CLONES
void F32ToBf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(Bf16Bits(src[i]));
}

TANDEM_CPU_CLONES
float RowMax(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

TANDEM_CPU_CLONES
float Exp2RowInPlace(float* x, int64_t n, float m) {
  V8 lanes{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V8 p = Exp2ApproxLanes(Load8(x + i) - m);
    Store8(x + i, p);
    lanes += p;
  }
  float sum = Sum8(lanes);
  for (; i < n; ++i) {
    x[i] = Exp2Approx(x[i] - m);
    sum += x[i];
  }
  return sum;
}

TANDEM_CPU_CLONES
void Exp2AddToColumns(const float* x, int64_t n, float m, float* col) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Store8(col + i, Load8(col + i) + Exp2ApproxLanes(Load8(x + i) - m));
  }
  for (; i < n; ++i) col[i] += Exp2Approx(x[i] - m);
}

TANDEM_CPU_CLONES
float SumExp2Shifted(const float* x, int64_t n, float offset, float scale) {
  V8 lanes{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) lanes += Exp2ApproxLanes((Load8(x + i) - offset) * scale);
  float sum = Sum8(lanes);
  for (; i < n; ++i) sum += Exp2Approx((x[i] - offset) * scale);
  return sum;
}

TANDEM_CPU_CLONES
void ScaleRow(float* x, int64_t n, float c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= c;
}

TANDEM_CPU_CLONES
void ScaleCopy(const float* src, int64_t n, float c, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * c;
}

TANDEM_CPU_CLONES
void MaskRow(float* x, int64_t n, const int32_t* slot_pos, int32_t q_pos) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const bool visible = slot_pos[i] >= 0 && slot_pos[i] <= q_pos;
    x[i] = visible ? x[i] : kNegInf;
  }
}

TANDEM_CPU_CLONES
float SumSquares(const float* x, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

TANDEM_CPU_CLONES
void ScaleByWeights(const float* x, const float* w, float inv_rms, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv_rms * w[i];
}

TANDEM_CPU_CLONES
void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  constexpr float kLog2e = std::numbers::log2e_v<float>;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V8 g = Load8(gate + i);
    Store8(out + i, g / (1.0f + Exp2ApproxLanes(-g * kLog2e)) * Load8(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + Exp2Approx(-g * kLog2e)) * up[i];
  }
}

}  // namespace tandem::gpu_worker::cpu
