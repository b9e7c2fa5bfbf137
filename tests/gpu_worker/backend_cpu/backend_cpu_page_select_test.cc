// SummarizePages and SelectPages of the cpu backend against page_select_reference.h: summaries
// exactly; selections exactly where every score is exact (quantized data, adversarial ties) and
// otherwise up to near-ties of the k-th score (f32 sums vs the double reference: 1e-5 of the
// row's largest |score|).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "backend_test_util.h"
#include "page_select_reference.h"

namespace tandem::gpu_worker {
namespace {

using page_reference::AddKeep;
using page_reference::ExpectSelection;
using page_reference::MakeSelectProblem;
using page_reference::MakeSummarizeCase;
using page_reference::ReferenceScores;
using page_reference::ReferenceSummaries;
using page_reference::RunSelectPages;
using page_reference::RunSelectPagesBatch;
using page_reference::RunSummarizePages;
using page_reference::SelectProblem;
using page_reference::SummarizeCase;
using testing::MakeCpuBackend;

constexpr double kNearTie = 1e-5;

// (dtype, head_dim, page_tokens)
class CpuSummarizePagesTest
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(CpuSummarizePagesTest, MatchesReferenceAndLeavesOtherPages) {
  const auto [dtype, head_dim, page_tokens] = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (const auto& [first_slot, first_page] : {std::pair<int64_t, int64_t>{0, 0}, {3, 2}}) {
    const SummarizeCase c =
        MakeSummarizeCase(2, head_dim, page_tokens, 5, first_slot, first_page, dtype, 7);
    const std::vector<float> got = RunSummarizePages(*backend, c);
    const std::vector<float> want = ReferenceSummaries(c.p, c.k_cache, c.summaries);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "element " << i << " first_slot " << first_slot;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuSummarizePagesTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16), ::testing::Values(64, 128),
                       ::testing::Values(1, 16, 64)),
    [](const auto& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_page" +
             std::to_string(std::get<2>(info.param));
    });

// (dtype, head_dim, group, num_tokens, num_pages) with select 37: pages below / equal / above.
class CpuSelectPagesTest
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t, int64_t, int64_t>> {};

TEST_P(CpuSelectPagesTest, MatchesReference) {
  const auto [dtype, head_dim, group, tokens, num_pages] = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const SelectProblem pr = MakeSelectProblem(tokens, 2, group, head_dim, num_pages, 37, dtype,
                                             false, num_pages, 11);
  const std::vector<int32_t> pages = RunSelectPages(*backend, pr);
  ExpectSelection(pr, ReferenceScores(pr), pages, kNearTie);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuSelectPagesTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16), ::testing::Values(64, 128),
                       ::testing::Values(1, 4), ::testing::Values(1, 3),
                       ::testing::Values(20, 37, 300)),
    [](const auto& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_g" +
             std::to_string(std::get<2>(info.param)) + "_t" +
             std::to_string(std::get<3>(info.param)) + "_pages" +
             std::to_string(std::get<4>(info.param));
    });

// Quantized values make every score exact; 13 distinct summaries per kv head repeated over 200
// pages make ties everywhere, the k-th score included: the lower ids must win, exactly.
TEST(CpuSelectPages, AdversarialTiesExact) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t group : {1, 4}) {
      for (int64_t select : {1, 50, 199}) {
        const SelectProblem pr =
            MakeSelectProblem(3, 2, group, 64, 200, select, dtype, true, 13, 21);
        ExpectSelection(pr, ReferenceScores(pr), RunSelectPages(*backend, pr), 0.0);
      }
    }
  }
}

// The centroid score (q·mean), exactly, with the same adversarial ties.
TEST(CpuSelectPages, CentroidScoreExact) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t group : {1, 4}) {
      for (int64_t select : {1, 50, 199}) {
        SelectProblem pr = MakeSelectProblem(3, 2, group, 64, 200, select, dtype, true, 13, 22);
        pr.score = PageScore::kCentroid;
        ExpectSelection(pr, ReferenceScores(pr), RunSelectPages(*backend, pr), 0.0);
      }
    }
  }
}

// Kept pages (a first pick by the other score) are in every row whatever their score, and the
// rest of the row is the best of the others: the two-score policy's second pass.
TEST(CpuSelectPages, KeptPagesStayAndTheRestFollowTheScore) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  uint32_t seed = 90;
  for (PageScore score : {PageScore::kBound, PageScore::kCentroid}) {
    for (int64_t keep : {1, 20, 49}) {
      SelectProblem pr = MakeSelectProblem(3, 2, 4, 64, 200, 50, DType::kBF16, true, 200, ++seed);
      pr.score = score;
      AddKeep(pr, keep, ++seed);
      const std::vector<int32_t> pages = RunSelectPages(*backend, pr);
      ExpectSelection(pr, ReferenceScores(pr), pages, 0.0);
      for (int64_t row = 0; row < 6; ++row) {   // the kept ids are there
        for (int64_t i = 0; i < keep; ++i) {
          const int32_t id = pr.keep[row * keep + i];
          if (id < 0) continue;
          EXPECT_TRUE(std::binary_search(pages.begin() + row * 50, pages.begin() + row * 50 + 50,
                                         id))
              << pr.Describe() << " row " << row << " lost kept page " << id;
        }
      }
    }
  }
}

