// The scan of one piece of a paged-attention call (paged_piece.h): the online-softmax loop over
// K and V rows read in place, compiled once per instruction set and row type.
#include "paged_piece.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "row_scan_kernels.h"
#include "tandem/common/exp2_approx.h"
#include "tandem/kv_store/int8_rows.h"

// The library is built without -march and runs on other hosts than the build: the scan is
// compiled for AVX-512, AVX2 and baseline x86-64, and ActiveCpuIsa() picks one per call
// (TANDEM_CPU_ISA forces a lesser one, so tests run every path on any host). GCC and clang.
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_PAGED_X86 1
#define TANDEM_PAGED_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2")))
#define TANDEM_PAGED_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#else
#define TANDEM_PAGED_X86 0
#endif
#define TANDEM_ALWAYS_INLINE inline __attribute__((always_inline))

namespace tandem::cpu_attention::internal {
namespace {

using ::tandem::Exp2Approx;
using ::tandem::Exp2ApproxLanes;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// Keys per online-softmax step: the scores of one step ([R, kChunk] floats) stay in L1.
// Scores are base-2 inside the kernel (see ComputePieceImpl).
constexpr size_t kChunk = 64;
// NOTE: named pages are short runs scattered over the pool (16 rows = 4 KiB of bf16 K, as much
// V), too short for the hardware prefetcher to ramp up: the scan prefetches the rows it will
// read PagedParams::prefetch_entries entries ahead (software prefetch), which triples the rate
// on random pages. The row-scan kernels issue those prefetches between their keys
// (RowPrefetch); the portable path issues a chunk's in one burst.

// GCC vector types: 16 (or 8) f32 lanes, lowered to zmm, ymm or xmm registers by each clone.
// The helpers taking and returning them are always inlined into the clones, so no vector
// crosses a call boundary: the ABI note GCC gives for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
static_assert(kChunk % 16 == 0, "the softmax step works on whole 16-lane vectors");
using V16 = float __attribute__((vector_size(64)));
using V8 = float __attribute__((vector_size(32)));
using V4 = float __attribute__((vector_size(16)));
using U32x16 = uint32_t __attribute__((vector_size(64)));
using U32x8 = uint32_t __attribute__((vector_size(32)));
using U16x16 = uint16_t __attribute__((vector_size(32)));
using U16x8 = uint16_t __attribute__((vector_size(16)));

template <typename V>
TANDEM_ALWAYS_INLINE V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
TANDEM_ALWAYS_INLINE void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

TANDEM_ALWAYS_INLINE float HSum(V16 v) {
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[1]) + (b[2] + b[3]);
}

// 16 (or 8) elements of a K or V row as f32: bf16 (raw bits) widened by a shift into the high
// half, f32 loaded as is.
TANDEM_ALWAYS_INLINE V16 Row16(const uint16_t* p) {
  U16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return (V16)(__builtin_convertvector(h, U32x16) << 16);
}
TANDEM_ALWAYS_INLINE V16 Row16(const float* p) { return Load<V16>(p); }
TANDEM_ALWAYS_INLINE V8 Row8(const uint16_t* p) {
  U16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return (V8)(__builtin_convertvector(h, U32x8) << 16);
}
TANDEM_ALWAYS_INLINE V8 Row8(const float* p) { return Load<V8>(p); }

// out[i] = q_i · k for the NR rows q_i = q + i * n (f32) and one K row k (n elements of T, a
// multiple of 8): one pass over k, NR independent accumulators.
template <size_t NR, typename T>
TANDEM_ALWAYS_INLINE void DotRows(const float* q, const T* k, size_t n, float* out) {
  V16 acc[NR] = {};
  size_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const V16 kv = Row16(k + d);
    for (size_t i = 0; i < NR; ++i) acc[i] += Load<V16>(q + i * n + d) * kv;
  }
  if (d < n) {  // one tail of 8
    const V8 kv = Row8(k + d);
    for (size_t i = 0; i < NR; ++i) {
      const V8 p = Load<V8>(q + i * n + d) * kv;
      acc[i] += V16{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    }
  }
  for (size_t i = 0; i < NR; ++i) out[i] = HSum(acc[i]);
}

// The V slice [d, d + lanes of V) of acc_i += Σ_c p[i * kChunk + c] · v_c for the NR rows
// acc_i = acc + i * n and the c_n V rows vp[c] (n elements of T). NOTE: the accumulators stay
// in registers over the whole chunk (an axpy per row and key would store and reload them every
// key).
template <typename V, size_t NR, typename T>
TANDEM_ALWAYS_INLINE void AccumulateSlice(const float* p, const std::byte* const* vp, size_t c_n,
                                          size_t n, size_t d, float* acc) {
  V a[NR];
  for (size_t i = 0; i < NR; ++i) a[i] = Load<V>(acc + i * n + d);
  for (size_t c = 0; c < c_n; ++c) {
    const T* row = reinterpret_cast<const T*>(vp[c]) + d;
    V v;
    if constexpr (sizeof(V) == sizeof(V16)) {
      v = Row16(row);
    } else {
      v = Row8(row);
    }
    for (size_t i = 0; i < NR; ++i) a[i] += p[i * kChunk + c] * v;
  }
  for (size_t i = 0; i < NR; ++i) Store(acc + i * n + d, a[i]);
}

// The whole rows (n a multiple of 8): 16-column slices, then one of 8.
template <size_t NR, typename T>
TANDEM_ALWAYS_INLINE void AccumulateRows(const float* p, const std::byte* const* vp, size_t c_n,
                                         size_t n, float* acc) {
  size_t d = 0;
  for (; d + 16 <= n; d += 16) AccumulateSlice<V16, NR, T>(p, vp, c_n, n, d, acc);
  if (d < n) AccumulateSlice<V8, NR, T>(p, vp, c_n, n, d, acc);
}

}  // namespace

