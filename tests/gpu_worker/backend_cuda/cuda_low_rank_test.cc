// KeyGram, ProjectKeys and SelectPages with PageScore::kLowRank on the cuda backend, against the
// f64 references of low_rank_reference.h (tolerances stated there) and, where the cpu backend is
// part of the build, against the cpu backend (the same tolerances: scores and the selection up
// to near-ties of the k-th score, codes within ±1). Cases cover the tensor-core scoring kernel
// (rank 32, 64, 128; group 1, 2, 4, 8 and padded groups 3, 5; 1 to 4 n-tiles of query columns
// and several column tiles; pages of 1, 2, 4, 8, 16, 32 and 48 rows), the generic kernel (other
// ranks, group 12, other page sizes, misaligned coordinates), prefill-sized token counts, a long
// decode row, kept pages, num_pages <= select, ties, batches mixing low-rank and summary entries,
// and every INVALID_ARGUMENT case. A last test times the scoring kernel at the decode shape (it
// prints the achieved read rate). Every test skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "key_projection.cuh"
#include "low_rank_score.cuh"
#include "low_rank_reference.h"
#include "page_select_reference.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cuda_test {
namespace {

using low_rank_reference::ExpectGram;
using low_rank_reference::ExpectProjection;
using low_rank_reference::ExpectScores;
using low_rank_reference::ExpectSelection;
using low_rank_reference::LowRankProblem;
using low_rank_reference::LowRankResult;
using low_rank_reference::MakeLowRankProblem;
using low_rank_reference::Projection;
using low_rank_reference::RandomBasis;
using low_rank_reference::RandomKeys;
using low_rank_reference::ReferenceScores;
using low_rank_reference::RunLowRankSelect;

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

class CudaLowRankTest : public CudaBackendFixture {
 protected:
  void SetUp() override {
    CudaBackendFixture::SetUp();
    if (backend_ != nullptr) cpu_ = CpuBackendOrNull();
  }

  // The cuda selection and scores against the reference and, when there is one, the cpu
  // backend's selection.
  void CheckSelect(const LowRankProblem& pr, size_t coords_offset = 0) {
    SCOPED_TRACE(pr.Describe());
    const std::vector<double> scores = ReferenceScores(pr);
    const LowRankResult got = RunLowRankSelect(*backend_, pr, coords_offset);
    if (pr.num_pages > pr.select) ExpectScores(pr, scores, got.scores);
    ExpectSelection(pr, scores, got.pages);
    if (cpu_ != nullptr) {
      const LowRankResult cpu = RunLowRankSelect(*cpu_, pr);
      ExpectSelection(pr, scores, got.pages, &cpu.pages);
    }
  }

  std::unique_ptr<Backend> cpu_;
};

TEST_F(CudaLowRankTest, KeyGramMatchesReference) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t head_dim : {64, 128, 40}) {
      for (int64_t count : {1, 37, 300}) {
        SCOPED_TRACE(
            absl::StrCat(std::string(DTypeName(dtype)), " D ", head_dim, " count ", count));
        const KeyGramParams p{.capacity = count + 8,
                              .first_slot = 5,
                              .count = count,
                              .dtype = dtype,
                              .num_kv_heads = 2,
                              .head_dim = head_dim};
        const std::vector<float> keys = RandomKeys(2, p.capacity, head_dim, dtype, 0, 3);
        const std::vector<float> gram = low_rank_reference::RunKeyGram(*backend_, p, keys);
        ExpectGram(p, keys, gram);
        if (cpu_ != nullptr) ExpectGram(p, keys, low_rank_reference::RunKeyGram(*cpu_, p, keys));
      }
    }
  }
}

