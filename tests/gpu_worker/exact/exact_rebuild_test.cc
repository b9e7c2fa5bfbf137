// Exact mode survives a lost CPU node (exact_rebuild.h; issue 16): on a random MHA geometry
// (tiny, 4 query = 4 kv heads, f32) whose offloaded entries are split 0.3 fetched / 0.3
// recomputed / 0.4 on two CPU attention servers on loopback ports, a server that goes away
// mid-decode leaves the steps degraded (Sequence::degraded_steps, what the response's degraded
// flag counts), then ExactTier::Rebuild recomputes the K/V of exactly the positions the nodes
// held (a gpu-mode prefill of the token prefix, kv_recompute.h) and re-homes them: on the
// surviving server, or, with no server left, in the host pages. Afterwards no step is degraded
// and the logits equal gpu mode's within 1e-4 over further decode steps and evictions. Also: a
// rebuild whose recompute fails stays degraded and is retried after ExactNodeRecovery::kRetry;
// EntryPositions' runs; RecomputeKvAt's bad input.
#include "tandem/gpu_worker/exact_rebuild.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../engine/engine_test_util.h"
#include "absl/strings/str_cat.h"
#include "exact_test_rig.h"
#include "loopback_node.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/kv_recompute.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

using testing::ArgmaxToken;
using testing::EvenExactRates;
using testing::ExactRig;
using testing::MakeExactRig;
using testing::MakeExactTestSequence;
using testing::MaxLogitDiff;
using testing::StepLogits;

constexpr float kLogitTolerance = 1e-4f;
constexpr int kPrompt = 300;  // with the rig's window of 64 + 4 sinks: 232 offloaded entries

class ExactRebuildTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
    ASSERT_TRUE(config.ok()) << config.status();
    ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,dtype=f32", *config).ok());
    std::string why;
    auto rig = MakeExactRig("", *config, /*seed=*/23, &why);
    if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
    ASSERT_TRUE(rig.ok()) << rig.status();
    rig_ = std::make_unique<ExactRig>(std::move(*rig));
    // Two CPU attention servers replace the rig's embedded node; gRPC so that a server that
    // goes away fails the next call at once.
    NodePoolOptions o;
    for (int i = 0; i < 2; ++i) {
      nodes_.push_back(testing::StartLoopbackNode());
      ASSERT_NE(nodes_.back(), nullptr);
      o.addresses.push_back(absl::StrCat("127.0.0.1:", nodes_.back()->port()));
    }
    o.transport = NodeTransport::kGrpc;
    o.probe_ms = 100;
    o.probe_deadline_ms = 300;
    auto pool = NodePool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    rig_->pool = std::move(*pool);
    gpu_ = MakeExactTestSequence(*rig_, AttentionMode::kGpu, "gpu", nullptr, {});
    exact_ = MakeExactTestSequence(*rig_, AttentionMode::kExact, "exact", &book_, {0.3, 0.3, true});
    ASSERT_NE(gpu_, nullptr);
    ASSERT_NE(exact_, nullptr);
    tier_ = static_cast<ExactTier*>(exact_->offload.get());
    // The prompt, then a few greedy steps: exact == gpu before any loss.
    std::vector<int32_t> prompt;
    const int64_t vocab = rig_->config.vocab_size;
    for (int i = 0; i < kPrompt; ++i) prompt.push_back(1 + (i * 53) % (vocab - 1));
    gpu_logits_ = StepLogits(*rig_, *gpu_, prompt);
    ASSERT_LE(MaxLogitDiff(gpu_logits_, StepLogits(*rig_, *exact_, prompt)), kLogitTolerance);
    ASSERT_GT(tier_->node_tokens(), 0);
    ASSERT_GT(tier_->host_tokens(), 0);
    ASSERT_GT(tier_->recompute_tokens(), 0);
    ASSERT_EQ(tier_->remote().nodes_in_use().size(), 2u);
  }

  // One greedy step on both sequences (the gpu sequence's choice); exact's logit difference.
  float Step() {
    const int32_t next = ArgmaxToken(gpu_logits_);
    gpu_logits_ = StepLogits(*rig_, *gpu_, {next});
    const std::vector<float> exact = StepLogits(*rig_, *exact_, {next});
    exact_->MaintainOffloaded();
    return MaxLogitDiff(gpu_logits_, exact);
  }

  // `steps` steps that must all be exact and not degraded; the worst difference.
  float ExpectExactSteps(int steps, const std::string& tag) {
    const uint64_t degraded = exact_->degraded_steps;
    float worst = 0;
    for (int i = 0; i < steps; ++i) {
      worst = std::max(worst, Step());
      EXPECT_LE(worst, kLogitTolerance) << tag << " step " << i;
    }
    EXPECT_EQ(exact_->degraded_steps, degraded) << tag;
    return worst;
  }

  // Steps after a loss: degraded ones (counted), evictions going on meanwhile.
  uint64_t DegradedSteps(int steps) {
    const uint64_t before = exact_->degraded_steps;
    for (int i = 0; i < steps; ++i) Step();
    return exact_->degraded_steps - before;
  }

  RecomputeAt Recompute() { return MakeRecomputeAt(*rig_->runner, *exact_, 512, nullptr); }

  size_t PoolIndex(int port) {
    for (size_t i = 0; i < rig_->pool->size(); ++i) {
      if (rig_->pool->address(i) == absl::StrCat("127.0.0.1:", port)) return i;
    }
    ADD_FAILURE() << port << " not in the pool";
    return 0;
  }

  ExactRateBook book_{EvenExactRates()};
  std::unique_ptr<ExactRig> rig_;
  std::vector<std::unique_ptr<cpu_attention::CpuAttentionServer>> nodes_;
  std::unique_ptr<Sequence> gpu_, exact_;
  ExactTier* tier_ = nullptr;
  std::vector<float> gpu_logits_;
};

