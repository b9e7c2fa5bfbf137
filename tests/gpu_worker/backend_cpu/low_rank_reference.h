// Naive references of KeyGram, ProjectKeys and SelectPages with PageScore::kLowRank (backend.h),
// written from the contract comments in double precision, and the problem generators, runners
// and checks shared by the cpu and cuda backend tests.
//
// Tolerances: the Gram matrix within 1e-5 of Σ_s |k_d·k_e|; codes within ±1 of the f64 rounding
// (a code may round the other way where c_r / scale is within rounding of a half) and scales
// within 1e-5 of the size of their terms; scores within kScoreTolerance of the row's scale (the
// larger of its largest finite |score| and 1/σ: a logsumexp is only as accurate as its largest
// term); selected pages equal to the reference except pages whose reference score is within that
// tolerance of the row's select-th best score (a near-tie that f32 sums may break the other way).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "page_select_reference.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::low_rank_reference {

using page_reference::Encode;
using page_reference::RoundTo;
using page_reference::UploadBytes;

inline constexpr double kScoreTolerance = 2e-5;

// `rank` orthonormal columns per kv head: basis [num_kv_heads, head_dim, rank], Gram-Schmidt of
// Gaussian columns in double, stored as f32.
inline std::vector<float> RandomBasis(int64_t num_kv_heads, int64_t head_dim, int64_t rank,
                                      uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> basis(num_kv_heads * head_dim * rank);
  for (int64_t g = 0; g < num_kv_heads; ++g) {
    std::vector<std::vector<double>> cols;
    while (static_cast<int64_t>(cols.size()) < rank) {
      std::vector<double> v(head_dim);
      for (double& x : v) x = normal(rng);
      for (int pass = 0; pass < 2; ++pass) {  // twice: orthogonal to rounding
        for (const std::vector<double>& u : cols) {
          const double dot = std::inner_product(v.begin(), v.end(), u.begin(), 0.0);
          for (int64_t d = 0; d < head_dim; ++d) v[d] -= dot * u[d];
        }
      }
      const double norm = std::sqrt(std::inner_product(v.begin(), v.end(), v.begin(), 0.0));
      if (norm < 1e-6) continue;
      for (double& x : v) x /= norm;
      cols.push_back(std::move(v));
    }
    for (int64_t d = 0; d < head_dim; ++d) {
      for (int64_t r = 0; r < rank; ++r) {
        basis[(g * head_dim + d) * rank + r] = static_cast<float>(cols[r][d]);
      }
    }
  }
  return basis;
}

// Keys [num_kv_heads, capacity, head_dim] as stored in `dtype`: uniform in [-2, 2] plus a few
// strong directions (keys live near a low-rank subspace), every `zero_every`-th key all zero
// (0: none).
inline std::vector<float> RandomKeys(int64_t num_kv_heads, int64_t capacity, int64_t head_dim,
                                     DType dtype, int64_t zero_every, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<float> dirs(4 * head_dim);
  for (float& x : dirs) x = uniform(rng);
  std::vector<float> keys(num_kv_heads * capacity * head_dim);
  for (int64_t row = 0; row < num_kv_heads * capacity; ++row) {
    float w[4];
    for (float& x : w) x = 2.0f * uniform(rng);
    for (int64_t d = 0; d < head_dim; ++d) {
      float k = 0.3f * uniform(rng);
      for (int i = 0; i < 4; ++i) k += w[i] * dirs[i * head_dim + d];
      keys[row * head_dim + d] = zero_every > 0 && row % zero_every == 0 ? 0.0f : RoundTo(k, dtype);
    }
  }
  return keys;
}

// ---- KeyGram ------------------------------------------------------------------------------

// gram [num_kv_heads, head_dim, head_dim] of KeyGram(p) over `keys` (values as stored).
inline std::vector<float> RunKeyGram(Backend& backend, const KeyGramParams& sizes,
                                     const std::vector<float>& keys) {
  const std::vector<uint8_t> key_bytes = Encode(keys, sizes.dtype);
  const size_t count = sizes.num_kv_heads * sizes.head_dim * sizes.head_dim;
  std::vector<float> gram(count, NAN);  // every element must be written
  DeviceBuffer k = UploadBytes(backend, key_bytes.data(), key_bytes.size());
  DeviceBuffer out = UploadBytes(backend, gram.data(), count * sizeof(float));
  KeyGramParams p = sizes;
  p.k = k.data();
  p.gram = out.as<float>();
  const absl::Status status = backend.KeyGram(p);
  EXPECT_TRUE(status.ok()) << status;
  const absl::Status copied = backend.CopyToHost(gram.data(), out.data(), count * sizeof(float));
  EXPECT_TRUE(copied.ok()) << copied;
  return gram;
}

