#include "tandem/cpu_attention/paged_attention.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aligned_buffer.h"
#include "row_scan_kernels.h"
#include "tandem/common/exp2_approx.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/cpu_attention/merge_state.h"
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

namespace tandem::cpu_attention {
namespace {

using internal::AlignedBuffer;
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
// A range covers at least this many entries (fewer, larger tasks for tiny problems).
constexpr uint64_t kMinRangeEntries = 256;

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

// Where a piece writes: row r = t * G + j at o + t * o_stride + j * D, lse + t * lse_stride + j.
struct RowsOut {
  float* o;
  size_t o_stride;
  float* lse;
  size_t lse_stride;
};

// One piece: entries [skip, skip + count) of the runs starting at `runs`, for R = T * G query
// rows. `work` holds [R, D] scaled queries, [R, D] accumulators, m [R], l [R] and the scores
// [R, kChunk].
struct PieceArgs {
  uint64_t prefetch_entries;   // PagedParams::prefetch_entries
  const KvRun* runs;
  uint64_t skip;
  uint64_t count;
  const float* q;
  size_t q_stride;
  uint32_t T, G, D;
  float scale;
  RowsOut out;
  float* work;
  // int8 and bf16: the register-widening kernels of row_scan_kernels.h (nullptr: the portable
  // path: f32 tiles for int8, GCC vector types for bf16)
  const internal::RowScanKernels* row_kernels = nullptr;
};

// int8 pieces also widen the chunk's K and V codes into f32 tiles [kChunk, D] each.
size_t WorkFloats(size_t rows, size_t D, bool int8) {
  return 2 * rows * D + 2 * rows + rows * kChunk + (int8 ? 2 * kChunk * D : 0);
}

// dst[i] = codes[i] as f32 for one int8 row of n codes. NOTE: a plain loop the vectoriser
// lowers to vpmovsxbw / vpmovsxwd / vcvtdq2ps; GCC 12 scalarises __builtin_convertvector from
// int8 lanes (one vcvtsi2ss per element), which made int8 pages 2-3x slower than bf16.
TANDEM_ALWAYS_INLINE void WidenCodes(const std::byte* row, size_t n, float* dst) {
  const auto* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(q[i]);
}

// A read position in a piece's runs: entry `offset` of *run, `left` entries to go.
struct RunCursor {
  const KvRun* run;
  uint64_t offset;
  uint64_t left;
};

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
  RunCursor ahead{a.runs, a.skip, a.count};
  PrefetchRows(ahead, a.prefetch_entries, row_bytes);
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
      const internal::RowPrefetch next{ahead_rows, GatherRows(ahead, c_n, row_bytes, ahead_rows),
                                       row_bytes};
      a.row_kernels->scores(qs, R, D, kp, c_n, kInt8 ? k_scale : nullptr, s, kChunk, next);
      scored = true;
    } else {
      PrefetchRows(ahead, c_n, row_bytes);
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

using PieceKernel = void (*)(const PieceArgs&);

template <typename Elem>
PieceKernel PieceKernelFor(CpuIsa isa) {
#if TANDEM_PAGED_X86
  if (isa == CpuIsa::kAvx512) return ComputePieceAvx512<Elem>;
  if (isa == CpuIsa::kAvx2) return ComputePieceAvx2<Elem>;
#endif
  return ComputePiecePortable<Elem>;
}

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

// Entries [begin, end) of problem `problem` (in the concatenation of its runs), computed by one
// task. slot < 0: writes the problem's output rows; else partial state `slot`, merged into
// them after all tasks finished.
struct Piece {
  size_t problem;
  uint64_t begin, end;
  int64_t slot;
};

absl::Status Validate(const PagedParams& p, std::span<const KvRun> runs,
                      std::span<const PagedProblem> problems) {
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: head_dim ", p.head_dim, " not in 8..256 step 8"));
  }
  if (p.dtype != kv_store::KvDType::kBf16 && p.dtype != kv_store::KvDType::kF32 &&
      p.dtype != kv_store::KvDType::kInt8) {
    return absl::InvalidArgumentError("paged attention: dtype must be bf16, f32 or int8");
  }
  if (p.group < 1 || p.tasks_per_thread < 1) {
    return absl::InvalidArgumentError("paged attention: group and tasks_per_thread must be >= 1");
  }
  if (p.prefetch_entries > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: prefetch_entries ", p.prefetch_entries, " > 4096"));
  }
  if (!std::isfinite(p.scale) || p.scale < 0) {
    return absl::InvalidArgumentError("paged attention: scale must be finite and >= 0");
  }
  for (size_t i = 0; i < problems.size(); ++i) {
    const PagedProblem& pr = problems[i];
    if (const PageSpan& ps = pr.pages; ps.shard != nullptr) {
      // Every page full but the last, which holds at least one entry.
      const uint64_t pages = ps.ids.size();
      if (ps.page_tokens < 1 || ps.entries > pages * ps.page_tokens ||
          (pages > 0 && ps.entries <= (pages - 1) * ps.page_tokens)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "paged attention: problem ", i, " names ", pages, " pages of ", ps.page_tokens,
            " entries covering ", ps.entries));
      }
    }
    if (pr.run_begin > pr.run_end || pr.run_end > runs.size() || pr.num_tokens < 1 ||
        pr.q == nullptr || pr.o == nullptr || pr.lse == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "paged attention: problem ", i, " has runs [", pr.run_begin, ", ", pr.run_end, ") of ",
          runs.size(), ", ", pr.num_tokens, " tokens, or a null pointer"));
    }
  }
  return absl::OkStatus();
}

