// Shard: block table, salience index, copy-on-write prefix sharing, truncation, rollback.
#include "tandem/kv_store/shard.h"

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kv_test_util.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/memory_budget.h"

namespace tandem::kv_store {
namespace {

using testing::ExpectShardMatches;
using testing::MakeMaw;
using testing::MakeRows;
using testing::ShardModel;

SelectRule Threshold(float t) { return SelectRule{false, t}; }
constexpr SelectRule kAll{true, 0.0f};

// A pool, budget and helpers to append model-tracked data.
class ShardFixture {
 public:
  explicit ShardFixture(BlockFormat f, uint64_t budget_bytes = uint64_t{1} << 30,
                        uint64_t max_blocks = 4096)
      : format(f), budget(budget_bytes) {
    auto p = BlockPool::Create(f, max_blocks, &budget);
    EXPECT_TRUE(p.ok()) << p.status();
    pool = std::move(*p);
  }

  // Appends n fresh entries (data keyed by `seed`) to shard and model; returns the status.
  absl::Status Append(Shard& shard, ShardModel& model, uint64_t n, uint32_t seed, SelectRule rule) {
    auto k = MakeRows(format.dtype, n, format.head_dim, seed);
    auto v = MakeRows(format.dtype, n, format.head_dim, seed + 1000);
    auto maw = MakeMaw(n, rule.threshold == 0 ? 1.0f : rule.threshold, seed);
    auto selected = shard.Append(k.data(), v.data(), maw.data(), n, rule);
    if (!selected.ok()) return selected.status();
    uint64_t expected = 0;
    for (float m : maw) expected += rule.Selects(m) ? 1 : 0;
    EXPECT_EQ(*selected, expected);
    model.Append(k, v, maw, rule);
    return absl::OkStatus();
  }

