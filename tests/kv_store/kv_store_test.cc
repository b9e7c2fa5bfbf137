// KvStore: sessions, option and input validation, multi-head append, forks, close, stats.
#include "tandem/kv_store/kv_store.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kv_test_util.h"

namespace tandem::kv_store {
namespace {

using testing::ExpectShardMatches;
using testing::MakeMaw;
using testing::MakeRows;
using testing::ShardModel;

SessionOptions Opts(uint32_t layers = 2, uint32_t kv_heads = 2, uint32_t head_dim = 64,
                    KvDType dtype = KvDType::kF32, uint32_t block_tokens = 16, float beta = 0.0f) {
  SessionOptions o;
  o.geometry = Geometry{layers, kv_heads * 4, kv_heads, head_dim};
  o.block_tokens = block_tokens;
  o.dtype = dtype;
  o.beta = beta;
  return o;
}

// The inputs of one KvStore::Append: k, v [heads, n, D], maw [heads, n].
struct AppendInput {
  std::vector<std::byte> k, v;
  std::vector<float> maw;

  // Head h's slice as separate host arrays (for a ShardModel).
  std::vector<std::byte> K(size_t h, uint32_t n, size_t row) const {
    return {k.begin() + h * n * row, k.begin() + (h + 1) * n * row};
  }
  std::vector<std::byte> V(size_t h, uint32_t n, size_t row) const {
    return {v.begin() + h * n * row, v.begin() + (h + 1) * n * row};
  }
  std::vector<float> Maw(size_t h, uint32_t n) const {
    return {maw.begin() + h * n, maw.begin() + (h + 1) * n};
  }
};

AppendInput MakeInput(const BlockFormat& f, size_t heads, uint32_t n, uint32_t seed,
                      float maw_scale = 1.0f) {
  AppendInput in;
  for (size_t h = 0; h < heads; ++h) {
    auto k = MakeRows(f.dtype, n, f.head_dim, seed + 100 * h);
    auto v = MakeRows(f.dtype, n, f.head_dim, seed + 100 * h + 50);
    auto maw = MakeMaw(n, maw_scale, seed + h);
    in.k.insert(in.k.end(), k.begin(), k.end());
    in.v.insert(in.v.end(), v.begin(), v.end());
    in.maw.insert(in.maw.end(), maw.begin(), maw.end());
  }
  return in;
}

absl::StatusOr<AppendStats> DoAppend(KvStore& store, Session& s, uint32_t layer,
                                     std::vector<uint32_t> heads, const AppendInput& in, uint32_t n,
                                     uint32_t window = 64) {
  return store.Append(s, layer, heads, in.k.data(), in.v.data(), in.maw.data(), n, window);
}

// Appends to `heads` of `layer` and mirrors it into models[head].
void AppendTracked(KvStore& store, Session& s, uint32_t layer, std::vector<uint32_t> heads,
                   uint32_t n, uint32_t seed, std::vector<ShardModel>& models,
                   SelectRule rule = SelectRule{}) {
  const BlockFormat& f = s.format();
  AppendInput in = MakeInput(f, heads.size(), n, seed);
  auto stats = DoAppend(store, s, layer, heads, in, n);
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (size_t h = 0; h < heads.size(); ++h) {
    models[heads[h]].Append(in.K(h, n, f.row_bytes()), in.V(h, n, f.row_bytes()), in.Maw(h, n),
                            rule);
  }
}

TEST(KvStoreTest, OpenSessionNormalisesOptions) {
  KvStore store({.capacity_bytes = 1 << 24, .default_block_tokens = 32});
  auto s = store.OpenSession("a", Opts(3, 4, 64, KvDType::kBf16, /*block_tokens=*/0));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->options().block_tokens, 32u);
  EXPECT_EQ((*s)->format(), (BlockFormat{32, 64, KvDType::kBf16}));
  EXPECT_EQ((*s)->num_shards(), 12u);
  EXPECT_EQ((*s)->shard_keys().size(), 12u);
  EXPECT_TRUE((*s)->options().shards.empty());  // moved into the shard table
  for (uint32_t layer = 0; layer < 3; ++layer) {
    auto heads = (*s)->owned_kv_heads(layer);
    EXPECT_EQ(std::vector<uint32_t>(heads.begin(), heads.end()),
              (std::vector<uint32_t>{0, 1, 2, 3}));
    for (uint32_t h = 0; h < 4; ++h) EXPECT_NE((*s)->shard(layer, h), nullptr);
  }
  EXPECT_TRUE((*s)->owned_kv_heads(3).empty());
  EXPECT_EQ((*s)->shard(3, 0), nullptr);
  EXPECT_EQ((*s)->shard(0, 4), nullptr);

