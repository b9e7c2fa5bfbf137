// RemoteKv placement across several CPU attention nodes (servers on loopback ports in this
// process): whatever the placement, and while shards migrate between nodes during decode, the
// partial states equal those of one node (up to f32 rounding); a session that does not fit is refused
// before anything is sent; a node that joins gets shards of new sessions; a draining node is
// emptied by migration.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {
namespace {

constexpr int64_t kLayers = 4, kQHeads = 8, kKvHeads = 4, kDim = 32;
constexpr int64_t kWindowEntries = 64;   // selection threshold beta / 64

// A loopback node in this process.
std::unique_ptr<cpu_attention::CpuAttentionServer> StartNode(uint64_t pool_bytes) {
  cpu_attention::ServerOptions o;
  o.address = "127.0.0.1:0";
  o.node.pool_bytes = pool_bytes;
  o.node.threads = 1;
  o.node.block_tokens = 16;
  auto server = cpu_attention::CpuAttentionServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

RemoteKvOptions Options(const std::string& id) {
  RemoteKvOptions o;
  o.session_id = id;
  o.num_layers = kLayers;
  o.num_q_heads = kQHeads;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.kv_dtype = DType::kF32;
  o.beta = 1.0f;
  o.block_tokens = 16;
  o.transport = NodeTransport::kGrpc;
  // Any modelled gain migrates: these tests are about the mechanics of moving shards, and
  // their shards are far too small for a move to repay its copy.
  o.replan_every_steps = 1;
  o.replan_min_gain = 0.0;
  o.replan_min_gain_seconds = 0.0;
  o.migration_bytes_per_second = 0.0;
  o.migration_chunk_entries = 37;   // several chunks per shard, not block aligned
  o.expected_tokens = 1000;
  return o;
}

// Deterministic skewed workload: head (l, h) selects a share of its entries that differs a lot
// between heads (HGCA: <1% to 30%), so costs are heterogeneous.
class Workload {
 public:
  explicit Workload(uint32_t seed) : rng_(seed) {
    std::uniform_real_distribution<double> log_share(std::log(0.01), std::log(0.6));
    for (int64_t s = 0; s < kLayers * kKvHeads; ++s) share_.push_back(std::exp(log_share(rng_)));
  }
  // Appends `n` entries per shard of every layer to each of `kvs`.
  void Append(std::vector<RemoteKv*> kvs, int64_t n) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (int64_t l = 0; l < kLayers; ++l) {
      std::vector<float> k(kKvHeads * n * kDim), v(k.size()), maw(kKvHeads * n);
      for (float& x : k) x = normal(rng_);
      for (float& x : v) x = normal(rng_);
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          maw[h * n + i] = unit(rng_) < share_[l * kKvHeads + h] ? 1.0f : 0.0f;
        }
      }
      for (RemoteKv* kv : kvs) {
        const absl::Status s = kv->Append(l, k.data(), v.data(), maw.data(), n, kWindowEntries);
        ASSERT_TRUE(s.ok()) << s;
      }
    }
  }
  std::vector<float> Query(int64_t tokens) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(tokens * kQHeads * kDim);
    for (float& x : q) x = normal(rng_);
    return q;
  }

 private:
  std::mt19937 rng_;
  std::vector<double> share_;
};

struct Partial {
  std::vector<float> o, lse;
};

Partial Attend(RemoteKv& kv, int64_t layer, const std::vector<float>& q) {
  const int64_t tokens = static_cast<int64_t>(q.size()) / (kQHeads * kDim);
  Partial p{std::vector<float>(q.size()), std::vector<float>(tokens * kQHeads)};
  const absl::Status s = kv.StartAttend(layer, q.data(), tokens);
  EXPECT_TRUE(s.ok()) << s;
  absl::StatusOr<bool> degraded = kv.FinishAttend(p.o.data(), p.lse.data());
  EXPECT_TRUE(degraded.ok()) << degraded.status();
  EXPECT_FALSE(degraded.value_or(true)) << "layer " << layer;
  return p;
}

// One decode step on both: every layer attends with the same query; results must be equal.
void StepAndCompare(RemoteKv& kv, RemoteKv& reference, Workload& w, int step) {
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::vector<float> q = w.Query(1);
    const Partial got = Attend(kv, l, q);
    const Partial want = Attend(reference, l, q);
    ASSERT_EQ(got.o.size(), want.o.size());
    double worst_o = 0, worst_lse = 0;
    for (size_t i = 0; i < got.o.size(); ++i) {
      worst_o = std::max<double>(worst_o, std::fabs(got.o[i] - want.o[i]));
    }
    for (size_t i = 0; i < got.lse.size(); ++i) {
      worst_lse = std::max<double>(worst_lse, std::fabs(got.lse[i] - want.lse[i]));
    }
    // Equal up to f32 rounding: a node orders its scan by the heads it holds, so a shard's
    // sums may associate differently on another node.
    ASSERT_LE(worst_o, 1e-5) << "step " << step << " layer " << l;
    ASSERT_LE(worst_lse, 1e-5) << "step " << step << " layer " << l;
  }
}

