// `exact` mode with recompute (KVPR, ExactRecompute behind ExactTier; issue 16): the share of the
// offloaded entries kept as layer inputs x̂ and recomputed into K/V on the device every step must
// give gpu mode's logits within 1e-4, alone (recompute share 1) and mixed with fetched host pages
// and a CPU node (0.3 fetch, 0.4 recompute, 0.3 nodes), on stories260k (GQA) and a random MHA
// geometry (4 query = 4 kv heads), over a prompt several windows long fed in chunks, greedy
// decode steps, and a second turn on the same kept sequence. The planner's own choice: with
// recompute allowed, the MHA geometry's plan recomputes (and the result is still exact); the
// GQA model's says why not and the tier asks the runner for no layer inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "../engine/engine_test_util.h"
#include "exact_test_rig.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

using testing::ArgmaxToken;
using testing::EvenExactRates;
using testing::ExactGeometryOf;
using testing::ExactRig;
using testing::ExactSplit;
using testing::MakeExactRig;
using testing::MakeExactTestSequence;
using testing::MaxLogitDiff;
using testing::StepLogits;

constexpr float kLogitTolerance = 1e-4f;
constexpr uint64_t kRandomSeed = 11;  // random weights of the MHA geometry

// Two turns on one kept sequence each: a prompt in chunks of 41, then `steps` greedy decode
// steps; exact against gpu at the end of every chunk and at every step.
struct Outcome {
  bool ok = false;
  int64_t recomputed = 0, fetched = 0, on_nodes = 0;
  ExactPlan plan;
};
Outcome ExpectExactEqualsGpu(ExactRig& rig, ExactRateBook& book, const ExactSplit& split, int prompt_len,
                             int steps, const std::string& tag) {
  auto gpu = MakeExactTestSequence(rig, AttentionMode::kGpu, "gpu-" + tag, nullptr, {});
  auto exact = MakeExactTestSequence(rig, AttentionMode::kExact, "exact-" + tag, &book, split);
  if (gpu == nullptr || exact == nullptr) {
    ADD_FAILURE() << tag << ": no sequence";
    return {};
  }
  const int64_t vocab = rig.config.vocab_size;
  float worst = 0;
  int fed = 0;
  for (int turn = 0; turn < 2; ++turn) {
    std::vector<int32_t> prompt;
    for (int i = 0; i < prompt_len; ++i) prompt.push_back(1 + (i * 53 + turn * 17) % (vocab - 1));
    std::vector<float> a, b;
    for (int i = 0; i < prompt_len; i += 41) {
      const std::vector<int32_t> chunk(prompt.begin() + i,
                                       prompt.begin() + std::min(prompt_len, i + 41));
      a = StepLogits(rig, *gpu, chunk);
      b = StepLogits(rig, *exact, chunk);
      worst = std::max(worst, MaxLogitDiff(a, b));
    }
    EXPECT_LE(worst, kLogitTolerance) << tag << " turn " << turn << " after the prompt";
    fed += prompt_len;
    for (int step = 0; step < steps; ++step) {
      const int32_t next = ArgmaxToken(a);
      EXPECT_EQ(next, ArgmaxToken(b)) << tag << " turn " << turn << " step " << step;
      a = StepLogits(rig, *gpu, {next});
      b = StepLogits(rig, *exact, {next});
      const float diff = MaxLogitDiff(a, b);
      worst = std::max(worst, diff);
      if (diff > kLogitTolerance) {
        ADD_FAILURE() << tag << " turn " << turn << " step " << step << ": " << diff;
        return {};
      }
      ++fed;
    }
    exact->MaintainOffloaded();
  }
  const auto* tier = static_cast<const ExactTier*>(exact->offload.get());
  EXPECT_EQ(tier->offloaded_tokens() + exact->device_entries(), fed) << tag;
  EXPECT_EQ(exact->degraded_steps, 0u) << tag;
  std::printf("%s: %lld recomputed / %lld fetched / %lld node entries, worst logit diff %.3g\n",
              tag.c_str(), static_cast<long long>(tier->recompute_tokens()),
              static_cast<long long>(tier->host_tokens()),
              static_cast<long long>(tier->node_tokens()), worst);
  return {worst <= kLogitTolerance, tier->recompute_tokens(), tier->host_tokens(),
          tier->node_tokens(), tier->plan()};
}