  BlockFormat format;
  MemoryBudget budget;
  std::unique_ptr<BlockPool> pool;
};

// Round trip over dtype x block_tokens x head_dim: K/V/MAW written by Append read back
// through the block table and the selected copy.
class ShardRoundTripTest
    : public ::testing::TestWithParam<std::tuple<KvDType, uint32_t, uint32_t>> {};

TEST_P(ShardRoundTripTest, AppendReadsBackThroughBlocksAndSelectedCopy) {
  const auto [dtype, block_tokens, head_dim] = GetParam();
  const BlockFormat f{block_tokens, head_dim, dtype};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  const SelectRule rule = Threshold(0.01f);
  // Odd chunk sizes: a single entry, one short of a block, several blocks plus a few, and an
  // exact block, so appends start mid-block and cross block boundaries.
  uint32_t seed = 1;
  for (uint64_t n : {uint64_t{1}, uint64_t{block_tokens - 1}, uint64_t{2 * block_tokens + 3},
                     uint64_t{5}, uint64_t{block_tokens}, uint64_t{block_tokens / 2 + 7}}) {
    ASSERT_TRUE(fx.Append(shard, model, n, seed++, rule).ok());
    ExpectShardMatches(shard, model);
  }
  EXPECT_GT(shard.selected_count(), 0u);
  EXPECT_LT(shard.selected_count(), shard.held());
  EXPECT_EQ(fx.pool->blocks_in_use(), shard.blocks().size());
  EXPECT_EQ(fx.budget.used(),
            shard.blocks().size() * f.block_bytes() + shard.selected_capacity_bytes());
}

INSTANTIATE_TEST_SUITE_P(DTypeBlockHeadDim, ShardRoundTripTest,
                         ::testing::Combine(::testing::Values(KvDType::kF32, KvDType::kBf16),
                                            ::testing::Values(16u, 64u, 256u),
                                            ::testing::Values(8u, 64u, 128u)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == KvDType::kF32 ? "f32"
                                                                                       : "bf16") +
                                  "_bt" + std::to_string(std::get<1>(info.param)) + "_hd" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(ShardTest, SelectAllKeepsEveryEntryEvenWithZeroMaw) {
  const BlockFormat f{16, 64, KvDType::kF32};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  auto k = MakeRows(f.dtype, 20, f.head_dim, 1);
  auto v = MakeRows(f.dtype, 20, f.head_dim, 2);
  std::vector<float> maw(20, 0.0f);
  auto selected = shard.Append(k.data(), v.data(), maw.data(), 20, kAll);
  ASSERT_TRUE(selected.ok());
  EXPECT_EQ(*selected, 20u);
  EXPECT_EQ(shard.selected_count(), 20u);
  EXPECT_EQ(std::memcmp(shard.selected_k(), k.data(), k.size()), 0);
  EXPECT_EQ(std::memcmp(shard.selected_v(), v.data(), v.size()), 0);
}

TEST(ShardTest, ThresholdIsStrictlyGreater) {
  const BlockFormat f{16, 64, KvDType::kBf16};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  const float t = 0.125f;
  std::vector<float> maw = {0.0f, t, std::nextafter(t, 1.0f), 1.0f, t * 0.5f, t};
  auto k = MakeRows(f.dtype, maw.size(), f.head_dim, 3);
  auto v = MakeRows(f.dtype, maw.size(), f.head_dim, 4);
  auto selected = shard.Append(k.data(), v.data(), maw.data(), maw.size(), Threshold(t));
  ASSERT_TRUE(selected.ok());
  EXPECT_EQ(*selected, 2u);
  const std::vector<uint8_t> flags(shard.selected_flags().begin(), shard.selected_flags().end());
  EXPECT_EQ(flags, (std::vector<uint8_t>{0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(testing::SelectedK(shard, 0), testing::Row(k, f, 2));
  EXPECT_EQ(testing::SelectedK(shard, 1), testing::Row(k, f, 3));
  EXPECT_EQ(testing::SelectedV(shard, 1), testing::Row(v, f, 3));
}

TEST(ShardTest, SetSelectionRebuildsTheCopyFromBlocks) {
  const BlockFormat f{16, 128, KvDType::kBf16};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  ASSERT_TRUE(fx.Append(shard, model, 50, 1, Threshold(0.5f)).ok());
  ASSERT_TRUE(fx.Append(shard, model, 30, 2, Threshold(0.5f)).ok());
  // Every third entry plus a run across a block boundary (14..19).
  std::vector<uint8_t> flags(80, 0);
  for (size_t i = 0; i < 80; i += 3) flags[i] = 1;
  for (size_t i = 14; i < 20; ++i) flags[i] = 7;  // any non-zero selects
  ASSERT_TRUE(shard.SetSelection(flags).ok());
  for (size_t i = 0; i < 80; ++i) model.selected[i] = flags[i] != 0 ? 1 : 0;
  ExpectShardMatches(shard, model);
  EXPECT_EQ(shard.selected_flags()[15], 1u);  // stored normalised

  // Select everything, then nothing.
  std::vector<uint8_t> all(80, 1);
  ASSERT_TRUE(shard.SetSelection(all).ok());
  model.selected.assign(80, 1);
  ExpectShardMatches(shard, model);
  ASSERT_TRUE(shard.SetSelection(std::vector<uint8_t>(80, 0)).ok());
  model.selected.assign(80, 0);
  ExpectShardMatches(shard, model);

  // A later append continues after the rebuilt copy.
  ASSERT_TRUE(fx.Append(shard, model, 9, 3, kAll).ok());
  ExpectShardMatches(shard, model);
}

TEST(ShardTest, SetSelectionRejectsWrongSizeAndKeepsState) {
  const BlockFormat f{16, 64, KvDType::kF32};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  ASSERT_TRUE(fx.Append(shard, model, 20, 1, Threshold(0.5f)).ok());
  EXPECT_EQ(shard.SetSelection(std::vector<uint8_t>(19, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectShardMatches(shard, model);
}

TEST(ShardTest, SetSelectionOutOfBudgetKeepsState) {
  const BlockFormat f{16, 64, KvDType::kF32};
  // Two blocks plus the selected copy of few rows; selecting all 32 needs 2 * 32 * 256 bytes.
  ShardFixture fx(f, 2 * f.block_bytes() + 4096);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  auto k = MakeRows(f.dtype, 32, f.head_dim, 1);
  auto v = MakeRows(f.dtype, 32, f.head_dim, 2);
  std::vector<float> maw(32, 0.0f);
  maw[3] = 1.0f;
  ASSERT_TRUE(shard.Append(k.data(), v.data(), maw.data(), 32, Threshold(0.5f)).ok());
  model.Append(k, v, maw, Threshold(0.5f));
  const uint64_t used = fx.budget.used();
  EXPECT_EQ(shard.SetSelection(std::vector<uint8_t>(32, 1)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fx.budget.used(), used);
  ExpectShardMatches(shard, model);
}

TEST(ShardTest, AppendOutOfBlocksChangesNothing) {
  const BlockFormat f{16, 64, KvDType::kF32};
  ShardFixture fx(f, uint64_t{1} << 30, /*max_blocks=*/3);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  ASSERT_TRUE(fx.Append(shard, model, 20, 1, kAll).ok());  // 2 blocks
  const uint64_t used = fx.budget.used();
  // 20 + 40 entries need 4 blocks; the pool has 3.
  EXPECT_EQ(fx.Append(shard, model, 40, 2, kAll).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fx.pool->blocks_in_use(), 2u);
  EXPECT_EQ(fx.budget.used(), used);
  ExpectShardMatches(shard, model);
  ASSERT_TRUE(fx.Append(shard, model, 28, 3, kAll).ok());  // exactly fills 3 blocks
  ExpectShardMatches(shard, model);
}

TEST(ShardTest, AppendOutOfBudgetForSelectedCopyChangesNothing) {
  const BlockFormat f{16, 64, KvDType::kF32};
  // Room for 2 blocks and 16 selected rows of K and V (16 * 256 * 2 = 8192 bytes).
  ShardFixture fx(f, 2 * f.block_bytes() + 8192);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  ASSERT_TRUE(fx.Append(shard, model, 8, 1, kAll).ok());
  const uint64_t used = fx.budget.used();
  const uint64_t blocks = fx.pool->blocks_in_use();
  // The second block fits, the selected copy of 8 + 16 rows (12288 bytes) would not.
  EXPECT_EQ(fx.Append(shard, model, 16, 2, kAll).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fx.pool->blocks_in_use(), blocks);
  EXPECT_EQ(fx.budget.used(), used);
  ExpectShardMatches(shard, model);
}

TEST(ShardTest, TruncateDropsTailBlocksAndSelectedRows) {
  const BlockFormat f{16, 64, KvDType::kBf16};
  ShardFixture fx(f);
  Shard shard(fx.pool.get(), &fx.budget);
  ShardModel model(f);
  ASSERT_TRUE(fx.Append(shard, model, 100, 1, Threshold(0.25f)).ok());
  EXPECT_EQ(fx.pool->blocks_in_use(), 7u);
  shard.Truncate(200);  // no-op
  ExpectShardMatches(shard, model);
  shard.Truncate(37);
  model.Truncate(37);
  ExpectShardMatches(shard, model);
  EXPECT_EQ(fx.pool->blocks_in_use(), 3u);
  shard.Truncate(32);  // exactly two blocks
  model.Truncate(32);
  ExpectShardMatches(shard, model);
  EXPECT_EQ(fx.pool->blocks_in_use(), 2u);
  ASSERT_TRUE(fx.Append(shard, model, 21, 2, Threshold(0.25f)).ok());
  ExpectShardMatches(shard, model);
  shard.Truncate(0);
  model.Truncate(0);
  ExpectShardMatches(shard, model);
  EXPECT_EQ(fx.pool->blocks_in_use(), 0u);
  EXPECT_EQ(fx.budget.used(), shard.selected_capacity_bytes());
}

TEST(ShardTest, DestructorReleasesBlocksAndSelectedCopy) {
  const BlockFormat f{16, 64, KvDType::kF32};
  ShardFixture fx(f);
  {
    Shard shard(fx.pool.get(), &fx.budget);
    ShardModel model(f);
    ASSERT_TRUE(fx.Append(shard, model, 70, 1, kAll).ok());
    EXPECT_GT(fx.budget.used(), 5 * f.block_bytes());
  }
  EXPECT_EQ(fx.pool->blocks_in_use(), 0u);
  EXPECT_EQ(fx.budget.used(), 0u);
}

class ShareTest : public ::testing::Test {
 protected:
  ShareTest() : f_{16, 64, KvDType::kBf16}, fx_(f_), model_(f_) {}

  BlockFormat f_;
  ShardFixture fx_;
  ShardModel model_;
};

TEST_F(ShareTest, ShareFromRefsBlocksAndCopiesSelection) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 100, 1, Threshold(0.5f)).ok());  // 7 blocks
  ASSERT_EQ(fx_.pool->blocks_in_use(), 7u);
  Shard child(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 70).ok());  // ceil(70 / 16) = 5 blocks
  EXPECT_EQ(fx_.pool->blocks_in_use(), 7u);       // shared, not copied
  ASSERT_EQ(child.blocks().size(), 5u);
  for (size_t b = 0; b < 5; ++b) {
    EXPECT_EQ(child.blocks()[b], parent.blocks()[b]);
    EXPECT_EQ(fx_.pool->refcount(parent.blocks()[b]), 2u);
  }
  EXPECT_EQ(fx_.pool->refcount(parent.blocks()[5]), 1u);
  ShardModel child_model = model_;
  child_model.Truncate(70);
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);
}

TEST_F(ShareTest, AppendToChildCopiesSharedPartialBlock) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 100, 1, Threshold(0.5f)).ok());
  Shard child(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 70).ok());
  ShardModel child_model = model_;
  child_model.Truncate(70);
  const BlockId shared_last = parent.blocks()[4];

