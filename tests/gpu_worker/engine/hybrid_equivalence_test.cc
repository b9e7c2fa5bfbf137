// The correctness anchor of hybrid attention (DESIGN.md numerics contract): with beta = 0 every
// offloaded entry is selected, so `hybrid` must equal `gpu` mode to fp32 rounding at every decode
// step, while the device window holds only a small part of the context. Checked on stories260k
// over 400 decode steps with window 64 + sink 4: logits within 1e-4 (max abs) at every step,
// identical greedy tokens, >= 80% of the KV on the CPU node at the end.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "runner_fixture.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

constexpr float kLogitTolerance = 1e-4f;

class HybridEquivalence : public testing::Stories260kRunnerTest {
 protected:
  std::unique_ptr<Sequence> MakeSequence(AttentionMode mode, const std::string& id) {
    const ModelConfig& c = model_->config;
    WindowOptions wo;
    wo.block = 16;
    wo.max_chunk = 512;
    wo.max_context = c.max_position_embeddings;
    if (mode == AttentionMode::kGpu) {
      wo.window = WindowOptions::kUnlimited;
      wo.sink = 0;
    } else {
      wo.window = 64;
      wo.sink = 4;
    }
    auto cache = WindowCache::Create(
        *backend_, {c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, wo);
    EXPECT_TRUE(cache.ok()) << cache.status();
    auto seq = std::make_unique<Sequence>(id, mode, std::move(*cache));
    if (mode == AttentionMode::kHybrid) {
      RemoteKvOptions ro;
      ro.session_id = id;
      ro.num_layers = c.num_layers;
      ro.num_q_heads = c.num_q_heads;
      ro.num_kv_heads = c.num_kv_heads;
      ro.head_dim = c.head_dim;
      ro.kv_dtype = DType::kF32;
      ro.beta = 0.0f;
      ro.block_tokens = 16;
      auto remote = RemoteKv::Open(*pool_, ro);
      EXPECT_TRUE(remote.ok()) << remote.status();
      if (remote.ok()) seq->offload = std::make_unique<NodeTier>(std::move(*remote), nullptr);
    }
    if (mode == AttentionMode::kOffload) {
      // Small pages so a few hundred tokens span several pages and the ping-pong slots cycle.
      auto offloaded = OffloadedKv::Create(
          *backend_, {c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, 48);
      EXPECT_TRUE(offloaded.ok()) << offloaded.status();
      if (offloaded.ok()) seq->offload = std::make_unique<HostTier>(std::move(*offloaded));
    }
    return seq;
  }


};

TEST_F(HybridEquivalence, BetaZeroEqualsGpuAtEveryDecodeStep) {
  auto gpu = MakeSequence(AttentionMode::kGpu, "gpu");
  auto hybrid = MakeSequence(AttentionMode::kHybrid, "hybrid");
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(hybrid, nullptr);
  // "Once upon a time" with BOS.
  std::vector<int32_t> feed = {1, 403, 407, 261, 378};
  float worst = 0.0f;
  int mismatched_tokens = 0;
  constexpr int kSteps = 400;
  for (int step = 0; step <= kSteps; ++step) {
    const std::vector<float> a = Step(*gpu, feed);
    const std::vector<float> b = Step(*hybrid, feed);
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    float diff = 0.0f;
    for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
    worst = std::max(worst, diff);
    ASSERT_LE(diff, kLogitTolerance) << "step " << step;
    const int32_t next_gpu = static_cast<int32_t>(std::max_element(a.begin(), a.end()) - a.begin());
    const int32_t next_hybrid =
        static_cast<int32_t>(std::max_element(b.begin(), b.end()) - b.begin());
    if (next_gpu != next_hybrid) ++mismatched_tokens;
    feed = {next_gpu};
  }
  EXPECT_EQ(mismatched_tokens, 0);
  const double offloaded = hybrid->offloaded_entries();
  const double total = offloaded + hybrid->device_entries();
  EXPECT_EQ(total, 5 + kSteps);
  EXPECT_GE(offloaded / total, 0.8);
  EXPECT_LE(hybrid->device_entries(), 4 + 64);
  EXPECT_EQ(hybrid->degraded_steps, 0u);
  std::printf("worst logit difference over %d steps: %.3g; %.0f of %.0f entries on the CPU node\n",
              kSteps, worst, offloaded, total);
}

// Prefill in chunks smaller than the prompt, evicting between chunks, gives the same logits as
// one pass in gpu mode (chunked prefill is exact).
TEST_F(HybridEquivalence, ChunkedPrefillWithEvictionEqualsOnePass) {
  auto gpu = MakeSequence(AttentionMode::kGpu, "gpu2");
  auto hybrid = MakeSequence(AttentionMode::kHybrid, "hybrid2");
  std::vector<int32_t> prompt;
  for (int i = 0; i < 300; ++i) prompt.push_back(1 + (i * 37) % 500);
  const std::vector<float> a = Step(*gpu, prompt);
  std::vector<float> b;
  for (size_t i = 0; i < prompt.size(); i += 37) {
    std::vector<int32_t> chunk(prompt.begin() + i,
                               prompt.begin() + std::min(prompt.size(), i + 37));
    b = Step(*hybrid, chunk);
  }
  ASSERT_EQ(a.size(), b.size());
  float diff = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
  EXPECT_LE(diff, kLogitTolerance);
  EXPECT_GT(hybrid->offloaded_entries(), 200);
}

// `offload` keeps only the window on the device and streams every other entry from host pages
// at each step: exact, so it equals gpu mode at every step, in decode and in chunked prefill.
TEST_F(HybridEquivalence, OffloadEqualsGpuAtEveryStep) {
  auto gpu = MakeSequence(AttentionMode::kGpu, "gpu3");
  auto offload = MakeSequence(AttentionMode::kOffload, "offload3");
  std::vector<int32_t> prompt;
  for (int i = 0; i < 150; ++i) prompt.push_back(1 + (i * 53) % 500);
  std::vector<float> a = Step(*gpu, prompt);
  std::vector<float> b;
  for (size_t i = 0; i < prompt.size(); i += 41) {
    b = Step(*offload, std::vector<int32_t>(prompt.begin() + i,
                                            prompt.begin() + std::min(prompt.size(), i + 41)));
  }
  float worst = 0.0f;
  for (int step = 0; step <= 200; ++step) {
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    float diff = 0.0f;
    for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
    worst = std::max(worst, diff);
    ASSERT_LE(diff, kLogitTolerance) << "step " << step;
    const int32_t next = static_cast<int32_t>(std::max_element(a.begin(), a.end()) - a.begin());
    a = Step(*gpu, {next});
    b = Step(*offload, {next});
  }
  // 351 positions: 4 sink + at most 64 recent on the device, the rest in host pages.
  EXPECT_LE(offload->device_entries(), 4 + 64);
  EXPECT_EQ(offload->offloaded_entries() + offload->device_entries(), 150 + 201);
  EXPECT_GE(static_cast<const HostTier&>(*offload->offload).kv().num_pages(0), 5);
  std::printf("offload: worst logit difference %.3g, %lld entries in host pages\n", worst,
              static_cast<long long>(offload->offloaded_entries()));
}

// A decode batch computes, for every sequence, what decoding it alone computes: sequences in
// all three modes at different lengths, stepped together, match the same sequences stepped
// one at a time.
TEST_F(HybridEquivalence, BatchDecodeEqualsSingleDecode) {
  const AttentionMode modes[] = {AttentionMode::kGpu, AttentionMode::kHybrid,
                                 AttentionMode::kOffload, AttentionMode::kGpu};
  std::vector<std::unique_ptr<Sequence>> batched, single;
  for (int i = 0; i < 4; ++i) {
    batched.push_back(MakeSequence(modes[i], "b" + std::to_string(i)));
    single.push_back(MakeSequence(modes[i], "s" + std::to_string(i)));
    std::vector<int32_t> prompt;
    for (int t = 0; t < 70 + 40 * i; ++t) prompt.push_back(1 + (t * 31 + i * 7) % 500);
    Step(*batched[i], prompt);
    Step(*single[i], prompt);
  }
  const int64_t vocab = model_->config.vocab_size;
  std::vector<int32_t> next = {5, 17, 29, 41};
  for (int step = 0; step < 60; ++step) {
    std::vector<Sequence*> seqs;
    for (auto& s : batched) seqs.push_back(s.get());
    ASSERT_TRUE(runner_->Decode(seqs, next.data()).ok());
    std::vector<float> all(4 * vocab);
    ASSERT_TRUE(
        backend_->CopyToHost(all.data(), runner_->batch_logits(), all.size() * 4).ok());
    for (int i = 0; i < 4; ++i) {
      const std::vector<float> alone = Step(*single[i], {next[i]});
      float diff = 0.0f;
      for (int64_t v = 0; v < vocab; ++v) {
        diff = std::max(diff, std::fabs(alone[v] - all[i * vocab + v]));
      }
      ASSERT_LE(diff, kLogitTolerance) << "sequence " << i << " step " << step;
      next[i] = static_cast<int32_t>(std::max_element(alone.begin(), alone.end()) -
                                     alone.begin());
    }
  }
  EXPECT_GT(batched[1]->offloaded_entries(), 0);
  EXPECT_GT(batched[2]->offloaded_entries(), 0);
  EXPECT_EQ(batched[1]->degraded_steps, 0u);
}

// Decode rejects an empty batch and a sequence given twice.
TEST_F(HybridEquivalence, BatchDecodeRejectsBadBatches) {
  auto a = MakeSequence(AttentionMode::kGpu, "r0");
  const int32_t ids[2] = {3, 4};
  EXPECT_EQ(runner_->Decode({}, ids).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runner_->Decode({a.get(), a.get()}, ids).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
