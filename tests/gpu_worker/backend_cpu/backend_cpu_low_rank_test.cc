// KeyGram, ProjectKeys and SelectPages with PageScore::kLowRank on the cpu backend, against the
// f64 references of low_rank_reference.h (tolerances stated there): the Gram matrix, codes
// within ±1 and scales within 1e-5, scores (read from the scratch) and the selected pages up to
// near-ties of the k-th score; kept pages, num_pages <= select, exact ties (lowest ids win),
// pages of 1..32 rows, large softmax scales (the stable logsumexp), bf16 and f32 keys end to end,
// batches mixing low-rank and summary entries, and every INVALID_ARGUMENT case.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend_test_util.h"
#include "low_rank_reference.h"
#include "page_select_reference.h"

namespace tandem::gpu_worker {
namespace {

using low_rank_reference::CheckLowRankSelect;
using low_rank_reference::ExpectGram;
using low_rank_reference::ExpectProjection;
using low_rank_reference::ExpectSelection;
using low_rank_reference::LowRankProblem;
using low_rank_reference::LowRankResult;
using low_rank_reference::MakeLowRankProblem;
using low_rank_reference::RandomBasis;
using low_rank_reference::RandomKeys;
using low_rank_reference::ReferenceScores;
using low_rank_reference::RunLowRankSelect;
using testing::MakeCpuBackend;

TEST(CpuKeyGram, MatchesReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t head_dim : {64, 128, 40}) {
      for (int64_t count : {1, 37, 300}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " D " + std::to_string(head_dim) + " count " +
                     std::to_string(count));
        const KeyGramParams p{.capacity = count + 8,
                              .first_slot = 5,
                              .count = count,
                              .dtype = dtype,
                              .num_kv_heads = 2,
                              .head_dim = head_dim};
        const std::vector<float> keys = RandomKeys(2, p.capacity, head_dim, dtype, 0, 3);
        ExpectGram(p, keys, low_rank_reference::RunKeyGram(*backend, p, keys));
      }
    }
  }
}

// (dtype, head_dim, rank; 0 = head_dim)
class CpuProjectKeysTest : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(CpuProjectKeysTest, MatchesReference) {
  const auto [dtype, head_dim, rank_param] = GetParam();
  const int64_t rank = rank_param == 0 ? head_dim : rank_param;
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const ProjectKeysParams p{.capacity = 60,
                            .first_slot = 3,
                            .count = 50,
                            .dtype = dtype,
                            .num_kv_heads = 2,
                            .head_dim = head_dim,
                            .rank = rank,
                            .max_tokens = 61,
                            .first_token = 4};
  const std::vector<float> keys = RandomKeys(2, p.capacity, head_dim, dtype, 7, 5);
  const std::vector<float> basis = RandomBasis(2, head_dim, rank, 6);
  ExpectProjection(p, keys, basis, low_rank_reference::RunProjectKeys(*backend, p, keys, basis));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuProjectKeysTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(64, 128),
                                            ::testing::Values(1, 32, 64, 0)),
                         [](const auto& info) {
                           return absl::StrCat(std::string(DTypeName(std::get<0>(info.param))),
                                               "_d", std::get<1>(info.param), "_r",
                                               std::get<2>(info.param));
                         });

// (head_dim, group, rank (0 = head_dim), num_tokens) with 16-row pages, 300 pages, select 37.
class CpuLowRankSelectTest
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, int64_t>> {};

TEST_P(CpuLowRankSelectTest, MatchesReference) {
  const auto [head_dim, group, rank_param, tokens] = GetParam();
  const int64_t rank = rank_param == 0 ? head_dim : rank_param;
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  CheckLowRankSelect(*backend,
                     MakeLowRankProblem(tokens, 2, group, head_dim, rank, 16, 300, 37, 11));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuLowRankSelectTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 4, 8, 3),
                       ::testing::Values(1, 32, 64, 0), ::testing::Values(1, 3)),
    [](const auto& info) {
      return absl::StrCat("d", std::get<0>(info.param), "_g", std::get<1>(info.param), "_r",
                          std::get<2>(info.param), "_t", std::get<3>(info.param));
    });

TEST(CpuLowRankSelect, PageSizes) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  uint32_t seed = 20;
  for (int64_t page_tokens : {1, 2, 5, 8, 32}) {
    CheckLowRankSelect(*backend,
                       MakeLowRankProblem(2, 2, 4, 128, 64, page_tokens, 200, 30, ++seed));
  }
}

// σ = 8 puts σ·(q̃·key) in the hundreds: a logsumexp without the max shift would overflow.
TEST(CpuLowRankSelect, LargeSoftmaxScaleStaysFinite) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  LowRankProblem pr = MakeLowRankProblem(2, 2, 4, 64, 64, 16, 200, 20, 31);
  pr.sigma = 8.0f;
  CheckLowRankSelect(*backend, pr);
  const LowRankResult got = RunLowRankSelect(*backend, pr);
  for (float s : got.scores) ASSERT_TRUE(std::isfinite(s)) << s;
}

TEST(CpuLowRankSelect, NumPagesAtMostSelect) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (int64_t num_pages : {1, 20, 37}) {
    const LowRankProblem pr = MakeLowRankProblem(3, 2, 4, 64, 32, 16, num_pages, 37, 41);
    const LowRankResult got = RunLowRankSelect(*backend, pr);
    ASSERT_EQ(got.pages.size(), 3u * 2 * 37);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t i = 0; i < 37; ++i) {
        EXPECT_EQ(got.pages[row * 37 + i], i < num_pages ? i : -1) << "row " << row;
      }
    }
  }
}

