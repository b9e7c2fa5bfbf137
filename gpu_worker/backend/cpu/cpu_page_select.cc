#include "cpu_page_select.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "cpu_low_rank_keys.h"
#include "tandem/common/bf16.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::cpu {
namespace {

// Pages scored per parallel work item (a row of a long context is split into many items).
constexpr int64_t kScorePagesPerItem = 256;

// Larger key = larger score (the IEEE order, -0 == +0; NaN with the sign bit clear above +inf).
inline uint32_t OrderKey(float score) {
  const uint32_t u = std::bit_cast<uint32_t>(score == 0.0f ? 0.0f : score);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

inline float ToF32(float x) { return x; }
inline float ToF32(bf16_t x) { return Bf16ToFloat(x); }
template <typename T>
T FromF32(float x);
template <>
inline float FromF32<float>(float x) { return x; }
template <>
inline bf16_t FromF32<bf16_t>(float x) { return FloatToBf16(x); }

// summaries[g, first_page + i, 0/1/2, :] = min/max/mean over the page's slots. The running
// minimum is replaced only by a strictly smaller key (the cuda kernel uses the same rule), so both
// backends store the same bits, -0 and +0 included; the mean is an f32 sum in slot order.
template <typename T>
void SummarizeTyped(const SummarizePagesParams& p, int threads) {
  const T* cache = static_cast<const T*>(p.k_cache);
  T* summaries = static_cast<T*>(p.summaries);
  const int64_t d_count = p.head_dim;
  const int64_t items = p.num_kv_heads * p.num_pages;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t g = item / p.num_pages;
    const int64_t page = item % p.num_pages;
    const T* first = cache + (g * p.capacity + p.first_slot + page * p.page_tokens) * d_count;
    T* dst = summaries + (g * p.max_pages + p.first_page + page) * kPageSummaryRows * d_count;
    for (int64_t d = 0; d < d_count; ++d) {
      T lo = first[d];
      T hi = first[d];
      float sum = ToF32(first[d]);
      for (int64_t s = 1; s < p.page_tokens; ++s) {
        const T v = first[s * d_count + d];
        if (ToF32(v) < ToF32(lo)) lo = v;
        if (ToF32(v) > ToF32(hi)) hi = v;
        sum += ToF32(v);
      }
      dst[d] = lo;
      dst[d_count + d] = hi;
      dst[2 * d_count + d] = FromF32<T>(sum / static_cast<float>(p.page_tokens));
    }
  }
}

// scores[row, page] for pages [begin, end) of one (token, kv head) row, f32 sums in d order. A
// centroid score is the bound's sum with min = max = mean (max(q·c, q·c) = q·c).
template <typename T>
void ScoreRange(const SelectPagesParams& p, int64_t t, int64_t g, int64_t begin, int64_t end,
                float* scores) {
  const int64_t d_count = p.head_dim;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const T* summaries = static_cast<const T*>(p.summaries);
  const float* q = p.q + t * p.q_row_stride + g * group * d_count;
  const bool centroid = p.score == PageScore::kCentroid;
  std::vector<float> lo(d_count), hi(d_count);
  for (int64_t page = begin; page < end; ++page) {
    const T* src = summaries + (g * p.max_pages + page) * kPageSummaryRows * d_count;
    for (int64_t d = 0; d < d_count; ++d) {
      lo[d] = ToF32(src[(centroid ? 2 : 0) * d_count + d]);
      hi[d] = ToF32(src[(centroid ? 2 : 1) * d_count + d]);
    }
    float best = 0.0f;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * d_count;
      float sum = 0.0f;
      for (int64_t d = 0; d < d_count; ++d) sum += std::max(qj[d] * lo[d], qj[d] * hi[d]);
      best = j == 0 ? sum : std::max(best, sum);
    }
    scores[page] = best == 0.0f ? 0.0f : best;
  }
}

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: %s", op, what));
}

}  // namespace

absl::Status ValidateSummarizePages(const SummarizePagesParams& p) {
  constexpr const char* kOp = "SummarizePages";
  if (p.k_cache == nullptr || p.summaries == nullptr) return Invalid(kOp, "null pointer");
  if (p.capacity < 1 || p.num_pages < 1 || p.page_tokens < 1 || p.max_pages < 1 ||
      p.num_kv_heads < 1 || p.head_dim < 1) {
    return Invalid(kOp, absl::StrFormat("capacity %d, num_pages %d, page_tokens %d, max_pages %d, "
                                        "num_kv_heads %d and head_dim %d must be >= 1",
                                        p.capacity, p.num_pages, p.page_tokens, p.max_pages,
                                        p.num_kv_heads, p.head_dim));
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return Invalid(kOp, "dtype must be f32 or bf16");
  }
  if (p.first_slot < 0 || p.num_pages > (p.capacity - p.first_slot) / p.page_tokens) {
    return Invalid(kOp, absl::StrFormat("slots [%d, %d + %d·%d) exceed capacity %d", p.first_slot,
                                        p.first_slot, p.num_pages, p.page_tokens, p.capacity));
  }
  if (p.first_page < 0 || p.num_pages > p.max_pages - p.first_page) {
    return Invalid(kOp, absl::StrFormat("pages [%d, %d + %d) exceed max_pages %d", p.first_page,
                                        p.first_page, p.num_pages, p.max_pages));
  }
  return absl::OkStatus();
}