class PlacementE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodePoolOptions one;   // one node in-process, configured like the loopback nodes
    one.embedded.threads = 1;
    one.embedded.block_tokens = 16;
    auto reference = NodePool::Create(one);
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_pool_ = std::move(*reference);
  }

  // Starts `count` more nodes and lists them.
  void AddNodes(int count, uint64_t pool_bytes = 64ull << 20) {
    for (int i = 0; i < count; ++i) {
      nodes_.push_back(StartNode(pool_bytes));
      ASSERT_NE(nodes_.back(), nullptr);
      std::lock_guard<std::mutex> lock(mu_);
      listed_.push_back(absl::StrCat("127.0.0.1:", nodes_.back()->port()));
    }
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

  v1::StatsResponse Stats(size_t node) { return nodes_[node]->node().Stats(); }
  // The pool's index of nodes_[node] (the pool numbers nodes in discovery order).
  size_t PoolIndex(size_t node) {
    const std::string address = absl::StrCat("127.0.0.1:", nodes_[node]->port());
    for (size_t i = 0; i < pool_->size(); ++i) {
      if (pool_->address(i) == address) return i;
    }
    ADD_FAILURE() << address << " is not in the pool";
    return 0;
  }
  // Pool indices of nodes_[list...], sorted.
  std::vector<size_t> PoolIndices(std::vector<size_t> list) {
    for (size_t& n : list) n = PoolIndex(n);
    std::sort(list.begin(), list.end());
    return list;
  }

  std::unique_ptr<NodePool> reference_pool_;
  std::vector<std::unique_ptr<cpu_attention::CpuAttentionServer>> nodes_;
  std::mutex mu_;
  std::vector<std::string> listed_;
  std::unique_ptr<NodePool> pool_;
};

TEST_F(PlacementE2eTest, MigratesDuringDecodeWithoutChangingResults) {
  AddNodes(3);
  MakePool();
  auto kv = RemoteKv::Open(*pool_, Options("mig"));
  ASSERT_TRUE(kv.ok()) << kv.status();
  RemoteKvOptions ro = Options("mig-ref");
  auto reference = RemoteKv::Open(*reference_pool_, ro);
  ASSERT_TRUE(reference.ok()) << reference.status();
  // Every node got shards (equal costs before any Attend: an even spread).
  EXPECT_EQ((*kv)->nodes_in_use().size(), 3u);

  Workload w(7);
  w.Append({kv->get(), reference->get()}, 300);
  const std::vector<int> before = (*kv)->placement();
  // Decode: each step appends a block (evictions continue during the copies) and attends.
  for (int step = 0; step < 40; ++step) {
    StepAndCompare(**kv, **reference, w, step);
    ASSERT_TRUE((*kv)->Maintain().ok());
    w.Append({kv->get(), reference->get()}, 16);
  }
  ASSERT_TRUE((*kv)->SettleMigrations(std::chrono::seconds(30)).ok());
  StepAndCompare(**kv, **reference, w, 40);
  const PlacementCounters& c = (*kv)->placement_counters();
  EXPECT_GT(c.migrations_done, 0u) << "the measured (skewed) costs moved no shard";
  EXPECT_EQ(c.migrations_failed, 0u);
  EXPECT_NE((*kv)->placement(), before);
  EXPECT_EQ((*kv)->degraded_attends(), 0u);
  // Copy, switch, free: the nodes together hold each shard once, as the single node does.
  uint64_t stored = 0;
  for (size_t n = 0; n < nodes_.size(); ++n) stored += Stats(n).stored_bytes();
  EXPECT_EQ(stored, reference_pool_->embedded()->node().Stats().stored_bytes());
  ASSERT_TRUE((*kv)->Close().ok());
  for (size_t n = 0; n < nodes_.size(); ++n) {
    EXPECT_EQ(Stats(n).sessions(), 0u) << "node " << n;
    EXPECT_EQ(Stats(n).blocks_in_use(), 0u) << "node " << n;
  }
}

