// LowRankIndex (issue 28): the low-rank coordinates of offloaded keys. Keys drawn from a known
// 3-dimensional subspace (plus a little noise) are staged until calib_tokens have arrived, a
// rank-4 basis is made from them, and from then on every offloaded key's coordinates give back
// q·k for any q (to int8 rounding), in the order the keys were offloaded, across an append that
// straddles the calibration, the buffers' growth, a fork and a park, and when the basis is made
// in the background (Advance). The cpu backend in CI, the cuda one with label gpu.
#include "tandem/gpu_worker/low_rank_index.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/parking_pool.h"

namespace tandem::gpu_worker {
namespace {

constexpr int64_t kLayers = 2, kHeads = 2, kDim = 16, kCapacity = 64;
constexpr int64_t kRank = 4, kCalib = 24, kSubspace = 3;

struct Keys {
  std::vector<float> values;  // [layers][heads, capacity, D] f32 (the dtype's values)
  std::vector<DeviceBuffer> device;
};

// Keys of every (layer, head) in a subspace of kSubspace random directions, in `dtype`.
Keys MakeKeys(Backend& backend, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Keys keys;
  keys.values.resize(kLayers * kHeads * kCapacity * kDim);
  for (int64_t lh = 0; lh < kLayers * kHeads; ++lh) {
    std::vector<float> dirs(kSubspace * kDim);
    for (float& x : dirs) x = normal(rng);
    for (int64_t s = 0; s < kCapacity; ++s) {
      float* k = keys.values.data() + (lh * kCapacity + s) * kDim;
      for (int64_t i = 0; i < kSubspace; ++i) {
        const float a = normal(rng) * static_cast<float>(i + 1);
        for (int64_t d = 0; d < kDim; ++d) k[d] += a * dirs[i * kDim + d];
      }
      for (int64_t d = 0; d < kDim; ++d) {
        k[d] += 1e-3f * normal(rng);
        if (dtype == DType::kBF16) k[d] = Bf16ToFloat(FloatToBf16(k[d]));
      }
    }
  }
  for (int64_t l = 0; l < kLayers; ++l) {
    const float* src = keys.values.data() + l * kHeads * kCapacity * kDim;
    const size_t count = kHeads * kCapacity * kDim;
    auto buffer = backend.Allocate(count * DTypeBytes(dtype));
    EXPECT_TRUE(buffer.ok());
    if (dtype == DType::kBF16) {
      std::vector<bf16_t> bf(count);
      for (size_t i = 0; i < count; ++i) bf[i] = FloatToBf16(src[i]);
      EXPECT_TRUE(backend.CopyToDevice(buffer->data(), bf.data(), count * 2).ok());
    } else {
      EXPECT_TRUE(backend.CopyToDevice(buffer->data(), src, count * 4).ok());
    }
    keys.device.push_back(std::move(*buffer));
  }
  return keys;
}

struct HostCopy {
  std::vector<int8_t> coords;
  std::vector<float> scales, basis;
};

HostCopy Download(Backend& backend, const LowRankIndex& index, int64_t layer) {
  HostCopy h;
  const int64_t cap = index.capacity_tokens();
  h.coords.resize(kHeads * cap * kRank);
  h.scales.resize(kHeads * cap);
  h.basis.resize(kHeads * kDim * kRank);
  EXPECT_TRUE(backend.CopyToHost(h.coords.data(), index.coords(layer), h.coords.size()).ok());
  EXPECT_TRUE(backend.CopyToHost(h.scales.data(), index.scales(layer), h.scales.size() * 4).ok());
  EXPECT_TRUE(backend.CopyToHost(h.basis.data(), index.basis(layer), h.basis.size() * 4).ok());
  return h;
}

// Every written row of every (layer, head) gives back q·k of the key appended in that order,
// for a few random q, within int8 rounding (1/254 of the largest coordinate per coordinate);
// the basis is orthonormal.
void ExpectCoordinatesGiveBackDots(Backend& backend, const LowRankIndex& index, const Keys& keys,
                                   const std::vector<int64_t>& order) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(index.ready(l));
    ASSERT_EQ(index.tokens(l), static_cast<int64_t>(order.size()));
    const HostCopy h = Download(backend, index, l);
    const int64_t cap = index.capacity_tokens();
    for (int64_t g = 0; g < kHeads; ++g) {
      const float* basis = h.basis.data() + g * kDim * kRank;
      for (int64_t r = 0; r < kRank; ++r) {
        for (int64_t r2 = 0; r2 < kRank; ++r2) {
          double dot = 0;
          for (int64_t d = 0; d < kDim; ++d) dot += basis[d * kRank + r] * basis[d * kRank + r2];
          ASSERT_NEAR(dot, r == r2 ? 1.0 : 0.0, 1e-4) << "layer " << l << " head " << g;
        }
      }
      for (int trial = 0; trial < 3; ++trial) {
        std::vector<float> q(kDim);
        for (float& x : q) x = normal(rng);
        std::vector<double> q_low(kRank, 0.0);
        for (int64_t r = 0; r < kRank; ++r) {
          for (int64_t d = 0; d < kDim; ++d) q_low[r] += q[d] * basis[d * kRank + r];
        }
        double q_norm = 0;
        for (double x : q_low) q_norm += x * x;
        for (size_t i = 0; i < order.size(); ++i) {
          const float* k = keys.values.data() + ((l * kHeads + g) * kCapacity + order[i]) * kDim;
          double exact = 0, k_norm = 0;
          for (int64_t d = 0; d < kDim; ++d) {
            exact += static_cast<double>(q[d]) * k[d];
            k_norm += static_cast<double>(k[d]) * k[d];
          }
          const float scale = h.scales[g * cap + i];
          double approx = 0;
          for (int64_t r = 0; r < kRank; ++r) {
            approx += q_low[r] * scale * h.coords[(g * cap + i) * kRank + r];
          }
          // Rounding: ≤ scale/2 per coordinate; the noise off the subspace: ~1e-3 per dim.
          const double tol =
              std::sqrt(q_norm) * (scale * std::sqrt(kRank) / 2 + 1e-2) + 1e-3 * std::sqrt(k_norm);
          ASSERT_NEAR(approx, exact, tol) << "layer " << l << " head " << g << " entry " << i;
        }
      }
    }
  }
}

