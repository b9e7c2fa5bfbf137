#include "row_scan_kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "tandem/cpu_isa/cpu_isa.h"

// GCC and clang (the sanitizer builds) alike: the kernels carry their own target attribute.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_INT8_X86 1
#else
#define TANDEM_INT8_X86 0
#endif

namespace tandem::cpu_attention::internal {

#if TANDEM_INT8_X86
// GCC 12's intrinsic headers trip -Wmaybe-uninitialized on _mm512_undefined_* (GCC PR 105593).
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define TANDEM_INT8_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TANDEM_INT8_INLINE TANDEM_INT8_AVX512 inline __attribute__((always_inline))

namespace avx512 {
namespace {

// Keys per step of the four-row dot products (DotCodes4xK): 16 accumulators. In cache, one
// thread, G 4: 2 keys 262 us, 3 keys 248 us, 4 keys 232 us per call (8 kv heads x 2048).
constexpr size_t kKeys = 4;

// 16 codes at p as f32 lanes; `m` selects the codes read (the rest are 0 and not touched, so a
// half vector at a row's end reads no byte past it).
TANDEM_INT8_INLINE __m512 Widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
TANDEM_INT8_INLINE __m512 Widen16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
// 16 bf16 values (raw bits) at p as f32 lanes: the bits shifted into the high half (exact).
TANDEM_INT8_INLINE __m512 Widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
TANDEM_INT8_INLINE __m512 Widen16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// [Σ a0, Σ a1, Σ a2, Σ a3]: one reduction tree for four rows (13 instructions, against ~8 per
// row for separate horizontal sums).
TANDEM_INT8_INLINE __m128 Reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

// Dot products of NR query rows (q + i * d) with one row of d codes; out[i] = the sums.
template <int NR, typename Code>
TANDEM_INT8_INLINE void DotCodes(const float* q, size_t d, const Code* k, float* out) {
  __m512 acc[NR];
  for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
  size_t x = 0;
  for (; x + 16 <= d; x += 16) {
    const __m512 kv = Widen16(k + x);
    for (int i = 0; i < NR; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * d + x), kv, acc[i]);
    }
  }
  if (x < d) {  // d % 16 == 8
    const __m512 kv = Widen16(k + x, 0x00ff);
    for (int i = 0; i < NR; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(0x00ff, q + i * d + x), kv, acc[i]);
    }
  }
  if constexpr (NR == 4) {
    _mm_storeu_ps(out, Reduce4(acc[0], acc[1], acc[2], acc[3]));
  } else {
    for (int i = 0; i < NR; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
  }
}

// The same for four rows and NK code rows k[0..NK) at once: 4 * NK independent FMA chains (one
// key's 4 chains of d / 16 dependent FMAs leave the FMA units waiting on their latency).
// out[j]: the four sums of key j.
template <int NK, typename Code>
TANDEM_INT8_INLINE void DotCodes4xK(const float* q, size_t d, const std::byte* const* k,
                                    __m128* out) {
  __m512 a[NK][4];
  const Code* kr[NK];
  for (int j = 0; j < NK; ++j) {
    kr[j] = reinterpret_cast<const Code*>(k[j]);
    for (int i = 0; i < 4; ++i) a[j][i] = _mm512_setzero_ps();
  }
  size_t x = 0;
  for (; x + 16 <= d; x += 16) {
    __m512 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = Widen16(kr[j] + x);
    for (int i = 0; i < 4; ++i) {
      const __m512 qv = _mm512_loadu_ps(q + i * d + x);
      for (int j = 0; j < NK; ++j) a[j][i] = _mm512_fmadd_ps(qv, kv[j], a[j][i]);
    }
  }
  if (x < d) {  // d % 16 == 8
    __m512 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = Widen16(kr[j] + x, 0x00ff);
    for (int i = 0; i < 4; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(0x00ff, q + i * d + x);
      for (int j = 0; j < NK; ++j) a[j][i] = _mm512_fmadd_ps(qv, kv[j], a[j][i]);
    }
  }
  for (int j = 0; j < NK; ++j) out[j] = Reduce4(a[j][0], a[j][1], a[j][2], a[j][3]);
}

// Columns [x, x + 16 * NV) of acc_i += Σ_c p[i * ld + c] · codes(v[c]) for NR rows; the last
// vector covers the lanes of `last` only. NOTE: NR x NV <= 16 accumulators stay in registers
// over all n keys (an axpy per key would store and reload them).
template <int NR, int NV, typename Code>
TANDEM_INT8_INLINE void AccumulateSlice(const float* p, size_t ld, const std::byte* const* v,
                                        size_t n, size_t d, size_t x, __mmask16 last, float* acc) {
  __m512 a[NR][NV];
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < NV; ++j) {
      a[i][j] = _mm512_maskz_loadu_ps(j == NV - 1 ? last : 0xffff, acc + i * d + x + 16 * j);
    }
  }
  for (size_t c = 0; c < n; ++c) {
    const Code* row = reinterpret_cast<const Code*>(v[c]) + x;
    __m512 w[NV];
    for (int j = 0; j < NV - 1; ++j) w[j] = Widen16(row + 16 * j);
    w[NV - 1] = Widen16(row + 16 * (NV - 1), last);
    for (int i = 0; i < NR; ++i) {
      const __m512 pi = _mm512_set1_ps(p[i * ld + c]);
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(pi, w[j], a[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < NV; ++j) {
      _mm512_mask_storeu_ps(acc + i * d + x + 16 * j, j == NV - 1 ? last : 0xffff, a[i][j]);
    }
  }
}

// All columns of NR rows: slices of up to 4 vectors (64 columns), the last one maybe shorter.
template <int NR, typename Code>
TANDEM_INT8_INLINE void AccumulateRows(const float* p, size_t ld, const std::byte* const* v,
                                       size_t n, size_t d, float* acc) {
  for (size_t x = 0; x < d; x += 64) {
    const size_t cols = d - x < 64 ? d - x : 64;  // a multiple of 8
    const size_t nv = (cols + 15) / 16;
    const __mmask16 last = cols % 16 == 0 ? 0xffff : 0x00ff;
    switch (nv) {
      case 1:
        AccumulateSlice<NR, 1, Code>(p, ld, v, n, d, x, last, acc);
        break;
      case 2:
        AccumulateSlice<NR, 2, Code>(p, ld, v, n, d, x, last, acc);
        break;
      case 3:
        AccumulateSlice<NR, 3, Code>(p, ld, v, n, d, x, last, acc);
        break;
      default:
        AccumulateSlice<NR, 4, Code>(p, ld, v, n, d, x, last, acc);
        break;
    }
  }
}

}  // namespace