// The periodic cost re-plan moves nothing whose modelled gain cannot repay its copy before the
// session ends (here two steps from its end: a few µs of gain per step against ~78 KB per shard
// to copy at 1 GB/s); a requested steady-state re-plan moves shards regardless.
TEST_F(PlacementE2eTest, PeriodicReplansMigrateOnlyWhatRepaysItsCopy) {
  AddNodes(3);
  MakePool();
  RemoteKvOptions o = Options("payback");
  o.expected_tokens = 302;
  o.migration_bytes_per_second = RemoteKvOptions{}.migration_bytes_per_second;
  ASSERT_GT(o.migration_bytes_per_second, 0);
  auto kv = RemoteKv::Open(*pool_, o);
  ASSERT_TRUE(kv.ok()) << kv.status();
  auto reference = RemoteKv::Open(*reference_pool_, Options("payback-ref"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  Workload w(7);
  w.Append({kv->get(), reference->get()}, 300);
  const std::vector<int> before = (*kv)->placement();
  for (int step = 0; step < 8; ++step) {
    StepAndCompare(**kv, **reference, w, step);
    ASSERT_TRUE((*kv)->Maintain().ok());
  }
  const PlacementCounters& c = (*kv)->placement_counters();
  EXPECT_GE(c.replans, 7u);
  EXPECT_EQ(c.migrations_started, 0u);
  EXPECT_EQ((*kv)->placement(), before);

  (*kv)->RequestReplan();
  ASSERT_TRUE((*kv)->SettleMigrations(std::chrono::seconds(30)).ok());
  EXPECT_GT(c.migrations_done, 0u) << "the steady-state re-plan moved no shard";
  EXPECT_NE((*kv)->placement(), before);
  StepAndCompare(**kv, **reference, w, 8);
}

// A kept session's next turn (Reserve) that would overfill its small node moves shards to the
// large one before the turn starts; one that fits nowhere is refused and moves nothing.
TEST_F(PlacementE2eTest, ReserveMovesShardsOffANodeThatWouldOverflow) {
  AddNodes(1, /*pool_bytes=*/8ull << 20);
  AddNodes(1, /*pool_bytes=*/64ull << 20);
  MakePool();
  auto kv = RemoteKv::Open(*pool_, Options("grow"));
  ASSERT_TRUE(kv.ok()) << kv.status();
  auto reference = RemoteKv::Open(*reference_pool_, Options("grow-ref"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  Workload w(11);
  w.Append({kv->get(), reference->get()}, 200);
  StepAndCompare(**kv, **reference, w, 0);
  auto on_small = [&] {
    const auto& placement = (*kv)->placement();
    return std::count(placement.begin(), placement.end(), static_cast<int>(PoolIndex(0)));
  };
  ASSERT_GT(on_small(), 7) << "the session should start spread evenly over both nodes";
  const std::vector<int> before = (*kv)->placement();

  // 20000 entries per shard: ~97 MB for the 16 shards, more than both pools hold.
  const absl::Status too_big = (*kv)->Reserve(20000);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted) << too_big;
  EXPECT_EQ((*kv)->placement(), before);
  EXPECT_EQ((*kv)->migrations_pending(), 0u);

  // 3500 entries: ~1.06 MB a shard (17 MB in all); the 8 MiB node keeps at most 7 of them.
  const int on_small_before = static_cast<int>(on_small());
  const absl::Status grown = (*kv)->Reserve(3500);
  ASSERT_TRUE(grown.ok()) << grown;
  ASSERT_TRUE((*kv)->SettleMigrations(std::chrono::seconds(30)).ok());
  EXPECT_LE(on_small(), 7);
  EXPECT_LT(on_small(), on_small_before);
  EXPECT_GT((*kv)->placement_counters().migrations_done, 0u);
  EXPECT_EQ((*kv)->placement_counters().migrations_failed, 0u);
  StepAndCompare(**kv, **reference, w, 1);
}

TEST_F(PlacementE2eTest, RefusesWhatDoesNotFitBeforeSendingAnything) {
  AddNodes(3, /*pool_bytes=*/4ull << 20);
  MakePool();
  RemoteKvOptions o = Options("big");
  // 16 shards of 20000 f32 entries (256 B of K + V, 4 B of MAW, 256 B of selected copy each):
  // ~165 MB against 12 MiB of pools.
  o.expected_tokens = 20000;
  auto kv = RemoteKv::Open(*pool_, o);
  ASSERT_FALSE(kv.ok());
  EXPECT_EQ(kv.status().code(), absl::StatusCode::kResourceExhausted) << kv.status();
  for (size_t n = 0; n < nodes_.size(); ++n) {
    EXPECT_EQ(Stats(n).sessions(), 0u) << "node " << n;
    EXPECT_EQ(Stats(n).used_bytes(), 0u) << "node " << n;
  }
  // What fits is placed, and within every node's pool.
  o.expected_tokens = 200;
  o.session_id = "fits";
  auto fits = RemoteKv::Open(*pool_, o);
  ASSERT_TRUE(fits.ok()) << fits.status();
}

TEST_F(PlacementE2eTest, JoinedNodeGetsSessionsAndDrainingNodeIsEmptied) {
  AddNodes(2);
  MakePool();
  auto first = RemoteKv::Open(*pool_, Options("first"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->nodes_in_use(), PoolIndices({0, 1}));

  AddNodes(1);   // a node joins (the headless Service gained an address)
  ASSERT_TRUE(pool_->Refresh().ok());
  ASSERT_EQ(pool_->size(), 3u);
  EXPECT_EQ(PoolIndex(2), 2u);   // a node that joins takes the next index
  EXPECT_TRUE(pool_->state(2).accepting());
  auto second = RemoteKv::Open(*pool_, Options("second"));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->nodes_in_use(), PoolIndices({0, 1, 2}));

  auto reference = RemoteKv::Open(*reference_pool_, Options("second-ref"));
  ASSERT_TRUE(reference.ok());
  Workload w(11);
  w.Append({second->get(), reference->get()}, 200);
  StepAndCompare(**second, **reference, w, 0);

  // Node 0 starts draining (SIGTERM on scale-down): its shards move off while decoding goes on.
  nodes_[0]->node().SetDraining(true);
  ASSERT_TRUE(pool_->Refresh().ok());
  const size_t drained = PoolIndex(0);
  EXPECT_FALSE(pool_->state(drained).accepting());
  auto uses_drained = [&](const RemoteKv& kv) {
    const std::vector<size_t> in_use = kv.nodes_in_use();
    return std::find(in_use.begin(), in_use.end(), drained) != in_use.end();
  };
  for (int step = 1; step < 20 && uses_drained(**second); ++step) {
    ASSERT_TRUE((*second)->Maintain().ok());
    w.Append({second->get(), reference->get()}, 16);
    StepAndCompare(**second, **reference, w, step);
  }
  ASSERT_TRUE((*second)->SettleMigrations(std::chrono::seconds(30)).ok());
  EXPECT_EQ((*second)->nodes_in_use(), PoolIndices({1, 2}));
  StepAndCompare(**second, **reference, w, 99);
  // The first session, idle, is drained by its own Maintain.
  ASSERT_TRUE((*first)->SettleMigrations(std::chrono::seconds(30)).ok());
  EXPECT_FALSE(uses_drained(**first));
  EXPECT_EQ(Stats(0).sessions(), 0u);
  EXPECT_EQ(Stats(0).blocks_in_use(), 0u);
  // New sessions avoid the draining node.
  auto third = RemoteKv::Open(*pool_, Options("third"));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ((*third)->nodes_in_use(), PoolIndices({1, 2}));
}

TEST_F(PlacementE2eTest, ReselectDuringMigrationCancelsCleanly) {
  AddNodes(3);
  MakePool();
  auto kv = RemoteKv::Open(*pool_, Options("resel"));
  ASSERT_TRUE(kv.ok()) << kv.status();
  auto reference = RemoteKv::Open(*reference_pool_, Options("resel-ref"));
  ASSERT_TRUE(reference.ok());
  Workload w(5);
  w.Append({kv->get(), reference->get()}, 2000);
  StepAndCompare(**kv, **reference, w, 0);
  (*kv)->RequestReplan();
  ASSERT_TRUE((*kv)->Maintain().ok());
  // Whether or not copies are still running, a Reselect re-evaluates the source shards; the
  // copies of old flags are dropped.
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::vector<float> q = w.Query(8);
    ASSERT_TRUE((*kv)->Reselect(l, q.data(), 8, 2.0f).ok());
    ASSERT_TRUE((*reference)->Reselect(l, q.data(), 8, 2.0f).ok());
  }
  EXPECT_EQ((*kv)->migrations_pending(), 0u);
  for (int step = 1; step < 10; ++step) {
    StepAndCompare(**kv, **reference, w, step);
    ASSERT_TRUE((*kv)->Maintain().ok());
  }
  ASSERT_TRUE((*kv)->SettleMigrations(std::chrono::seconds(30)).ok());
  StepAndCompare(**kv, **reference, w, 10);
}

}  // namespace
}  // namespace tandem::gpu_worker