absl::Status PagedAttentionImpl(const PagedParams& params, std::span<const KvRun> runs,
                                std::span<const PagedProblem> problems, ThreadPool& pool) {
  const size_t D = params.head_dim, G = params.group;
  const float scale = params.scale > 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(D));

  // Entries and cost per problem; cost ~ memory (K + V rows) plus compute (R dot products and
  // R axpys per entry), in units of one entry with 4 query rows.
  std::vector<uint64_t> entries(problems.size(), 0);
  std::vector<uint64_t> weight(problems.size(), 0);
  uint64_t total = 0;
  size_t max_rows = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const PagedProblem& pr = problems[i];
    if (pr.pages.shard != nullptr) {
      entries[i] = pr.pages.entries;
    } else {
      for (size_t r = pr.run_begin; r < pr.run_end; ++r) entries[i] += runs[r].n;
    }
    const size_t rows = size_t{pr.num_tokens} * G;
    weight[i] = rows + 4;
    total += entries[i] * weight[i];
    if (entries[i] > 0) max_rows = std::max(max_rows, rows);
    if (entries[i] != 0) continue;
    for (size_t t = 0; t < pr.num_tokens; ++t) {
      std::fill_n(pr.o + t * pr.o_token_stride, G * D, 0.0f);
      std::fill_n(pr.lse + t * pr.lse_token_stride, G, kNegInf);
    }
  }
  if (total == 0) return absl::OkStatus();

  // Cut the cost of all problems, end to end, into equal ranges (HGCA §3.3 head-merged tasks).
  uint64_t all_entries = 0;
  for (uint64_t e : entries) all_entries += e;
  const uint64_t max_tasks = uint64_t{params.tasks_per_thread} * pool.num_threads();
  const uint64_t num_ranges = std::max<uint64_t>(
      1, std::min(max_tasks, (all_entries + kMinRangeEntries - 1) / kMinRangeEntries));
  std::vector<Piece> pieces;
  std::vector<size_t> range_first(num_ranges + 1);
  std::vector<uint32_t> pieces_of(problems.size(), 0);
  {
    size_t p = 0;
    uint64_t off = 0, pos = 0;  // entry offset in problem p; cost done so far
    for (uint64_t r = 0; r < num_ranges; ++r) {
      range_first[r] = pieces.size();
      const uint64_t range_end = r + 1 == num_ranges ? total : (r + 1) * total / num_ranges;
      while (pos < range_end) {
        while (entries[p] == 0) ++p;
        const uint64_t want = (range_end - pos + weight[p] - 1) / weight[p];
        const uint64_t take = std::min(entries[p] - off, std::max<uint64_t>(1, want));
        const int64_t slot = pieces_of[p]++ == 0 ? -1 : 0;
        pieces.push_back(Piece{p, off, off + take, slot});
        pos += take * weight[p];
        off += take;
        if (off == entries[p]) {
          ++p;
          off = 0;
        }
      }
    }
    range_first[num_ranges] = pieces.size();
  }
  int64_t num_slots = 0;
  size_t slot_floats = 0;
  for (Piece& piece : pieces) {
    if (piece.slot >= 0) piece.slot = num_slots++;
  }
  slot_floats = max_rows * D + max_rows;
  std::vector<float> partials(static_cast<size_t>(num_slots) * slot_floats);

  const internal::RowScanKernels* row_kernels =
      params.dtype == kv_store::KvDType::kInt8   ? internal::GetInt8ScanKernels()
      : params.dtype == kv_store::KvDType::kBf16 ? internal::GetBf16ScanKernels()
                                                 : nullptr;
  const PieceKernel compute_piece = PieceKernelFor(params.dtype, ActiveCpuIsa());
  std::vector<absl::Status> statuses(num_ranges);
  PagedTaskTimes* const times = params.task_times;
  const auto call_start = std::chrono::steady_clock::now();
  const auto seconds_since_start = [call_start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start).count();
  };
  if (times != nullptr) {
    times->start_s.assign(num_ranges, 0.0);
    times->end_s.assign(num_ranges, 0.0);
    times->entries = all_entries;
  }
  pool.ParallelFor(num_ranges, [&](size_t r) {
    if (times != nullptr) times->start_s[r] = seconds_since_start();
    try {
      thread_local AlignedBuffer work_buffer;
      thread_local std::vector<KvRun> page_runs;   // a page problem's piece, resolved
      for (size_t i = range_first[r]; i < range_first[r + 1]; ++i) {
        const Piece& piece = pieces[i];
        const PagedProblem& pr = problems[piece.problem];
        const size_t rows = size_t{pr.num_tokens} * G;
        PieceArgs a;
        a.prefetch_entries = params.prefetch_entries;
        if (const PageSpan& ps = pr.pages; ps.shard != nullptr) {
          // The pages holding entries [begin, end): every page but the last is full.
          const uint64_t first = piece.begin / ps.page_tokens;
          const uint64_t last = (piece.end + ps.page_tokens - 1) / ps.page_tokens;
          page_runs.clear();
          AppendPageRuns(*ps.shard, ps.ids.subspan(first, last - first), ps.page_tokens,
                         &page_runs);
          a.runs = page_runs.data();
          a.skip = piece.begin - first * ps.page_tokens;
        } else {
          a.runs = runs.data() + pr.run_begin;
          a.skip = piece.begin;
        }
        // Find the run holding entry `begin`.
        while (a.skip >= a.runs->n) a.skip -= (a.runs++)->n;
        a.count = piece.end - piece.begin;
        a.q = pr.q;
        a.q_stride = pr.q_token_stride;
        a.T = pr.num_tokens;
        a.G = static_cast<uint32_t>(G);
        a.D = static_cast<uint32_t>(D);
        a.scale = scale;
        if (piece.slot < 0) {
          a.out = RowsOut{pr.o, pr.o_token_stride, pr.lse, pr.lse_token_stride};
        } else {
          float* base = partials.data() + piece.slot * slot_floats;
          a.out = RowsOut{base, G * D, base + rows * D, G};
        }
        a.row_kernels = row_kernels;
        a.work = work_buffer.Get<float>(
            WorkFloats(rows, D, params.dtype == kv_store::KvDType::kInt8));
        compute_piece(a);
      }
    } catch (const std::bad_alloc&) {
      statuses[r] = absl::ResourceExhaustedError("paged attention: scratch allocation failed");
    } catch (const std::exception& e) {
      statuses[r] = absl::InternalError(absl::StrFormat("paged attention: %s", e.what()));
    }
    if (times != nullptr) times->end_s[r] = seconds_since_start();
  });
  for (const absl::Status& s : statuses) TANDEM_RETURN_IF_ERROR(s);

  // Merge the partial states of problems split across ranges, in entry order.
  for (const Piece& piece : pieces) {
    if (piece.slot < 0) continue;
    const PagedProblem& pr = problems[piece.problem];
    const size_t rows = size_t{pr.num_tokens} * G;
    const float* src_o = partials.data() + piece.slot * slot_floats;
    const float* src_lse = src_o + rows * D;
    for (size_t t = 0; t < pr.num_tokens; ++t) {
      for (size_t j = 0; j < G; ++j) {
        MergeStateInPlace(pr.o + t * pr.o_token_stride + j * D,
                          pr.lse + t * pr.lse_token_stride + j, src_o + (t * G + j) * D,
                          src_lse[t * G + j], D);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPageRow(std::span<const int32_t> row, int64_t held, uint32_t page_tokens,
                          const char* what) {
  bool padding = false;
  int64_t prev = -1;
  for (size_t i = 0; i < row.size(); ++i) {
    const int32_t id = row[i];
    if (id == -1) {
      padding = true;
      continue;
    }
    if (id < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: page id ", id, " is negative (only -1 pads)"));
    }
    if (padding) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: page id ", id, " follows -1 padding"));
    }
    if (id <= prev) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", i, "]: page id ", id,
                                                     " is not above the previous id ", prev,
                                                     " (ids must be strictly ascending)"));
    }
    if (held >= 0 && static_cast<int64_t>(id) * page_tokens >= held) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", i, "]: page ", id, " starts at entry ", static_cast<int64_t>(id) * page_tokens,
          " but the shard holds ", held, " entries (", page_tokens, " per page)"));
    }
    prev = id;
  }
  return absl::OkStatus();
}