  // 70 % 16 = 6 rows held in the shared block 4: the child copies it before writing.
  ASSERT_TRUE(fx_.Append(child, child_model, 5, 9, Threshold(0.5f)).ok());
  EXPECT_EQ(fx_.pool->blocks_in_use(), 8u);
  EXPECT_NE(child.blocks()[4], shared_last);
  EXPECT_EQ(fx_.pool->refcount(shared_last), 1u);
  EXPECT_EQ(fx_.pool->refcount(child.blocks()[4]), 1u);
  for (size_t b = 0; b < 4; ++b) EXPECT_EQ(fx_.pool->refcount(parent.blocks()[b]), 2u);
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);  // the parent's rows 70..79 were not overwritten

  // More appends to the child: whole new blocks, the parent stays intact.
  ASSERT_TRUE(fx_.Append(child, child_model, 40, 10, Threshold(0.5f)).ok());
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);
}

TEST_F(ShareTest, AppendToParentDoesNotChangeChild) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 70, 1, kAll).ok());
  Shard child(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 70).ok());
  const ShardModel child_model = model_;
  const BlockId shared_last = parent.blocks()[4];
  ASSERT_TRUE(fx_.Append(parent, model_, 30, 2, kAll).ok());
  EXPECT_NE(parent.blocks()[4], shared_last);  // the parent copied on write
  EXPECT_EQ(child.blocks()[4], shared_last);
  EXPECT_EQ(fx_.pool->refcount(shared_last), 1u);
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);
}

