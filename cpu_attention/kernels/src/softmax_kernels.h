// Element-wise kernels of the chunked online softmax in sparse_attention.cc (private to
// cpu_attention; include from that file only).
//
// Scores of one chunk lie in a flat [keys, M] array: index i is key i / M, query row i % M. The
// kernels walk it in blocks of `w` elements (w: a multiple of M and of 16), so a per-row vector
// replicated with period M (m2_rep, max_rep, sum_rep: [w]) lines up with every block. With the
// bf16 split the raw score of i is st[2i] + st[2i+1] (hi row + lo row of the matmul), else st[i].
// Exponentials are base 2 on scores pre-multiplied by log2(e) (one multiply fewer per element).
//
// The library is built without -march and runs on other hosts than the build: the portable
// kernels are compiled for AVX-512, AVX2 and baseline x86-64 (target_clones), and hand-written
// AVX-512 ones (with AVX512_BF16 conversions where present) are picked at run time.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "tandem/common/exp2_approx.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define TANDEM_X86_KERNELS 1
#define TANDEM_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_X86_KERNELS 0
#define TANDEM_VECTOR_CLONES
#endif

namespace tandem::cpu_attention::internal {

struct SoftmaxKernels {
  // max_rep[j] = max of raw[i] over i = j (mod w), i < count.
  void (*row_max)(const float* st, bool split, size_t count, size_t w, float* max_rep);
  // p = 2^(raw[i] * scale2 - m2_rep[i mod w]); sum_rep[j] = sum of p over i = j (mod w);
  // p stored as bf16 pairs p_pairs[i] = hi | lo << 16 (hi = bf16(p), lo = bf16(p - hi)), i.e.
  // matmul rows 2r (hi) and 2r + 1 (lo) of the key-major P. Split layout of st only.
  void (*exp_split)(const float* st, size_t count, size_t w, float scale2, const float* m2_rep,
                    float* sum_rep, uint32_t* p_pairs);
  // As exp_split with f32 probabilities p_out[i] (no split: f32 KV).
  void (*exp_f32)(const float* st, size_t count, size_t w, float scale2, const float* m2_rep,
                  float* sum_rep, float* p_out);
  const char* name;
};

namespace portable {

constexpr size_t kLanes = 16;

// Round to nearest even bf16 of a finite float, as the low 16 bits of a uint32.
inline uint32_t Bf16Bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

inline float Bf16BitsToFloat(uint32_t b) { return std::bit_cast<float>(b << 16); }

using ::tandem::Exp2Approx;

inline float Raw(const float* st, bool split, size_t i) {
  return split ? st[2 * i] + st[2 * i + 1] : st[i];
}

TANDEM_VECTOR_CLONES
static void RowMax(const float* st, bool split, size_t count, size_t w, float* max_rep) {
  for (size_t j = 0; j < w; ++j) max_rep[j] = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < count; i += w) {
    const size_t len = std::min(w, count - i);
    size_t j = 0;
    if (split) {
      const float* src = st + 2 * i;
      for (; j + kLanes <= len; j += kLanes) {
#pragma omp simd
        for (size_t l = j; l < j + kLanes; ++l) {
          const float v = src[2 * l] + src[2 * l + 1];
          max_rep[l] = v > max_rep[l] ? v : max_rep[l];
        }
      }
    } else {
      const float* src = st + i;
      for (; j + kLanes <= len; j += kLanes) {
#pragma omp simd
        for (size_t l = j; l < j + kLanes; ++l) {
          max_rep[l] = src[l] > max_rep[l] ? src[l] : max_rep[l];
        }
      }
    }
    for (; j < len; ++j) max_rep[j] = std::max(max_rep[j], Raw(st, split, i + j));
  }
}

inline uint32_t ExpSplitOne(float raw, float scale2, float m2, float& sum) {
  const float p = Exp2Approx(raw * scale2 - m2);
  sum += p;
  const uint32_t hi = Bf16Bits(p);
  const uint32_t lo = Bf16Bits(p - Bf16BitsToFloat(hi));
  return hi | (lo << 16);
}

TANDEM_VECTOR_CLONES
static void ExpSplit(const float* st, size_t count, size_t w, float scale2, const float* m2_rep,
                     float* sum_rep, uint32_t* p_pairs) {
  for (size_t j = 0; j < w; ++j) sum_rep[j] = 0.0f;
  for (size_t i = 0; i < count; i += w) {
    const size_t len = std::min(w, count - i);
    const float* src = st + 2 * i;
    uint32_t* dst = p_pairs + i;
    size_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
#pragma omp simd
      for (size_t l = j; l < j + kLanes; ++l) {
        dst[l] = ExpSplitOne(src[2 * l] + src[2 * l + 1], scale2, m2_rep[l], sum_rep[l]);
      }
    }
    for (; j < len; ++j) {
      dst[j] = ExpSplitOne(src[2 * j] + src[2 * j + 1], scale2, m2_rep[j], sum_rep[j]);
    }
  }
}