#define TANDEM_SCAN_TARGET TANDEM_INT8_AVX512
namespace int8 {
using Code = int8_t;
#include "row_scan_drivers.inc"
}  // namespace int8
namespace bf16 {
using Code = uint16_t;
#include "row_scan_drivers.inc"
}  // namespace bf16
#undef TANDEM_SCAN_TARGET

}  // namespace avx512

#define TANDEM_INT8_AVX2 __attribute__((target("avx2,fma")))
#define TANDEM_INT8_INLINE2 TANDEM_INT8_AVX2 inline __attribute__((always_inline))

// The same with 8-lane vectors (16 registers): d is a multiple of 8, so no lane masks.
namespace avx2 {
namespace {

// 8 accumulators + 2 keys (bf16: their even and odd halves) + q: 11 (bf16: up to 14) of the 16
// registers
constexpr size_t kKeys = 2;

// 8 codes at p as f32 lanes (reads exactly 8 bytes).
TANDEM_INT8_INLINE2 __m256 Widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 bf16 values (raw bits) at p as f32 lanes (reads exactly 16 bytes).
TANDEM_INT8_INLINE2 __m256 Widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// bf16 rows are read 16 values at a time and split by parity (the split order, ReorderSplit):
// one 32-byte load, then the even values are the low halves shifted up and the odd ones the high
// halves masked (exact), with no shuffle; Widen8's zero-extension costs a shuffle per 8 values
// (one shuffle port on Intel cores). One thread of the 2-core EPYC, d 128, 4 rows, cached:
// scores 103 -> 71 ns per key, accumulate 102 -> 91 ns.
template <typename Code>
constexpr bool kSplit = std::is_same_v<Code, uint16_t>;

// even = values 0, 2, .., 14 at p, odd = 1, 3, .., 15, as f32 lanes.
TANDEM_INT8_INLINE2 void WidenSplit16(const uint16_t* p, __m256* even, __m256* odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// [Σ a0, Σ a1, Σ a2, Σ a3] (hadd as in avx512::Reduce4).
TANDEM_INT8_INLINE2 __m128 Reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

TANDEM_INT8_INLINE2 float HSum(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// bf16: q rows in the split order. The even and odd products go to separate accumulators (2·NR
// independent FMA chains).
template <int NR, typename Code>
TANDEM_INT8_INLINE2 void DotCodes(const float* q, size_t d, const Code* k, float* out) {
  __m256 acc[NR];
  for (int i = 0; i < NR; ++i) acc[i] = _mm256_setzero_ps();
  size_t x = 0;
  if constexpr (kSplit<Code>) {
    __m256 odd_acc[NR];
    for (int i = 0; i < NR; ++i) odd_acc[i] = _mm256_setzero_ps();
    for (; x + 16 <= d; x += 16) {
      __m256 ke, ko;
      WidenSplit16(k + x, &ke, &ko);
      for (int i = 0; i < NR; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + x), ke, acc[i]);
        odd_acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + x + 8), ko, odd_acc[i]);
      }
    }
    for (int i = 0; i < NR; ++i) acc[i] = _mm256_add_ps(acc[i], odd_acc[i]);
  }
  for (; x < d; x += 8) {  // int8 rows; bf16: a last block of 8 (d % 16 == 8)
    const __m256 kv = Widen8(k + x);
    for (int i = 0; i < NR; ++i) {
      acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + x), kv, acc[i]);
    }
  }
  if constexpr (NR == 4) {
    _mm_storeu_ps(out, Reduce4(acc[0], acc[1], acc[2], acc[3]));
  } else {
    for (int i = 0; i < NR; ++i) out[i] = HSum(acc[i]);
  }
}