TEST_F(ShareTest, BlockAlignedPrefixNeedsNoCopy) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 64, 1, Threshold(0.5f)).ok());
  Shard child(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 64).ok());
  ShardModel child_model = model_;
  ASSERT_TRUE(fx_.Append(child, child_model, 3, 2, Threshold(0.5f)).ok());
  EXPECT_EQ(fx_.pool->blocks_in_use(), 5u);  // 4 shared + 1 new
  for (size_t b = 0; b < 4; ++b) EXPECT_EQ(fx_.pool->refcount(parent.blocks()[b]), 2u);
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);
}

TEST_F(ShareTest, DroppingEitherSideKeepsTheOtherIntact) {
  auto parent = std::make_unique<Shard>(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(*parent, model_, 50, 1, Threshold(0.5f)).ok());
  auto child = std::make_unique<Shard>(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child->ShareFrom(*parent, 40).ok());
  ShardModel child_model = model_;
  child_model.Truncate(40);
  parent.reset();
  EXPECT_EQ(fx_.pool->blocks_in_use(), 3u);
  ExpectShardMatches(*child, child_model);
  // Now the sole owner: it writes its partial block in place.
  const BlockId last = child->blocks()[2];
  ASSERT_TRUE(fx_.Append(*child, child_model, 4, 2, Threshold(0.5f)).ok());
  EXPECT_EQ(child->blocks()[2], last);
  ExpectShardMatches(*child, child_model);
  child.reset();
  EXPECT_EQ(fx_.pool->blocks_in_use(), 0u);
  EXPECT_EQ(fx_.budget.used(), 0u);
}

