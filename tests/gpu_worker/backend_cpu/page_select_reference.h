// Naive references of SummarizePages and SelectPages (backend.h), written from the contract
// comments, and the problem generators and checks shared by the cpu and cuda backend tests.
// Scores are brute-force sums in double; the selection is a full sort by (score descending,
// page id ascending).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::page_reference {

inline float RoundTo(float x, DType dtype) {
  return dtype == DType::kBF16 ? Bf16ToFloat(FloatToBf16(x)) : x;
}

// Bytes of `values` stored as `dtype` (kF32 or kBF16; the values must be representable).
inline std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const bf16_t bits = FloatToBf16(values[i]);
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
  }
  return bytes;
}

inline std::vector<float> Decode(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t count = bytes.size() / DTypeBytes(dtype);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&values[i], &bytes[i * 4], 4);
    } else {
      bf16_t bits;
      std::memcpy(&bits, &bytes[i * 2], 2);
      values[i] = Bf16ToFloat(bits);
    }
  }
  return values;
}

// summaries [num_kv_heads, max_pages, 3, head_dim] after SummarizePages(p) over `before`
// (k_cache / summaries as values; pages outside [first_page, first_page + num_pages) unchanged).
inline std::vector<float> ReferenceSummaries(const SummarizePagesParams& p,
                                             const std::vector<float>& k_cache,
                                             std::vector<float> summaries) {
  const int64_t d_count = p.head_dim;
  for (int64_t g = 0; g < p.num_kv_heads; ++g) {
    for (int64_t i = 0; i < p.num_pages; ++i) {
      for (int64_t d = 0; d < d_count; ++d) {
        float lo = INFINITY, hi = -INFINITY, sum = 0.0f;   // the mean: f32, slot order
        for (int64_t s = 0; s < p.page_tokens; ++s) {
          const int64_t slot = p.first_slot + i * p.page_tokens + s;
          const float k = k_cache[(g * p.capacity + slot) * d_count + d];
          lo = std::min(lo, k);
          hi = std::max(hi, k);
          sum += k;
        }
        float* dst =
            &summaries[((g * p.max_pages + p.first_page + i) * kPageSummaryRows) * d_count];
        dst[d] = lo;
        dst[d_count + d] = hi;
        dst[2 * d_count + d] = RoundTo(sum / static_cast<float>(p.page_tokens), p.dtype);
      }
    }
  }
  return summaries;
}

// One SelectPages problem with host data; `summaries` hold values as stored in `dtype`.
struct SelectProblem {
  int64_t num_tokens = 1, num_q_heads = 1, num_kv_heads = 1, head_dim = 1;
  int64_t num_pages = 1, max_pages = 1, select = 1, q_row_stride = 1;
  DType dtype = DType::kF32;
  PageScore score = PageScore::kBound;
  std::vector<float> q;          // [num_tokens, q_row_stride]
  std::vector<float> summaries;  // [num_kv_heads, max_pages, 3, head_dim] (min, max, mean)
  std::vector<int32_t> keep;     // empty, or [num_tokens, num_kv_heads, keep_per_head]
  int64_t keep_per_head = 0;

  int64_t group() const { return num_q_heads / num_kv_heads; }
  std::string Describe() const {
    return "T " + std::to_string(num_tokens) + " Hq " + std::to_string(num_q_heads) + " Hkv " +
           std::to_string(num_kv_heads) + " D " + std::to_string(head_dim) + " pages " +
           std::to_string(num_pages) + "/" + std::to_string(max_pages) + " select " +
           std::to_string(select) + " " + std::string(DTypeName(dtype)) +
           (score == PageScore::kCentroid ? " centroid" : " bound") +
           (keep.empty() ? "" : " keep " + std::to_string(keep_per_head));
  }
};