TEST_F(ExactRebuildTest, LostNodeIsRebuiltOnTheSurvivorAndExactAgain) {
  std::printf("before the loss: worst logit diff %.3g\n", ExpectExactSteps(5, "healthy"));
  EXPECT_FALSE(tier_->needs_rebuild());
  const size_t lost = PoolIndex(nodes_[1]->port());
  nodes_[1].reset();
  // Degraded (flagged), not failed; evictions go on (20 steps: past a block of 16).
  const int64_t nodes_before = tier_->node_tokens();
  EXPECT_GT(DegradedSteps(20), 0u);
  EXPECT_GT(tier_->node_tokens(), nodes_before);
  EXPECT_TRUE(tier_->needs_rebuild());
  EXPECT_EQ(tier_->remote().placement_counters().nodes_lost, 1u);

  // No recompute set: nothing is rebuilt (the engine sets it for every exact sequence).
  absl::StatusOr<bool> rebuilt = tier_->Rebuild();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  EXPECT_FALSE(*rebuilt);
  EXPECT_TRUE(tier_->needs_rebuild());

  // A recompute that fails (no device room now) leaves the loss in place, retried later.
  tier_->set_recompute(MakeRecomputeAt(*rig_->runner, *exact_, 512, [](size_t) {
    return absl::ResourceExhaustedError("device memory (test)");
  }));
  // The retry is due kRetry after the failure, which happens between these two times.
  const auto before_failure = std::chrono::steady_clock::now();
  rebuilt = tier_->Rebuild();
  const auto after_failure = std::chrono::steady_clock::now();
  EXPECT_EQ(rebuilt.status().code(), absl::StatusCode::kResourceExhausted) << rebuilt.status();
  EXPECT_TRUE(tier_->needs_rebuild());
  EXPECT_GT(DegradedSteps(2), 0u);
  tier_->set_recompute(Recompute());
  const int64_t node_entries = tier_->node_tokens();
  rebuilt = tier_->Rebuild();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  // "Not due yet" is certain only if this call ended before before_failure + kRetry (200 ms):
  // on a loaded CI machine the two degraded steps above can take longer, and then the retry may
  // have been due and run (the checks below apply to it).
  const bool checked =
      std::chrono::steady_clock::now() < before_failure + ExactNodeRecovery::kRetry;
  if (checked) {
    EXPECT_FALSE(*rebuilt) << "the retry is not due yet";
  } else {
    std::printf("(over %lld ms since the failure: 'not due yet' not checked)\n",
                static_cast<long long>(ExactNodeRecovery::kRetry.count()));
  }
  if (!*rebuilt) {
    std::this_thread::sleep_until(after_failure + ExactNodeRecovery::kRetry +
                                  std::chrono::milliseconds(1));
    rebuilt = tier_->Rebuild();
    ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  }
  EXPECT_TRUE(*rebuilt);
  EXPECT_FALSE(tier_->needs_rebuild());
  EXPECT_GT(tier_->remote().placement_counters().shards_rebuilt, 0u);
  for (size_t n : tier_->remote().nodes_in_use()) EXPECT_NE(n, lost);
  EXPECT_EQ(tier_->node_tokens(), node_entries);  // re-homed on the survivor, not moved
  std::printf("rebuilt %llu shards (%lld node entries) in %.1f ms\n",
              static_cast<unsigned long long>(tier_->remote().placement_counters().shards_rebuilt),
              static_cast<long long>(node_entries),
              tier_->remote().placement_counters().last_rebuild_ms);

  // Exact again, over more evictions to the nodes.
  std::printf("after the rebuild: worst logit diff %.3g\n", ExpectExactSteps(40, "rebuilt"));
  EXPECT_GT(tier_->node_tokens(), node_entries);
  ASSERT_TRUE(tier_->Close().ok());
  EXPECT_EQ(nodes_[0]->node().Stats().sessions(), 0u);
}