  SessionOptions o = Opts(3, 4);
  o.shards = {{2, 3}, {0, 1}, {2, 0}};
  auto t = store.OpenSession("b", o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->shard_keys(), (std::vector<ShardKey>{{0, 1}, {2, 0}, {2, 3}}));
  EXPECT_EQ((*t)->num_shards(), 3u);
  EXPECT_EQ(std::vector<uint32_t>((*t)->owned_kv_heads(2).begin(), (*t)->owned_kv_heads(2).end()),
            (std::vector<uint32_t>{0, 3}));
  EXPECT_TRUE((*t)->owned_kv_heads(1).empty());
  EXPECT_NE((*t)->shard(0, 1), nullptr);
  EXPECT_EQ((*t)->shard(0, 0), nullptr);
  EXPECT_NE((*t)->shard(0, 1), (*t)->shard(2, 0));
  auto found = store.Find("b");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->get(), t->get());
  EXPECT_EQ(store.Stats().sessions, 2u);
}

TEST(KvStoreTest, SessionIdValidation) {
  KvStore store({});
  for (const std::string& bad : {std::string(), std::string(129, 'a'), std::string("a b"),
                                 std::string("a/b"), std::string("é"), std::string("x\n")}) {
    auto s = store.OpenSession(bad, Opts());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_TRUE(store.OpenSession(std::string(128, 'z'), Opts()).ok());
  EXPECT_TRUE(store.OpenSession("Az09._:-", Opts()).ok());
  EXPECT_EQ(store.Stats().sessions, 2u);
}

TEST(KvStoreTest, DuplicateUnknownAndSessionLimit) {
  KvStore store({.capacity_bytes = 1 << 24, .default_block_tokens = 64, .max_sessions = 2});
  ASSERT_TRUE(store.OpenSession("a", Opts()).ok());
  EXPECT_EQ(store.OpenSession("a", Opts()).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(store.OpenSession("b", Opts()).ok());
  auto c = store.OpenSession("c", Opts());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("max_sessions 2"), std::string::npos) << c.status();
  EXPECT_EQ(store.Find("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.CloseSession("c").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store.CloseSession("a").ok());
  EXPECT_EQ(store.CloseSession("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.OpenSession("c", Opts()).ok());
}

TEST(KvStoreTest, BadOptionsAreInvalidArgument) {
  KvStore store({});
  auto expect_invalid = [&](SessionOptions o, const std::string& field) {
    auto s = store.OpenSession("x", std::move(o));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.status().message().find(field), std::string::npos) << s.status();
  };
  SessionOptions o = Opts();
  o.geometry.num_layers = 0;
  expect_invalid(o, "num_layers");
  o = Opts();
  o.geometry.num_kv_heads = 1025;
  expect_invalid(o, "num_kv_heads");
  o = Opts();
  o.geometry.num_q_heads = 7;  // not a multiple of 2
  expect_invalid(o, "num_q_heads");
  o = Opts();
  o.geometry.head_dim = 100;
  expect_invalid(o, "head_dim");
  expect_invalid(Opts(2, 2, 64, KvDType::kF32, 8), "block_tokens");
  expect_invalid(Opts(2, 2, 64, KvDType::kF32, 512), "block_tokens");
  expect_invalid(Opts(2, 2, 64, KvDType::kF32, 16, -1.0f), "beta");
  expect_invalid(Opts(2, 2, 64, KvDType::kF32, 16, std::nanf("")), "beta");
  expect_invalid(Opts(2, 2, 64, KvDType::kF32, 16, std::numeric_limits<float>::infinity()), "beta");
  o = Opts();
  o.shards = {{0, 0}, {2, 0}};
  expect_invalid(o, "layer 2");
  o = Opts();
  o.shards = {{0, 2}};
  expect_invalid(o, "kv_head 2");
  o = Opts();
  o.shards = {{1, 1}, {0, 0}, {1, 1}};
  expect_invalid(o, "listed twice");
  KvStore bad_default({.capacity_bytes = 1 << 20, .default_block_tokens = 7});
  EXPECT_EQ(bad_default.OpenSession("x", Opts(2, 2, 64, KvDType::kF32, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Stats().sessions, 0u);
}

TEST(KvStoreTest, AppendValidationRejectsBadInputAndAppendsNothing) {
  KvStore store({});
  SessionOptions o = Opts(2, 4);
  o.shards = {{0, 0}, {0, 1}, {1, 2}};
  auto s = store.OpenSession("s", o);
  ASSERT_TRUE(s.ok());
  Session& session = **s;
  const BlockFormat& f = session.format();
  const AppendInput in = MakeInput(f, 2, 8, 1);
  auto code = [&](uint32_t layer, std::vector<uint32_t> heads, uint32_t n, uint32_t window,
                  const AppendInput& input) {
    return DoAppend(store, session, layer, heads, input, n, window).status().code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(2, {0, 1}, 8, 64, in), kInvalid);  // layer out of range
  EXPECT_EQ(code(0, {0, 4}, 8, 64, in), kInvalid);  // kv head out of range
  EXPECT_EQ(code(0, {1, 1}, 8, 64, in), kInvalid);  // duplicate head
  EXPECT_EQ(code(0, {0, 2}, 8, 64, in), kInvalid);  // head 2 of layer 0 is not owned
  EXPECT_EQ(code(1, {2, 0}, 8, 64, in), kInvalid);  // head 0 of layer 1 is not owned
  EXPECT_EQ(code(0, {}, 8, 64, in), kInvalid);      // no heads
  EXPECT_EQ(code(0, {0, 1}, 0, 64, in), kInvalid);  // n == 0
  EXPECT_EQ(code(0, {0, 1}, 8, 0, in), kInvalid);   // window_entries == 0
  const AppendInput big = MakeInput(f, 1, 65537, 1);
  EXPECT_EQ(code(0, {0}, 65537, 64, big), kInvalid);  // n > 65536
  for (float bad : {std::nanf(""), -0.5f, std::numeric_limits<float>::infinity()}) {
    AppendInput nan_in = in;
    nan_in.maw[13] = bad;  // head 1, entry 5
    auto st = DoAppend(store, session, 0, {0, 1}, nan_in, 8);
    EXPECT_EQ(st.status().code(), kInvalid) << bad;
    EXPECT_NE(st.status().message().find("maw[1][5]"), std::string::npos) << st.status();
  }
  EXPECT_EQ(
      store.Append(session, 0, std::vector<uint32_t>{0}, nullptr, in.v.data(), in.maw.data(), 8, 64)
          .status()
          .code(),
      kInvalid);
  EXPECT_EQ(session.shard(0, 0)->held(), 0u);
  EXPECT_EQ(session.shard(0, 1)->held(), 0u);
  EXPECT_EQ(store.Stats().blocks_in_use, 0u);
  EXPECT_EQ(store.budget().used(), 0u);
  // The same input with valid arguments goes through.
  auto ok = DoAppend(store, session, 0, {0, 1}, in, 8);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->entries_appended, 16u);
}

TEST(KvStoreTest, MultiHeadAppendRoundTrip) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kBf16}) {
    KvStore store({});
    auto s = store.OpenSession("s", Opts(2, 4, 128, dtype, 64));
    ASSERT_TRUE(s.ok());
    std::vector<ShardModel> models(4, ShardModel((*s)->format()));
    AppendTracked(store, **s, 1, {3, 0, 2}, 100, 1, models);  // heads in any order
    AppendTracked(store, **s, 1, {0, 1, 2, 3}, 29, 2, models);
    for (uint32_t h = 0; h < 4; ++h) ExpectShardMatches(*(*s)->shard(1, h), models[h]);
    for (uint32_t h = 0; h < 4; ++h) EXPECT_EQ((*s)->shard(0, h)->held(), 0u);
  }
}

TEST(KvStoreTest, SelectionIsMawAboveBetaOverWindow) {
  KvStore store({});
  auto s = store.OpenSession("s", Opts(1, 1, 64, KvDType::kF32, 16, /*beta=*/2.0f));
  ASSERT_TRUE(s.ok());
  Session& session = **s;
  const BlockFormat& f = session.format();
  const float threshold = 2.0f / 100.0f;  // beta / window_entries
  AppendInput in = MakeInput(f, 1, 5, 1);
  in.maw = {0.0f, threshold, std::nextafter(threshold, 1.0f), 0.5f, 0.019f};
  auto stats = DoAppend(store, session, 0, {0}, in, 5, /*window=*/100);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->entries_appended, 5u);
  EXPECT_EQ(stats->entries_selected, 2u);
  const Shard& shard = *session.shard(0, 0);
  EXPECT_EQ(std::vector<uint8_t>(shard.selected_flags().begin(), shard.selected_flags().end()),
            (std::vector<uint8_t>{0, 0, 1, 1, 0}));
  EXPECT_EQ(testing::SelectedK(shard, 0), testing::Row(in.k, f, 2));
  EXPECT_EQ(testing::SelectedV(shard, 1), testing::Row(in.v, f, 3));

  // A larger window lowers the threshold: beta / 400 = 0.005 selects 0.019 too.
  stats = DoAppend(store, session, 0, {0}, in, 5, /*window=*/400);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->entries_selected, 4u);

  // beta == 0 (dense) selects everything, MAW 0 included.
  {
    std::unique_lock<std::shared_mutex> lock(session.mutex());
    session.set_beta(0.0f);
  }
  stats = DoAppend(store, session, 0, {0}, in, 5);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->entries_selected, 5u);
  EXPECT_EQ(shard.selected_count(), 11u);
  EXPECT_EQ(shard.held(), 15u);
}