inline void ExpectGram(const KeyGramParams& p, const std::vector<float>& keys,
                       const std::vector<float>& gram) {
  const int64_t dim = p.head_dim;
  ASSERT_EQ(static_cast<int64_t>(gram.size()), p.num_kv_heads * dim * dim);
  for (int64_t g = 0; g < p.num_kv_heads; ++g) {
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t e = 0; e < dim; ++e) {
        double sum = 0.0, magnitude = 0.0;
        for (int64_t s = p.first_slot; s < p.first_slot + p.count; ++s) {
          const double product = static_cast<double>(keys[(g * p.capacity + s) * dim + d]) *
                                 keys[(g * p.capacity + s) * dim + e];
          sum += product;
          magnitude += std::abs(product);
        }
        const float got = gram[(g * dim + d) * dim + e];
        ASSERT_LE(std::abs(got - sum), 1e-5 * magnitude + 1e-30)
            << "gram[" << g << ", " << d << ", " << e << "] = " << got << ", want " << sum;
      }
    }
  }
}

// ---- ProjectKeys --------------------------------------------------------------------------

struct Projection {
  std::vector<int8_t> coords;  // [num_kv_heads, max_tokens, rank]
  std::vector<float> scales;   // [num_kv_heads, max_tokens]
};

inline constexpr int8_t kCodePoison = 99;
inline constexpr float kScalePoison = -5.0f;

// ProjectKeys(p) over `keys` and `basis` into coords / scales poisoned with kCodePoison /
// kScalePoison (rows outside [first_token, + count) must keep them).
inline Projection RunProjectKeys(Backend& backend, const ProjectKeysParams& sizes,
                                 const std::vector<float>& keys, const std::vector<float>& basis) {
  const std::vector<uint8_t> key_bytes = Encode(keys, sizes.dtype);
  Projection out;
  out.coords.assign(sizes.num_kv_heads * sizes.max_tokens * sizes.rank, kCodePoison);
  out.scales.assign(sizes.num_kv_heads * sizes.max_tokens, kScalePoison);
  DeviceBuffer k = UploadBytes(backend, key_bytes.data(), key_bytes.size());
  DeviceBuffer b = UploadBytes(backend, basis.data(), basis.size() * sizeof(float));
  DeviceBuffer coords = UploadBytes(backend, out.coords.data(), out.coords.size());
  DeviceBuffer scales = UploadBytes(backend, out.scales.data(), out.scales.size() * sizeof(float));
  ProjectKeysParams p = sizes;
  p.k = k.data();
  p.basis = b.as<float>();
  p.coords = coords.as<int8_t>();
  p.scales = scales.as<float>();
  const absl::Status status = backend.ProjectKeys(p);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_TRUE(backend.CopyToHost(out.coords.data(), coords.data(), out.coords.size()).ok());
  EXPECT_TRUE(
      backend.CopyToHost(out.scales.data(), scales.data(), out.scales.size() * sizeof(float)).ok());
  return out;
}

// The projection against the f64 definition: scales within 1e-5 of the largest Σ_d |k_d·b_dr|
// / 127 (f32 sums of cancelling terms; exactly 0 for a zero key), codes within ±1 and at least
// 99% exact; the other rows untouched.
inline void ExpectProjection(const ProjectKeysParams& p, const std::vector<float>& keys,
                             const std::vector<float>& basis, const Projection& got) {
  const int64_t rank = p.rank;
  int64_t off_by_one = 0, codes = 0;
  for (int64_t g = 0; g < p.num_kv_heads; ++g) {
    for (int64_t row = 0; row < p.max_tokens; ++row) {
      const int64_t dst = g * p.max_tokens + row;
      const int64_t i = row - p.first_token;
      if (i < 0 || i >= p.count) {
        ASSERT_EQ(got.scales[dst], kScalePoison) << "row " << row << " of head " << g << " written";
        for (int64_t r = 0; r < rank; ++r) ASSERT_EQ(got.coords[dst * rank + r], kCodePoison);
        continue;
      }
      const float* key = &keys[(g * p.capacity + p.first_slot + i) * p.head_dim];
      std::vector<double> c(rank, 0.0);
      double amax = 0.0, magnitude = 0.0;  // magnitude: the largest Σ_d |k_d·basis[d, r]|
      for (int64_t r = 0; r < rank; ++r) {
        double terms = 0.0;
        for (int64_t d = 0; d < p.head_dim; ++d) {
          const double product =
              static_cast<double>(key[d]) * basis[(g * p.head_dim + d) * rank + r];
          c[r] += product;
          terms += std::abs(product);
        }
        amax = std::max(amax, std::abs(c[r]));
        magnitude = std::max(magnitude, terms);
      }
      const double scale = amax / 127.0;
      ASSERT_LE(std::abs(got.scales[dst] - scale), 1e-5 * magnitude / 127.0)
          << "scale of key " << i << " head " << g << ": " << got.scales[dst] << ", want " << scale;
      for (int64_t r = 0; r < rank; ++r) {
        const int want = scale == 0.0 ? 0 : static_cast<int>(std::nearbyint(c[r] / scale));
        const int code = got.coords[dst * rank + r];
        ASSERT_LE(std::abs(code - std::clamp(want, -127, 127)), 1)
            << "code " << r << " of key " << i << " head " << g << ": " << code << ", want " << want
            << " (c / scale " << c[r] / scale << ")";
        off_by_one += code != want;
        ++codes;
      }
    }
  }
  EXPECT_LE(off_by_one * 100, codes) << off_by_one << " of " << codes << " codes off by one";
}