template <int NK, typename Code>
TANDEM_INT8_INLINE2 void DotCodes4xK(const float* q, size_t d, const std::byte* const* k,
                                     __m128* out) {
  __m256 a[NK][4];
  const Code* kr[NK];
  for (int j = 0; j < NK; ++j) {
    kr[j] = reinterpret_cast<const Code*>(k[j]);
    for (int i = 0; i < 4; ++i) a[j][i] = _mm256_setzero_ps();
  }
  size_t x = 0;
  if constexpr (kSplit<Code>) {  // q rows in the split order
    for (; x + 16 <= d; x += 16) {
      __m256 ke[NK], ko[NK];
      for (int j = 0; j < NK; ++j) WidenSplit16(kr[j] + x, &ke[j], &ko[j]);
      for (int i = 0; i < 4; ++i) {
        const __m256 qe = _mm256_loadu_ps(q + i * d + x);
        for (int j = 0; j < NK; ++j) a[j][i] = _mm256_fmadd_ps(qe, ke[j], a[j][i]);
        const __m256 qo = _mm256_loadu_ps(q + i * d + x + 8);
        for (int j = 0; j < NK; ++j) a[j][i] = _mm256_fmadd_ps(qo, ko[j], a[j][i]);
      }
    }
  }
  for (; x < d; x += 8) {  // int8 rows; bf16: a last block of 8 (d % 16 == 8)
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = Widen8(kr[j] + x);
    for (int i = 0; i < 4; ++i) {
      const __m256 qv = _mm256_loadu_ps(q + i * d + x);
      for (int j = 0; j < NK; ++j) a[j][i] = _mm256_fmadd_ps(qv, kv[j], a[j][i]);
    }
  }
  for (int j = 0; j < NK; ++j) out[j] = Reduce4(a[j][0], a[j][1], a[j][2], a[j][3]);
}