TEST(KvStoreTest, MultiHeadAppendIsAllOrNothingWhenBudgetRunsOut) {
  const BlockFormat f{16, 64, KvDType::kF32};
  const uint64_t block = f.block_bytes();
  const uint64_t row = f.row_bytes();
  // 10 entries per head first: one block + a 10-row selected copy of K and V per head. Then 22
  // more per head need one more block and 22 more selected rows each: heads 0 and 1 fit, the
  // block of head 2 is one byte short.
  const uint64_t initial = 3 * (block + 2 * 10 * row);
  const uint64_t per_head = block + 2 * 22 * row;
  KvStore store({.capacity_bytes = initial + 2 * per_head + block - 1});
  SessionOptions o = Opts(1, 3, 64, KvDType::kF32, 16);
  auto s = store.OpenSession("s", o);
  ASSERT_TRUE(s.ok());
  std::vector<ShardModel> models(3, ShardModel(f));
  AppendTracked(store, **s, 0, {0, 1, 2}, 10, 1, models);
  ASSERT_EQ(store.budget().used(), initial);
  const StoreStats before = store.Stats();

  const AppendInput in = MakeInput(f, 3, 22, 7);
  auto failed = DoAppend(store, **s, 0, {0, 1, 2}, in, 22);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("kv_head 2"), std::string::npos) << failed.status();
  for (uint32_t h = 0; h < 3; ++h) ExpectShardMatches(*(*s)->shard(0, h), models[h]);
  const StoreStats after = store.Stats();
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(after.block_bytes_in_use, before.block_bytes_in_use);
  EXPECT_EQ(after.stored_bytes, before.stored_bytes);

  // A smaller append that fits still works afterwards.
  AppendTracked(store, **s, 0, {0, 1, 2}, 6, 9, models);
  for (uint32_t h = 0; h < 3; ++h) ExpectShardMatches(*(*s)->shard(0, h), models[h]);
}