TANDEM_VECTOR_CLONES
static void ExpF32(const float* st, size_t count, size_t w, float scale2, const float* m2_rep,
                   float* sum_rep, float* p_out) {
  for (size_t j = 0; j < w; ++j) sum_rep[j] = 0.0f;
  for (size_t i = 0; i < count; i += w) {
    const size_t len = std::min(w, count - i);
    const float* src = st + i;
    float* dst = p_out + i;
    size_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
#pragma omp simd
      for (size_t l = j; l < j + kLanes; ++l) {
        dst[l] = Exp2Approx(src[l] * scale2 - m2_rep[l]);
        sum_rep[l] += dst[l];
      }
    }
    for (; j < len; ++j) {
      dst[j] = Exp2Approx(src[j] * scale2 - m2_rep[j]);
      sum_rep[j] += dst[j];
    }
  }
}

}  // namespace portable

#if TANDEM_X86_KERNELS
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized on _mm512_undefined_* (GCC PR 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TANDEM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// Raw scores of lanes [l, l + 16) (the first `n` valid) from the split layout: the hi + lo pair
// sums of 32 consecutive floats.
TANDEM_AVX512 inline __m512 LoadSplitRaw(const float* st, size_t l, unsigned n) {
  const uint32_t m32 = n >= 16 ? 0xffffffffu : (1u << (2 * n)) - 1u;
  const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m32), st + 2 * l);
  const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m32 >> 16), st + 2 * l + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

TANDEM_AVX512 inline __mmask16 LaneMask(unsigned n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// 2^x for a vector (same polynomial as portable::Exp2Approx); scalef handles every exponent,
// down to 0 for very negative x.
TANDEM_AVX512 inline __m512 Exp2(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.535336188319500e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.339887440266574e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618437357674640e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550332471162809e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402264791363012e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931472028550421e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

TANDEM_AVX512 static void RowMax(const float* st, bool split, size_t count, size_t w,
                                 float* max_rep) {
  for (size_t j = 0; j < w; ++j) max_rep[j] = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < count; i += w) {
    const size_t len = std::min(w, count - i);
    for (size_t l = 0; l < len; l += 16) {
      const unsigned n = static_cast<unsigned>(std::min<size_t>(16, len - l));
      const __mmask16 mask = LaneMask(n);
      const __m512 raw =
          split ? LoadSplitRaw(st + 2 * i, l, n) : _mm512_maskz_loadu_ps(mask, st + i + l);
      const __m512 cur = _mm512_loadu_ps(max_rep + l);
      _mm512_storeu_ps(max_rep + l, _mm512_mask_max_ps(cur, mask, cur, raw));
    }
  }
}

// bf16 (hi, lo) pairs of p, integer round-to-nearest-even (no AVX512_BF16).
TANDEM_AVX512 inline __m512i SplitPairs(__m512 p) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i u = _mm512_castps_si512(p);
  const __m512i hi = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)),
      16);
  const __m512 r = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  const __m512i v = _mm512_castps_si512(r);
  const __m512i lo = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(v, bias), _mm512_and_si512(_mm512_srli_epi32(v, 16), one)),
      16);
  return _mm512_or_si512(hi, _mm512_slli_epi32(lo, 16));
}

// The same with the AVX512_BF16 conversion (round to nearest even; denormals flush to 0).
TANDEM_AVX512_BF16 inline __m512i SplitPairsBf16(__m512 p) {
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
  const __m512 r = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r));
  return _mm512_or_si512(hi, _mm512_slli_epi32(lo, 16));
}

#define TANDEM_EXP_SPLIT_BODY(SPLIT)                                                              \
  for (size_t j = 0; j < w; ++j) sum_rep[j] = 0.0f;                                               \
  const __m512 s2 = _mm512_set1_ps(scale2);                                                       \
  for (size_t i = 0; i < count; i += w) {                                                         \
    const size_t len = std::min(w, count - i);                                                    \
    for (size_t l = 0; l < len; l += 16) {                                                        \
      const unsigned n = static_cast<unsigned>(std::min<size_t>(16, len - l));                    \
      const __mmask16 mask = LaneMask(n);                                                         \
      const __m512 raw = LoadSplitRaw(st + 2 * i, l, n);                                          \
      const __m512 p =                                                                            \
          _mm512_maskz_mov_ps(mask, Exp2(_mm512_fmsub_ps(raw, s2, _mm512_loadu_ps(m2_rep + l)))); \
      _mm512_storeu_ps(sum_rep + l, _mm512_add_ps(_mm512_loadu_ps(sum_rep + l), p));              \
      _mm512_mask_storeu_epi32(p_pairs + i + l, mask, SPLIT(p));                                  \
    }                                                                                             \
  }

TANDEM_AVX512 static void ExpSplit(const float* st, size_t count, size_t w, float scale2,
                                   const float* m2_rep, float* sum_rep,
                                   uint32_t* p_pairs){TANDEM_EXP_SPLIT_BODY(SplitPairs)}

TANDEM_AVX512_BF16
    static void ExpSplitBf16(const float* st, size_t count, size_t w, float scale2,
                             const float* m2_rep, float* sum_rep, uint32_t* p_pairs) {
  TANDEM_EXP_SPLIT_BODY(SplitPairsBf16)
}

#undef TANDEM_EXP_SPLIT_BODY

}  // namespace avx512
#pragma GCC diagnostic pop
#endif  // TANDEM_X86_KERNELS

// The fastest kernels of ActiveCpuIsa() (tandem/cpu_isa: TANDEM_CPU_ISA=avx2 or =portable
// leaves out the hand-written AVX-512 ones, for tests and comparisons).
const SoftmaxKernels& GetSoftmaxKernels();

}  // namespace tandem::cpu_attention::internal