absl::Status ValidateSelectPages(const SelectPagesParams& p) {
  constexpr const char* kOp = "SelectPages";
  // kLowRank reads no summaries (they may be null).
  if (p.q == nullptr || p.pages == nullptr || p.scratch == nullptr ||
      (p.summaries == nullptr && p.score != PageScore::kLowRank)) {
    return Invalid(kOp, "null pointer");
  }
  if (p.num_tokens < 1 || p.num_q_heads < 1 || p.num_kv_heads < 1 || p.head_dim < 1 ||
      p.select < 1 || p.num_pages < 1) {
    return Invalid(kOp, absl::StrFormat("num_tokens %d, num_q_heads %d, num_kv_heads %d, "
                                        "head_dim %d, select %d and num_pages %d must be >= 1",
                                        p.num_tokens, p.num_q_heads, p.num_kv_heads, p.head_dim,
                                        p.select, p.num_pages));
  }
  if (p.num_pages > p.max_pages || p.num_pages > INT32_MAX || p.select > INT32_MAX) {
    return Invalid(kOp, absl::StrFormat("num_pages %d must be <= max_pages %d and select %d "
                                        "<= INT32_MAX",
                                        p.num_pages, p.max_pages, p.select));
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return Invalid(kOp, absl::StrFormat("num_q_heads %d is not a multiple of num_kv_heads %d",
                                        p.num_q_heads, p.num_kv_heads));
  }
  if (p.q_row_stride < p.num_q_heads * p.head_dim) {
    return Invalid(kOp, absl::StrFormat("q_row_stride %d < num_q_heads·head_dim %d",
                                        p.q_row_stride, p.num_q_heads * p.head_dim));
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return Invalid(kOp, "dtype must be f32 or bf16");
  }
  if (p.score != PageScore::kBound && p.score != PageScore::kCentroid &&
      p.score != PageScore::kLowRank) {
    return Invalid(kOp, "unknown page score");
  }
  if (p.score == PageScore::kLowRank) TANDEM_RETURN_IF_ERROR(ValidateLowRankKeys(p));
  if (p.keep != nullptr && (p.keep_per_head < 1 || p.keep_per_head >= p.select)) {
    return Invalid(kOp, absl::StrFormat("keep_per_head %d must be in [1, select %d)",
                                        p.keep_per_head, p.select));
  }
  return absl::OkStatus();
}

absl::Status PageSelectRunner::Summarize(const SummarizePagesParams& p) {
  TANDEM_RETURN_IF_ERROR(ValidateSummarizePages(p));
  if (p.dtype == DType::kF32) {
    SummarizeTyped<float>(p, threads_);
  } else {
    SummarizeTyped<bf16_t>(p, threads_);
  }
  return absl::OkStatus();
}

absl::Status PageSelectRunner::Select(const SelectPagesParams& p) {
  TANDEM_RETURN_IF_ERROR(ValidateSelectPages(p));
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  const int64_t n = p.num_pages;
  if (n <= p.select) {  // every page, then -1 padding; nothing to score
    for (int64_t row = 0; row < rows; ++row) {
      int32_t* out = p.pages + row * p.select;
      std::iota(out, out + n, 0);
      std::fill(out + n, out + p.select, -1);
    }
    return absl::OkStatus();
  }

  float* scores = static_cast<float*>(p.scratch);  // [rows, n]
  const int64_t items_per_row = (n + kScorePagesPerItem - 1) / kScorePagesPerItem;
  const int64_t items = rows * items_per_row;
  const bool bf16 = p.dtype == DType::kBF16;
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t row = item / items_per_row;
    const int64_t begin = (item % items_per_row) * kScorePagesPerItem;
    const int64_t end = std::min(n, begin + kScorePagesPerItem);
    const int64_t t = row / p.num_kv_heads;
    const int64_t g = row % p.num_kv_heads;
    if (p.score == PageScore::kLowRank) {
      LowRankScoreRange(p, t, g, begin, end, scores + row * n);
    } else if (bf16) {
      ScoreRange<bf16_t>(p, t, g, begin, end, scores + row * n);
    } else {
      ScoreRange<float>(p, t, g, begin, end, scores + row * n);
    }
  }

  // Kept pages score above every other (+inf; no bound, centroid or low-rank score reaches it).
  for (int64_t row = 0; p.keep != nullptr && row < rows; ++row) {
    for (int64_t i = 0; i < p.keep_per_head; ++i) {
      const int32_t id = p.keep[row * p.keep_per_head + i];
      if (id >= 0 && id < n) scores[row * n + id] = INFINITY;
    }
  }

  const int threads = static_cast<int>(std::min<int64_t>(threads_, rows));
  int32_t* ids = ids_.Get<int32_t>(static_cast<size_t>(threads) * n);
  if (ids == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("SelectPages: no memory for %d candidate lists of %d pages", threads, n));
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t row = 0; row < rows; ++row) {
    int32_t* candidates = ids + static_cast<int64_t>(omp_get_thread_num()) * n;
    const float* row_scores = scores + row * n;
    std::iota(candidates, candidates + n, 0);
    auto better = [row_scores](int32_t a, int32_t b) {
      const uint32_t ka = OrderKey(row_scores[a]);
      const uint32_t kb = OrderKey(row_scores[b]);
      return ka > kb || (ka == kb && a < b);
    };
    std::nth_element(candidates, candidates + p.select, candidates + n, better);
    std::sort(candidates, candidates + p.select);
    std::copy(candidates, candidates + p.select, p.pages + row * p.select);
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
