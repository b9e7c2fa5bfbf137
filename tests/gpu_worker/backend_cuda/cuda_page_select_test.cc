// SummarizePages and SelectPages of the cuda backend against the naive references of
// page_select_reference.h and, where the cpu backend is part of the build, against the cpu
// backend. Summaries must match exactly. Selections must match exactly where every score is
// exact (quantized data, adversarial ties); otherwise a page may differ only when its reference
// score is within 1e-5 of the row's largest |score| of the k-th score (the kernel sums in another
// f32 order). Cases cover the specialised scoring kernel (head_dim 64/128, group 1/2/4/8), the
// generic one (other head dims and groups), token tiles, both top-k block sizes and the
// num_pages <= select shortcut. Every test skips without a CUDA device.
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "page_select_reference.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cuda_test {
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

constexpr double kNearTie = 1e-5;

// The cpu backend, or nullptr where this build has none.
std::unique_ptr<Backend> CpuBackendOrNull() {
#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend(0);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return cpu.ok() ? *std::move(cpu) : nullptr;
#else
  return nullptr;
#endif
}

class CudaPageSelectTest : public CudaBackendFixture {
 protected:
  // The cuda selection against the reference and, when there is one, the cpu backend.
  void CheckSelect(const SelectProblem& pr, double rel_tol) {
    const std::vector<double> scores = ReferenceScores(pr);
    const std::vector<int32_t> pages = RunSelectPages(*backend_, pr);
    ExpectSelection(pr, scores, pages, rel_tol);
    if (std::unique_ptr<Backend> cpu = CpuBackendOrNull()) {
      const std::vector<int32_t> cpu_pages = RunSelectPages(*cpu, pr);
      ExpectSelection(pr, scores, pages, rel_tol, &cpu_pages);
    }
  }

  void CheckSummarize(const SummarizeCase& c) {
    const std::vector<float> got = RunSummarizePages(*backend_, c);
    const std::vector<float> want = ReferenceSummaries(c.p, c.k_cache, c.summaries);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
    if (std::unique_ptr<Backend> cpu = CpuBackendOrNull()) {
      EXPECT_EQ(RunSummarizePages(*cpu, c), got);
    }
  }
};

using CudaSummarizePagesTest = CudaPageSelectTest;

TEST_F(CudaSummarizePagesTest, MatchesReference) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t head_dim : {64, 128, 12}) {  // 12: rows not a multiple of 16 bytes (bf16)
      for (int64_t page_tokens : {1, 16, 64}) {
        for (const auto& [first_slot, first_page] : {std::pair<int64_t, int64_t>{0, 0}, {3, 2}}) {
          SCOPED_TRACE(std::string(DTypeName(dtype)) + " D " + std::to_string(head_dim) +
                       " page " + std::to_string(page_tokens) + " first_slot " +
                       std::to_string(first_slot));
          CheckSummarize(MakeSummarizeCase(2, head_dim, page_tokens, 7, first_slot, first_page,
                                           dtype, 3));
        }
      }
    }
  }
}

// (dtype, head_dim, group, num_tokens, num_pages) with select 37.
class CudaSelectPagesTest
    : public CudaPageSelectTest,
      public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t, int64_t, int64_t>> {
};

TEST_P(CudaSelectPagesTest, MatchesReference) {
  const auto [dtype, head_dim, group, tokens, num_pages] = GetParam();
  CheckSelect(MakeSelectProblem(tokens, 2, group, head_dim, num_pages, 37, dtype, false,
                                num_pages, 11),
              kNearTie);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaSelectPagesTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(64, 128, 48), ::testing::Values(1, 4, 3),
                       ::testing::Values(1, 3), ::testing::Values(20, 37, 300, 9000)),
    [](const auto& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_d" +
             std::to_string(std::get<1>(info.param)) + "_g" +
             std::to_string(std::get<2>(info.param)) + "_t" +
             std::to_string(std::get<3>(info.param)) + "_pages" +
             std::to_string(std::get<4>(info.param));
    });

TEST_F(CudaPageSelectTest, AdversarialTiesExact) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t group : {1, 2, 4, 8, 3}) {
      for (int64_t head_dim : {64, 128}) {
        for (int64_t select : {1, 50, 199}) {
          CheckSelect(MakeSelectProblem(3, 2, group, head_dim, 200, select, dtype, true, 13, 21),
                      0.0);
        }
      }
      // Long rows (the 1024-thread top-k) with ties at the threshold.
      CheckSelect(MakeSelectProblem(1, 2, group, 128, 12000, 300, dtype, true, 997, 22), 0.0);
    }
  }
}