// Values: `quantized` draws multiples of 1/4 in [-2, 2] (every f32 product and sum of a score is
// then exact, so all backends agree bit for bit and ties are exact); otherwise uniform reals.
// `distinct` summaries per kv head; the rest repeat them (pages p and p + distinct are
// identical: adversarial ties). Pages num_pages.. of max_pages get huge scores: they must never
// be read.
inline SelectProblem MakeSelectProblem(int64_t num_tokens, int64_t num_kv_heads, int64_t group,
                                       int64_t head_dim, int64_t num_pages, int64_t select,
                                       DType dtype, bool quantized, int64_t distinct,
                                       uint32_t seed) {
  SelectProblem pr;
  pr.num_tokens = num_tokens;
  pr.num_kv_heads = num_kv_heads;
  pr.num_q_heads = num_kv_heads * group;
  pr.head_dim = head_dim;
  pr.num_pages = num_pages;
  pr.max_pages = num_pages + 3;
  pr.select = select;
  pr.q_row_stride = pr.num_q_heads * head_dim + 5;  // padded rows
  pr.dtype = dtype;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_int_distribution<int> quarter(-8, 8);
  auto draw = [&] { return quantized ? quarter(rng) / 4.0f : uniform(rng); };
  pr.q.assign(num_tokens * pr.q_row_stride, NAN);  // the padding is never read
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < pr.num_q_heads * head_dim; ++i) pr.q[t * pr.q_row_stride + i] = draw();
  }
  constexpr int64_t kRows = kPageSummaryRows;
  pr.summaries.assign(num_kv_heads * pr.max_pages * kRows * head_dim, 0.0f);
  for (int64_t g = 0; g < num_kv_heads; ++g) {
    for (int64_t page = 0; page < pr.max_pages; ++page) {
      float* dst = &pr.summaries[(g * pr.max_pages + page) * kRows * head_dim];
      if (page >= num_pages) {
        for (int64_t d = 0; d < kRows * head_dim; ++d) dst[d] = d < head_dim ? -1e4f : 1e4f;
        continue;
      }
      if (page >= distinct) {
        const float* src = &pr.summaries[(g * pr.max_pages + page % distinct) * kRows * head_dim];
        std::copy(src, src + kRows * head_dim, dst);
        continue;
      }
      for (int64_t d = 0; d < head_dim; ++d) {
        const float a = RoundTo(draw(), dtype);
        const float b = RoundTo(draw(), dtype);
        dst[d] = std::min(a, b);
        dst[head_dim + d] = std::max(a, b);
        dst[2 * head_dim + d] = RoundTo(draw(), dtype);   // any key value will do
      }
    }
  }
  return pr;
}

// Gives every row of `pr` a keep list of `keep_per_head` distinct pages (a first selection by
// the other score), with one -1 in the last row when there is room (ignored ids).
inline void AddKeep(SelectProblem& pr, int64_t keep_per_head, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t rows = pr.num_tokens * pr.num_kv_heads;
  pr.keep_per_head = keep_per_head;
  pr.keep.assign(rows * keep_per_head, -1);
  std::vector<int32_t> ids(pr.num_pages);
  for (int64_t row = 0; row < rows; ++row) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int64_t n = row + 1 == rows && keep_per_head > 1 ? keep_per_head - 1 : keep_per_head;
    std::copy(ids.begin(), ids.begin() + n, pr.keep.begin() + row * keep_per_head);
  }
}

// score[t, g, p] in double, straight from backend.h (kept pages: +inf).
inline std::vector<double> ReferenceScores(const SelectProblem& pr) {
  const int64_t d_count = pr.head_dim;
  std::vector<double> scores(pr.num_tokens * pr.num_kv_heads * pr.num_pages);
  for (int64_t t = 0; t < pr.num_tokens; ++t) {
    for (int64_t g = 0; g < pr.num_kv_heads; ++g) {
      for (int64_t page = 0; page < pr.num_pages; ++page) {
        const float* row = &pr.summaries[(g * pr.max_pages + page) * kPageSummaryRows * d_count];
        double best = -INFINITY;
        for (int64_t j = 0; j < pr.group(); ++j) {
          const float* q = &pr.q[t * pr.q_row_stride + (g * pr.group() + j) * d_count];
          double sum = 0.0;
          for (int64_t d = 0; d < d_count; ++d) {
            const double qd = q[d];
            sum += pr.score == PageScore::kCentroid
                       ? qd * row[2 * d_count + d]
                       : std::max(qd * row[d], qd * row[d_count + d]);
          }
          best = std::max(best, sum);
        }
        scores[(t * pr.num_kv_heads + g) * pr.num_pages + page] = best;
      }
      for (int64_t i = 0; i < pr.keep_per_head && !pr.keep.empty(); ++i) {
        const int32_t id = pr.keep[(t * pr.num_kv_heads + g) * pr.keep_per_head + i];
        if (id >= 0 && id < pr.num_pages) {
          scores[(t * pr.num_kv_heads + g) * pr.num_pages + id] = INFINITY;
        }
      }
    }
  }
  return scores;
}

