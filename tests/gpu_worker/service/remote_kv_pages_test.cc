// RemoteKv with `pages` selection over two loopback nodes in this process: Attend over named
// pages (and without pages: every held entry) equals the double reference, over gRPC and over
// shared memory bit for bit; pages on a maw session are refused before anything is sent; a node
// that joins later gets a pages session (migrated shards attend as before, with no selected
// copy anywhere).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {
namespace {

constexpr int64_t kLayers = 2, kQHeads = 8, kKvHeads = 4, kDim = 64, kG = kQHeads / kKvHeads;
constexpr int64_t kHeld = 500;  // per shard; 32 pages of 16, the last one partial (4 entries)
constexpr uint32_t kPageTokens = 16;
constexpr int64_t kTokens = 2, kPph = 6;
constexpr double kOTol = 1e-5, kLseTol = 1e-4;

std::unique_ptr<cpu_attention::CpuAttentionServer> StartNode() {
  cpu_attention::ServerOptions o;
  o.address = "127.0.0.1:0";
  o.node.pool_bytes = 64ull << 20;
  o.node.threads = 2;
  auto server = cpu_attention::CpuAttentionServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

class RemoteKvPagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(41);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t l = 0; l < kLayers; ++l) {
      std::vector<uint16_t> k, v;
      for (int64_t i = 0; i < kKvHeads * kHeld * kDim; ++i) {
        k.push_back(FloatToBf16(normal(rng)));
        v.push_back(FloatToBf16(normal(rng)));
      }
      k_.push_back(std::move(k));
      v_.push_back(std::move(v));
    }
    maw_.assign(kKvHeads * kHeld, 0.0f);
    q_.resize(kTokens * kQHeads * kDim);
    for (float& x : q_) x = normal(rng);
    // Per (token, kv head): a mix of adjacent pages, the partial last page, padding, and one
    // empty row.
    std::uniform_int_distribution<int32_t> page(0, 31);
    for (int64_t row = 0; row < kTokens * kKvHeads; ++row) {
      std::vector<int32_t> ids;
      const int64_t count = row == 3 ? 0 : 1 + row % kPph;
      while (static_cast<int64_t>(ids.size()) < count) {
        const int32_t p = row == 0 ? static_cast<int32_t>(31 - ids.size()) : page(rng);
        if (std::find(ids.begin(), ids.end(), p) == ids.end()) ids.push_back(p);
      }
      std::sort(ids.begin(), ids.end());
      ids.resize(kPph, -1);
      pages_.insert(pages_.end(), ids.begin(), ids.end());
    }
  }

  void AddNode() {
    nodes_.push_back(StartNode());
    ASSERT_NE(nodes_.back(), nullptr);
    std::lock_guard<std::mutex> lock(mu_);
    listed_.push_back(absl::StrCat("127.0.0.1:", nodes_.back()->port()));
  }

  void MakePool() {
    NodePoolOptions o;
    o.discovery = [this]() -> absl::StatusOr<std::vector<std::string>> {
      std::lock_guard<std::mutex> lock(mu_);
      return listed_;
    };
    auto pool = NodePool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  static RemoteKvOptions Options(const std::string& id, NodeTransport transport) {
    RemoteKvOptions o;
    o.session_id = id;
    o.num_layers = kLayers;
    o.num_q_heads = kQHeads;
    o.num_kv_heads = kKvHeads;
    o.head_dim = kDim;
    o.kv_dtype = DType::kBF16;
    o.block_tokens = 64;
    o.selection = SelectionRule::kPages;
    o.page_tokens = kPageTokens;
    o.placement = PlacementPolicy::kUniform;  // both nodes get shards
    o.transport = transport;
    return o;
  }

  // window_entries: the MAW threshold's n_gpu; pages sessions take 0.
  void AppendAll(RemoteKv& kv, int64_t window_entries = 0) {
    for (int64_t l = 0; l < kLayers; ++l) {
      const absl::Status s =
          kv.Append(l, k_[l].data(), v_[l].data(), maw_.data(), kHeld, window_entries);
      ASSERT_TRUE(s.ok()) << s;
    }
  }

  // One Attend of `layer`; o [T, H_q, D], lse [T, H_q].
  void Attend(RemoteKv& kv, int64_t layer, const PageSelection* pages, std::vector<float>* o,
              std::vector<float>* lse) {
    o->assign(q_.size(), 0.0f);
    lse->assign(kTokens * kQHeads, 0.0f);
    const absl::Status s = kv.StartAttend(layer, q_.data(), kTokens, pages);
    ASSERT_TRUE(s.ok()) << s;
    absl::StatusOr<bool> degraded = kv.FinishAttend(o->data(), lse->data());
    ASSERT_TRUE(degraded.ok()) << degraded.status();
    EXPECT_FALSE(*degraded);
  }

  // Every (token, query head) against the reference over the named pages (all when null).
  void ExpectReference(int64_t layer, const PageSelection* pages, const std::vector<float>& o,
                       const std::vector<float>& lse) {
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        std::vector<float> k, v;
        for (int64_t i = 0; i < kHeld; ++i) {
          bool keep = pages == nullptr;
          for (int64_t j = 0; !keep && j < kPph; ++j) {
            const int32_t p = pages->ids[(t * kKvHeads + h) * kPph + j];
            keep = p >= 0 && i / kPageTokens == p;
          }
          if (!keep) continue;
          for (int64_t d = 0; d < kDim; ++d) {
            k.push_back(Bf16ToFloat(k_[layer][(h * kHeld + i) * kDim + d]));
            v.push_back(Bf16ToFloat(v_[layer][(h * kHeld + i) * kDim + d]));
          }
        }
        std::vector<double> ref_o, ref_lse;
        const float* q = q_.data() + (t * kQHeads + h * kG) * kDim;
        cpu_attention::ReferenceAttention(q, k.data(), v.data(), k.size() / kDim, 1, kG, kDim,
                                          1.0 / std::sqrt(double{kDim}), &ref_o, &ref_lse);
        const size_t row = t * kQHeads + h * kG;
        if (k.empty()) {
          for (int64_t j = 0; j < kG; ++j) EXPECT_TRUE(std::isinf(lse[row + j]));
          for (int64_t i = 0; i < kG * kDim; ++i) ASSERT_EQ(o[row * kDim + i], 0.0f);
          continue;
        }
        for (int64_t j = 0; j < kG; ++j) {
          EXPECT_NEAR(lse[row + j], ref_lse[j], kLseTol) << "t " << t << " h " << h;
        }
        EXPECT_LE(cpu_attention::RelativeError(o.data() + row * kDim, ref_o.data(), kG * kDim),
                  kOTol)
            << "t " << t << " h " << h;
      }
    }
  }

  std::vector<std::vector<uint16_t>> k_, v_;  // per layer, bf16 [H_kv, kHeld, D]
  std::vector<float> maw_;
  std::vector<float> q_;        // [kTokens, H_q, D]
  std::vector<int32_t> pages_;  // [kTokens, H_kv, kPph]
  std::vector<std::unique_ptr<cpu_attention::CpuAttentionServer>> nodes_;
  std::mutex mu_;
  std::vector<std::string> listed_;
  std::unique_ptr<NodePool> pool_;
};