class LowRankIndexTest : public ::testing::TestWithParam<DType> {};

TEST_P(LowRankIndexTest, CoordinatesGiveBackDotProductsAcrossCalibrationGrowthForkAndPark) {
  TANDEM_SKIP_WITHOUT_BACKEND();
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  ASSERT_NE(backend, nullptr) << why;
  const DType dtype = GetParam();
  const WindowGeometry geometry{kLayers, kHeads, kDim, dtype};
  Keys keys = MakeKeys(*backend, dtype, 11);
  auto index = LowRankIndex::Create(*backend, geometry, {kRank, kCalib}, /*reserve_tokens=*/8);
  ASSERT_TRUE(index.ok()) << index.status();

  // Slot ranges in order: 16 staged, then 16 that cross the calibration (8 staged + the basis
  // + 8 projected), then 24 projected; the capacity grows from 8 twice.
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{40, 16}, {8, 16}, {0, 8}, {24, 16}};
  std::vector<int64_t> order;
  for (const auto& [first, count] : ranges) {
    for (int64_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(index->Append(l, keys.device[l].data(), kCapacity, first, count).ok());
    }
    for (int64_t s = first; s < first + count; ++s) order.push_back(s);
    const bool calibrated = static_cast<int64_t>(order.size()) >= kCalib;
    EXPECT_EQ(index->ready(0), calibrated) << order.size() << " keys";
    EXPECT_EQ(index->Keys(1, 8, 0.25f).ok(), calibrated);
  }
  ASSERT_TRUE(backend->Synchronize().ok());
  ExpectCoordinatesGiveBackDots(*backend, *index, keys, order);

  auto fork = index->Fork(/*reserve_tokens=*/100);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_GE(fork->capacity_tokens(), 100);
  ExpectCoordinatesGiveBackDots(*backend, *fork, keys, order);

  ParkingPool pool(*backend, size_t{1} << 24, 4096);
  const size_t resident = index->resident_bytes();
  ASSERT_TRUE(index->Park(pool).ok());
  EXPECT_TRUE(index->parked());
  EXPECT_EQ(index->device_bytes(), 0u);
  EXPECT_GE(index->parked_bytes(), index->ParkBytes());
  ASSERT_TRUE(index->Unpark().ok());
  EXPECT_EQ(index->device_bytes(), resident);
  ExpectCoordinatesGiveBackDots(*backend, *index, keys, order);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LowRankIndexTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) {
                           return std::string(info.param == DType::kF32 ? "f32" : "bf16");
                         });

// Before the basis: the staged keys park and come back, and the calibration then completes.
TEST(LowRankIndexStagingTest, StagedKeysSurviveParkingAndForking) {
  TANDEM_SKIP_WITHOUT_BACKEND();
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  ASSERT_NE(backend, nullptr) << why;
  const WindowGeometry geometry{kLayers, kHeads, kDim, DType::kF32};
  Keys keys = MakeKeys(*backend, DType::kF32, 5);
  auto index = LowRankIndex::Create(*backend, geometry, {kRank, kCalib}, 0);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->tokens_until_due(), kCalib);
  for (int64_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(index->Append(l, keys.device[l].data(), kCapacity, 0, 16).ok());
  }
  EXPECT_FALSE(index->ready(0));
  EXPECT_EQ(index->tokens_until_due(), kCalib - 16);   // what fills the staging exactly
  ParkingPool pool(*backend, size_t{1} << 24, 4096);
  ASSERT_TRUE(index->Park(pool).ok());
  ASSERT_TRUE(index->Unpark().ok());
  auto fork = index->Fork(0);
  ASSERT_TRUE(fork.ok()) << fork.status();
  std::vector<int64_t> order;
  for (int64_t s = 0; s < 32; ++s) order.push_back(s);
  for (LowRankIndex* i : {&*index, &*fork}) {
    for (int64_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(i->Append(l, keys.device[l].data(), kCapacity, 16, 16).ok());
    }
    ASSERT_TRUE(backend->Synchronize().ok());
    ExpectCoordinatesGiveBackDots(*backend, *i, keys, order);
  }
}