uint64_t AppendPageRuns(const kv_store::Shard& shard, std::span<const int32_t> row,
                        uint32_t page_tokens, std::vector<KvRun>* runs) {
  const uint64_t held = shard.held();
  const uint64_t bt = shard.format().block_tokens;
  const size_t row_bytes = shard.format().row_bytes();
  uint64_t covered = 0;
  size_t i = 0;
  while (i < row.size() && row[i] >= 0) {
    // Merge consecutive page ids into one entry range [first, end).
    const uint64_t first = static_cast<uint64_t>(row[i]) * page_tokens;
    int64_t last_id = row[i++];
    while (i < row.size() && row[i] == last_id + 1) last_id = row[i++];
    const uint64_t end =
        std::min<uint64_t>(held, (static_cast<uint64_t>(last_id) + 1) * page_tokens);
    // Split the range at block boundaries.
    for (uint64_t e = first; e < end;) {
      const uint64_t block = e / bt, in_block = e % bt;
      const uint64_t n = std::min(end - e, bt - in_block);
      runs->push_back(KvRun{shard.block_k(block) + in_block * row_bytes,
                            shard.block_v(block) + in_block * row_bytes, static_cast<uint32_t>(n)});
      e += n;
    }
    covered += end - first;
  }
  return covered;
}