// Every page identical: the answer is pages 0..select-1.
TEST(CpuSelectPages, AllEqualScoresKeepLowestIds) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const SelectProblem pr = MakeSelectProblem(1, 1, 4, 128, 1000, 64, DType::kBF16, true, 1, 5);
  const std::vector<int32_t> pages = RunSelectPages(*backend, pr);
  ASSERT_EQ(pages.size(), 64u);
  for (int32_t i = 0; i < 64; ++i) EXPECT_EQ(pages[i], i);
}

// A long row (Llama-3-8B group and head_dim, 20000 pages).
TEST(CpuSelectPages, LongRow) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const SelectProblem pr =
        MakeSelectProblem(1, 2, 4, 128, 20000, 128, dtype, false, 20000, 31);
    ExpectSelection(pr, ReferenceScores(pr), RunSelectPages(*backend, pr), kNearTie);
  }
}

// The default SelectPagesBatch (a loop) equals SelectPages on each entry, and stops at the
// first failing entry with its error.
TEST(CpuSelectPages, BatchEqualsPerEntry) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  std::vector<SelectProblem> problems;
  uint32_t seed = 60;
  for (int64_t n : {300, 1000, 30, 4097}) {
    problems.push_back(MakeSelectProblem(1, 2, 4, 128, n, 37, DType::kBF16, false, n, ++seed));
  }
  problems.push_back(MakeSelectProblem(3, 2, 2, 64, 500, 20, DType::kF32, true, 41, ++seed));
  problems.push_back(MakeSelectProblem(1, 2, 4, 128, 700, 37, DType::kBF16, false, 700, ++seed));
  problems.back().score = PageScore::kCentroid;
  AddKeep(problems.back(), 18, ++seed);
  const std::vector<std::vector<int32_t>> batched = RunSelectPagesBatch(*backend, problems);
  ASSERT_EQ(batched.size(), problems.size());
  for (size_t i = 0; i < problems.size(); ++i) {
    SCOPED_TRACE(problems[i].Describe());
    EXPECT_EQ(batched[i], RunSelectPages(*backend, problems[i]));
  }
  const SelectPagesParams broken[] = {SelectPagesParams{}};
  EXPECT_EQ(backend->SelectPagesBatch(broken, 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuSelectPages, RejectsBrokenParams) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  testing::DeviceArrays arrays(*backend);
  float* q = arrays.Allocate<float>(8 * 64);
  float* summaries = arrays.Allocate<float>(2 * 10 * kPageSummaryRows * 64);
  int32_t* pages = arrays.Allocate<int32_t>(2 * 4);
  float* scratch = arrays.Allocate<float>(SelectPagesScratchBytes(1, 2, 10) / 4);
  const SelectPagesParams good{.q = q,
                               .q_row_stride = 8 * 64,
                               .summaries = summaries,
                               .dtype = DType::kF32,
                               .max_pages = 10,
                               .num_pages = 10,
                               .num_tokens = 1,
                               .num_q_heads = 8,
                               .num_kv_heads = 2,
                               .head_dim = 64,
                               .select = 4,
                               .pages = pages,
                               .scratch = scratch};
  TANDEM_ASSERT_OK(backend->SelectPages(good));
  auto broken = [&](auto change) {
    SelectPagesParams p = good;
    change(p);
    return backend->SelectPages(p);
  };
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.q = nullptr; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.summaries = nullptr; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.pages = nullptr; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.scratch = nullptr; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.select = 0; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.num_pages = 0; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.num_pages = 11; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.num_tokens = 0; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.num_q_heads = 7; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.q_row_stride = 8 * 64 - 1; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.dtype = DType::kF16; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.head_dim = 0; }));
  TANDEM_EXPECT_INVALID(broken([](SelectPagesParams& p) { p.score = static_cast<PageScore>(7); }));
  TANDEM_EXPECT_INVALID(broken([pages](SelectPagesParams& p) {   // keep needs keep_per_head
    p.keep = pages;
    p.keep_per_head = 0;
  }));
  TANDEM_EXPECT_INVALID(broken([pages](SelectPagesParams& p) {   // and fewer than select
    p.keep = pages;
    p.keep_per_head = 4;
  }));

  const SummarizePagesParams summarize{.k_cache = q,
                                       .capacity = 64,
                                       .first_slot = 0,
                                       .num_pages = 4,
                                       .page_tokens = 16,
                                       .summaries = summaries,
                                       .max_pages = 10,
                                       .first_page = 6,
                                       .dtype = DType::kF32,
                                       .num_kv_heads = 1,
                                       .head_dim = 8};
  TANDEM_ASSERT_OK(backend->SummarizePages(summarize));
  auto broken_summary = [&](auto change) {
    SummarizePagesParams p = summarize;
    change(p);
    return backend->SummarizePages(p);
  };
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.k_cache = nullptr; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.summaries = nullptr; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.first_slot = 1; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.first_slot = -1; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.first_page = 7; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.page_tokens = 0; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.num_pages = 0; }));
  TANDEM_EXPECT_INVALID(broken_summary([](SummarizePagesParams& p) { p.dtype = DType::kF16; }));
}

}  // namespace
}  // namespace tandem::gpu_worker