class ForkTest : public ::testing::Test {
 protected:
  ForkTest()
      : store_({.capacity_bytes = 1 << 26}),
        f_{16, 64, KvDType::kBf16},
        parent_models_(2, ShardModel(f_)) {}

  void SetUp() override {
    auto p = store_.OpenSession("parent", Opts(1, 2, 64, KvDType::kBf16, 16));
    ASSERT_TRUE(p.ok());
    parent_ = *p;
    AppendTracked(store_, *parent_, 0, {0, 1}, 100, 1, parent_models_);  // 7 blocks per head
    ASSERT_EQ(store_.Stats().blocks_in_use, 14u);
  }

  const BlockPool& pool() const { return *parent_->shard(0, 0)->pool(); }

  KvStore store_;
  BlockFormat f_;
  std::shared_ptr<Session> parent_;
  std::vector<ShardModel> parent_models_;
};

TEST_F(ForkTest, ForkSharesBlocksAndCopiesOnWrite) {
  SessionOptions o = Opts(1, 2, 64, KvDType::kBf16, 16, /*beta=*/0.5f);  // beta may differ
  auto c = store_.ForkSession("child", o, "parent", 70);
  ASSERT_TRUE(c.ok()) << c.status();
  std::shared_ptr<Session> child = *c;
  EXPECT_EQ(child->beta(), 0.5f);
  StoreStats stats = store_.Stats();
  EXPECT_EQ(stats.blocks_in_use, 14u);  // ceil(70 / 16) = 5 blocks per head, shared
  EXPECT_EQ(stats.sessions, 2u);
  // Shared prefixes count once per shard holding them.
  EXPECT_EQ(stats.stored_bytes, 2 * (100 + 70) * f_.entry_bytes());
  std::vector<ShardModel> child_models = parent_models_;
  for (uint32_t h = 0; h < 2; ++h) {
    child_models[h].Truncate(70);
    const Shard& ps = *parent_->shard(0, h);
    const Shard& cs = *child->shard(0, h);
    ASSERT_EQ(cs.blocks().size(), 5u);
    for (size_t b = 0; b < 5; ++b) {
      EXPECT_EQ(cs.blocks()[b], ps.blocks()[b]);
      EXPECT_EQ(pool().refcount(ps.blocks()[b]), 2u);
    }
    ExpectShardMatches(cs, child_models[h]);
  }

  // Appending to the child copies its partial last block (70 % 16 = 6 rows) and leaves the
  // parent's entries 70..99 in that block untouched.
  AppendTracked(store_, *child, 0, {0}, 5, 3, child_models, SelectRule{false, 0.5f / 64});
  EXPECT_EQ(store_.Stats().blocks_in_use, 15u);
  EXPECT_NE(child->shard(0, 0)->blocks()[4], parent_->shard(0, 0)->blocks()[4]);
  EXPECT_EQ(pool().refcount(parent_->shard(0, 0)->blocks()[4]), 1u);
  EXPECT_EQ(pool().refcount(parent_->shard(0, 1)->blocks()[4]), 2u);
  for (uint32_t h = 0; h < 2; ++h) {
    ExpectShardMatches(*child->shard(0, h), child_models[h]);
    ExpectShardMatches(*parent_->shard(0, h), parent_models_[h]);
  }
}

