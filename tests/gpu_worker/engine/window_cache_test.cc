// WindowCache: slot assignment (sink + ring), the eviction plan, and that ReadBlocks returns
// exactly the K/V/MAW written to the evicted slots, head-major.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

class WindowCacheTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing::MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
  }
  std::unique_ptr<Backend> backend_;
};

// K of token at position p, head h, dim d: a value that identifies all three.
float KValue(int64_t p, int64_t h, int64_t d) { return p * 8.0f + h * 2.0f + d * 0.125f; }

TEST_P(WindowCacheTest, EvictsOldestBlocksWithTheirContents) {
  const DType dtype = GetParam();
  const WindowGeometry g{2, 3, 8, dtype};
  WindowOptions o;
  o.sink = 4;
  o.window = 32;
  o.block = 8;
  o.max_chunk = 20;
  o.max_context = 1000;
  auto cache = WindowCache::Create(*backend_, g, o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  int64_t evicted = 0;
  for (int round = 0; round < 12; ++round) {
    const int64_t n = 1 + (round * 7) % 20;
    const int64_t first = cache->next_position();
    auto slots = cache->Append(n);
    ASSERT_TRUE(slots.ok()) << slots.status();
    // Write K = KValue, V = -KValue through the backend's WriteKv, for both layers.
    std::vector<float> rows(n * 3 * 2 * 8);   // [n, (k heads | v heads), D]
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t d = 0; d < 8; ++d) {
          rows[(t * 6 + h) * 8 + d] = KValue(first + t, h, d);
          rows[(t * 6 + 3 + h) * 8 + d] = -KValue(first + t, h, d);
        }
      }
    }
    auto dev_rows = backend_->Allocate(rows.size() * 4);
    auto dev_slots = backend_->Allocate(n * 4);
    ASSERT_TRUE(dev_rows.ok() && dev_slots.ok());
    ASSERT_TRUE(backend_->CopyToDevice(dev_rows->data(), rows.data(), rows.size() * 4).ok());
    ASSERT_TRUE(backend_->CopyToDevice(dev_slots->data(), (*slots)->data(), n * 4).ok());
    for (int64_t l = 0; l < 2; ++l) {
      WriteKvParams w;
      w.k = dev_rows->as<float>();
      w.v = dev_rows->as<float>() + 3 * 8;
      w.row_stride = 6 * 8;
      w.slots = dev_slots->as<int32_t>();
      w.k_cache = cache->k(l);
      w.v_cache = cache->v(l);
      w.cache_dtype = dtype;
      w.num_tokens = n;
      w.num_kv_heads = 3;
      w.capacity = cache->capacity();
      w.head_dim = 8;
      ASSERT_TRUE(backend_->WriteKv(w).ok());
    }
    const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
    int64_t total = 0;
    for (const EvictedBlock& b : blocks) {
      EXPECT_EQ(b.first_pos, 4 + evicted + total);
      EXPECT_EQ(b.count, 8);
      total += b.count;
    }
    if (!blocks.empty()) {
      const size_t elem = DTypeBytes(dtype);
      std::vector<char> k(3 * total * 8 * elem), v(k.size());
      std::vector<float> maw(3 * total);
      ASSERT_TRUE(cache->ReadBlocks(1, blocks, k.data(), v.data(), maw.data()).ok());
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t t = 0; t < total; ++t) {
          for (int64_t d = 0; d < 8; ++d) {
            const size_t i = (h * total + t) * 8 + d;
            const float kv = dtype == DType::kF32 ? reinterpret_cast<float*>(k.data())[i]
                                                  : Bf16ToFloat(reinterpret_cast<uint16_t*>(k.data())[i]);
            const float vv = dtype == DType::kF32 ? reinterpret_cast<float*>(v.data())[i]
                                                  : Bf16ToFloat(reinterpret_cast<uint16_t*>(v.data())[i]);
            const float want = KValue(4 + evicted + t, h, d);
            const float tol = dtype == DType::kF32 ? 0.0f : std::fabs(want) / 128.0f;
            ASSERT_NEAR(kv, want, tol) << "h " << h << " t " << t << " d " << d;
            ASSERT_NEAR(vv, -want, tol);
          }
          EXPECT_EQ(maw[h * total + t], 0.0f);   // never attended: sent as 0
        }
      }
      ASSERT_TRUE(cache->Release(blocks).ok());
      evicted += total;
    }
    const int64_t recent = std::max<int64_t>(cache->next_position() - 4, 0) -
                           cache->evicted_tokens();
    EXPECT_LE(recent, 32);
    if (!blocks.empty()) {
      EXPECT_GT(recent, 32 - 8);   // whole blocks leave, no more than needed
    }
    EXPECT_EQ(cache->entries(), cache->next_position() - evicted);
  }
  EXPECT_GT(evicted, 0);
}