// The centroid score (q·mean) and kept pages (the two-score policy's second pass), exactly, on
// the specialised kernels (D 64, 128), the fallback (G 3) and long rows.
TEST_F(CudaPageSelectTest, CentroidAndKeptPagesExact) {
  uint32_t seed = 70;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t group : {1, 4, 3}) {
      for (int64_t head_dim : {64, 128}) {
        SelectProblem pr = MakeSelectProblem(3, 2, group, head_dim, 200, 50, dtype, true, 13, ++seed);
        pr.score = PageScore::kCentroid;
        CheckSelect(pr, 0.0);
        AddKeep(pr, 20, ++seed);
        CheckSelect(pr, 0.0);
        pr.score = PageScore::kBound;
        CheckSelect(pr, 0.0);
      }
    }
    SelectProblem pr = MakeSelectProblem(1, 2, 4, 128, 12000, 300, dtype, true, 997, ++seed);
    pr.score = PageScore::kCentroid;
    AddKeep(pr, 150, ++seed);
    CheckSelect(pr, 0.0);
  }
}

TEST_F(CudaPageSelectTest, AllEqualScoresKeepLowestIds) {
  const SelectProblem pr = MakeSelectProblem(1, 1, 4, 128, 20000, 64, DType::kBF16, true, 1, 5);
  const std::vector<int32_t> pages = RunSelectPages(*backend_, pr);
  ASSERT_EQ(pages.size(), 64u);
  for (int32_t i = 0; i < 64; ++i) EXPECT_EQ(pages[i], i);
}

// Prefill-sized token counts: several q tiles per kv head (12 tokens per tile at G 8, D 128),
// and more rows than SMs (the one-block-per-row top-k on long rows).
TEST_F(CudaPageSelectTest, TokenTiles) {
  CheckSelect(MakeSelectProblem(40, 2, 8, 128, 500, 32, DType::kBF16, false, 500, 41), kNearTie);
  CheckSelect(MakeSelectProblem(40, 2, 8, 128, 500, 32, DType::kF32, true, 61, 42), 0.0);
  CheckSelect(MakeSelectProblem(70, 2, 4, 64, 9000, 100, DType::kBF16, true, 500, 43), 0.0);
}

// The production shape: Llama-3-8B (Hq 32, Hkv 8, D 128), bf16, decode of 1 and 2 tokens,
// 70000 pages.
TEST_F(CudaPageSelectTest, Llama3DecodeLongContext) {
  for (int64_t tokens : {1, 2}) {
    CheckSelect(MakeSelectProblem(tokens, 8, 4, 128, 70000, 128, DType::kBF16, false, 70000, 51),
                kNearTie);
  }
}

// SelectPagesBatch gives exactly the pages of SelectPages on each entry: decode entries of
// different page counts (one batched launch pair; the cooperative top-k), entries of another
// token count and dtype, adversarial ties, and entries that run alone (num_pages <= select,
// a head_dim without a specialised kernel).
TEST_F(CudaPageSelectTest, BatchEqualsPerEntry) {
  std::vector<SelectProblem> problems;
  const int64_t decode_pages[] = {300, 1000, 4097, 9000, 20000, 65, 2500, 38};
  uint32_t seed = 100;
  for (int64_t n : decode_pages) {
    problems.push_back(MakeSelectProblem(1, 8, 4, 128, n, 37, DType::kBF16, false, n, ++seed));
  }
  problems.push_back(MakeSelectProblem(1, 8, 4, 128, 3000, 64, DType::kBF16, true, 97, ++seed));
  problems.push_back(MakeSelectProblem(3, 8, 4, 128, 700, 37, DType::kBF16, false, 700, ++seed));
  problems.push_back(MakeSelectProblem(1, 8, 4, 128, 30, 37, DType::kBF16, false, 30, ++seed));
  problems.push_back(MakeSelectProblem(1, 2, 3, 48, 900, 37, DType::kF32, false, 900, ++seed));
  problems.push_back(MakeSelectProblem(1, 8, 4, 128, 5000, 37, DType::kF32, false, 5000, ++seed));
  // Entries with kept pages among those without (one launch marks them), and a centroid entry
  // (another batch: the score is shared by a batch's entries).
  for (size_t i : {1, 3}) AddKeep(problems[i], 12, ++seed);
  problems.push_back(MakeSelectProblem(1, 8, 4, 128, 6000, 37, DType::kBF16, false, 6000, ++seed));
  problems.back().score = PageScore::kCentroid;
  AddKeep(problems.back(), 20, ++seed);
  problems.push_back(MakeSelectProblem(1, 8, 4, 128, 900, 37, DType::kBF16, false, 900, ++seed));
  problems.back().score = PageScore::kCentroid;
  const std::vector<std::vector<int32_t>> batched = RunSelectPagesBatch(*backend_, problems);
  ASSERT_EQ(batched.size(), problems.size());
  for (size_t i = 0; i < problems.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i) + ": " + problems[i].Describe());
    EXPECT_EQ(batched[i], RunSelectPages(*backend_, problems[i]));
  }
}