// (dtype, head_dim, rank; 0 = head_dim). Rank 300 of head_dim 320: the two-pass path (rank > 256).
class CudaProjectKeysTest
    : public CudaLowRankTest,
      public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(CudaProjectKeysTest, MatchesReferenceAndCpu) {
  const auto [dtype, head_dim, rank_param] = GetParam();
  const int64_t rank = rank_param == 0 ? head_dim : rank_param;
  if (rank > head_dim) GTEST_SKIP() << "rank " << rank << " > head_dim " << head_dim;
  const ProjectKeysParams p{.capacity = 200,
                            .first_slot = 3,
                            .count = 150,
                            .dtype = dtype,
                            .num_kv_heads = 2,
                            .head_dim = head_dim,
                            .rank = rank,
                            .max_tokens = 161,
                            .first_token = 4};
  const std::vector<float> keys = RandomKeys(2, p.capacity, head_dim, dtype, 7, 5);
  const std::vector<float> basis = RandomBasis(2, head_dim, rank, 6);
  const Projection got = low_rank_reference::RunProjectKeys(*backend_, p, keys, basis);
  ExpectProjection(p, keys, basis, got);
  if (cpu_ != nullptr) {
    const Projection cpu = low_rank_reference::RunProjectKeys(*cpu_, p, keys, basis);
    for (size_t i = 0; i < got.coords.size(); ++i) {
      ASSERT_LE(std::abs(got.coords[i] - cpu.coords[i]), 1) << "code " << i;
    }
    for (size_t i = 0; i < got.scales.size(); ++i) {
      ASSERT_NEAR(got.scales[i], cpu.scales[i], 1e-5 * std::abs(cpu.scales[i]) + 1e-6)
          << "scale " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaProjectKeysTest,
    ::testing::Values(std::tuple<DType, int64_t, int64_t>{DType::kF32, 64, 1},
                      std::tuple<DType, int64_t, int64_t>{DType::kF32, 64, 32},
                      std::tuple<DType, int64_t, int64_t>{DType::kF32, 64, 0},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 64, 64},
                      std::tuple<DType, int64_t, int64_t>{DType::kF32, 128, 64},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 128, 1},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 128, 32},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 128, 64},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 128, 0},
                      std::tuple<DType, int64_t, int64_t>{DType::kF32, 256, 0},
                      std::tuple<DType, int64_t, int64_t>{DType::kBF16, 320, 300}),
    [](const auto& info) {
      return absl::StrCat(std::string(DTypeName(std::get<0>(info.param))), "_d",
                          std::get<1>(info.param), "_r", std::get<2>(info.param));
    });

// (rank, group, num_tokens) at head_dim 128, 16-row pages, 300 pages, select 37: the tensor-core
// kernel at every column count (group padded to 1, 2, 4, 8 columns per token; 1 to 4 n-tiles;
// 9 tokens of group 8 take three column tiles).
class CudaLowRankKernelTest
    : public CudaLowRankTest,
      public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(CudaLowRankKernelTest, MatchesReferenceAndCpu) {
  const auto [rank, group, tokens] = GetParam();
  CheckSelect(MakeLowRankProblem(tokens, 2, group, 128, rank, 16, 300, 37, 11));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLowRankKernelTest,
                         ::testing::Combine(::testing::Values(32, 64, 128),
                                            ::testing::Values(1, 2, 4, 8, 3, 5),
                                            ::testing::Values(1, 2, 3, 4, 9)),
                         [](const auto& info) {
                           return absl::StrCat("r", std::get<0>(info.param), "_g",
                                               std::get<1>(info.param), "_t",
                                               std::get<2>(info.param));
                         });

TEST_F(CudaLowRankTest, HeadDim64) {
  uint32_t seed = 100;
  for (int64_t rank : {32, 64, 1, 48}) {
    for (int64_t group : {1, 4, 8}) {
      for (int64_t tokens : {1, 4}) {
        CheckSelect(MakeLowRankProblem(tokens, 2, group, 64, rank, 16, 200, 25, ++seed));
      }
    }
  }
}

// The generic kernel: ranks without a specialisation, group 12, page sizes that neither divide
// 16 nor are multiples of it, misaligned coordinates.
TEST_F(CudaLowRankTest, GenericKernel) {
  uint32_t seed = 200;
  for (int64_t rank : {1, 48, 100, 128}) {
    CheckSelect(MakeLowRankProblem(2, 2, 4, 128, rank, 16, 150, 20, ++seed), rank == 128 ? 4 : 0);
  }
  CheckSelect(MakeLowRankProblem(3, 2, 12, 64, 64, 16, 150, 20, ++seed));
  for (int64_t page_tokens : {3, 5, 12, 24}) {
    CheckSelect(MakeLowRankProblem(2, 2, 4, 64, 64, page_tokens, 150, 20, ++seed));
  }
}