// pages [T, Hkv, select]: full sort by (score desc, id asc), the first `select`, ascending,
// -1 padding.
inline std::vector<int32_t> ReferenceSelection(const SelectProblem& pr,
                                               const std::vector<double>& scores) {
  const int64_t rows = pr.num_tokens * pr.num_kv_heads;
  std::vector<int32_t> pages(rows * pr.select, -1);
  std::vector<int32_t> order(pr.num_pages);
  for (int64_t row = 0; row < rows; ++row) {
    const double* s = &scores[row * pr.num_pages];
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [s](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    const int64_t kept = std::min(pr.select, pr.num_pages);
    std::sort(order.begin(), order.begin() + kept);
    std::copy(order.begin(), order.begin() + kept, pages.begin() + row * pr.select);
  }
  return pages;
}

// Checks `actual` against `expected` (by default the reference selection) row by row: each row
// holds min(select, num_pages) distinct ascending ids in [0, num_pages), then -1. With
// rel_tol = 0 it must equal `expected`; otherwise a page may differ only when its reference score
// is within rel_tol · (max |score| of the row) of the select-th best score (a near-tie that f32
// sums in another order may break the other way).
inline void ExpectSelection(const SelectProblem& pr, const std::vector<double>& scores,
                            const std::vector<int32_t>& actual, double rel_tol,
                            const std::vector<int32_t>* expected_pages = nullptr) {
  const std::vector<int32_t> expected =
      expected_pages != nullptr ? *expected_pages : ReferenceSelection(pr, scores);
  ASSERT_EQ(actual.size(), expected.size());
  const int64_t kept = std::min(pr.select, pr.num_pages);
  for (int64_t row = 0; row < pr.num_tokens * pr.num_kv_heads; ++row) {
    const int32_t* a = &actual[row * pr.select];
    const int32_t* e = &expected[row * pr.select];
    for (int64_t i = 0; i < pr.select; ++i) {
      if (i >= kept) {
        ASSERT_EQ(a[i], -1) << pr.Describe() << " row " << row << " slot " << i;
        continue;
      }
      ASSERT_TRUE(a[i] >= 0 && a[i] < pr.num_pages && (i == 0 || a[i] > a[i - 1]))
          << pr.Describe() << " row " << row << " slot " << i << ": " << a[i];
    }
    if (rel_tol == 0.0) {
      for (int64_t i = 0; i < pr.select; ++i) {
        ASSERT_EQ(a[i], e[i]) << pr.Describe() << " row " << row << " slot " << i;
      }
      continue;
    }
    const double* s = &scores[row * pr.num_pages];
    double max_abs = 0.0;
    for (int64_t p = 0; p < pr.num_pages; ++p) {
      if (std::isfinite(s[p])) max_abs = std::max(max_abs, std::abs(s[p]));
    }
    std::vector<double> sorted(s, s + pr.num_pages);
    std::nth_element(sorted.begin(), sorted.begin() + (kept - 1), sorted.end(),
                     std::greater<double>());
    const double kth = sorted[kept - 1];
    const std::set<int32_t> got(a, a + kept), want(e, e + kept);
    for (const std::set<int32_t>* side : {&got, &want}) {
      for (int32_t p : *side) {
        if (got.count(p) != 0 && want.count(p) != 0) continue;
        EXPECT_LE(std::abs(s[p] - kth), rel_tol * max_abs)
            << pr.Describe() << " row " << row << ": page " << p << " (score " << s[p]
            << ") differs from the reference, k-th score " << kth;
      }
    }
  }
}

// Copies `bytes` of host data into a new buffer of `backend` (a test failure on error).
inline DeviceBuffer UploadBytes(Backend& backend, const void* src, size_t bytes) {
  absl::StatusOr<DeviceBuffer> buffer = backend.Allocate(std::max<size_t>(bytes, 1));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return DeviceBuffer();
  if (bytes > 0) {
    const absl::Status copied = backend.CopyToDevice(buffer->data(), src, bytes);
    EXPECT_TRUE(copied.ok()) << copied;
  }
  return *std::move(buffer);
}

// Runs backend.SelectPages on the problem; the pages [T, Hkv, select] (poisoned with 7777
// before the call), or an empty vector when the call fails (with a test failure).
inline std::vector<int32_t> RunSelectPages(Backend& backend, const SelectProblem& pr) {
  const std::vector<uint8_t> summary_bytes = Encode(pr.summaries, pr.dtype);
  DeviceBuffer q = UploadBytes(backend, pr.q.data(), pr.q.size() * sizeof(float));
  DeviceBuffer summaries = UploadBytes(backend, summary_bytes.data(), summary_bytes.size());
  const int64_t count = pr.num_tokens * pr.num_kv_heads * pr.select;
  std::vector<int32_t> pages(count, 7777);
  DeviceBuffer pages_buffer = UploadBytes(backend, pages.data(), count * sizeof(int32_t));
  DeviceBuffer keep = UploadBytes(backend, pr.keep.data(), pr.keep.size() * sizeof(int32_t));
  absl::StatusOr<DeviceBuffer> scratch =
      backend.Allocate(SelectPagesScratchBytes(pr.num_tokens, pr.num_kv_heads, pr.num_pages));
  EXPECT_TRUE(scratch.ok()) << scratch.status();
  if (!scratch.ok()) return {};
  const absl::Status status = backend.SelectPages(
      {.q = q.as<float>(),
       .q_row_stride = pr.q_row_stride,
       .summaries = summaries.data(),
       .dtype = pr.dtype,
       .max_pages = pr.max_pages,
       .num_pages = pr.num_pages,
       .num_tokens = pr.num_tokens,
       .num_q_heads = pr.num_q_heads,
       .num_kv_heads = pr.num_kv_heads,
       .head_dim = pr.head_dim,
       .select = pr.select,
       .score = pr.score,
       .keep = pr.keep.empty() ? nullptr : keep.as<int32_t>(),
       .keep_per_head = pr.keep_per_head,
       .pages = pages_buffer.as<int32_t>(),
       .scratch = scratch->data()});
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  const absl::Status copied =
      backend.CopyToHost(pages.data(), pages_buffer.data(), count * sizeof(int32_t));
  EXPECT_TRUE(copied.ok()) << copied;
  return pages;
}

// SelectPagesBatch over `problems` (each with its own q, summaries, pages and scratch); the
// pages of each, in order.
inline std::vector<std::vector<int32_t>> RunSelectPagesBatch(
    Backend& backend, const std::vector<SelectProblem>& problems) {
  std::vector<DeviceBuffer> buffers;
  std::vector<SelectPagesParams> params;
  std::vector<std::vector<int32_t>> pages;
  for (const SelectProblem& pr : problems) {
    const std::vector<uint8_t> summary_bytes = Encode(pr.summaries, pr.dtype);
    const int64_t count = pr.num_tokens * pr.num_kv_heads * pr.select;
    pages.emplace_back(count, 7777);
    buffers.push_back(UploadBytes(backend, pr.q.data(), pr.q.size() * sizeof(float)));
    buffers.push_back(UploadBytes(backend, summary_bytes.data(), summary_bytes.size()));
    buffers.push_back(UploadBytes(backend, pages.back().data(), count * sizeof(int32_t)));
    buffers.push_back(UploadBytes(backend, pr.keep.data(), pr.keep.size() * sizeof(int32_t)));
    absl::StatusOr<DeviceBuffer> scratch =
        backend.Allocate(SelectPagesScratchBytes(pr.num_tokens, pr.num_kv_heads, pr.num_pages));
    EXPECT_TRUE(scratch.ok()) << scratch.status();
    if (!scratch.ok()) return {};
    buffers.push_back(*std::move(scratch));
    const size_t b = buffers.size();
    params.push_back({.q = buffers[b - 5].as<float>(),
                      .q_row_stride = pr.q_row_stride,
                      .summaries = buffers[b - 4].data(),
                      .dtype = pr.dtype,
                      .max_pages = pr.max_pages,
                      .num_pages = pr.num_pages,
                      .num_tokens = pr.num_tokens,
                      .num_q_heads = pr.num_q_heads,
                      .num_kv_heads = pr.num_kv_heads,
                      .head_dim = pr.head_dim,
                      .select = pr.select,
                      .score = pr.score,
                      .keep = pr.keep.empty() ? nullptr : buffers[b - 2].as<int32_t>(),
                      .keep_per_head = pr.keep_per_head,
                      .pages = buffers[b - 3].as<int32_t>(),
                      .scratch = buffers[b - 1].data()});
  }
  const absl::Status status = backend.SelectPagesBatch(params.data(), params.size());
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  for (size_t i = 0; i < problems.size(); ++i) {
    const absl::Status copied = backend.CopyToHost(pages[i].data(), params[i].pages,
                                                   pages[i].size() * sizeof(int32_t));
    EXPECT_TRUE(copied.ok()) << copied;
  }
  return pages;
}

// One SummarizePages case: a K cache of random keys (with repeated values and signed zeros),
// summaries poisoned before the call.
struct SummarizeCase {
  SummarizePagesParams p;  // sizes and dtype; pointers unset
  std::vector<float> k_cache;    // [num_kv_heads, capacity, head_dim], values as stored
  std::vector<float> summaries;  // [num_kv_heads, max_pages, 3, head_dim] before the call
};

inline SummarizeCase MakeSummarizeCase(int64_t num_kv_heads, int64_t head_dim,
                                       int64_t page_tokens, int64_t num_pages, int64_t first_slot,
                                       int64_t first_page, DType dtype, uint32_t seed) {
  SummarizeCase c;
  c.p.num_kv_heads = num_kv_heads;
  c.p.head_dim = head_dim;
  c.p.page_tokens = page_tokens;
  c.p.num_pages = num_pages;
  c.p.first_slot = first_slot;
  c.p.first_page = first_page;
  c.p.capacity = first_slot + num_pages * page_tokens + 5;
  c.p.max_pages = first_page + num_pages + 2;
  c.p.dtype = dtype;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 9);
  c.k_cache.resize(num_kv_heads * c.p.capacity * head_dim);
  for (float& k : c.k_cache) {
    const int r = pick(rng);
    k = r == 0 ? 0.5f : (r == 1 ? 0.0f : RoundTo(uniform(rng), dtype));  // repeats and zeros
  }
  c.summaries.assign(num_kv_heads * c.p.max_pages * kPageSummaryRows * head_dim, 42.0f);
  return c;
}

// Runs backend.SummarizePages on the case; the summaries after the call (values).
inline std::vector<float> RunSummarizePages(Backend& backend, const SummarizeCase& c) {
  const std::vector<uint8_t> cache_bytes = Encode(c.k_cache, c.p.dtype);
  std::vector<uint8_t> summary_bytes = Encode(c.summaries, c.p.dtype);
  DeviceBuffer cache = UploadBytes(backend, cache_bytes.data(), cache_bytes.size());
  DeviceBuffer summaries = UploadBytes(backend, summary_bytes.data(), summary_bytes.size());
  SummarizePagesParams p = c.p;
  p.k_cache = cache.data();
  p.summaries = summaries.data();
  const absl::Status status = backend.SummarizePages(p);
  EXPECT_TRUE(status.ok()) << status;
  const absl::Status copied =
      backend.CopyToHost(summary_bytes.data(), summaries.data(), summary_bytes.size());
  EXPECT_TRUE(copied.ok()) << copied;
  return Decode(summary_bytes, c.p.dtype);
}

}  // namespace tandem::gpu_worker::page_reference