size_t WorkFloats(size_t rows, size_t D, bool int8) {
  return 2 * rows * D + 2 * rows + rows * kChunk + (int8 ? 2 * kChunk * D : 0);
}

namespace {

// dst[i] = codes[i] as f32 for one int8 row of n codes. NOTE: a plain loop the vectoriser
// lowers to vpmovsxbw / vpmovsxwd / vcvtdq2ps; GCC 12 scalarises __builtin_convertvector from
// int8 lanes (one vcvtsi2ss per element), which made int8 pages 2-3x slower than bf16.
TANDEM_ALWAYS_INLINE void WidenCodes(const std::byte* row, size_t n, float* dst) {
  const auto* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(q[i]);
}

// Calls fn(k, v, count) for the runs of the next n entries at `c` (count consecutive K rows
// from k, V rows from v) and advances it past them.
template <typename Fn>
TANDEM_ALWAYS_INLINE void ForNextRows(RunCursor& c, uint64_t n, size_t row_bytes, Fn&& fn) {
  while (n > 0 && c.left > 0) {
    while (c.offset >= c.run->n) {
      ++c.run;
      c.offset = 0;
    }
    const uint64_t take = std::min<uint64_t>({n, c.left, c.run->n - c.offset});
    fn(c.run->k + c.offset * row_bytes, c.run->v + c.offset * row_bytes, take);
    c.offset += take;
    c.left -= take;
    n -= take;
  }
}

// Prefetches the K and V rows of the next n entries at `c` and advances it past them.
TANDEM_ALWAYS_INLINE void PrefetchRows(RunCursor& c, uint64_t n, size_t row_bytes) {
  ForNextRows(c, n, row_bytes, [row_bytes](const std::byte* k, const std::byte* v, uint64_t m) {
    for (size_t b = 0; b < m * row_bytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k) + b);
      __builtin_prefetch(reinterpret_cast<const char*>(v) + b);
    }
  });
}