// Pages of 1..8 rows (several pages per 16-row step; 301 pages leave the last step partial) and
// of 32 and 48 rows (each page merges 2 or 3 steps), with 1 and 3 query tokens.
TEST_F(CudaLowRankTest, PageSizes) {
  uint32_t seed = 300;
  for (int64_t page_tokens : {1, 2, 4, 8, 16, 32, 48}) {
    for (int64_t tokens : {1, 3}) {
      CheckSelect(MakeLowRankProblem(tokens, 2, 4, 128, 64, page_tokens, 301, 40, ++seed));
    }
  }
}

// σ = 8: σ·(q̃·key) in the hundreds, where a logsumexp without the max shift overflows.
TEST_F(CudaLowRankTest, LargeSoftmaxScaleStaysFinite) {
  for (int64_t page_tokens : {4, 16, 32}) {
    LowRankProblem pr = MakeLowRankProblem(2, 2, 4, 64, 64, page_tokens, 200, 20, 31);
    pr.sigma = 8.0f;
    CheckSelect(pr);
    for (float s : RunLowRankSelect(*backend_, pr).scores) ASSERT_TRUE(std::isfinite(s)) << s;
  }
}

// Prefill-sized token counts: many column tiles per kv head.
TEST_F(CudaLowRankTest, PrefillTokens) {
  CheckSelect(MakeLowRankProblem(100, 2, 4, 128, 64, 16, 200, 32, 41));
  CheckSelect(MakeLowRankProblem(70, 2, 8, 128, 128, 16, 100, 16, 42));
  CheckSelect(MakeLowRankProblem(50, 2, 1, 64, 32, 8, 150, 16, 43));
}

// The decode shape of Llama-3-8B (Hkv 8, group 4, head_dim 128) at rank 64 over 8192 pages of
// 16 keys per kv head (the grid spreads each head over many blocks).
TEST_F(CudaLowRankTest, DecodeLongRow) {
  for (int64_t tokens : {1, 4}) {
    CheckSelect(MakeLowRankProblem(tokens, 8, 4, 128, 64, 16, 8192, 128, 51));
  }
}

TEST_F(CudaLowRankTest, NumPagesAtMostSelect) {
  for (int64_t num_pages : {1, 20, 37}) {
    const LowRankProblem pr = MakeLowRankProblem(3, 2, 4, 64, 32, 16, num_pages, 37, 61);
    const LowRankResult got = RunLowRankSelect(*backend_, pr);
    ASSERT_EQ(got.pages.size(), 3u * 2 * 37);
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t i = 0; i < 37; ++i) {
        EXPECT_EQ(got.pages[row * 37 + i], i < num_pages ? i : -1) << "row " << row;
      }
    }
  }
}

TEST_F(CudaLowRankTest, KeptPages) {
  uint32_t seed = 70;
  for (int64_t keep : {1, 20, 36}) {
    for (int64_t rank : {64, 48}) {  // the tensor-core and the generic kernel
      LowRankProblem pr = MakeLowRankProblem(3, 2, 4, 64, rank, 16, 200, 37, ++seed);
      low_rank_reference::AddKeep(pr, keep, ++seed);
      CheckSelect(pr);
    }
  }
}

// Identical pages score identically on the GPU too (whatever rows of a step they occupy): with
// every page the same the answer is 0..select-1; with 13 distinct pages repeated, a copy is kept
// only with every lower copy.
TEST_F(CudaLowRankTest, TiesKeepLowestIds) {
  for (int64_t page_tokens : {4, 16}) {
    const LowRankProblem same =
        MakeLowRankProblem(2, 2, 4, 64, 64, page_tokens, 5000, 64, 81, 3.0f, 1);
    const LowRankResult got = RunLowRankSelect(*backend_, same);
    for (int64_t row = 0; row < 4; ++row) {
      for (int32_t i = 0; i < 64; ++i) ASSERT_EQ(got.pages[row * 64 + i], i) << "row " << row;
    }
    const LowRankProblem repeated =
        MakeLowRankProblem(2, 2, 4, 64, 64, page_tokens, 200, 50, 82, 3.0f, 13);
    CheckSelect(repeated);
    const LowRankResult tied = RunLowRankSelect(*backend_, repeated);
    for (int64_t row = 0; row < 4; ++row) {
      const int32_t* pages = &tied.pages[row * 50];
      for (int i = 0; i < 50; ++i) {
        if (pages[i] >= 13) {
          EXPECT_TRUE(std::binary_search(pages, pages + 50, pages[i] - 13))
              << "row " << row << " keeps page " << pages[i] << " without " << pages[i] - 13;
        }
      }
    }
  }
}