// ---- SelectPages, kLowRank ------------------------------------------------------------------

// One kLowRank selection with host data. Rows [num_pages·page_tokens, max_tokens) of every head
// hold huge keys: they must never be read.
struct LowRankProblem {
  int64_t num_tokens = 1, num_q_heads = 1, num_kv_heads = 1, head_dim = 1, rank = 1;
  int64_t page_tokens = 1, num_pages = 1, max_tokens = 1, select = 1, q_row_stride = 1;
  float sigma = 1.0f;
  std::vector<float> q;        // [num_tokens, q_row_stride]
  std::vector<float> basis;    // [num_kv_heads, head_dim, rank]
  std::vector<int8_t> coords;  // [num_kv_heads, max_tokens, rank]
  std::vector<float> scales;   // [num_kv_heads, max_tokens]
  std::vector<int32_t> keep;   // empty, or [num_tokens, num_kv_heads, keep_per_head]
  int64_t keep_per_head = 0;

  int64_t group() const { return num_q_heads / num_kv_heads; }
  std::string Describe() const {
    return "low rank: T " + std::to_string(num_tokens) + " Hq " + std::to_string(num_q_heads) +
           " Hkv " + std::to_string(num_kv_heads) + " D " + std::to_string(head_dim) + " R " +
           std::to_string(rank) + " page " + std::to_string(page_tokens) + " pages " +
           std::to_string(num_pages) + " select " + std::to_string(select) + " sigma " +
           std::to_string(sigma) + (keep.empty() ? "" : " keep " + std::to_string(keep_per_head));
  }
};

// q uniform in [-q_range, q_range] (rows padded with NaN, never read); codes uniform in
// [-127, 127] with one ±127 per key (as ProjectKeys makes them); scales uniform in
// [0.005, 0.025]. `distinct` pages per kv head, the rest copies of them (page p repeats
// p % distinct: exact ties).
inline LowRankProblem MakeLowRankProblem(int64_t num_tokens, int64_t num_kv_heads, int64_t group,
                                         int64_t head_dim, int64_t rank, int64_t page_tokens,
                                         int64_t num_pages, int64_t select, uint32_t seed,
                                         float q_range = 3.0f, int64_t distinct = 0) {
  LowRankProblem pr;
  pr.num_tokens = num_tokens;
  pr.num_kv_heads = num_kv_heads;
  pr.num_q_heads = num_kv_heads * group;
  pr.head_dim = head_dim;
  pr.rank = rank;
  pr.page_tokens = page_tokens;
  pr.num_pages = num_pages;
  pr.max_tokens = num_pages * page_tokens + 7;
  pr.select = select;
  pr.q_row_stride = pr.num_q_heads * head_dim + 3;
  pr.sigma = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (distinct <= 0) distinct = num_pages;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> q_dist(-q_range, q_range);
  std::uniform_int_distribution<int> code_dist(-127, 127);
  std::uniform_real_distribution<float> scale_dist(0.005f, 0.025f);
  pr.q.assign(num_tokens * pr.q_row_stride, NAN);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < pr.num_q_heads * head_dim; ++i)
      pr.q[t * pr.q_row_stride + i] = q_dist(rng);
  }
  pr.basis = RandomBasis(num_kv_heads, head_dim, rank, seed + 1);
  pr.coords.assign(num_kv_heads * pr.max_tokens * rank, 127);
  pr.scales.assign(num_kv_heads * pr.max_tokens, 1e6f);
  const int64_t rows = num_pages * page_tokens;
  for (int64_t g = 0; g < num_kv_heads; ++g) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t dst = g * pr.max_tokens + row;
      const int64_t page = row / page_tokens;
      if (page >= distinct) {
        const int64_t src = g * pr.max_tokens + (page % distinct) * page_tokens + row % page_tokens;
        std::copy_n(&pr.coords[src * rank], rank, &pr.coords[dst * rank]);
        pr.scales[dst] = pr.scales[src];
        continue;
      }
      for (int64_t r = 0; r < rank; ++r)
        pr.coords[dst * rank + r] = static_cast<int8_t>(code_dist(rng));
      pr.coords[dst * rank + rng() % rank] = rng() % 2 == 0 ? 127 : -127;
      pr.scales[dst] = scale_dist(rng);
    }
  }
  return pr;
}