// Forced shares: every entry recomputed, and recompute mixed with fetch and the node.
// Two turns of prompt_len + 30 steps each.
void CheckForcedSplits(ExactRig& rig, const std::string& name, int prompt_len) {
  ExactRateBook even(EvenExactRates());
  struct Case {
    ExactSplit split;
    const char* tag;
  };
  for (const Case& c :
       {Case{{0.0, 1.0, true}, "recompute-only"}, Case{{0.3, 0.4, true}, "mixed"}}) {
    const std::string tag = name + "-" + c.tag;
    auto exact = MakeExactTestSequence(rig, AttentionMode::kExact, "e-" + tag, &even, c.split);
    ASSERT_NE(exact, nullptr);
    const auto& tier = static_cast<const ExactTier&>(*exact->offload);
    EXPECT_TRUE(tier.wants_layer_inputs()) << tag;
    exact.reset();
    const Outcome o = ExpectExactEqualsGpu(rig, even, c.split, prompt_len, 30, tag);
    ASSERT_TRUE(o.ok) << tag;
    EXPECT_GT(o.recomputed, 0) << tag;
    if (c.split.fetch == 0) {
      EXPECT_EQ(o.fetched, 0) << tag;
      EXPECT_EQ(o.on_nodes, 0) << tag;
    } else {
      EXPECT_GT(o.fetched, 0) << tag;
      EXPECT_GT(o.on_nodes, 0) << tag;
    }
  }
}

// Shares as the split lands: recomputed, fetched and node entries against the forced shares.
TEST(ExactRecompute, SplitLandsWhereForced) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  ExactRateBook even(EvenExactRates());
  auto exact = MakeExactTestSequence(*rig, AttentionMode::kExact, "lands", &even, {0.3, 0.4, true});
  ASSERT_NE(exact, nullptr);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 400; ++i) prompt.push_back(1 + (i * 7) % 500);
  StepLogits(*rig, *exact, prompt);
  const auto& tier = static_cast<const ExactTier&>(*exact->offload);
  const double total = static_cast<double>(tier.offloaded_tokens());
  ASSERT_GT(total, 300);
  EXPECT_NEAR(tier.recompute_tokens(), 0.4 * total, 1.0);
  EXPECT_NEAR(tier.host_tokens(), 0.3 * total, 1.0);
  EXPECT_NEAR(tier.node_tokens(), 0.3 * total, 2.0);
}

TEST(ExactRecompute, Stories260kEqualsGpu) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  CheckForcedSplits(*rig, "stories260k", 200);  // 460 of its 512 positions
}

TEST(ExactRecompute, RandomMhaGeometryEqualsGpu) {
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,dtype=f32", *config).ok());
  std::string why;
  auto rig = MakeExactRig("", *config, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  CheckForcedSplits(*rig, "random-mha", 300);
}

// The planner decides: an MHA geometry (activation row smaller than its K+V row) recomputes
// where the GEMM is fast, and stays exact; the GQA model does not, and says why.
TEST(ExactRecompute, PlannerVerdictDecides) {
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,dtype=f32", *config).ok());
  std::string why;
  auto mha = MakeExactRig("", *config, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(mha.ok()) << mha.status();
  ASSERT_LT(ExactGeometryOf(mha->config).activation_row_bytes(), ExactGeometryOf(mha->config).kv_row_bytes());
  ExactRateBook even(EvenExactRates());
  const Outcome planned = ExpectExactEqualsGpu(*mha, even, {}, 300, 10, "mha-planned");
  ASSERT_TRUE(planned.ok);
  EXPECT_GT(planned.plan.recompute_share, 0.0) << planned.plan.recompute_reason;
  EXPECT_GT(planned.recomputed, 0);
  {
    auto seq = MakeExactTestSequence(*mha, AttentionMode::kExact, "mha-verdict", &even, {});
    ASSERT_NE(seq, nullptr);
    const auto& tier = static_cast<const ExactTier&>(*seq->offload);
    EXPECT_TRUE(tier.plan().recompute_pays) << tier.plan().recompute_reason;
    EXPECT_GT(tier.plan().recompute_share, 0.0);
    EXPECT_TRUE(tier.wants_layer_inputs());
    // Recompute off: the same verdict, no share, no layer inputs.
    auto off = MakeExactTestSequence(*mha, AttentionMode::kExact, "mha-off", &even, {-1, -1, false});
    ASSERT_NE(off, nullptr);
    const auto& off_tier = static_cast<const ExactTier&>(*off->offload);
    EXPECT_TRUE(off_tier.plan().recompute_pays);
    EXPECT_EQ(off_tier.plan().recompute_share, 0.0);
    EXPECT_FALSE(off_tier.wants_layer_inputs());
  }

  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  auto gqa = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  ASSERT_TRUE(gqa.ok()) << gqa.status();
  ASSERT_LT(gqa->config.num_kv_heads, gqa->config.num_q_heads);
  auto seq = MakeExactTestSequence(*gqa, AttentionMode::kExact, "gqa-verdict", &even, {});
  ASSERT_NE(seq, nullptr);
  const auto& tier = static_cast<const ExactTier&>(*seq->offload);
  EXPECT_FALSE(tier.plan().recompute_pays);
  EXPECT_EQ(tier.plan().recompute_share, 0.0);
  EXPECT_NE(tier.plan().recompute_reason.find("does not pay"), std::string::npos)
      << tier.plan().recompute_reason;
  EXPECT_FALSE(tier.wants_layer_inputs());
  std::vector<int32_t> prompt(200, 3);
  StepLogits(*gqa, *seq, prompt);
  EXPECT_EQ(tier.recompute_tokens(), 0);
}

}  // namespace
}  // namespace tandem::gpu_worker