// Keys (f32 and bf16) projected on the GPU, then selected from: the reference scores the
// backend's own codes.
TEST_F(CudaLowRankTest, ProjectedKeysEndToEnd) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t rank : {32, 64, 128}) {
      LowRankProblem pr = MakeLowRankProblem(2, 2, 4, 128, rank, 16, 300, 20, 91);
      const ProjectKeysParams p{.capacity = pr.max_tokens,
                                .first_slot = 0,
                                .count = pr.num_pages * pr.page_tokens,
                                .dtype = dtype,
                                .num_kv_heads = 2,
                                .head_dim = 128,
                                .rank = rank,
                                .max_tokens = pr.max_tokens,
                                .first_token = 0};
      const std::vector<float> keys = RandomKeys(2, pr.max_tokens, 128, dtype, 0, 92);
      const Projection projected = low_rank_reference::RunProjectKeys(*backend_, p, keys, pr.basis);
      ExpectProjection(p, keys, pr.basis, projected);
      pr.coords = projected.coords;
      pr.scales = projected.scales;
      CheckSelect(pr);
    }
  }
}

// SelectPagesBatch with low-rank entries among summary entries (which still batch): each entry
// equals its SelectPages.
TEST_F(CudaLowRankTest, BatchEqualsPerEntry) {
  std::vector<LowRankProblem> low_rank;
  low_rank.push_back(MakeLowRankProblem(1, 8, 4, 128, 64, 16, 3000, 37, 101));
  low_rank.push_back(MakeLowRankProblem(1, 8, 4, 128, 64, 16, 30, 37, 102));
  low_rank.push_back(MakeLowRankProblem(2, 8, 4, 128, 48, 8, 900, 37, 103));
  std::vector<page_reference::SelectProblem> summary;
  for (int64_t n : {1000, 4097, 300}) {
    summary.push_back(page_reference::MakeSelectProblem(1, 8, 4, 128, n, 37, DType::kBF16, false, n,
                                                        static_cast<uint32_t>(104 + n)));
  }
  low_rank_reference::AddKeep(low_rank[0], 12, 110);
  page_reference::AddKeep(summary[1], 12, 111);
  const std::vector<bool> order = {false, true, false, true, true, false};
  const std::vector<std::vector<int32_t>> batched =
      low_rank_reference::RunMixedBatch(*backend_, low_rank, summary, order);
  ASSERT_EQ(batched.size(), order.size());
  size_t next_low_rank = 0, next_summary = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    SCOPED_TRACE("entry " + std::to_string(i));
    if (order[i]) {
      EXPECT_EQ(batched[i], RunLowRankSelect(*backend_, low_rank[next_low_rank++]).pages);
    } else {
      EXPECT_EQ(batched[i], page_reference::RunSelectPages(*backend_, summary[next_summary++]));
    }
  }
}

TEST_F(CudaLowRankTest, RejectsBrokenParams) {
  low_rank_reference::ExpectRejectsBrokenParams(*backend_);
}