// Many decode entries: more rows than the cooperative top-k can hold (one block per row).
TEST_F(CudaPageSelectTest, BatchManyEntriesEqualsPerEntry) {
  std::vector<SelectProblem> problems;
  for (int i = 0; i < 48; ++i) {
    const int64_t n = 200 + 173 * i;
    problems.push_back(MakeSelectProblem(1, 8, 4, 64, n, 16, DType::kF32, i % 3 == 0, 50 + i,
                                         static_cast<uint32_t>(500 + i)));
  }
  const std::vector<std::vector<int32_t>> batched = RunSelectPagesBatch(*backend_, problems);
  ASSERT_EQ(batched.size(), problems.size());
  for (size_t i = 0; i < problems.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i) + ": " + problems[i].Describe());
    EXPECT_EQ(batched[i], RunSelectPages(*backend_, problems[i]));
  }
}

TEST_F(CudaPageSelectTest, RejectsBrokenParams) {
  DeviceBuffer q = Filled(8 * 64, 0.0f);
  DeviceBuffer summaries = Filled(2 * 10 * kPageSummaryRows * 64, 0.0f);
  DeviceBuffer pages = Filled(2 * 4, 0.0f);
  DeviceBuffer scratch = Filled(SelectPagesScratchBytes(1, 2, 10) / 4, 0.0f);
  const SelectPagesParams good{.q = q.as<float>(),
                               .q_row_stride = 8 * 64,
                               .summaries = summaries.data(),
                               .dtype = DType::kF32,
                               .max_pages = 10,
                               .num_pages = 10,
                               .num_tokens = 1,
                               .num_q_heads = 8,
                               .num_kv_heads = 2,
                               .head_dim = 64,
                               .select = 4,
                               .pages = pages.as<int32_t>(),
                               .scratch = scratch.data()};
  ASSERT_TRUE(backend_->SelectPages(good).ok());
  auto broken = [&](auto change) {
    SelectPagesParams p = good;
    change(p);
    return backend_->SelectPages(p).code();
  };
  constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.q = nullptr; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.summaries = nullptr; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.pages = nullptr; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.scratch = nullptr; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.select = 0; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.num_pages = 0; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.num_pages = 11; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.num_q_heads = 7; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.q_row_stride = 8 * 64 - 1; }), kInvalid);
  EXPECT_EQ(broken([](SelectPagesParams& p) { p.dtype = DType::kF16; }), kInvalid);

  const SummarizePagesParams summarize{.k_cache = q.data(),
                                       .capacity = 64,
                                       .first_slot = 0,
                                       .num_pages = 4,
                                       .page_tokens = 16,
                                       .summaries = summaries.data(),
                                       .max_pages = 10,
                                       .first_page = 6,
                                       .dtype = DType::kF32,
                                       .num_kv_heads = 1,
                                       .head_dim = 8};
  ASSERT_TRUE(backend_->SummarizePages(summarize).ok());
  auto broken_summary = [&](auto change) {
    SummarizePagesParams p = summarize;
    change(p);
    return backend_->SummarizePages(p).code();
  };
  EXPECT_EQ(broken_summary([](SummarizePagesParams& p) { p.k_cache = nullptr; }), kInvalid);
  EXPECT_EQ(broken_summary([](SummarizePagesParams& p) { p.first_slot = 1; }), kInvalid);
  EXPECT_EQ(broken_summary([](SummarizePagesParams& p) { p.first_page = 7; }), kInvalid);
  EXPECT_EQ(broken_summary([](SummarizePagesParams& p) { p.page_tokens = 0; }), kInvalid);
  EXPECT_EQ(broken_summary([](SummarizePagesParams& p) { p.dtype = DType::kF16; }), kInvalid);
  EXPECT_TRUE(backend_->Synchronize().ok());
}

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