// Gives every row a keep list of `keep_per_head` distinct pages, with one -1 in the last row.
inline void AddKeep(LowRankProblem& pr, int64_t keep_per_head, uint32_t seed) {
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

// score[t, g, p] in double, straight from backend.h (kept pages: +inf). `pages` limits the work
// to the listed pages of every row (the others are NaN); empty: all.
inline std::vector<double> ReferenceScores(const LowRankProblem& pr,
                                           const std::vector<int64_t>& pages = {}) {
  const int64_t n = pr.num_pages, rank = pr.rank, dim = pr.head_dim, group = pr.group();
  std::vector<int64_t> list = pages;
  if (list.empty()) {
    list.resize(n);
    std::iota(list.begin(), list.end(), 0);
  }
  std::vector<double> scores(pr.num_tokens * pr.num_kv_heads * n, NAN);
  std::vector<double> q_tilde(group * rank), x(pr.page_tokens);
  for (int64_t t = 0; t < pr.num_tokens; ++t) {
    for (int64_t g = 0; g < pr.num_kv_heads; ++g) {
      for (int64_t j = 0; j < group; ++j) {
        const float* q = &pr.q[t * pr.q_row_stride + (g * group + j) * dim];
        for (int64_t r = 0; r < rank; ++r) {
          double sum = 0.0;
          for (int64_t d = 0; d < dim; ++d)
            sum += static_cast<double>(q[d]) * pr.basis[(g * dim + d) * rank + r];
          q_tilde[j * rank + r] = sum;
        }
      }
      double* row_scores = &scores[(t * pr.num_kv_heads + g) * n];
      for (int64_t page : list) {
        double best = -INFINITY;
        for (int64_t j = 0; j < group; ++j) {
          double m = -INFINITY;
          for (int64_t s = 0; s < pr.page_tokens; ++s) {
            const int64_t row = g * pr.max_tokens + page * pr.page_tokens + s;
            double dot = 0.0;
            for (int64_t r = 0; r < rank; ++r)
              dot += q_tilde[j * rank + r] * pr.coords[row * rank + r];
            x[s] = static_cast<double>(pr.sigma) * pr.scales[row] * dot;
            m = std::max(m, x[s]);
          }
          double sum = 0.0;
          for (double v : x) sum += std::exp(v - m);
          best = std::max(best, (m + std::log(sum)) / pr.sigma);
        }
        row_scores[page] = best;
      }
      for (int64_t i = 0; i < pr.keep_per_head && !pr.keep.empty(); ++i) {
        const int32_t id = pr.keep[(t * pr.num_kv_heads + g) * pr.keep_per_head + i];
        if (id >= 0 && id < n) row_scores[id] = INFINITY;
      }
    }
  }
  return scores;
}

// The tolerance of a row's scores (see the top of this file).
inline double RowTolerance(const LowRankProblem& pr, const double* scores) {
  double max_abs = 1.0 / pr.sigma;
  for (int64_t p = 0; p < pr.num_pages; ++p) {
    if (std::isfinite(scores[p])) max_abs = std::max(max_abs, std::abs(scores[p]));
  }
  return kScoreTolerance * max_abs;
}

// Every score of `got` [T, Hkv, num_pages] (the backend's scratch) against the reference
// (NaN entries of `want` are skipped; +inf must be +inf).
inline void ExpectScores(const LowRankProblem& pr, const std::vector<double>& want,
                         const std::vector<float>& got) {
  ASSERT_EQ(got.size(), want.size());
  for (int64_t row = 0; row < pr.num_tokens * pr.num_kv_heads; ++row) {
    const double* w = &want[row * pr.num_pages];
    const float* s = &got[row * pr.num_pages];
    const double tol = RowTolerance(pr, w);
    for (int64_t p = 0; p < pr.num_pages; ++p) {
      if (std::isnan(w[p])) continue;
      if (std::isinf(w[p])) {
        ASSERT_EQ(s[p], static_cast<float>(w[p]))
            << pr.Describe() << " row " << row << " page " << p;
        continue;
      }
      ASSERT_LE(std::abs(s[p] - w[p]), tol)
          << pr.Describe() << " row " << row << " page " << p << ": " << s[p] << ", want " << w[p];
    }
  }
}

// pages [T, Hkv, select]: full sort by (score desc, id asc), the first `select`, ascending,
// -1 padding.
inline std::vector<int32_t> ReferenceSelection(const LowRankProblem& pr,
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

// `actual` against `expected` (by default the reference selection) row by row: each row holds
// min(select, num_pages) distinct ascending ids in [0, num_pages), then -1; a page may differ
// only when its reference score is within the row's tolerance of the select-th best score.
inline void ExpectSelection(const LowRankProblem& pr, const std::vector<double>& scores,
                            const std::vector<int32_t>& actual,
                            const std::vector<int32_t>* expected_pages = nullptr) {
  const std::vector<int32_t> expected =
      expected_pages != nullptr ? *expected_pages : ReferenceSelection(pr, scores);
  ASSERT_EQ(actual.size(), expected.size()) << pr.Describe();
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
    if (kept == pr.num_pages) continue;
    const double* s = &scores[row * pr.num_pages];
    const double tol = RowTolerance(pr, s);
    std::vector<double> sorted(s, s + pr.num_pages);
    std::nth_element(sorted.begin(), sorted.begin() + (kept - 1), sorted.end(),
                     std::greater<double>());
    const double kth = sorted[kept - 1];
    const std::set<int32_t> got(a, a + kept), want(e, e + kept);
    for (const std::set<int32_t>* side : {&got, &want}) {
      for (int32_t p : *side) {
        if (got.count(p) != 0 && want.count(p) != 0) continue;
        EXPECT_LE(std::abs(s[p] - kth), tol)
            << pr.Describe() << " row " << row << ": page " << p << " (score " << s[p]
            << ") differs from the reference, k-th score " << kth;
      }
    }
  }
}

// A problem's device buffers and its SelectPagesParams (kLowRank: summaries null, which it does
// not read).
struct DeviceLowRank {
  std::vector<DeviceBuffer> buffers;
  SelectPagesParams params;
};

// coords_offset: the coordinates start that many bytes into their buffer (misaligned rows).
inline DeviceLowRank UploadLowRank(Backend& backend, const LowRankProblem& pr,
                                   size_t coords_offset = 0) {
  DeviceLowRank dev;
  const int64_t pages = pr.num_tokens * pr.num_kv_heads * pr.select;
  const std::vector<int32_t> poison(pages, 7777);
  std::vector<int8_t> coords(coords_offset, 0);
  coords.insert(coords.end(), pr.coords.begin(), pr.coords.end());
  dev.buffers.push_back(UploadBytes(backend, pr.q.data(), pr.q.size() * sizeof(float)));
  dev.buffers.push_back(UploadBytes(backend, pr.basis.data(), pr.basis.size() * sizeof(float)));
  dev.buffers.push_back(UploadBytes(backend, coords.data(), coords.size()));
  dev.buffers.push_back(UploadBytes(backend, pr.scales.data(), pr.scales.size() * sizeof(float)));
  dev.buffers.push_back(UploadBytes(backend, poison.data(), pages * sizeof(int32_t)));
  dev.buffers.push_back(UploadBytes(backend, pr.keep.data(), pr.keep.size() * sizeof(int32_t)));
  absl::StatusOr<DeviceBuffer> scratch =
      backend.Allocate(SelectPagesScratchBytes(pr.num_tokens, pr.num_kv_heads, pr.num_pages));
  EXPECT_TRUE(scratch.ok()) << scratch.status();
  dev.buffers.push_back(scratch.ok() ? *std::move(scratch) : DeviceBuffer());
  SelectPagesParams& p = dev.params;
  p.q = dev.buffers[0].as<float>();
  p.q_row_stride = pr.q_row_stride;
  p.summaries = nullptr;
  p.dtype = DType::kF32;
  p.max_pages = pr.num_pages;
  p.num_pages = pr.num_pages;
  p.num_tokens = pr.num_tokens;
  p.num_q_heads = pr.num_q_heads;
  p.num_kv_heads = pr.num_kv_heads;
  p.head_dim = pr.head_dim;
  p.select = pr.select;
  p.score = PageScore::kLowRank;
  p.low_rank.basis = dev.buffers[1].as<float>();
  p.low_rank.coords = dev.buffers[2].as<int8_t>() + coords_offset;
  p.low_rank.scales = dev.buffers[3].as<float>();
  p.low_rank.rank = pr.rank;
  p.low_rank.max_tokens = pr.max_tokens;
  p.low_rank.page_tokens = pr.page_tokens;
  p.low_rank.softmax_scale = pr.sigma;
  p.keep = pr.keep.empty() ? nullptr : dev.buffers[5].as<int32_t>();
  p.keep_per_head = pr.keep_per_head;
  p.pages = dev.buffers[4].as<int32_t>();
  p.scratch = dev.buffers[6].data();
  return dev;
}

struct LowRankResult {
  std::vector<int32_t> pages;  // [T, Hkv, select]
  // [T, Hkv, num_pages]: the scores both backends leave at the start of the scratch (kept pages
  // +inf); empty when num_pages <= select (nothing is scored).
  std::vector<float> scores;
};

inline LowRankResult Download(Backend& backend, const LowRankProblem& pr,
                              const SelectPagesParams& p) {
  LowRankResult out;
  out.pages.resize(pr.num_tokens * pr.num_kv_heads * pr.select);
  EXPECT_TRUE(
      backend.CopyToHost(out.pages.data(), p.pages, out.pages.size() * sizeof(int32_t)).ok());
  if (pr.num_pages > pr.select) {
    out.scores.resize(pr.num_tokens * pr.num_kv_heads * pr.num_pages);
    EXPECT_TRUE(
        backend.CopyToHost(out.scores.data(), p.scratch, out.scores.size() * sizeof(float)).ok());
  }
  return out;
}

// SelectPages (kLowRank) on the problem; empty pages after a failure (with a test failure).
inline LowRankResult RunLowRankSelect(Backend& backend, const LowRankProblem& pr,
                                      size_t coords_offset = 0) {
  DeviceLowRank dev = UploadLowRank(backend, pr, coords_offset);
  const absl::Status status = backend.SelectPages(dev.params);
  EXPECT_TRUE(status.ok()) << status << " " << pr.Describe();
  if (!status.ok()) return {};
  return Download(backend, pr, dev.params);
}

// The reference scores and selection of `pr` against SelectPages on `backend`.
inline void CheckLowRankSelect(Backend& backend, const LowRankProblem& pr) {
  SCOPED_TRACE(pr.Describe());
  const std::vector<double> scores = ReferenceScores(pr);
  const LowRankResult got = RunLowRankSelect(backend, pr);
  if (pr.num_pages > pr.select) ExpectScores(pr, scores, got.scores);
  ExpectSelection(pr, scores, got.pages);
}

// A summary-scored problem (page_select_reference.h) as device buffers and params, for batches
// that mix both kinds of entry.
inline DeviceLowRank UploadSummaryProblem(Backend& backend,
                                          const page_reference::SelectProblem& pr) {
  DeviceLowRank dev;
  const std::vector<uint8_t> summary_bytes = Encode(pr.summaries, pr.dtype);
  const int64_t pages = pr.num_tokens * pr.num_kv_heads * pr.select;
  const std::vector<int32_t> poison(pages, 7777);
  dev.buffers.push_back(UploadBytes(backend, pr.q.data(), pr.q.size() * sizeof(float)));
  dev.buffers.push_back(UploadBytes(backend, summary_bytes.data(), summary_bytes.size()));
  dev.buffers.push_back(UploadBytes(backend, poison.data(), pages * sizeof(int32_t)));
  dev.buffers.push_back(UploadBytes(backend, pr.keep.data(), pr.keep.size() * sizeof(int32_t)));
  absl::StatusOr<DeviceBuffer> scratch =
      backend.Allocate(SelectPagesScratchBytes(pr.num_tokens, pr.num_kv_heads, pr.num_pages));
  EXPECT_TRUE(scratch.ok()) << scratch.status();
  dev.buffers.push_back(scratch.ok() ? *std::move(scratch) : DeviceBuffer());
  SelectPagesParams& p = dev.params;
  p.q = dev.buffers[0].as<float>();
  p.q_row_stride = pr.q_row_stride;
  p.summaries = dev.buffers[1].data();
  p.dtype = pr.dtype;
  p.max_pages = pr.max_pages;
  p.num_pages = pr.num_pages;
  p.num_tokens = pr.num_tokens;
  p.num_q_heads = pr.num_q_heads;
  p.num_kv_heads = pr.num_kv_heads;
  p.head_dim = pr.head_dim;
  p.select = pr.select;
  p.score = pr.score;
  p.keep = pr.keep.empty() ? nullptr : dev.buffers[3].as<int32_t>();
  p.keep_per_head = pr.keep_per_head;
  p.pages = dev.buffers[2].as<int32_t>();
  p.scratch = dev.buffers[4].data();
  return dev;
}

// SelectPagesBatch over low-rank and summary entries in the order given (low_rank[i] where
// is_low_rank[k], else summary[i]); the pages of each entry in that order.
inline std::vector<std::vector<int32_t>> RunMixedBatch(
    Backend& backend, const std::vector<LowRankProblem>& low_rank,
    const std::vector<page_reference::SelectProblem>& summary,
    const std::vector<bool>& is_low_rank) {
  std::vector<DeviceLowRank> devs;
  std::vector<SelectPagesParams> params;
  std::vector<size_t> sizes;
  size_t next_low_rank = 0, next_summary = 0;
  for (bool lr : is_low_rank) {
    if (lr) {
      const LowRankProblem& pr = low_rank.at(next_low_rank++);
      devs.push_back(UploadLowRank(backend, pr));
      sizes.push_back(pr.num_tokens * pr.num_kv_heads * pr.select);
    } else {
      const page_reference::SelectProblem& pr = summary.at(next_summary++);
      devs.push_back(UploadSummaryProblem(backend, pr));
      sizes.push_back(pr.num_tokens * pr.num_kv_heads * pr.select);
    }
    params.push_back(devs.back().params);
  }
  const absl::Status status = backend.SelectPagesBatch(params.data(), params.size());
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  std::vector<std::vector<int32_t>> pages;
  for (size_t i = 0; i < params.size(); ++i) {
    pages.emplace_back(sizes[i]);
    EXPECT_TRUE(
        backend.CopyToHost(pages.back().data(), params[i].pages, sizes[i] * sizeof(int32_t)).ok());
  }
  return pages;
}

// Every INVALID_ARGUMENT case of KeyGram, ProjectKeys and a kLowRank SelectPages on `backend`,
// each from parameters that pass (checked first); the message names the broken field.
inline void ExpectRejectsBrokenParams(Backend& backend) {
  auto expect_invalid = [](const absl::Status& status, const std::string& field) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field << ": " << status;
    EXPECT_NE(std::string(status.message()).find(field), std::string::npos)
        << "the message should name " << field << ": " << status;
  };

  // SelectPages, kLowRank: null summaries are fine (UploadLowRank's params).
  const LowRankProblem pr = MakeLowRankProblem(1, 2, 4, 64, 32, 16, 10, 4, 1);
  DeviceLowRank dev = UploadLowRank(backend, pr);
  const SelectPagesParams good = dev.params;
  ASSERT_TRUE(backend.SelectPages(good).ok());
  auto select = [&](auto change) {
    SelectPagesParams p = good;
    change(p);
    return backend.SelectPages(p);
  };
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.basis = nullptr; }), "basis");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.coords = nullptr; }), "coords");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.scales = nullptr; }), "scales");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.rank = 0; }), "rank");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.rank = 65; }), "rank");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.page_tokens = 0; }), "page_tokens");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.max_tokens = 159; }), "max_tokens");
  expect_invalid(select([](SelectPagesParams& p) { p.low_rank.max_tokens = 0; }), "max_tokens");
  for (float sigma : {0.0f, -1.0f, INFINITY, NAN}) {
    expect_invalid(select([sigma](SelectPagesParams& p) { p.low_rank.softmax_scale = sigma; }),
                   "softmax_scale");
  }
  expect_invalid(select([](SelectPagesParams& p) { p.dtype = DType::kF16; }), "dtype");
  expect_invalid(select([](SelectPagesParams& p) { p.q = nullptr; }), "null pointer");
  expect_invalid(select([](SelectPagesParams& p) { p.pages = nullptr; }), "null pointer");
  expect_invalid(select([](SelectPagesParams& p) { p.scratch = nullptr; }), "null pointer");
  expect_invalid(select([](SelectPagesParams& p) { p.num_tokens = 0; }), "num_tokens");
  expect_invalid(select([](SelectPagesParams& p) { p.num_pages = 0; }), "num_pages");
  expect_invalid(select([](SelectPagesParams& p) { p.max_pages = 9; }), "max_pages");
  expect_invalid(select([](SelectPagesParams& p) { p.select = 0; }), "select");
  expect_invalid(select([](SelectPagesParams& p) { p.num_q_heads = 7; }), "num_q_heads");
  expect_invalid(select([](SelectPagesParams& p) { p.q_row_stride = 8 * 64 - 1; }), "q_row_stride");
  expect_invalid(select([](SelectPagesParams& p) {  // keep needs 1 <= keep_per_head < select
                   p.keep = p.pages;
                   p.keep_per_head = 4;
                 }),
                 "keep_per_head");
  // Only kLowRank may go without summaries.
  expect_invalid(select([](SelectPagesParams& p) { p.score = PageScore::kBound; }), "null pointer");
  expect_invalid(select([](SelectPagesParams& p) { p.score = PageScore::kCentroid; }),
                 "null pointer");

  // KeyGram over a cache of 2 heads, 40 slots, head_dim 64.
  const std::vector<float> keys(2 * 40 * 64, 0.5f);
  DeviceBuffer k = UploadBytes(backend, keys.data(), keys.size() * sizeof(float));
  absl::StatusOr<DeviceBuffer> gram = backend.Allocate(2 * 64 * 64 * sizeof(float));
  ASSERT_TRUE(gram.ok()) << gram.status();
  const KeyGramParams good_gram{.k = k.data(),
                                .capacity = 40,
                                .first_slot = 5,
                                .count = 35,
                                .dtype = DType::kF32,
                                .num_kv_heads = 2,
                                .head_dim = 64,
                                .gram = gram->as<float>()};
  ASSERT_TRUE(backend.KeyGram(good_gram).ok());
  auto key_gram = [&](auto change) {
    KeyGramParams p = good_gram;
    change(p);
    return backend.KeyGram(p);
  };
  expect_invalid(key_gram([](KeyGramParams& p) { p.k = nullptr; }), "null pointer");
  expect_invalid(key_gram([](KeyGramParams& p) { p.gram = nullptr; }), "null pointer");
  expect_invalid(key_gram([](KeyGramParams& p) { p.count = 0; }), "count");
  expect_invalid(key_gram([](KeyGramParams& p) { p.count = 36; }), "capacity");
  expect_invalid(key_gram([](KeyGramParams& p) { p.first_slot = -1; }), "first_slot");
  expect_invalid(key_gram([](KeyGramParams& p) { p.capacity = 0; }), "capacity");
  expect_invalid(key_gram([](KeyGramParams& p) { p.head_dim = 0; }), "head_dim");
  expect_invalid(key_gram([](KeyGramParams& p) { p.num_kv_heads = 0; }), "num_kv_heads");
  expect_invalid(key_gram([](KeyGramParams& p) { p.dtype = DType::kF16; }), "dtype");

  // ProjectKeys of those keys into rows [3, 3 + 35) of 40, rank 32.
  absl::StatusOr<DeviceBuffer> coords = backend.Allocate(2 * 40 * 32);
  absl::StatusOr<DeviceBuffer> scales = backend.Allocate(2 * 40 * sizeof(float));
  ASSERT_TRUE(coords.ok() && scales.ok());
  const ProjectKeysParams good_project{.k = k.data(),
                                       .capacity = 40,
                                       .first_slot = 5,
                                       .count = 35,
                                       .dtype = DType::kF32,
                                       .num_kv_heads = 2,
                                       .head_dim = 64,
                                       .basis = good.low_rank.basis,
                                       .rank = 32,
                                       .coords = coords->as<int8_t>(),
                                       .scales = scales->as<float>(),
                                       .max_tokens = 40,
                                       .first_token = 3};
  ASSERT_TRUE(backend.ProjectKeys(good_project).ok());
  auto project = [&](auto change) {
    ProjectKeysParams p = good_project;
    change(p);
    return backend.ProjectKeys(p);
  };
  expect_invalid(project([](ProjectKeysParams& p) { p.k = nullptr; }), "null pointer");
  expect_invalid(project([](ProjectKeysParams& p) { p.basis = nullptr; }), "basis");
  expect_invalid(project([](ProjectKeysParams& p) { p.coords = nullptr; }), "coords");
  expect_invalid(project([](ProjectKeysParams& p) { p.scales = nullptr; }), "scales");
  expect_invalid(project([](ProjectKeysParams& p) { p.rank = 0; }), "rank");
  expect_invalid(project([](ProjectKeysParams& p) { p.rank = 65; }), "rank");
  expect_invalid(project([](ProjectKeysParams& p) { p.count = 0; }), "count");
  expect_invalid(project([](ProjectKeysParams& p) { p.first_slot = 6; }), "capacity");
  expect_invalid(project([](ProjectKeysParams& p) { p.first_slot = -1; }), "first_slot");
  expect_invalid(project([](ProjectKeysParams& p) { p.first_token = 6; }), "max_tokens");
  expect_invalid(project([](ProjectKeysParams& p) { p.first_token = -1; }), "first_token");
  expect_invalid(project([](ProjectKeysParams& p) { p.max_tokens = 0; }), "max_tokens");
  expect_invalid(project([](ProjectKeysParams& p) { p.head_dim = 0; }), "head_dim");
  expect_invalid(project([](ProjectKeysParams& p) { p.num_kv_heads = 0; }), "num_kv_heads");
  expect_invalid(project([](ProjectKeysParams& p) { p.dtype = DType::kF16; }), "dtype");
  EXPECT_TRUE(backend.Synchronize().ok());
}

}  // namespace tandem::gpu_worker::low_rank_reference
