// Shard migration in the store: KvStore::Reshard (adding empty shards, dropping owned ones,
// validation, the budget and block references given back), the import path with explicit
// selection flags (Shard::AppendWithSelection, KvStore::Append with `selected`) and the export
// path (Shard::ReadEntries), checked bit for bit against the data appended.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kv_test_util.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::kv_store {
namespace {

using testing::ExpectShardMatches;
using testing::MakeMaw;
using testing::MakeRows;
using testing::ShardModel;

SessionOptions Opts(uint32_t layers, uint32_t kv_heads, KvDType dtype = KvDType::kF32,
                    uint32_t block_tokens = 16, float beta = 0.0f) {
  SessionOptions o;
  o.geometry = Geometry{layers, kv_heads * 2, kv_heads, 64};
  o.block_tokens = block_tokens;
  o.dtype = dtype;
  o.beta = beta;
  return o;
}

std::vector<uint32_t> Heads(const Session& s, uint32_t layer) {
  auto heads = s.owned_kv_heads(layer);
  return {heads.begin(), heads.end()};
}

// Appends n entries to one kv head of `layer` (MAW around beta / 64 so about 3/4 are selected
// with window 64) and mirrors them into `model`.
void AppendOne(KvStore& store, Session& s, uint32_t layer, uint32_t head, uint32_t n, uint32_t seed,
               ShardModel* model) {
  const BlockFormat& f = s.format();
  const auto k = MakeRows(f.dtype, n, f.head_dim, seed);
  const auto v = MakeRows(f.dtype, n, f.head_dim, seed + 500);
  const float threshold = s.beta() / 64;
  const auto maw = MakeMaw(n, threshold == 0 ? 1.0f : threshold, seed);
  const uint32_t heads[] = {head};
  auto stats = store.Append(s, layer, heads, k.data(), v.data(), maw.data(), n, 64);
  ASSERT_TRUE(stats.ok()) << stats.status();
  if (model != nullptr) {
    model->Append(k, v, maw, SelectRule{s.beta() == 0, threshold});
  }
}

// ---------------------------------------------------------------------------------------------
// KvStore::Reshard

TEST(ReshardTest, AddAndDropUpdateOwnedHeadsAndReturnTheBudgetExactly) {
  KvStore store({.capacity_bytes = 1 << 26});
  SessionOptions o = Opts(3, 4, KvDType::kBf16, 16, /*beta=*/1.0f);
  o.shards = {{0, 0}, {0, 1}, {1, 2}};
  auto opened = store.OpenSession("s", o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Session& s = **opened;
  const BlockFormat f = s.format();
  ShardModel m00(f), m12(f);
  AppendOne(store, s, 0, 0, 40, 1, &m00);
  AppendOne(store, s, 0, 1, 53, 2, nullptr);  // 4 blocks
  AppendOne(store, s, 1, 2, 17, 3, &m12);
  const Shard* dropped_shard = s.shard(0, 1);
  ASSERT_NE(dropped_shard, nullptr);
  ASSERT_EQ(dropped_shard->blocks().size(), 4u);
  const uint64_t dropped_bytes = 4 * f.block_bytes() + dropped_shard->selected_capacity_bytes();
  ASSERT_GT(dropped_shard->selected_capacity_bytes(), 0u);
  const StoreStats before = store.Stats();

  const ShardKey add[] = {{2, 3}, {0, 2}};
  const ShardKey drop[] = {{0, 1}};
  auto r = store.Reshard(s, add, drop);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_released, 4u);
  EXPECT_EQ(r->shards, 4u);
  EXPECT_EQ(s.num_shards(), 4u);
  EXPECT_EQ(s.shard_keys(), (std::vector<ShardKey>{{0, 0}, {0, 2}, {1, 2}, {2, 3}}));
  EXPECT_EQ(Heads(s, 0), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(Heads(s, 1), (std::vector<uint32_t>{2}));
  EXPECT_EQ(Heads(s, 2), (std::vector<uint32_t>{3}));
  EXPECT_EQ(s.shard(0, 1), nullptr);
  ASSERT_NE(s.shard(0, 2), nullptr);
  EXPECT_EQ(s.shard(0, 2)->held(), 0u);
  EXPECT_EQ(s.shard(2, 3)->held(), 0u);
  // Untouched shards keep their entries.
  ExpectShardMatches(*s.shard(0, 0), m00);
  ExpectShardMatches(*s.shard(1, 2), m12);

  const StoreStats after = store.Stats();
  EXPECT_EQ(before.used_bytes - after.used_bytes, dropped_bytes);
  EXPECT_EQ(store.budget().used(), after.used_bytes);
  EXPECT_EQ(before.blocks_in_use - after.blocks_in_use, 4u);
  EXPECT_EQ(before.stored_bytes - after.stored_bytes, 53 * f.entry_bytes());

  // The new set is what Append checks against.
  ShardModel m02(f);
  AppendOne(store, s, 0, 2, 20, 4, &m02);
  ExpectShardMatches(*s.shard(0, 2), m02);
  const auto k = MakeRows(f.dtype, 4, f.head_dim, 9);
  const std::vector<float> maw(4, 1.0f);
  const uint32_t gone[] = {1};
  EXPECT_EQ(store.Append(s, 0, gone, k.data(), k.data(), maw.data(), 4, 64).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Dropping everything leaves an open session that owns nothing and holds no memory.
  const std::vector<ShardKey> all = s.shard_keys();
  r = store.Reshard(s, {}, all);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->shards, 0u);
  EXPECT_EQ(r->blocks_released, 3u + 2u + 2u);  // 40, 17 and 20 entries in blocks of 16
  EXPECT_FALSE(s.closed());
  for (uint32_t layer = 0; layer < 3; ++layer) EXPECT_TRUE(Heads(s, layer).empty());
  EXPECT_EQ(store.budget().used(), 0u);
  EXPECT_EQ(store.Stats().blocks_in_use, 0u);
  EXPECT_EQ(store.Stats().sessions, 1u);
  ASSERT_TRUE(store.Find("s").ok());
}

TEST(ReshardTest, ReaddedShardIsANewShard) {
  KvStore store({.capacity_bytes = 1 << 24});
  auto s = store.OpenSession("s", Opts(1, 2));
  ASSERT_TRUE(s.ok());
  AppendOne(store, **s, 0, 1, 30, 1, nullptr);
  const uint64_t serial = (*s)->shard(0, 1)->serial();
  const ShardKey key[] = {{0, 1}};
  ASSERT_TRUE(store.Reshard(**s, {}, key).ok());
  ASSERT_TRUE(store.Reshard(**s, key, {}).ok());
  EXPECT_NE((*s)->shard(0, 1)->serial(), serial);
  EXPECT_NE((*s)->shard(0, 1)->serial(), (*s)->shard(0, 0)->serial());
  EXPECT_EQ((*s)->shard(0, 1)->held(), 0u);
  EXPECT_EQ(store.Stats().blocks_in_use, 0u);
}

TEST(ReshardTest, InvalidRequestsChangeNothing) {
  KvStore store({.capacity_bytes = 1 << 24});
  SessionOptions o = Opts(2, 3);
  o.shards = {{0, 0}, {0, 1}, {1, 2}};
  auto opened = store.OpenSession("s", o);
  ASSERT_TRUE(opened.ok());
  Session& s = **opened;
  AppendOne(store, s, 0, 1, 25, 1, nullptr);
  const std::vector<ShardKey> keys_before = s.shard_keys();
  const uint64_t used_before = store.budget().used();

  struct Case {
    std::vector<ShardKey> add, drop;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{{2, 0}}, {}, "layer 2"},                       // add: layer out of range
      {{{1, 3}}, {}, "kv_head 3"},                     // add: kv head out of range
      {{{1, 0}, {1, 0}}, {}, "listed twice"},          // add: duplicate
      {{{0, 1}}, {}, "already owns"},                  // add: owned
      {{}, {{1, 1}}, "does not own"},                  // drop: not owned
      {{}, {{0, 0}, {0, 0}}, "listed twice"},          // drop: duplicate
      {{{0, 2}}, {{0, 2}}, "both added and dropped"},  // in both lists (not owned)
      {{{0, 1}}, {{0, 1}}, "both added and dropped"},  // in both lists (owned)
      {{{1, 0}, {5, 5}}, {{0, 1}}, "layer 5"},         // a valid drop with an invalid add
      {{{1, 0}}, {{0, 1}, {1, 1}}, "does not own"},    // a valid add with an invalid drop
  };
  for (const Case& c : cases) {
    auto r = store.Reshard(s, c.add, c.drop);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
    EXPECT_EQ(s.shard_keys(), keys_before) << c.message;
    EXPECT_EQ(store.budget().used(), used_before) << c.message;
    EXPECT_EQ(s.shard(0, 1)->held(), 25u) << c.message;
  }
  // Session-level calls check the same way.
  const ShardKey owned[] = {{0, 0}};
  EXPECT_EQ(s.AddShards(owned).code(), absl::StatusCode::kInvalidArgument);
  const ShardKey missing[] = {{1, 0}};
  EXPECT_EQ(s.DropShards(missing).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.shard_keys(), keys_before);

  // A closed session: NOT_FOUND.
  std::shared_ptr<Session> handle = *opened;
  ASSERT_TRUE(store.CloseSession("s").ok());
  EXPECT_TRUE(handle->closed());
  EXPECT_EQ(store.Reshard(*handle, missing, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Reshard(*handle, {}, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(handle->num_shards(), 0u);
}

// Dropping a fork's shard gives back only what was the child's: the prefix blocks it shared
// stay with the parent (their reference count goes back to 1).
TEST(ReshardTest, DroppingAForkedShardKeepsTheParentsBlocks) {
  KvStore store({.capacity_bytes = 1 << 26});
  auto p = store.OpenSession("parent", Opts(1, 2, KvDType::kBf16, 16, 0.5f));
  ASSERT_TRUE(p.ok());
  const BlockFormat f = (*p)->format();
  ShardModel parent_model(f);
  AppendOne(store, **p, 0, 0, 100, 1, &parent_model);  // 7 blocks
  AppendOne(store, **p, 0, 1, 100, 9, nullptr);        // 7 blocks
  auto c = store.ForkSession("child", Opts(1, 2, KvDType::kBf16, 16, 0.5f), "parent", 70);
  ASSERT_TRUE(c.ok()) << c.status();
  AppendOne(store, **c, 0, 0, 5, 2, nullptr);  // copies the partial 5th block on write
  ASSERT_EQ(store.Stats().blocks_in_use, 15u);
  const Shard& child_shard = *(*c)->shard(0, 0);
  const uint64_t child_selected = child_shard.selected_capacity_bytes();
  const uint64_t used = store.budget().used();
  const BlockPool& pool = *child_shard.pool();
  const BlockId shared = (*p)->shard(0, 0)->blocks()[0];
  EXPECT_EQ(pool.refcount(shared), 2u);

  const ShardKey key[] = {{0, 0}};
  auto r = store.Reshard(**c, {}, key);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_released, 5u);  // 4 shared + 1 private copy
  EXPECT_EQ(r->shards, 1u);
  EXPECT_EQ(store.Stats().blocks_in_use, 14u);
  EXPECT_EQ(pool.refcount(shared), 1u);
  EXPECT_EQ(used - store.budget().used(), f.block_bytes() + child_selected);
  ExpectShardMatches(*(*p)->shard(0, 0), parent_model);
  // Fork now needs the parent's shard set: the child's differs.
  EXPECT_EQ(
      store.ForkSession("grandchild", Opts(1, 2, KvDType::kBf16, 16), "child", 0).status().code(),
      absl::StatusCode::kInvalidArgument);
  SessionOptions one = Opts(1, 2, KvDType::kBf16, 16);
  one.shards = {{0, 1}};
  EXPECT_TRUE(store.ForkSession("grandchild", one, "child", 0).ok());
}

// ---------------------------------------------------------------------------------------------
// Import with selection flags, export

// Exports [first, first + n) of `src` in chunks of `chunk` and imports them into `dst` with
// their flags, in chunks of the same size.
void Migrate(const Shard& src, Shard& dst, uint64_t first, uint64_t n, uint64_t chunk) {
  const size_t row = src.format().row_bytes();
  for (uint64_t done = 0; done < n;) {
    const uint64_t c = std::min(chunk, n - done);
    std::vector<std::byte> k(c * row), v(c * row);
    std::vector<float> maw(c);
    std::vector<uint8_t> flags(c, 7);
    ASSERT_TRUE(
        src.ReadEntries(first + done, c, k.data(), v.data(), maw.data(), flags.data()).ok());
    for (uint8_t flag : flags) ASSERT_LE(flag, 1);
    auto selected = dst.AppendWithSelection(k.data(), v.data(), maw.data(), flags.data(), c);
    ASSERT_TRUE(selected.ok()) << selected.status();
    EXPECT_EQ(*selected, static_cast<uint64_t>(std::count(flags.begin(), flags.end(), 1)));
    done += c;
  }
}

// Model of entries [first, first + n) of `model`.
ShardModel Slice(const ShardModel& model, uint64_t first, uint64_t n) {
  const size_t row = model.format.row_bytes();
  ShardModel out(model.format);
  out.k.assign(model.k.begin() + first * row, model.k.begin() + (first + n) * row);
  out.v.assign(model.v.begin() + first * row, model.v.begin() + (first + n) * row);
  out.maw.assign(model.maw.begin() + first, model.maw.begin() + first + n);
  out.selected.assign(model.selected.begin() + first, model.selected.begin() + first + n);
  return out;
}

class ShardMigrationTest : public ::testing::TestWithParam<KvDType> {
 protected:
  void SetUp() override {
    const BlockFormat f{16, 64, GetParam()};
    auto p = BlockPool::Create(f, 1024, &budget_);
    ASSERT_TRUE(p.ok());
    pool_ = std::move(*p);
  }

  // Appends n entries (MAW rule with threshold 0.25) to shard and model.
  void Fill(Shard& shard, ShardModel& model, uint64_t n, uint32_t seed) {
    const BlockFormat& f = pool_->format();
    const auto k = MakeRows(f.dtype, n, f.head_dim, seed);
    const auto v = MakeRows(f.dtype, n, f.head_dim, seed + 77);
    const auto maw = MakeMaw(n, 0.25f, seed);
    const SelectRule rule{false, 0.25f};
    ASSERT_TRUE(shard.Append(k.data(), v.data(), maw.data(), n, rule).ok());
    model.Append(k, v, maw, rule);
  }

  MemoryBudget budget_{1 << 26};
  std::unique_ptr<BlockPool> pool_;
};

TEST_P(ShardMigrationTest, ExportImportRoundTripIsBitIdenticalWithChangedFlags) {
  const BlockFormat& f = pool_->format();
  Shard src(pool_.get(), &budget_);
  ShardModel model(f);
  Fill(src, model, 45, 1);
  Fill(src, model, 38, 2);  // 83 entries: 5 full blocks and 3 rows
  // A Reselect-like change of the flags, unrelated to the MAW rule: the import must carry
  // these flags, not recompute them.
  std::vector<uint8_t> flags(model.held());
  for (size_t i = 0; i < flags.size(); ++i) flags[i] = (i * 5 + 1) % 3 == 0;
  ASSERT_TRUE(src.SetSelection(flags).ok());
  model.selected = flags;
  ExpectShardMatches(src, model);

  for (uint64_t chunk : {uint64_t{1}, uint64_t{7}, uint64_t{16}, uint64_t{83}}) {
    Shard dst(pool_.get(), &budget_);
    Migrate(src, dst, 0, model.held(), chunk);
    ExpectShardMatches(dst, model);
  }
  // A middle range crossing block boundaries, appended after existing entries of the target.
  Shard dst(pool_.get(), &budget_);
  ShardModel dst_model(f);
  Fill(dst, dst_model, 9, 3);
  Migrate(src, dst, 13, 50, 11);
  const ShardModel part = Slice(model, 13, 50);
  dst_model.k.insert(dst_model.k.end(), part.k.begin(), part.k.end());
  dst_model.v.insert(dst_model.v.end(), part.v.begin(), part.v.end());
  dst_model.maw.insert(dst_model.maw.end(), part.maw.begin(), part.maw.end());
  dst_model.selected.insert(dst_model.selected.end(), part.selected.begin(), part.selected.end());
  ExpectShardMatches(dst, dst_model);
}

TEST_P(ShardMigrationTest, ExportOfAForkedShardCrossesTheSharedPrefix) {
  const BlockFormat& f = pool_->format();
  Shard parent(pool_.get(), &budget_);
  ShardModel parent_model(f);
  Fill(parent, parent_model, 60, 4);
  Shard child(pool_.get(), &budget_);
  ASSERT_TRUE(child.ShareFrom(parent, 37).ok());
  ShardModel child_model = Slice(parent_model, 0, 37);
  Fill(child, child_model, 30, 5);  // copy-on-write of block 2, then fresh blocks
  ASSERT_EQ(pool_->refcount(child.blocks()[0]), 2u);
  ExpectShardMatches(child, child_model);

  Shard whole(pool_.get(), &budget_);
  Migrate(child, whole, 0, child.held(), 10);
  ExpectShardMatches(whole, child_model);
  // The range [30, 50): shared rows, then the child's own.
  Shard part(pool_.get(), &budget_);
  Migrate(child, part, 30, 20, 6);
  ExpectShardMatches(part, Slice(child_model, 30, 20));
  // The migrated copies own their blocks: the parent's stay shared with the child only.
  EXPECT_EQ(pool_->refcount(child.blocks()[0]), 2u);
  EXPECT_EQ(pool_->refcount(whole.blocks()[0]), 1u);
}

TEST_P(ShardMigrationTest, ReadEntriesChecksTheRange) {
  Shard shard(pool_.get(), &budget_);
  ShardModel model(pool_->format());
  Fill(shard, model, 20, 6);
  std::vector<std::byte> k(64 * 64 * 4), v(64 * 64 * 4);
  std::vector<float> maw(64);
  std::vector<uint8_t> flags(64);
  EXPECT_EQ(shard.ReadEntries(0, 21, k.data(), v.data(), maw.data(), flags.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(shard.ReadEntries(21, 0, k.data(), v.data(), maw.data(), flags.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(
      shard.ReadEntries(15, ~uint64_t{0}, k.data(), v.data(), maw.data(), flags.data()).code(),
      absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(shard.ReadEntries(20, 0, nullptr, nullptr, nullptr, nullptr).ok());
  ASSERT_TRUE(shard.ReadEntries(19, 1, k.data(), v.data(), maw.data(), flags.data()).ok());
  EXPECT_EQ(maw[0], model.maw[19]);
  EXPECT_EQ(flags[0], model.selected[19]);
  EXPECT_EQ(std::memcmp(k.data(), model.k.data() + 19 * pool_->format().row_bytes(),
                        pool_->format().row_bytes()),
            0);
}

INSTANTIATE_TEST_SUITE_P(DTypes, ShardMigrationTest,
                         ::testing::Values(KvDType::kF32, KvDType::kBf16));

TEST(KvStoreImportTest, AppendWithFlagsIgnoresMawAndWindow) {
  KvStore store({.capacity_bytes = 1 << 24});
  // beta 1e9: the MAW rule would select nothing.
  auto opened = store.OpenSession("s", Opts(1, 2, KvDType::kF32, 16, 1e9f));
  ASSERT_TRUE(opened.ok());
  Session& s = **opened;
  const BlockFormat f = s.format();
  const uint32_t n = 21;
  auto k = MakeRows(f.dtype, 2 * n, f.head_dim, 1);
  auto v = MakeRows(f.dtype, 2 * n, f.head_dim, 2);
  std::vector<float> maw(2 * n, 0.0f);
  std::vector<uint8_t> flags(2 * n);
  for (size_t i = 0; i < flags.size(); ++i) flags[i] = i % 4 != 1;
  const uint32_t heads[] = {1, 0};
  auto stats = store.Append(s, 0, heads, k.data(), v.data(), maw.data(), n, /*window=*/0, flags);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->entries_appended, 2u * n);
  EXPECT_EQ(stats->entries_selected,
            static_cast<uint64_t>(std::count(flags.begin(), flags.end(), 1)));
  for (uint32_t h = 0; h < 2; ++h) {
    const Shard& shard = *s.shard(0, heads[h]);
    ShardModel model(f);
    model.k.assign(k.begin() + h * n * f.row_bytes(), k.begin() + (h + 1) * n * f.row_bytes());
    model.v.assign(v.begin() + h * n * f.row_bytes(), v.begin() + (h + 1) * n * f.row_bytes());
    model.maw.assign(n, 0.0f);
    model.selected.assign(flags.begin() + h * n, flags.begin() + (h + 1) * n);
    ExpectShardMatches(shard, model);
  }

  // Bad flags: wrong count, a value other than 0/1. Nothing is appended.
  const std::vector<uint8_t> short_flags(2 * n - 1, 1);
  EXPECT_EQ(
      store.Append(s, 0, heads, k.data(), v.data(), maw.data(), n, 0, short_flags).status().code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> two = flags;
  two[n + 3] = 2;
  auto bad = store.Append(s, 0, heads, k.data(), v.data(), maw.data(), n, 0, two);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("selected[1][3]"), std::string::npos) << bad.status();
  // Without flags window_entries 0 stays an error.
  EXPECT_EQ(store.Append(s, 0, heads, k.data(), v.data(), maw.data(), n, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.shard(0, 0)->held(), n);
  EXPECT_EQ(s.shard(0, 1)->held(), n);
}

}  // namespace
}  // namespace tandem::kv_store