uint64_t PageEntries(std::span<const int32_t> ids, uint32_t page_tokens, uint64_t held) {
  if (ids.empty()) return 0;
  const uint64_t last_end =
      std::min<uint64_t>(held, (static_cast<uint64_t>(ids.back()) + 1) * page_tokens);
  const uint64_t last_first = static_cast<uint64_t>(ids.back()) * page_tokens;
  return (ids.size() - 1) * uint64_t{page_tokens} + (last_end - last_first);
}

uint64_t AppendAllRuns(const kv_store::Shard& shard, std::vector<KvRun>* runs) {
  for (size_t b = 0; b < shard.blocks().size(); ++b) {
    const uint32_t n = shard.block_entries(b);
    if (n > 0) runs->push_back(KvRun{shard.block_k(b), shard.block_v(b), n});
  }
  return shard.held();
}

absl::Status PagedAttention(const PagedParams& params, std::span<const KvRun> runs,
                            std::span<const PagedProblem> problems, ThreadPool& pool) {
  TANDEM_RETURN_IF_ERROR(Validate(params, runs, problems));
  try {
    return PagedAttentionImpl(params, runs, problems, pool);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("paged attention: out of memory for the task plan");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("paged attention: %s", e.what()));
  }
}

}  // namespace tandem::cpu_attention