// Kept pages (a first pick by the bound) are in every row whatever their score; the rest of the
// row follows the low-rank score.
TEST(CpuLowRankSelect, KeptPagesStayAndTheRestFollowTheScore) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  uint32_t seed = 50;
  for (int64_t keep : {1, 20, 36}) {
    LowRankProblem pr = MakeLowRankProblem(3, 2, 4, 64, 64, 16, 200, 37, ++seed);
    low_rank_reference::AddKeep(pr, keep, ++seed);
    CheckLowRankSelect(*backend, pr);
    const LowRankResult got = RunLowRankSelect(*backend, pr);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t i = 0; i < keep; ++i) {
        const int32_t id = pr.keep[row * keep + i];
        if (id < 0) continue;
        EXPECT_TRUE(
            std::binary_search(got.pages.begin() + row * 37, got.pages.begin() + row * 37 + 37, id))
            << "row " << row << " lost kept page " << id;
      }
    }
  }
}

// Identical pages score identically: with every page the same the answer is 0..select-1, and
// with 13 distinct pages repeated the lower copies win every tie at the cut.
TEST(CpuLowRankSelect, TiesKeepLowestIds) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const LowRankProblem same = MakeLowRankProblem(2, 2, 4, 64, 64, 16, 500, 64, 61, 3.0f, 1);
  const LowRankResult got = RunLowRankSelect(*backend, same);
  for (int64_t row = 0; row < 4; ++row) {
    for (int32_t i = 0; i < 64; ++i) ASSERT_EQ(got.pages[row * 64 + i], i) << "row " << row;
  }
  const LowRankProblem repeated = MakeLowRankProblem(2, 2, 4, 64, 64, 16, 200, 50, 62, 3.0f, 13);
  const std::vector<double> scores = ReferenceScores(repeated);
  const LowRankResult tied = RunLowRankSelect(*backend, repeated);
  ExpectSelection(repeated, scores, tied.pages);
  for (int64_t row = 0; row < 4; ++row) {  // a copy is kept only with every lower copy
    const int32_t* pages = &tied.pages[row * 50];
    for (int i = 0; i < 50; ++i) {
      if (pages[i] >= 13) {
        EXPECT_TRUE(std::binary_search(pages, pages + 50, pages[i] - 13))
            << "row " << row << " keeps page " << pages[i] << " without " << pages[i] - 13;
      }
    }
  }
}

// Keys (f32 and bf16) projected by the backend, then selected from: the reference scores the
// backend's own codes.
TEST(CpuLowRankSelect, ProjectedKeysEndToEnd) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t rank : {32, 128}) {
      LowRankProblem pr = MakeLowRankProblem(2, 2, 4, 128, rank, 16, 150, 20, 71);
      const ProjectKeysParams p{.capacity = pr.max_tokens,
                                .first_slot = 0,
                                .count = pr.num_pages * pr.page_tokens,
                                .dtype = dtype,
                                .num_kv_heads = 2,
                                .head_dim = 128,
                                .rank = rank,
                                .max_tokens = pr.max_tokens,
                                .first_token = 0};
      const std::vector<float> keys = RandomKeys(2, pr.max_tokens, 128, dtype, 0, 72);
      const low_rank_reference::Projection projected =
          low_rank_reference::RunProjectKeys(*backend, p, keys, pr.basis);
      ExpectProjection(p, keys, pr.basis, projected);
      pr.coords = projected.coords;
      pr.scales = projected.scales;
      CheckLowRankSelect(*backend, pr);
    }
  }
}

// The default SelectPagesBatch (a loop) over low-rank and summary entries equals SelectPages on
// each entry.
TEST(CpuLowRankSelect, BatchEqualsPerEntry) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  std::vector<LowRankProblem> low_rank;
  low_rank.push_back(MakeLowRankProblem(1, 2, 4, 64, 64, 16, 300, 37, 81));
  low_rank.push_back(MakeLowRankProblem(1, 2, 4, 64, 64, 16, 30, 37, 82));
  low_rank.push_back(MakeLowRankProblem(2, 2, 4, 64, 32, 8, 500, 37, 83));
  std::vector<page_reference::SelectProblem> summary;
  summary.push_back(
      page_reference::MakeSelectProblem(1, 2, 4, 64, 400, 37, DType::kBF16, false, 400, 84));
  summary.push_back(
      page_reference::MakeSelectProblem(1, 2, 4, 64, 300, 37, DType::kF32, false, 300, 85));
  const std::vector<std::vector<int32_t>> batched = low_rank_reference::RunMixedBatch(
      *backend, low_rank, summary, {true, false, true, false, true});
  ASSERT_EQ(batched.size(), 5u);
  EXPECT_EQ(batched[0], RunLowRankSelect(*backend, low_rank[0]).pages);
  EXPECT_EQ(batched[1], page_reference::RunSelectPages(*backend, summary[0]));
  EXPECT_EQ(batched[2], RunLowRankSelect(*backend, low_rank[1]).pages);
  EXPECT_EQ(batched[3], page_reference::RunSelectPages(*backend, summary[1]));
  EXPECT_EQ(batched[4], RunLowRankSelect(*backend, low_rank[2]).pages);
}

TEST(CpuLowRank, RejectsBrokenParams) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  low_rank_reference::ExpectRejectsBrokenParams(*backend);
}

}  // namespace
}  // namespace tandem::gpu_worker
