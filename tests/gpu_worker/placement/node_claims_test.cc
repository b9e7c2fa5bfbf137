// Claims on node memory (node_claims.h, NodePool "Claims"): the ledger's arithmetic, and sessions
// opened one after another on one in-process node before any of their entries arrive are not
// placed against the same free bytes (the second is refused at Open, not by a failed AppendKv
// later); a closed session's room is seen again after the Refresh that Open does on a refusal;
// once a session's entries are all charged and the node reported them, it claims nothing more;
// a fork claims what it adds beyond the whole blocks it shares with its parent.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tandem/gpu_worker/node_claims.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::gpu_worker {
namespace {

TEST(NodeClaimsTest, PendingIsWhatIsStillToChargeBeyondTheLastStats) {
  NodeClaims claims;
  const uint64_t a = claims.Add(), b = claims.Add();
  ASSERT_NE(a, 0u);
  ASSERT_NE(a, b);
  claims.Set(a, 1, /*projected=*/1000, /*charged=*/0);
  claims.Set(b, 1, 500, 200);
  EXPECT_EQ(claims.Pending(0), 0u);
  EXPECT_EQ(claims.Pending(1), 1500u);   // nothing charged was seen by a Stats yet
  EXPECT_EQ(claims.Pending(1, a), 500u);
  EXPECT_EQ(claims.Pending(1, b), 1000u);

  // A Stats call sent now sees b's 200 charged bytes once its answer arrives.
  claims.AskingStats(1);
  claims.Set(b, 1, 500, 400);   // charged while the call was in flight: not counted as seen
  EXPECT_EQ(claims.Pending(1), 1500u);
  claims.SawStats(1);
  EXPECT_EQ(claims.Pending(1), 1000u + 300u);

  // Charging past the projection claims the excess too; a removed claim is gone at once.
  claims.Set(a, 1, 1000, 1200);
  EXPECT_EQ(claims.Pending(1, b), 1200u);
  claims.Remove(a);
  EXPECT_EQ(claims.Pending(1), 300u);
  EXPECT_EQ(claims.size(), 1u);
  claims.Set(a, 1, 99, 0);   // a removed id is ignored
  EXPECT_EQ(claims.Pending(1), 300u);

  // The node restarted: what b charged there is gone with the old process, all of b is pending.
  claims.Forget(1);
  EXPECT_EQ(claims.Pending(1), 500u);
  claims.SawStats(1);   // (nothing asked since: stays forgotten)
  EXPECT_EQ(claims.Pending(1), 500u);
}

constexpr int64_t kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 16, kBlock = 16;
constexpr uint64_t kPoolBytes = 4ull << 20;

RemoteKvOptions Options(const std::string& id, int64_t expected_tokens) {
  RemoteKvOptions o;
  o.session_id = id;
  o.num_layers = kLayers;
  o.num_q_heads = kQHeads;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.kv_dtype = DType::kF32;
  o.selection = SelectionRule::kPages;   // no selected copy: the charge is whole blocks
  o.page_tokens = kBlock;
  o.block_tokens = kBlock;
  o.transport = NodeTransport::kGrpc;
  o.placement = PlacementPolicy::kUniform;
  o.expected_tokens = expected_tokens;
  return o;
}

// Bytes the node charges for a session's blocks at `tokens` entries per shard.
uint64_t SessionBlockBytes(int64_t tokens) {
  const kv_store::BlockFormat format{kBlock, kDim, kv_store::KvDType::kF32};
  return kLayers * kKvHeads * format.ShardBytes(static_cast<uint64_t>(tokens), 0);
}

class NodeClaimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodePoolOptions o;
    o.embedded.pool_bytes = kPoolBytes;
    o.embedded.threads = 1;
    o.embedded.block_tokens = kBlock;
    auto pool = NodePool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    // The largest whole-block length of which a session takes at most 60% of the node: one fits,
    // two do not.
    while (SessionBlockBytes(tokens_ + kBlock) <= kPoolBytes * 6 / 10) tokens_ += kBlock;
    ASSERT_GT(tokens_, 0);
  }
  // Appends `n` entries per shard of every layer.
  static void Append(RemoteKv& kv, int64_t n) {
    std::vector<float> k(kKvHeads * n * kDim, 0.5f), v(k.size(), -0.5f), maw(kKvHeads * n, 1.0f);
    for (int64_t l = 0; l < kLayers; ++l) {
      const absl::Status s = kv.Append(l, k.data(), v.data(), maw.data(), n, 0);
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  std::unique_ptr<NodePool> pool_;
  int64_t tokens_ = 0;
};

TEST_F(NodeClaimTest, SessionsOpenedTogetherAreNotPlacedAgainstTheSameFreeBytes) {
  const uint64_t free_before = pool_->state(0).free_bytes;
  auto first = RemoteKv::Open(*pool_, Options("first", tokens_));
  ASSERT_TRUE(first.ok()) << first.status();
  // Nothing is charged on the node yet, but the pool counts the first session's claim.
  EXPECT_EQ(pool_->state(0).claimed_bytes, SessionBlockBytes(tokens_));
  EXPECT_EQ(pool_->state(0).free_bytes, free_before - SessionBlockBytes(tokens_));
  EXPECT_EQ(pool_->Snapshot(/*except_claim=*/1'000'000).at(0).claimed_bytes,
            SessionBlockBytes(tokens_));

  // The second session would fit the node's reported free bytes, not what is left of them.
  auto second = RemoteKv::Open(*pool_, Options("second", tokens_));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();

  // The first session's entries arrive: its claim turns into charged bytes, and once a Stats
  // answer saw them nothing is claimed beyond it.
  Append(**first, tokens_);
  EXPECT_EQ((*first)->NodeBytes(), SessionBlockBytes(tokens_));
  ASSERT_TRUE(pool_->Refresh().ok());
  EXPECT_EQ(pool_->state(0).claimed_bytes, 0u);
  auto again = RemoteKv::Open(*pool_, Options("again", tokens_));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();

  // Closed, its room is back: Open refreshes the pool's view on a refusal before it gives up.
  ASSERT_TRUE((*first)->Close().ok());
  EXPECT_EQ((*first)->NodeBytes(), 0u);
  auto after = RemoteKv::Open(*pool_, Options("after", tokens_));
  ASSERT_TRUE(after.ok()) << after.status();
  Append(**after, tokens_);   // its entries fit: no append is refused
  ASSERT_TRUE((*after)->Close().ok());
  EXPECT_EQ(pool_->state(0).claimed_bytes, 0u);
}

TEST_F(NodeClaimTest, AForkClaimsOnlyWhatItAddsToThePrefixItShares) {
  const int64_t prefix = tokens_ / 2 / kBlock * kBlock;
  auto parent = RemoteKv::Open(*pool_, Options("parent", prefix));
  ASSERT_TRUE(parent.ok()) << parent.status();
  Append(**parent, prefix);
  ASSERT_TRUE(pool_->Refresh().ok());
  EXPECT_EQ(pool_->state(0).claimed_bytes, 0u);
  // The fork grows to tokens_: it claims the blocks past the shared prefix only.
  auto fork = (*parent)->Fork("fork", tokens_);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(pool_->state(0).claimed_bytes, SessionBlockBytes(tokens_) - SessionBlockBytes(prefix));
  // What its entries take (shared or not: evicting for node room must see it once the parent
  // is gone).
  EXPECT_EQ((*fork)->NodeBytes(), SessionBlockBytes(prefix));
  Append(**fork, tokens_ - prefix);
  EXPECT_EQ((*fork)->NodeBytes(), SessionBlockBytes(tokens_));
  ASSERT_TRUE(pool_->Refresh().ok());
  EXPECT_EQ(pool_->state(0).claimed_bytes, 0u);
}

// A fork of a prefix that ends inside a block gets its own copy of that block (copy-on-write):
// it claims that block too.
TEST_F(NodeClaimTest, AForkClaimsThePartialBlockItCopies) {
  const int64_t prefix = kBlock * 3 + kBlock / 2;
  auto parent = RemoteKv::Open(*pool_, Options("parent", prefix));
  ASSERT_TRUE(parent.ok()) << parent.status();
  Append(**parent, prefix);
  ASSERT_TRUE(pool_->Refresh().ok());
  auto fork = (*parent)->Fork("fork", prefix + kBlock);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(pool_->state(0).claimed_bytes,
            SessionBlockBytes(prefix + kBlock) - SessionBlockBytes(kBlock * 3));
}

}  // namespace
}  // namespace tandem::gpu_worker