TEST_F(RemoteKvPagesTest, NamedPagesAndDenseMatchReferenceOverBothTransports) {
  AddNode();
  AddNode();
  MakePool();
  std::vector<float> o[2], lse[2];
  const PageSelection pages{pages_.data(), kPph};
  for (NodeTransport transport : {NodeTransport::kGrpc, NodeTransport::kShm}) {
    const int i = transport == NodeTransport::kShm;
    SCOPED_TRACE(i ? "shm" : "grpc");
    auto kv = RemoteKv::Open(*pool_, Options(i ? "s" : "g", transport));
    ASSERT_TRUE(kv.ok()) << kv.status();
    EXPECT_EQ((*kv)->nodes_in_use().size(), 2u);
    EXPECT_EQ((*kv)->shm_nodes(), i ? 2u : 0u);
    AppendAll(**kv);
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      Attend(**kv, layer, &pages, &o[i], &lse[i]);
      ExpectReference(layer, &pages, o[i], lse[i]);
    }
    EXPECT_EQ((*kv)->shm_attends(), i ? 2u * kLayers : 0u);
    // Entries per token (mean, rounded up) come back as the selection counters.
    uint64_t selected = 0;
    for (int32_t p : pages_) {
      if (p >= 0) selected += std::min<int64_t>(kHeld, (p + 1) * kPageTokens) - p * kPageTokens;
    }
    EXPECT_GE((*kv)->last_selection()[kLayers - 1].selected, selected / kTokens);
    EXPECT_EQ((*kv)->last_selection()[kLayers - 1].held, uint64_t{kKvHeads * kHeld});

    std::vector<float> dense_o, dense_lse;
    Attend(**kv, 1, nullptr, &dense_o, &dense_lse);
    ExpectReference(1, nullptr, dense_o, dense_lse);
    EXPECT_EQ((*kv)->last_selection()[1].selected, uint64_t{kKvHeads * kHeld});
    // A pages session has nothing to re-evaluate.
    EXPECT_TRUE((*kv)->Reselect(1, q_.data(), kTokens, std::nullopt).ok());
    ASSERT_TRUE((*kv)->Close().ok());
  }
  EXPECT_EQ(0, std::memcmp(o[0].data(), o[1].data(), o[0].size() * 4));
  EXPECT_EQ(0, std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * 4));
  for (const auto& node : nodes_) EXPECT_EQ(node->node().Stats().selected_bytes(), 0u);
}