TEST_F(ShareTest, TruncateChildOnlyDropsItsReferences) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 64, 1, Threshold(0.5f)).ok());
  Shard child(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 64).ok());
  child.Truncate(20);
  ShardModel child_model = model_;
  child_model.Truncate(20);
  EXPECT_EQ(fx_.pool->blocks_in_use(), 4u);
  EXPECT_EQ(fx_.pool->refcount(parent.blocks()[0]), 2u);
  EXPECT_EQ(fx_.pool->refcount(parent.blocks()[1]), 2u);
  EXPECT_EQ(fx_.pool->refcount(parent.blocks()[2]), 1u);
  ExpectShardMatches(child, child_model);
  ExpectShardMatches(parent, model_);
}

TEST_F(ShareTest, CopyOnWriteOutOfBlocksChangesNothing) {
  ShardFixture fx(f_, uint64_t{1} << 30, /*max_blocks=*/2);
  ShardModel model(f_);
  Shard parent(fx.pool.get(), &fx.budget);
  ASSERT_TRUE(fx.Append(parent, model, 20, 1, kAll).ok());  // 2 blocks, pool full
  Shard child(fx.pool.get(), &fx.budget);
  ASSERT_TRUE(child.ShareFrom(parent, 20).ok());
  ShardModel child_model = model;
  const uint64_t used = fx.budget.used();
  EXPECT_EQ(fx.Append(child, child_model, 1, 2, kAll).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(child.blocks()[1], parent.blocks()[1]);
  EXPECT_EQ(fx.pool->refcount(parent.blocks()[1]), 2u);
  EXPECT_EQ(fx.budget.used(), used);
  ExpectShardMatches(child, child_model);
}

TEST_F(ShareTest, ShareFromErrors) {
  Shard parent(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(fx_.Append(parent, model_, 30, 1, kAll).ok());
  Shard child(fx_.pool.get(), &fx_.budget);
  absl::Status s = child.ShareFrom(parent, 31);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("31"), std::string::npos) << s;
  EXPECT_EQ(child.held(), 0u);
  ShardModel child_model(f_);
  ASSERT_TRUE(fx_.Append(child, child_model, 1, 2, kAll).ok());
  EXPECT_EQ(child.ShareFrom(parent, 10).code(), absl::StatusCode::kFailedPrecondition);
  ExpectShardMatches(child, child_model);

  ShardFixture other(f_);
  Shard stranger(other.pool.get(), &other.budget);
  EXPECT_EQ(stranger.ShareFrom(parent, 10).code(), absl::StatusCode::kInvalidArgument);
  Shard empty(fx_.pool.get(), &fx_.budget);
  ASSERT_TRUE(empty.ShareFrom(parent, 0).ok());
  EXPECT_EQ(empty.held(), 0u);
  EXPECT_TRUE(empty.blocks().empty());
}

}  // namespace
}  // namespace tandem::kv_store