// Columns [x, x + 8 * NV) of acc_i += Σ_c p[i * ld + c] · codes(v[c]) for NR rows. bf16 with
// NV = 2: acc rows in the split order, so the 16 columns' even and odd halves are the two vectors.
template <int NR, int NV, typename Code>
TANDEM_INT8_INLINE2 void AccumulateSlice(const float* p, size_t ld, const std::byte* const* v,
                                         size_t n, size_t d, size_t x, float* acc) {
  __m256 a[NR][NV];
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < NV; ++j) a[i][j] = _mm256_loadu_ps(acc + i * d + x + 8 * j);
  }
  for (size_t c = 0; c < n; ++c) {
    const Code* row = reinterpret_cast<const Code*>(v[c]) + x;
    __m256 w[NV];
    if constexpr (kSplit<Code> && NV == 2) {
      WidenSplit16(row, &w[0], &w[1]);
    } else {
      for (int j = 0; j < NV; ++j) w[j] = Widen8(row + 8 * j);
    }
    for (int i = 0; i < NR; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i * ld + c]);
      for (int j = 0; j < NV; ++j) a[i][j] = _mm256_fmadd_ps(pi, w[j], a[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + i * d + x + 8 * j, a[i][j]);
  }
}

template <int NR, typename Code>
TANDEM_INT8_INLINE2 void AccumulateRows(const float* p, size_t ld, const std::byte* const* v,
                                        size_t n, size_t d, float* acc) {
  size_t x = 0;
  for (; x + 16 <= d; x += 16) AccumulateSlice<NR, 2, Code>(p, ld, v, n, d, x, acc);
  if (x < d) AccumulateSlice<NR, 1, Code>(p, ld, v, n, d, x, acc);
}

}  // namespace

#define TANDEM_SCAN_TARGET TANDEM_INT8_AVX2
namespace int8 {
using Code = int8_t;
#include "row_scan_drivers.inc"
}  // namespace int8
namespace bf16 {
using Code = uint16_t;
#include "row_scan_drivers.inc"
}  // namespace bf16
#undef TANDEM_SCAN_TARGET

}  // namespace avx2

namespace {

// The split order of the AVX2 bf16 kernels: each 16-float block of a row holds its 8 even then
// its 8 odd elements; a last block of 8 (d % 16 == 8) stays as it is. Element j of a block sits
// at SplitPosition(j).
constexpr size_t SplitPosition(size_t j) { return j % 2 == 0 ? j / 2 : 8 + j / 2; }

// Rearranges `rows` rows of d floats in place: into the split order, or back from it.
template <bool kIntoSplit>
void ReorderSplit(float* x, size_t rows, size_t d) {
  for (size_t r = 0; r < rows; ++r) {
    float* row = x + r * d;
    for (size_t b = 0; b + 16 <= d; b += 16) {
      float t[16];
      for (size_t j = 0; j < 16; ++j) {
        if constexpr (kIntoSplit) {
          t[SplitPosition(j)] = row[b + j];
        } else {
          t[j] = row[b + SplitPosition(j)];
        }
      }
      std::memcpy(row + b, t, sizeof(t));
    }
  }
}

// The kernels of ActiveCpuIsa(): one of a row type's two sets, or the portable path (nullptr).
const RowScanKernels* ForActiveIsa(const RowScanKernels& avx512, const RowScanKernels& avx2) {
  switch (ActiveCpuIsa()) {
    case CpuIsa::kAvx512:
      return &avx512;
    case CpuIsa::kAvx2:
      return &avx2;
    case CpuIsa::kPortable:
      break;
  }
  return nullptr;
}

}  // namespace

const RowScanKernels* GetInt8ScanKernels() {
  static const RowScanKernels kAvx512{avx512::int8::Scores, avx512::int8::Accumulate, nullptr,
                                      nullptr, "avx512"};
  static const RowScanKernels kAvx2{avx2::int8::Scores, avx2::int8::Accumulate, nullptr, nullptr,
                                    "avx2"};
  return ForActiveIsa(kAvx512, kAvx2);
}

const RowScanKernels* GetBf16ScanKernels() {
  static const RowScanKernels kAvx512{avx512::bf16::Scores, avx512::bf16::Accumulate, nullptr,
                                      nullptr, "avx512"};
  static const RowScanKernels kAvx2{avx2::bf16::Scores, avx2::bf16::Accumulate,
                                    ReorderSplit<true>, ReorderSplit<false>, "avx2"};
  return ForActiveIsa(kAvx512, kAvx2);
}

#pragma GCC diagnostic pop
#else  // not x86-64 GCC or clang: the portable path only

const RowScanKernels* GetInt8ScanKernels() { return nullptr; }
const RowScanKernels* GetBf16ScanKernels() { return nullptr; }

#endif

}  // namespace tandem::cpu_attention::internal