// Writes the K and V row addresses of the next n entries at `c` to rows (K, V, K, V, ..; at most
// 2n) and advances it past them; returns how many it wrote.
TANDEM_ALWAYS_INLINE size_t GatherRows(RunCursor& c, uint64_t n, size_t row_bytes,
                                       const std::byte** rows) {
  size_t count = 0;
  ForNextRows(c, n, row_bytes, [&](const std::byte* k, const std::byte* v, uint64_t m) {
    for (uint64_t i = 0; i < m; ++i) {
      rows[count++] = k + i * row_bytes;
      rows[count++] = v + i * row_bytes;
    }
  });
  return count;
}

// Where a piece's prefetches are: in its own entries (`now`), then in the next piece's
// (`then`, asked for from `source` when `now` runs out), of which `then_taken` entries are
// prefetched so far.
struct AheadCursor {
  RunCursor now;
  NextPiece source;
  RunCursor then{};
  uint64_t then_taken = 0;

  // Prefetches the rows of the next n entries.
  void Prefetch(uint64_t n, size_t row_bytes) {
    const uint64_t own = std::min(n, now.left);
    PrefetchRows(now, own, row_bytes);
    if (own == n || !AskNext()) return;
    const uint64_t more = std::min(n - own, then.left);
    PrefetchRows(then, more, row_bytes);
    then_taken += more;
  }
  // Writes the K and V row addresses of the next n entries to rows (at most 2n); returns how
  // many it wrote.
  size_t Gather(uint64_t n, size_t row_bytes, const std::byte** rows) {
    const uint64_t own = std::min(n, now.left);
    size_t count = GatherRows(now, own, row_bytes, rows);
    if (own == n || !AskNext()) return count;
    const uint64_t more = std::min(n - own, then.left);
    count += GatherRows(then, more, row_bytes, rows + count);
    then_taken += more;
    return count;
  }

 private:
  // Fetches `then` the first time; false when there is no next piece.
  bool AskNext() {
    if (source.fn != nullptr) {
      then = source.fn(source.ctx);
      source.fn = nullptr;
    }
    return then.left > 0;
  }
};