TEST_F(RemoteKvPagesTest, PagesOnAMawSessionAreRefusedBeforeSending) {
  AddNode();
  MakePool();
  RemoteKvOptions o = Options("maw", NodeTransport::kGrpc);
  o.selection = SelectionRule::kMaw;
  o.beta = 0.0f;
  auto kv = RemoteKv::Open(*pool_, o);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const uint64_t calls = nodes_[0]->node().Stats().attend_calls();
  const PageSelection pages{pages_.data(), kPph};
  EXPECT_EQ((*kv)->StartAttend(0, q_.data(), kTokens, &pages).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(nodes_[0]->node().Stats().attend_calls(), calls);
  // The session still attends (no Attend is left in flight).
  AppendAll(**kv, /*window_entries=*/64);
  std::vector<float> out, lse;
  Attend(**kv, 0, nullptr, &out, &lse);
  ExpectReference(0, nullptr, out, lse);

  RemoteKvOptions bad = Options("bad", NodeTransport::kGrpc);
  bad.page_tokens = 0;
  EXPECT_EQ(RemoteKv::Open(*pool_, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RemoteKvPagesTest, ShardsMigratedToAJoiningNodeAttendAsBefore) {
  AddNode();
  MakePool();
  RemoteKvOptions o = Options("mig", NodeTransport::kGrpc);
  o.placement = PlacementPolicy::kBalanced;
  o.replan_every_steps = 1;
  o.replan_min_gain = 0.0;
  o.replan_min_gain_seconds = 0.0;
  o.migration_bytes_per_second = 0.0;
  o.migration_chunk_entries = 37;
  auto kv = RemoteKv::Open(*pool_, o);
  ASSERT_TRUE(kv.ok()) << kv.status();
  AppendAll(**kv);
  const PageSelection pages{pages_.data(), kPph};
  std::vector<float> before_o, before_lse;
  Attend(**kv, 1, &pages, &before_o, &before_lse);

  AddNode();  // a node joins: the re-plan moves shards to it
  ASSERT_TRUE(pool_->Refresh().ok());
  (*kv)->RequestReplan();
  ASSERT_TRUE((*kv)->Maintain().ok());
  ASSERT_TRUE((*kv)->SettleMigrations(std::chrono::seconds(30)).ok());
  EXPECT_GT((*kv)->placement_counters().migrations_done, 0u);
  EXPECT_EQ((*kv)->placement_counters().migrations_failed, 0u);
  EXPECT_EQ((*kv)->nodes_in_use().size(), 2u);

  std::vector<float> after_o, after_lse;
  Attend(**kv, 1, &pages, &after_o, &after_lse);
  // Not bit for bit: a node's task split (and so the order of the partial merges) depends on
  // the heads it holds. Both sides equal the reference.
  ExpectReference(1, &pages, before_o, before_lse);
  ExpectReference(1, &pages, after_o, after_lse);
  for (const auto& node : nodes_) EXPECT_EQ(node->node().Stats().selected_bytes(), 0u);
  ASSERT_TRUE((*kv)->Close().ok());
}

}  // namespace
}  // namespace tandem::gpu_worker