TEST_F(ForkTest, AppendToParentDoesNotChangeChild) {
  auto c = store_.ForkSession("child", Opts(1, 2, 64, KvDType::kBf16, 16), "parent", 100);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<ShardModel> child_models = parent_models_;
  EXPECT_EQ(store_.Stats().blocks_in_use, 14u);
  AppendTracked(store_, *parent_, 0, {0, 1}, 40, 5, parent_models_);
  for (uint32_t h = 0; h < 2; ++h) {
    ExpectShardMatches(*(*c)->shard(0, h), child_models[h]);
    ExpectShardMatches(*parent_->shard(0, h), parent_models_[h]);
    EXPECT_EQ(pool().refcount((*c)->shard(0, h)->blocks()[6]), 1u);  // the parent copied it
  }
}

TEST_F(ForkTest, ForkErrors) {
  const StoreStats before = store_.Stats();
  auto code = [&](const std::string& id, SessionOptions o, const std::string& parent,
                  uint64_t prefix) {
    return store_.ForkSession(id, std::move(o), parent, prefix).status().code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const SessionOptions good = Opts(1, 2, 64, KvDType::kBf16, 16);
  EXPECT_EQ(code("c", good, "nobody", 1), absl::StatusCode::kNotFound);
  EXPECT_EQ(code("parent", good, "parent", 1), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(code("bad id", good, "parent", 1), kInvalid);
  EXPECT_EQ(code("c", good, "parent", 101), kInvalid);  // more than the parent holds
  EXPECT_EQ(code("c", Opts(1, 2, 64, KvDType::kBf16, 32), "parent", 1), kInvalid);
  EXPECT_EQ(code("c", Opts(1, 2, 64, KvDType::kF32, 16), "parent", 1), kInvalid);
  EXPECT_EQ(code("c", Opts(1, 2, 128, KvDType::kBf16, 16), "parent", 1), kInvalid);
  EXPECT_EQ(code("c", Opts(2, 2, 64, KvDType::kBf16, 16), "parent", 1), kInvalid);
  SessionOptions fewer = good;
  fewer.shards = {{0, 1}};
  EXPECT_EQ(code("c", fewer, "parent", 1), kInvalid);
  // Listing every shard explicitly equals the empty (all) list after normalisation.
  SessionOptions explicit_all = good;
  explicit_all.shards = {{0, 1}, {0, 0}};
  const StoreStats after = store_.Stats();
  EXPECT_EQ(after.sessions, before.sessions);
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  auto c = store_.ForkSession("c", explicit_all, "parent", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->shard(0, 0)->held(), 0u);
}

TEST_F(ForkTest, ClosingParentFirstThenChildFreesEverything) {
  auto c = store_.ForkSession("child", Opts(1, 2, 64, KvDType::kBf16, 16), "parent", 70);
  ASSERT_TRUE(c.ok());
  std::vector<ShardModel> child_models = parent_models_;
  for (auto& m : child_models) m.Truncate(70);
  AppendTracked(store_, **c, 0, {1}, 3, 4, child_models);  // one copied block
  EXPECT_EQ(store_.Stats().blocks_in_use, 15u);

  auto dropped = store_.CloseSession("parent");
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(*dropped, 14u);
  EXPECT_EQ(parent_->shard(0, 0), nullptr);
  // The child keeps 5 blocks per head (one of them its own copy).
  EXPECT_EQ(store_.Stats().blocks_in_use, 10u);
  for (uint32_t h = 0; h < 2; ++h) ExpectShardMatches(*(*c)->shard(0, h), child_models[h]);
  dropped = store_.CloseSession("child");
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(*dropped, 10u);
  const StoreStats stats = store_.Stats();
  EXPECT_EQ(stats.blocks_in_use, 0u);
  EXPECT_EQ(stats.used_bytes, 0u);
  EXPECT_EQ(stats.stored_bytes, 0u);
  EXPECT_EQ(stats.selected_bytes, 0u);
  EXPECT_EQ(stats.sessions, 0u);
}

TEST_F(ForkTest, ClosingChildFirstThenParentFreesEverything) {
  auto c = store_.ForkSession("child", Opts(1, 2, 64, KvDType::kBf16, 16), "parent", 70);
  ASSERT_TRUE(c.ok());
  auto g = store_.ForkSession("grandchild", Opts(1, 2, 64, KvDType::kBf16, 16), "child", 33);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(pool().refcount(parent_->shard(0, 0)->blocks()[0]), 3u);
  EXPECT_EQ(pool().refcount(parent_->shard(0, 0)->blocks()[3]), 2u);
  auto dropped = store_.CloseSession("child");
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(*dropped, 10u);
  EXPECT_EQ(store_.Stats().blocks_in_use, 14u);
  ASSERT_TRUE(store_.CloseSession("parent").ok());
  EXPECT_EQ(store_.Stats().blocks_in_use, 6u);  // ceil(33 / 16) = 3 blocks per head
  std::vector<ShardModel> models = parent_models_;
  for (uint32_t h = 0; h < 2; ++h) {
    models[h].Truncate(33);
    ExpectShardMatches(*(*g)->shard(0, h), models[h]);
  }
  ASSERT_TRUE(store_.CloseSession("grandchild").ok());
  EXPECT_EQ(store_.Stats().blocks_in_use, 0u);
  EXPECT_EQ(store_.budget().used(), 0u);
}

TEST(KvStoreTest, ClosedSessionHandleIsInert) {
  KvStore store({});
  auto s = store.OpenSession("s", Opts());
  ASSERT_TRUE(s.ok());
  std::shared_ptr<Session> session = *s;
  const AppendInput in = MakeInput(session->format(), 2, 40, 1);
  ASSERT_TRUE(DoAppend(store, *session, 1, {0, 1}, in, 40).ok());
  auto dropped = store.CloseSession("s");
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(*dropped, 6u);  // 3 blocks x 2 heads
  EXPECT_EQ(session->shard(1, 0), nullptr);
  EXPECT_EQ(session->num_shards(), 0u);
  EXPECT_TRUE(session->owned_kv_heads(1).empty());
  EXPECT_EQ(DoAppend(store, *session, 1, {0, 1}, in, 40).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store.ForkSession("f", Opts(), "s", 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.budget().used(), 0u);
  // The id can be reused.
  EXPECT_TRUE(store.OpenSession("s", Opts()).ok());
}

TEST(KvStoreTest, StatsSumPoolsAndSessions) {
  KvStore store({.capacity_bytes = 1 << 26});
  auto a = store.OpenSession("a", Opts(1, 2, 64, KvDType::kF32, 16));
  auto b = store.OpenSession("b", Opts(1, 1, 128, KvDType::kBf16, 64, /*beta=*/1.0f));
  ASSERT_TRUE(a.ok() && b.ok());
  const BlockFormat fa = (*a)->format();
  const BlockFormat fb = (*b)->format();
  ASSERT_TRUE(DoAppend(store, **a, 0, {0, 1}, MakeInput(fa, 2, 20, 1), 20).ok());
  // MAW in [0, 4/64) with threshold 1/64 selects some of b's entries.
  auto sb = DoAppend(store, **b, 0, {0}, MakeInput(fb, 1, 70, 2, 1.0f / 64), 70, 64);
  ASSERT_TRUE(sb.ok());
  EXPECT_GT(sb->entries_selected, 0u);
  EXPECT_LT(sb->entries_selected, 70u);

  const StoreStats st = store.Stats();
  EXPECT_EQ(st.capacity_bytes, uint64_t{1} << 26);
  EXPECT_EQ(st.sessions, 2u);
  EXPECT_EQ(st.blocks_in_use, 4u + 2u);
  EXPECT_EQ(st.block_bytes_in_use, 4 * fa.block_bytes() + 2 * fb.block_bytes());
  EXPECT_EQ(st.stored_bytes, 40 * fa.entry_bytes() + 70 * fb.entry_bytes());
  const uint64_t selected = (*a)->shard(0, 0)->selected_capacity_bytes() +
                            (*a)->shard(0, 1)->selected_capacity_bytes() +
                            (*b)->shard(0, 0)->selected_capacity_bytes();
  EXPECT_EQ(st.selected_bytes, selected);
  EXPECT_GE(st.selected_bytes,
            2 * 20 * 2 * fa.row_bytes() + 2 * sb->entries_selected * fb.row_bytes());
  EXPECT_EQ(st.used_bytes, st.block_bytes_in_use + st.selected_bytes);
}

TEST(KvStoreTest, StoreDestroyedBeforeSessionHandle) {
  std::shared_ptr<Session> survivor;
  {
    KvStore store({});
    auto s = store.OpenSession("s", Opts());
    ASSERT_TRUE(s.ok());
    survivor = *s;
    ASSERT_TRUE(DoAppend(store, *survivor, 0, {0}, MakeInput(survivor->format(), 1, 9, 1), 9).ok());
  }
  EXPECT_EQ(survivor->shard(0, 0), nullptr);
}

TEST(KvStoreTest, ConcurrentSessionsBalanceTheBudget) {
  KvStore store({.capacity_bytes = 1 << 28});
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        const std::string id = absl::StrCat("t", t, "-", i);
        auto s = store.OpenSession(id, Opts(2, 2, 64, KvDType::kBf16, 16, 0.25f));
        if (!s.ok()) {
          ++failures;
          continue;
        }
        const AppendInput in = MakeInput((*s)->format(), 2, 37, i);
        for (uint32_t layer = 0; layer < 2; ++layer) {
          if (!DoAppend(store, **s, layer, {0, 1}, in, 37).ok()) ++failures;
        }
        auto fork = store.ForkSession(id + "f", Opts(2, 2, 64, KvDType::kBf16, 16), id, 20);
        if (!fork.ok() || !DoAppend(store, **fork, 1, {1}, in, 5).ok()) ++failures;
        (void)store.Stats();
        if (!store.CloseSession(i % 2 ? id : id + "f").ok()) ++failures;
        if (!store.CloseSession(i % 2 ? id + "f" : id).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const StoreStats st = store.Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.blocks_in_use, 0u);
  EXPECT_EQ(st.used_bytes, 0u);
}

}  // namespace
}  // namespace tandem::kv_store

namespace tandem::kv_store {
namespace {

// A session with pages (page_tokens > 0) keeps no salience index: appends select nothing and
// charge no selected copy, window_entries may be 0, flags must be 0, forks must match.
TEST(KvStoreTest, PagesSessionKeepsNoSelectionIndex) {
  KvStore store(KvStore::Options{64ull << 20, 64, 16});
  SessionOptions o = Opts(1, 2, 64, KvDType::kBf16, 16, /*beta=*/0.0f);
  o.page_tokens = 16;
  auto s = store.OpenSession("p", o);
  ASSERT_TRUE(s.ok()) << s.status();
  const AppendInput in = MakeInput((*s)->format(), 2, 40, 3);
  const std::vector<uint32_t> heads = {0, 1};
  // beta = 0 would select everything in a MAW session; a pages session selects nothing.
  auto appended = store.Append(**s, 0, heads, in.k.data(), in.v.data(), in.maw.data(), 40, 0);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->entries_appended, 80u);
  EXPECT_EQ(appended->entries_selected, 0u);
  EXPECT_EQ(store.Stats().selected_bytes, 0u);
  EXPECT_EQ((*s)->shard(0, 1)->held(), 40u);
  EXPECT_EQ((*s)->shard(0, 1)->selected_count(), 0u);

  std::vector<uint8_t> flags(80, 0);
  EXPECT_TRUE(store.Append(**s, 0, heads, in.k.data(), in.v.data(), in.maw.data(), 40, 0, flags)
                  .ok());
  flags[7] = 1;
  const absl::Status flagged =
      store.Append(**s, 0, heads, in.k.data(), in.v.data(), in.maw.data(), 40, 0, flags)
          .status();
  EXPECT_EQ(flagged.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flagged.message().find("no selection index"), std::string::npos) << flagged;
  EXPECT_EQ((*s)->shard(0, 0)->held(), 80u) << "a refused append changes nothing";

  SessionOptions maw = Opts(1, 2, 64, KvDType::kBf16, 16);
  EXPECT_EQ(store.ForkSession("f", maw, "p", 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store.ForkSession("g", o, "p", 10).ok());
  o.page_tokens = 4097;
  EXPECT_EQ(store.OpenSession("q", o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kv_store