// Elem: one stored element of a K or V row: uint16_t (bf16 bits), float, or int8_t (an int8
// row [D codes][f32 scale], kv_store/int8_rows.h: s = scale_k * (q · codes) and the V scale is
// folded into p after the softmax sums, so the row's scales cost two multiplies per key). On
// AVX-512 or AVX2 (a.row_kernels) the codes are widened in registers; else once
// per chunk into L1/L2-resident f32 tiles (exact: |code| <= 127) that the f32 dot products and
// axpys then read.
template <typename Elem>
TANDEM_ALWAYS_INLINE void ComputePieceImpl(const PieceArgs& a) {
  constexpr bool kInt8 = std::is_same_v<Elem, int8_t>;
  const size_t D = a.D, G = a.G, R = size_t{a.T} * G;
  float* qs = a.work;                                       // [R, D]
  float* acc = qs + R * D;                                  // [R, D]
  float* m = acc + R * D;                                   // [R]
  float* l = m + R;                                         // [R]
  float* s = l + R;                                         // [R, kChunk]
  float* k_tile = s + R * kChunk;                           // int8: [kChunk, D] K codes
  float* v_tile = k_tile + kChunk * D;                      // int8: [kChunk, D] V codes
  // The type the dot products and axpys read: int8 codes through the f32 tiles.
  using Row = std::conditional_t<kInt8, float, Elem>;
  // Scores are kept in base 2 (q pre-multiplied by scale · log2(e)): 2^(s2 - m2) = e^(s - m).
  const float scale2 = a.scale * kLog2e;
  for (size_t t = 0; t < a.T; ++t) {
    for (size_t j = 0; j < G; ++j) {
      const float* src = a.q + t * a.q_stride + j * D;
      float* dst = qs + (t * G + j) * D;
      for (size_t d = 0; d < D; ++d) dst[d] = src[d] * scale2;
    }
  }
  const internal::RowScanKernels* rk = a.row_kernels;
  if (rk != nullptr && rk->to_kernel_order != nullptr) rk->to_kernel_order(qs, R, D);
  std::fill_n(acc, R * D, 0.0f);  // zeros in every order
  std::fill_n(m, R, kNegInf);
  std::fill_n(l, R, 0.0f);

  const size_t row_bytes = D * sizeof(Elem) + (kInt8 ? kv_store::kInt8ScaleBytes : 0);
  const KvRun* run = a.runs;
  uint64_t in_run = a.skip;  // next entry inside *run
  uint64_t left = a.count;
  const std::byte* kp[kChunk];
  const std::byte* vp[kChunk];
  float k_scale[kChunk];  // int8: the rows' scales
  float v_scale[kChunk];
  const std::byte* ahead_rows[2 * kChunk];  // K and V rows the kernel prefetches
  AheadCursor ahead{RunCursor{a.runs, a.skip, a.count}, a.next};
  const uint64_t warm = std::min(a.prefetched, a.count);
  ForNextRows(ahead.now, warm, row_bytes, [](const std::byte*, const std::byte*, uint64_t) {});
  if (a.prefetch_entries > warm) ahead.Prefetch(a.prefetch_entries - warm, row_bytes);
  while (left > 0) {
    // Gather the next chunk's row addresses across run boundaries.
    size_t c_n = 0;
    while (c_n < kChunk && left > 0) {
      while (in_run >= run->n) {
        ++run;
        in_run = 0;
      }
      const uint64_t take = std::min<uint64_t>({kChunk - c_n, left, run->n - in_run});
      for (uint64_t i = 0; i < take; ++i) {
        kp[c_n + i] = run->k + (in_run + i) * row_bytes;
        vp[c_n + i] = run->v + (in_run + i) * row_bytes;
      }
      c_n += take;
      in_run += take;
      left -= take;
    }
    bool scored = false;  // s holds the chunk's scores
    if constexpr (kInt8) {
      for (size_t c = 0; c < c_n; ++c) {
        k_scale[c] = kv_store::Int8RowScale(kp[c], a.D);
        v_scale[c] = kv_store::Int8RowScale(vp[c], a.D);
      }
    }
    if (a.row_kernels != nullptr) {
      // The kernel prefetches the next c_n entries ahead between its keys.
      const internal::RowPrefetch next{ahead_rows, ahead.Gather(c_n, row_bytes, ahead_rows),
                                       row_bytes};
      a.row_kernels->scores(qs, R, D, kp, c_n, kInt8 ? k_scale : nullptr, s, kChunk, next);
      scored = true;
    } else {
      ahead.Prefetch(c_n, row_bytes);
    }
    if constexpr (kInt8) {
      for (size_t c = 0; c < c_n && a.row_kernels == nullptr; ++c) {
        WidenCodes(kp[c], D, k_tile + c * D);
        WidenCodes(vp[c], D, v_tile + c * D);
        kp[c] = reinterpret_cast<const std::byte*>(k_tile + c * D);
        vp[c] = reinterpret_cast<const std::byte*>(v_tile + c * D);
      }
    }
    // Scores s[r, c] = scale * q_r · k_c.
    for (size_t c = 0; c < c_n && !scored; ++c) {
      const Row* k = reinterpret_cast<const Row*>(kp[c]);
      float out[4];
      size_t r = 0;
      const float ks = kInt8 ? k_scale[c] : 1.0f;
      for (; r + 4 <= R; r += 4) {
        DotRows<4>(qs + r * D, k, D, out);
        for (size_t i = 0; i < 4; ++i) s[(r + i) * kChunk + c] = kInt8 ? out[i] * ks : out[i];
      }
      for (; r < R; ++r) {
        DotRows<1>(qs + r * D, k, D, out);
        s[r * kChunk + c] = kInt8 ? out[0] * ks : out[0];
      }
    }
    // Online softmax: rescale the accumulators to the new row maximum, p = exp(s - m).
    for (size_t r = 0; r < R; ++r) {
      float* sr = s + r * kChunk;
      // Lanes past c_n hold -inf: they change neither the maximum nor (p = 0) the sum.
      for (size_t c = c_n; c < kChunk; ++c) sr[c] = kNegInf;
      V16 mv = Load<V16>(sr);
      for (size_t c = 16; c < kChunk; c += 16) {
        const V16 x = Load<V16>(sr + c);
        mv = mv > x ? mv : x;
      }
      float mx = m[r];
      for (size_t i = 0; i < 16; ++i) mx = std::max(mx, mv[i]);
      if (mx > m[r]) {
        // ~0 on the first chunk (m = -inf: Exp2Approx gives 0), where l and acc are 0 anyway.
        const float alpha = Exp2Approx(m[r] - mx);
        l[r] *= alpha;
        float* ar = acc + r * D;
        for (size_t d = 0; d < D; d += 8) Store(ar + d, Load<V8>(ar + d) * alpha);
        m[r] = mx;
      }
      // Lanes past c_n give exactly 0 (-inf). NOTE: whole vectors; a scalar Exp2Approx loop here
      // stayed scalar (GCC 12) and cost one core as much as both row-scan kernels together.
      // 8 lanes: ymm on AVX2 and AVX-512 (GCC lowers 16-lane compares on AVX2 lane by lane).
      for (size_t c = 0; c < kChunk; c += 8) Store(sr + c, Exp2ApproxLanes(Load<V8>(sr + c) - mx));
      V16 sum = Load<V16>(sr);
      for (size_t c = 16; c < kChunk; c += 16) sum += Load<V16>(sr + c);
      l[r] += HSum(sum);
      if constexpr (kInt8) {
        for (size_t c = 0; c < c_n; ++c) sr[c] *= v_scale[c];
      }
    }
    // acc[r] += p[r, c] * v_c.
    if (a.row_kernels != nullptr) {
      a.row_kernels->accumulate(s, kChunk, R, vp, c_n, D, acc);
      continue;
    }
    size_t r = 0;
    for (; r + 4 <= R; r += 4) AccumulateRows<4, Row>(s + r * kChunk, vp, c_n, D, acc + r * D);
    for (; r < R; ++r) AccumulateRows<1, Row>(s + r * kChunk, vp, c_n, D, acc + r * D);
  }
  if (rk != nullptr && rk->from_kernel_order != nullptr) rk->from_kernel_order(acc, R, D);
  // count > 0, so every row saw a finite score and l >= 1.
  for (size_t t = 0; t < a.T; ++t) {
    for (size_t j = 0; j < G; ++j) {
      const size_t r = t * G + j;
      const float inv = 1.0f / l[r];
      float* dst = a.out.o + t * a.out.o_stride + j * D;
      for (size_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
      a.out.lse[t * a.out.lse_stride + j] = (m[r] + std::log2(l[r])) * kLn2;
    }
  }
  if (a.next_prefetched != nullptr) *a.next_prefetched = ahead.then_taken;
}

// One compiled copy of the scan per instruction set and element type.
template <typename Elem>
void ComputePiecePortable(const PieceArgs& a) {
  ComputePieceImpl<Elem>(a);
}
#if TANDEM_PAGED_X86
template <typename Elem>
TANDEM_PAGED_AVX2 void ComputePieceAvx2(const PieceArgs& a) {
  ComputePieceImpl<Elem>(a);
}
template <typename Elem>
TANDEM_PAGED_AVX512 void ComputePieceAvx512(const PieceArgs& a) {
  ComputePieceImpl<Elem>(a);
}
#endif

template <typename Elem>
PieceKernel PieceKernelFor(CpuIsa isa) {
#if TANDEM_PAGED_X86
  if (isa == CpuIsa::kAvx512) return ComputePieceAvx512<Elem>;
  if (isa == CpuIsa::kAvx2) return ComputePieceAvx2<Elem>;
#endif
  return ComputePiecePortable<Elem>;
}

}  // namespace

PieceKernel PieceKernelFor(kv_store::KvDType dtype, CpuIsa isa) {
  switch (dtype) {
    case kv_store::KvDType::kBf16:
      return PieceKernelFor<uint16_t>(isa);
    case kv_store::KvDType::kInt8:
      return PieceKernelFor<int8_t>(isa);
    default:
      return PieceKernelFor<float>(isa);
  }
}

}  // namespace tandem::cpu_attention::internal