TEST_F(ExactRebuildTest, WithNoNodeLeftTheNodeEntriesMoveToTheHostPages) {
  ExpectExactSteps(3, "healthy");
  nodes_[0].reset();
  nodes_[1].reset();
  EXPECT_GT(DegradedSteps(20), 0u);
  EXPECT_TRUE(tier_->needs_rebuild());
  const int64_t total = tier_->offloaded_tokens();
  const int64_t host = tier_->host_tokens(), node = tier_->node_tokens();
  const int64_t recomputed = tier_->recompute_tokens();
  tier_->set_recompute(Recompute());
  absl::StatusOr<bool> rebuilt = tier_->Rebuild();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  EXPECT_TRUE(*rebuilt);
  EXPECT_FALSE(tier_->needs_rebuild());
  EXPECT_EQ(tier_->node_tokens(), 0);
  EXPECT_EQ(tier_->host_tokens(), host + node);
  EXPECT_EQ(tier_->offloaded_tokens(), total);
  // The plan without nodes: the recompute share kept, the rest fetched.
  EXPECT_EQ(tier_->plan().node_share, 0.0);
  std::printf("without nodes: worst logit diff %.3g\n", ExpectExactSteps(40, "on host"));
  EXPECT_EQ(tier_->node_tokens(), 0);
  EXPECT_GT(tier_->host_tokens(), host + node);
  EXPECT_GE(tier_->recompute_tokens(), recomputed);
  // A new turn's reservation holds without nodes.
  EXPECT_TRUE(tier_->Reserve(tier_->offloaded_tokens() + 64).ok());
  EXPECT_TRUE(tier_->Close().ok());
}

// Degraded steps past a window's worth: their positions left the window (to the host pages, the
// recompute rows and the surviving node) before the rebuild, where they cannot be rewritten, so
// the rebuilt sequence says so: every later step is flagged degraded.
TEST_F(ExactRebuildTest, TaintedPositionsThatLeftTheWindowKeepTheFlag) {
  nodes_[1].reset();
  EXPECT_GT(DegradedSteps(testing::kExactWindow + 40), 0u);
  tier_->set_recompute(Recompute());
  absl::StatusOr<bool> rebuilt = tier_->Rebuild();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  EXPECT_TRUE(*rebuilt);
  EXPECT_FALSE(tier_->needs_rebuild());
  // Every layer's attend of every step (degraded_steps counts layer attends).
  EXPECT_EQ(DegradedSteps(5), 5u * rig_->config.num_layers);
}