// A staging filled exactly leaves the layer due, not ready: Advance makes the bases of every due
// layer in one background job and a later Advance installs them. Parking waits for the job and
// installs its bases; a fork taken while they are due makes its own from the staged keys.
TEST(LowRankIndexStagingTest, BasesAreMadeOffTheAppendAndInstalledByAdvance) {
  TANDEM_SKIP_WITHOUT_BACKEND();
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  ASSERT_NE(backend, nullptr) << why;
  const WindowGeometry geometry{kLayers, kHeads, kDim, DType::kF32};
  Keys keys = MakeKeys(*backend, DType::kF32, 9);
  auto index = LowRankIndex::Create(*backend, geometry, {kRank, kCalib}, 0);
  ASSERT_TRUE(index.ok()) << index.status();
  for (int64_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(index->Append(l, keys.device[l].data(), kCapacity, 0, kCalib).ok());
    EXPECT_FALSE(index->ready(l));
  }
  EXPECT_TRUE(index->calibrating());
  EXPECT_EQ(index->tokens_until_due(), 0);
  EXPECT_EQ(index->Keys(0, 8, 0.25f).status().code(), absl::StatusCode::kFailedPrecondition);
  auto fork = index->Fork(0);
  ASSERT_TRUE(fork.ok()) << fork.status();

  ASSERT_TRUE(index->Advance().ok());   // the job starts; it may or may not be done
  EXPECT_TRUE(index->calibrating() || index->ready(0));
  ParkingPool pool(*backend, size_t{1} << 24, 4096);
  ASSERT_TRUE(index->Park(pool).ok());
  ASSERT_TRUE(index->Unpark().ok());
  EXPECT_FALSE(index->calibrating());
  std::vector<int64_t> order;
  for (int64_t s = 0; s < kCalib; ++s) order.push_back(s);
  ASSERT_TRUE(backend->Synchronize().ok());
  ExpectCoordinatesGiveBackDots(*backend, *index, keys, order);

  EXPECT_FALSE(fork->ready(0));
  EXPECT_TRUE(fork->calibrating());
  ASSERT_TRUE(fork->Advance(/*wait=*/true).ok());
  EXPECT_FALSE(fork->calibrating());
  // Keys after the basis are projected at once.
  for (int64_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(fork->Append(l, keys.device[l].data(), kCapacity, kCalib, 8).ok());
  }
  for (int64_t s = kCalib; s < kCalib + 8; ++s) order.push_back(s);
  ASSERT_TRUE(backend->Synchronize().ok());
  ExpectCoordinatesGiveBackDots(*backend, *fork, keys, order);
}

TEST(LowRankIndexOptionsTest, BadOptionsAreRefusedByName) {
  EXPECT_TRUE(ValidateLowRankOptions({LowRankOptions::kHalfHeadDim, 4096}, 128).ok());
  EXPECT_TRUE(ValidateLowRankOptions({0, 4096}, 128).ok());
  EXPECT_TRUE(ValidateLowRankOptions({128, 1}, 128).ok());
  for (const LowRankOptions& bad :
       {LowRankOptions{129, 4096}, LowRankOptions{-2, 4096}, LowRankOptions{64, 0}}) {
    const absl::Status s = ValidateLowRankOptions(bad, 128);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("low-rank keys"), std::string::npos) << s;
  }
  EXPECT_EQ(LowRankOptions{LowRankOptions::kHalfHeadDim}.RankFor(128), 64);
  // Summaries and coordinates together in the memory estimate: 3 rows of D per page plus
  // rank + 4 bytes per key, a basis and the staging per (layer, kv head).
  const WindowGeometry g{2, 4, 128, DType::kBF16};
  const size_t summaries = PageIndex::BytesFor(g, 16, 8192);
  const size_t with = PageIndex::BytesFor(g, 16, 8192, {64, 4096});
  EXPECT_EQ(with - summaries, size_t{2} * 4 * (8192 * 68 + 128 * 64 * 4 + 4096 * 128 * 2));
}

}  // namespace
}  // namespace tandem::gpu_worker
