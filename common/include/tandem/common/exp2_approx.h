// 2^x for the softmax kernels of the CPU node (cpu_attention) and of the cpu backend
// (gpu_worker/backend/cpu): a scalar form for loops the compiler may vectorise, and a lane form
// on GCC vectors for loops it must.
#pragma once

#include <bit>
#include <cstdint>

namespace tandem {

// 2^f for |f| <= 1/2 (Cephes exp2f's degree-6 polynomial), for a float or a GCC vector of
// floats: the one polynomial of both forms below.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename T>
inline __attribute__((always_inline)) T Exp2Polynomial(T f) {
  T y = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  return y * f + 1.0f;
}
#pragma GCC diagnostic pop

// 2^x with ~2 ulp relative error (Cephes exp2f: x = n + f, |f| <= 1/2, degree-6 polynomial),
// written with selects so that loops can vectorise (GCC 12 does with AVX-512 masks; its AVX2
// clones of such loops stayed scalar: Exp2ApproxLanes below). x < -126 (including -inf) gives
// exactly 0, which masked scores rely on; x > 127 saturates at 2^127.
inline float Exp2Approx(float x) {
  const float xc = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = xc + magic;
  const float fn = t - magic;
  const int32_t n = static_cast<int32_t>(std::bit_cast<uint32_t>(t) - 0x4B400000u);
  const float f = xc - fn;
  const float r = Exp2Polynomial(f) * std::bit_cast<float>(static_cast<uint32_t>(n + 127) << 23);
  return x < -126.0f ? 0.0f : r;
}

// Exp2Approx on every lane of a GCC vector of floats (float __attribute__((vector_size(N)))):
// the same clamps and polynomial; -inf lanes give exactly 0. Inlined into the caller, so the
// caller's instruction set decides the registers. NOTE: a loop of the scalar form is not always
// vectorised: GCC 12 kept the paged scan's softmax loop scalar, `#pragma omp simd` included
// (the selects stayed branches). Always inlined, so no vector crosses a call: GCC's ABI note
// for vector returns does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename V>
inline __attribute__((always_inline)) V Exp2ApproxLanes(V x) {
  using Bits = decltype(x < x);  // int32 lanes of the same size: -1 where a comparison holds
  const V lo = V{} - 126.0f, hi = V{} + 127.0f;
  const Bits below = x < lo, above = x > hi;
  const V xc = (V)((below & (Bits)lo) | (above & (Bits)hi) | (~(below | above) & (Bits)x));
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V t = xc + magic;
  const V fn = t - magic;
  const Bits n = (Bits)t - 0x4B400000;
  const V f = xc - fn;
  const V r = Exp2Polynomial(f) * (V)((n + 127) << 23);
  return (V)(~below & (Bits)r);
}
#pragma GCC diagnostic pop

}  // namespace tandem