TEST(EntryPositions, RunsFollowTheBatchSlices) {
  EntryPositions p;
  // A batch of two blocks (positions 4..19 and 20..35): entries 10..31 of it.
  p.AddFromBatch({{0, 4, 16}, {16, 20, 16}}, 10, 22);
  ASSERT_EQ(p.runs().size(), 1u);
  EXPECT_EQ(p.runs()[0].first_pos, 14);
  EXPECT_EQ(p.runs()[0].first_slot, 14);
  EXPECT_EQ(p.runs()[0].count, 22);
  // The next batch's tail (positions 45..51) starts a run; an empty slice adds nothing.
  p.AddFromBatch({{32, 36, 16}}, 9, 7);
  p.AddFromBatch({{48, 52, 16}}, 16, 0);
  ASSERT_EQ(p.runs().size(), 2u);
  EXPECT_EQ(p.runs()[1].first_pos, 45);
  EXPECT_EQ(p.runs()[1].count, 7);
  // Continuing positions extend the last run.
  p.AddFromBatch({{48, 52, 16}}, 0, 4);
  ASSERT_EQ(p.runs().size(), 2u);
  EXPECT_EQ(p.runs()[1].count, 11);
  EXPECT_EQ(p.size(), 33);
  p.Clear();
  EXPECT_EQ(p.size(), 0);
  EXPECT_TRUE(p.runs().empty());
}

TEST_F(ExactRebuildTest, RecomputeKvAtRefusesBadRuns) {
  const auto sink = [](int64_t, const void*, const void*, int64_t) { return absl::OkStatus(); };
  const int64_t fed = static_cast<int64_t>(exact_->tokens.size());
  for (const std::vector<EvictedBlock>& runs :
       std::vector<std::vector<EvictedBlock>>{{},
                                              {{0, 10, 5}, {0, 12, 5}},  // overlapping
                                              {{0, 20, 5}, {0, 10, 5}},  // descending
                                              {{0, 10, 0}},              // empty run
                                              {{0, fed - 2, 4}}}) {      // beyond the tokens
    const absl::Status s = RecomputeKvAt(*rig_->runner, *exact_, {runs, -1}, 512, sink);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  // The K/V of scattered positions equal those of the gpu sequence at the same positions.
  const std::vector<EvictedBlock> runs = {{0, 7, 3}, {0, 40, 20}, {0, 250, 9}};
  std::vector<std::vector<float>> got;
  ASSERT_TRUE(RecomputeKvAt(*rig_->runner, *exact_, {runs, -1}, 512,
                            [&](int64_t layer, const void* k, const void*, int64_t tokens) {
                              const auto* f = static_cast<const float*>(k);
                              got.emplace_back(f, f + rig_->config.num_kv_heads * tokens *
                                                          rig_->config.head_dim);
                              return layer < rig_->config.num_layers ? absl::OkStatus()
                                                                     : absl::InternalError("layer");
                            })
                  .ok());
  ASSERT_EQ(got.size(), static_cast<size_t>(rig_->config.num_layers));
  const int64_t tokens = 32, d = rig_->config.head_dim, heads = rig_->config.num_kv_heads;
  std::vector<float> k(heads * tokens * d), v(k.size()), maw(heads * tokens);
  for (int64_t l = 0; l < rig_->config.num_layers; ++l) {
    // The gpu sequence's window is unlimited: position p in slot p.
    ASSERT_TRUE(
        gpu_->window
            .ReadBlocks(l, {{7, 7, 3}, {40, 40, 20}, {250, 250, 9}}, k.data(), v.data(), maw.data())
            .ok());
    float worst = 0;
    for (size_t i = 0; i < k.size(); ++i) worst = std::max(worst, std::fabs(k[i] - got[l][i]));
    EXPECT_LE(worst, 1e-4f) << "layer " << l;
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