TEST_P(WindowCacheTest, UnlimitedWindowNeverEvictsAndStopsAtTheContext) {
  WindowOptions o;
  o.window = WindowOptions::kUnlimited;
  o.sink = 0;
  o.block = 16;
  o.max_chunk = 64;
  o.max_context = 100;
  auto cache = WindowCache::Create(*backend_, {1, 1, 8, GetParam()}, o);
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(cache->Append(64).ok());
  EXPECT_TRUE(cache->PendingEvictions().empty());
  EXPECT_EQ(cache->scan_slots(), 64);
  ASSERT_TRUE(cache->Append(36).ok());
  EXPECT_EQ(cache->Append(1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->Append(65).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->entries(), 100);
}

// Grow moves an unlimited window into larger buffers: positions and their K/V rows survive, and
// BytesFor predicts the bytes before and after (the engine's device-KV budget relies on it).
TEST_P(WindowCacheTest, GrowKeepsTheKvAndBytesForPredictsTheSize) {
  const WindowGeometry geometry{2, 2, 8, GetParam()};
  WindowOptions o;
  o.window = WindowOptions::kUnlimited;
  o.sink = 0;
  o.block = 16;
  o.max_chunk = 64;
  o.max_context = 100;
  auto cache = WindowCache::Create(*backend_, geometry, o);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor(geometry, o));
  ASSERT_TRUE(cache->Append(40).ok());
  const size_t row = 8 * DTypeBytes(GetParam());
  std::vector<uint8_t> k(2 * cache->capacity() * row), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint8_t>(i * 7 + 1);
    v[i] = static_cast<uint8_t>(i * 13 + 5);
  }
  for (int64_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(backend_->CopyToDevice(cache->k(l), k.data(), k.size()).ok());
    ASSERT_TRUE(backend_->CopyToDevice(cache->v(l), v.data(), v.size()).ok());
  }
  const int64_t old_capacity = cache->capacity();
  ASSERT_TRUE(cache->Grow(300).ok());
  o.max_context = 300;
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor(geometry, o));
  EXPECT_GT(cache->capacity(), old_capacity);
  EXPECT_EQ(cache->entries(), 40);
  EXPECT_EQ(cache->next_position(), 40);
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t h = 0; h < 2; ++h) {
      // The rows of the 40 positions (slot = position); the other slots hold no token.
      std::vector<uint8_t> got(40 * row);
      ASSERT_TRUE(backend_->CopyToHost(got.data(),
                                       static_cast<const char*>(cache->k(l)) +
                                           h * cache->capacity() * row,
                                       got.size()).ok());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), k.begin() + h * old_capacity * row))
          << "K of layer " << l << " head " << h;
      ASSERT_TRUE(backend_->CopyToHost(got.data(),
                                       static_cast<const char*>(cache->v(l)) +
                                           h * cache->capacity() * row,
                                       got.size()).ok());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), v.begin() + h * old_capacity * row))
          << "V of layer " << l << " head " << h;
    }
  }
  ASSERT_TRUE(cache->Append(60).ok());   // past the old limit of 100
  EXPECT_EQ(cache->entries(), 100);
  // A bounded window does not grow.
  WindowOptions bounded = o;
  bounded.window = 32;
  auto fixed = WindowCache::Create(*backend_, geometry, bounded);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->device_bytes(), WindowCache::BytesFor(geometry, bounded));
  EXPECT_EQ(fixed->Grow(1000).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(WindowCacheTest, RejectsBadOptions) {
  WindowOptions o;
  o.window = 8;
  o.block = 16;   // window smaller than a block
  EXPECT_EQ(WindowCache::Create(*backend_, {1, 1, 8, GetParam()}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.window = 64;
  EXPECT_EQ(WindowCache::Create(*backend_, {0, 1, 8, GetParam()}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WindowCache::Create(*backend_, {1, 1, 8, DType::kF16}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Skip advances positions past KV held elsewhere: only with a full sink and no recent token, by
// whole blocks; the next appended token lands at the advanced position, and evictions resume
// from there.
TEST_P(WindowCacheTest, SkipAdvancesPositionsHeldElsewhere) {
  WindowOptions o;
  o.sink = 4;
  o.window = 16;
  o.block = 8;
  o.max_chunk = 16;
  o.max_context = 10000;
  auto cache = WindowCache::Create(*backend_, {1, 1, 8, GetParam()}, o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->Skip(8).code(), absl::StatusCode::kFailedPrecondition);   // sink not full
  ASSERT_TRUE(cache->Append(4).ok());
  EXPECT_EQ(cache->Skip(5).code(), absl::StatusCode::kInvalidArgument);      // not whole blocks
  ASSERT_TRUE(cache->Skip(800).ok());
  EXPECT_EQ(cache->next_position(), 804);
  EXPECT_EQ(cache->evicted_tokens(), 800);
  EXPECT_EQ(cache->entries(), 4);
  ASSERT_TRUE(cache->Append(16).ok());
  EXPECT_EQ(cache->Skip(8).code(), absl::StatusCode::kFailedPrecondition);   // recent tokens
  EXPECT_TRUE(cache->PendingEvictions().empty());
  ASSERT_TRUE(cache->Append(8).ok());
  const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].first_pos, 804);
  EXPECT_EQ(cache->Skip(20000 - 20000 % 8).code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(DTypes, WindowCacheTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace tandem::gpu_worker