// The scoring kernel alone at the decode shape the design targets: 512K keys per kv head, 8 kv
// heads, group 4, head_dim 128, rank 64, 16-key pages, 1..4 query tokens. Prints the time and
// the read rate (coordinates, scales, basis and q); checks 256 sampled pages of every row.
TEST_F(CudaLowRankTest, DecodeScoringReadRate) {
  constexpr int64_t kHkv = 8, kGroup = 4, kDim = 128, kRank = 64, kPage = 16;
  constexpr int64_t kPages = (512 << 10) / kPage, kKeys = kPages * kPage;
  LowRankProblem pr;
  pr.num_kv_heads = kHkv;
  pr.num_q_heads = kHkv * kGroup;
  pr.head_dim = kDim;
  pr.rank = kRank;
  pr.page_tokens = kPage;
  pr.num_pages = kPages;
  pr.max_tokens = kKeys;
  pr.sigma = 1.0f / std::sqrt(static_cast<float>(kDim));
  pr.q_row_stride = pr.num_q_heads * kDim;
  pr.basis = RandomBasis(kHkv, kDim, kRank, 1);
  pr.coords.resize(kHkv * kKeys * kRank);
  pr.scales.resize(kHkv * kKeys);
  uint64_t state = 12345;
  auto next = [&state] {  // splitmix64: fast enough for 268 MB
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t i = 0; i < pr.coords.size(); i += 8) {
    const uint64_t bits = next();
    for (size_t b = 0; b < 8; ++b) {
      pr.coords[i + b] =
          static_cast<int8_t>(static_cast<int>((bits >> (8 * b)) & 0xff) % 255 - 127);
    }
  }
  for (float& s : pr.scales) s = 0.005f + 0.02f * static_cast<float>(next() >> 40) / 16777216.0f;
  DeviceBuffer basis = Upload(pr.basis);
  DeviceBuffer coords = Upload(pr.coords);
  DeviceBuffer scales = Upload(pr.scales);
  DeviceBuffer scores = Filled(4 * kHkv * kPages, 0.0f);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  std::mt19937 rng(7);
  for (int64_t tokens = 1; tokens <= 4; ++tokens) {
    pr.num_tokens = tokens;
    pr.q.resize(tokens * pr.q_row_stride);
    for (float& v : pr.q) v = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
    DeviceBuffer q = Upload(pr.q);
    const cuda_backend::LowRankScoreArgs args{.q = q.as<float>(),
                                              .q_row_stride = pr.q_row_stride,
                                              .basis = basis.as<float>(),
                                              .coords = coords.as<int8_t>(),
                                              .scales = scales.as<float>(),
                                              .rank = kRank,
                                              .max_tokens = kKeys,
                                              .page_tokens = kPage,
                                              .softmax_scale = pr.sigma,
                                              .num_pages = kPages,
                                              .num_tokens = tokens,
                                              .num_q_heads = pr.num_q_heads,
                                              .num_kv_heads = kHkv,
                                              .head_dim = kDim,
                                              .scores = scores.as<float>(),
                                              .num_sms = sms};
    ASSERT_TRUE(cuda_backend::LowRankScoresUseTensorCores(args));
    ASSERT_TRUE(backend_->Synchronize().ok());
    cudaEvent_t start, stop;
    ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
    constexpr int kWarmup = 3, kRuns = 20;
    for (int i = 0; i < kWarmup; ++i)
      ASSERT_EQ(cuda_backend::LaunchLowRankScores(args, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(start, 0), cudaSuccess);
    for (int i = 0; i < kRuns; ++i)
      ASSERT_EQ(cuda_backend::LaunchLowRankScores(args, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(stop, 0), cudaSuccess);
    ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0.0f;
    ASSERT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    const double seconds = ms / 1e3 / kRuns;
    const double bytes = static_cast<double>(kHkv) * kKeys * (kRank + 4);
    std::printf(
        "low-rank scores: %lld token(s), %lld keys x %lld kv heads, rank %lld: %.1f us, "
        "%.0f GB/s of coordinates and scales\n",
        static_cast<long long>(tokens), static_cast<long long>(kKeys), static_cast<long long>(kHkv),
        static_cast<long long>(kRank), seconds * 1e6, bytes / seconds / 1e9);

    std::vector<int64_t> sample;
    for (int i = 0; i < 256; ++i) sample.push_back(static_cast<int64_t>(next() % kPages));
    sample.push_back(0);
    sample.push_back(kPages - 1);
    const std::vector<double> want = ReferenceScores(pr, sample);
    const std::vector<float> got = Download<float>(scores, tokens * kHkv * kPages);
    ExpectScores(pr, want, got);
  }
}

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
