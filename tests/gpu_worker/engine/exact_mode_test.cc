// `exact` mode (ExactTier, issue 16) equals `gpu` mode: the offloaded KV split between host pages
// streamed to the device and a CPU node attending densely, merged by LSE, must give the logits
// of all-KV-on-the-device attention within 1e-4 at every step, for every split the planner can
// choose: forced all-nodes (fetch share 0), all-PCIe (1), mixed (0.37), and the split planned
// from rates probed on this machine. Checked on stories260k, gutenberg-14m (bf16 weights: a
// looser bound, see its test) and a random MHA geometry (tiny preset, 4 query = 4 kv heads),
// each with a prompt several windows long fed in the same chunks to both (evictions between
// chunks), then greedy decode steps with the same token; a decode batch mixing exact and gpu
// sequences matches the sequences decoded alone. Also: the split lands where the plan says, a
// request-shaped misuse (a MAW node session) is refused, and the probe measures every path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "../exact/exact_test_rig.h"
#include "engine_test_util.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

using testing::EvenExactRates;
using testing::ExactGeometryOf;
using testing::ExactRig;
using testing::kExactSink;
using testing::kExactWindow;
using testing::MakeExactRig;
using testing::MaxLogitDiff;
using testing::StepLogits;

constexpr float kLogitTolerance = 1e-4f;
constexpr uint64_t kRandomSeed = 7;  // random weights of the MHA geometries

// A sequence of `mode` whose exact tier forces `fetch_share` (< 0: the book's plan); no recompute.
std::unique_ptr<Sequence> MakeSequence(ExactRig& rig, AttentionMode mode, const std::string& id,
                                       ExactRateBook* book, double fetch_share) {
  return testing::MakeExactTestSequence(rig, mode, id, book, {fetch_share, -1, false});
}

// Prompt of `prompt_len` tokens in chunks of 41, then `steps` greedy decode steps: exact with
// the forced fetch share (< 0: the book's plan) against gpu, logits compared at every step.
void ExpectExactEqualsGpu(ExactRig& rig, ExactRateBook& book, double fetch_share, int prompt_len,
                          int steps, const std::string& tag, float tolerance) {
  auto gpu = MakeSequence(rig, AttentionMode::kGpu, "gpu-" + tag, nullptr, -1);
  auto exact = MakeSequence(rig, AttentionMode::kExact, "exact-" + tag, &book, fetch_share);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(exact, nullptr);
  const int64_t vocab = rig.config.vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < prompt_len; ++i) prompt.push_back(1 + (i * 53) % (vocab - 1));
  // Both in the same chunks (the GEMMs then see the same rows: only attention differs).
  std::vector<float> a, b;
  for (int i = 0; i < prompt_len; i += 41) {
    const std::vector<int32_t> chunk(prompt.begin() + i,
                                     prompt.begin() + std::min(prompt_len, i + 41));
    a = StepLogits(rig, *gpu, chunk);
    b = StepLogits(rig, *exact, chunk);
  }
  float worst = MaxLogitDiff(a, b);
  ASSERT_LE(worst, tolerance) << tag << " after the prompt";
  for (int step = 0; step < steps; ++step) {
    const int32_t next = static_cast<int32_t>(std::max_element(a.begin(), a.end()) - a.begin());
    ASSERT_EQ(next, std::max_element(b.begin(), b.end()) - b.begin()) << tag << " step " << step;
    a = StepLogits(rig, *gpu, {next});
    b = StepLogits(rig, *exact, {next});
    const float diff = MaxLogitDiff(a, b);
    worst = std::max(worst, diff);
    ASSERT_LE(diff, tolerance) << tag << " step " << step;
  }
  const auto& tier = static_cast<const ExactTier&>(*exact->offload);
  const int64_t offloaded = tier.offloaded_tokens();
  EXPECT_EQ(offloaded + exact->device_entries(), prompt_len + steps) << tag;
  EXPECT_LE(exact->device_entries(), kExactSink + kExactWindow) << tag;
  EXPECT_EQ(exact->degraded_steps, 0u) << tag;
  const double share = fetch_share >= 0 ? fetch_share : tier.plan().fetch_share;
  // Blocks are split so that the host keeps round(share · total) of all offloaded entries.
  EXPECT_NEAR(static_cast<double>(tier.host_tokens()), share * offloaded, 1.0) << tag;
  if (share == 0) {
    EXPECT_EQ(tier.host_tokens(), 0) << tag;
  }
  if (share == 1) {
    EXPECT_EQ(tier.node_tokens(), 0) << tag;
  }
  std::printf("%s: fetch share %.2f: %lld host / %lld node entries, worst logit diff %.3g\n",
              tag.c_str(), share, static_cast<long long>(tier.host_tokens()),
              static_cast<long long>(tier.node_tokens()), worst);
}

class ExactMode : public ::testing::Test {
 protected:
  // Every forced split and the probed plan on one rig.
  void CheckAllSplits(ExactRig& rig, int prompt_len, int steps, const std::string& name,
                      float tolerance = kLogitTolerance) {
    ExactRateBook even(EvenExactRates());
    for (const double share : {0.0, 1.0, 0.37}) {
      ExpectExactEqualsGpu(rig, even, share, prompt_len, steps, name + "-" + std::to_string(share),
                           tolerance);
      if (HasFatalFailure()) return;
    }
    auto probed =
        ExactRateBook::Measure(*rig.backend, *rig.pool, ExactGeometryOf(rig.config), DType::kF32,
                               {.pcie_bytes = 8 << 20,
                                .device_kv_bytes = 4 << 20,
                                .gemm_flops = 2e8,
                                .node_bytes = 4 << 20});
    ASSERT_TRUE(probed.ok()) << probed.status();
    ExpectExactEqualsGpu(rig, **probed, -1, prompt_len, steps, name + "-planned", tolerance);
  }
};

TEST_F(ExactMode, Stories260kEqualsGpuForEverySplit) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  CheckAllSplits(*rig, 300, 60, "stories260k");
}

TEST_F(ExactMode, Gutenberg14mEqualsGpuForEverySplit) {
  TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("gutenberg-14m").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  // NOTE: gutenberg-14m has bf16 weights, and the cpu backend's MatMul rounds its f32 input
  // rows to bf16 for them: a 1-ulp difference in an attention output (any other partition of
  // the same entries, offload mode's pages included: 1.5e-2..4.8e-2 against gpu mode at 100
  // tokens) can flip a bf16 rounding and moves the logits by ~1e-2. The f32 models above
  // hold 1e-4; here the bound is 0.1 with the same greedy token at every step.
  CheckAllSplits(*rig, 140, 6, "gutenberg-14m", 0.1f);
}

TEST_F(ExactMode, RandomMhaGeometryEqualsGpuForEverySplit) {
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,dtype=f32", *config).ok());
  std::string why;
  auto rig = MakeExactRig("", *config, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  CheckAllSplits(*rig, 300, 30, "random-mha");
}

// Exact and gpu sequences decoded in one batch match each decoded alone.
TEST_F(ExactMode, BatchDecodeEqualsSingleDecode) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  ExactRateBook even(EvenExactRates());
  const AttentionMode modes[] = {AttentionMode::kExact, AttentionMode::kGpu, AttentionMode::kExact};
  const double shares[] = {0.5, -1, 0.25};
  std::vector<std::unique_ptr<Sequence>> batched, single;
  for (int i = 0; i < 3; ++i) {
    batched.push_back(MakeSequence(*rig, modes[i], "b" + std::to_string(i), &even, shares[i]));
    single.push_back(MakeSequence(*rig, modes[i], "s" + std::to_string(i), &even, shares[i]));
    ASSERT_NE(batched.back(), nullptr);
    ASSERT_NE(single.back(), nullptr);
    std::vector<int32_t> prompt;
    for (int t = 0; t < 150 + 60 * i; ++t) prompt.push_back(1 + (t * 31 + i * 7) % 500);
    StepLogits(*rig, *batched[i], prompt);
    StepLogits(*rig, *single[i], prompt);
  }
  const int64_t vocab = rig->config.vocab_size;
  std::vector<int32_t> next = {5, 17, 29};
  for (int step = 0; step < 30; ++step) {
    std::vector<Sequence*> seqs;
    for (auto& s : batched) seqs.push_back(s.get());
    ASSERT_TRUE(rig->runner->Decode(seqs, next.data()).ok());
    std::vector<float> all(3 * vocab);
    ASSERT_TRUE(
        rig->backend->CopyToHost(all.data(), rig->runner->batch_logits(), all.size() * 4).ok());
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> alone = StepLogits(*rig, *single[i], {next[i]});
      ASSERT_LE(MaxLogitDiff(alone,
                        std::vector<float>(all.begin() + i * vocab, all.begin() + (i + 1) * vocab)),
                kLogitTolerance)
          << "sequence " << i << " step " << step;
      next[i] = static_cast<int32_t>(std::max_element(alone.begin(), alone.end()) - alone.begin());
    }
  }
  const auto& t0 = static_cast<const ExactTier&>(*batched[0]->offload);
  EXPECT_GT(t0.host_tokens(), 0);
  EXPECT_GT(t0.node_tokens(), 0);
}

// Online correction: a book that claims nearly free CPU nodes plans (almost) everything onto
// them; Maintain() between steps records the nodes' measured rate (RemoteKv's model of the
// replies it timed) and re-plans, so the book's node rate falls to the node's real one and the
// fetch share grows.
TEST_F(ExactMode, MaintainCorrectsTheNodeRateAndReplans) {
  // Random weights with 2 KiB of K+V per token and layer: the nodes' share of a 1000-token
  // prompt is over 1 MiB a layer, large enough for RemoteKv to time the nodes' replies.
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,head_dim=64,dtype=f32", *config).ok());
  std::string why;
  auto rig = MakeExactRig("", *config, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  ExactPathRates claimed = EvenExactRates();
  claimed.node_bytes_per_second = 1e15;
  claimed.node_overhead_seconds = 0;
  ExactRateBook book(claimed);
  auto seq = MakeSequence(*rig, AttentionMode::kExact, "online", &book, -1);
  ASSERT_NE(seq, nullptr);
  const auto& tier = static_cast<const ExactTier&>(*seq->offload);
  const double before = tier.plan().fetch_share;
  EXPECT_LT(before, 0.01);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 1000; ++i) prompt.push_back(1 + (i * 29) % 250);
  std::vector<float> logits = StepLogits(*rig, *seq, prompt);
  for (int step = 0; step < 48; ++step) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    logits = StepLogits(*rig, *seq, {next});
    seq->MaintainOffloaded();
  }
  EXPECT_GT(book.node_samples(), 0u);
  EXPECT_LT(book.rates().node_bytes_per_second, 1e12);  // a real node, not the claim
  EXPECT_GT(tier.plan().fetch_share, 0.05);
  std::printf("online: node rate %.3g B/s after %llu samples, fetch share %.3f -> %.3f\n",
              book.rates().node_bytes_per_second,
              static_cast<unsigned long long>(book.node_samples()), before,
              tier.plan().fetch_share);
}

TEST_F(ExactMode, ProbeMeasuresEveryPathAndRefusesBadParts) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::string why;
  auto rig = MakeExactRig(testing::ModelDir("stories260k").string(), {}, kRandomSeed, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  ExactPathRates rates;
  const ExactGeometry g = ExactGeometryOf(rig->config);
  ExactProbeOptions small{
      .pcie_bytes = 4 << 20, .device_kv_bytes = 1 << 20, .gemm_flops = 1e7, .node_bytes = 1 << 20};
  auto device = ProbeDeviceRates(*rig->backend, g, DType::kF32, small);
  ASSERT_TRUE(device.ok()) << device.status();
  rates = *device;
  ASSERT_TRUE(ProbeNodeRates(*rig->pool, g, DType::kF32, rates, small).ok());
  EXPECT_GT(rates.pcie_bytes_per_second, 1e6);
  EXPECT_GT(rates.device_attend_bytes_per_second, 1e6);
  EXPECT_GT(rates.gemm_flops_per_second, 1e6);
  EXPECT_EQ(rates.nodes, 1u);
  EXPECT_GT(rates.node_bytes_per_second, 1e6);
  std::printf("probed: %s\n", FormatExactRates(rates).c_str());

  // A node session with MAW selection keeps a selected copy: refused.
  RemoteKvOptions ro;
  ro.session_id = "maw";
  ro.num_layers = rig->config.num_layers;
  ro.num_q_heads = rig->config.num_q_heads;
  ro.num_kv_heads = rig->config.num_kv_heads;
  ro.head_dim = rig->config.head_dim;
  ro.kv_dtype = DType::kF32;
  auto remote = RemoteKv::Open(*rig->pool, ro);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const WindowGeometry wg{ro.num_layers, ro.num_kv_heads, ro.head_dim, DType::kF32};
  auto host = OffloadedKv::Create(*rig->backend, wg, 48);
  ASSERT_TRUE(host.ok());
  ExactRateBook book(rates);
  auto tier = ExactTier::Create(std::move(*host), std::move(*remote), &book, {});
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker

namespace tandem::gpu_worker {
namespace {

// The served path: Engine::Generate with mode exact (the split forced to half, as the planned
// split of a toy model on this machine is all-fetch) gives gpu mode's greedy tokens, in one
// turn and in a second turn of a kept session, reports its split, and refuses the hybrid knobs.
class ExactEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    options.nodes.embedded.pool_bytes = 64ull << 20;
    options.default_window = 32;
    options.offload_page_tokens = 32;
    options.exact_fetch_share = 0.5;
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  GenerateRequest Request(AttentionMode mode, const std::string& session, int first) const {
    GenerateRequest r;
    for (int i = 0; i < 150; ++i) r.prompt_ids.push_back(1 + (first + i * 37) % 500);
    r.max_tokens = 40;
    r.ignore_eos = true;
    r.mode = mode;
    r.session_id = session;
    return r;
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(ExactEngine, GenerateMatchesGpuAndReportsTheSplit) {
  for (int turn = 0; turn < 2; ++turn) {
    auto gpu = engine_->Generate(Request(AttentionMode::kGpu, "g", turn * 11));
    auto exact = engine_->Generate(Request(AttentionMode::kExact, "e", turn * 11));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    ASSERT_TRUE(exact.ok()) << exact.status();
    EXPECT_EQ(gpu->token_ids, exact->token_ids) << "turn " << turn;
    EXPECT_EQ(exact->mode, AttentionMode::kExact);
    EXPECT_FALSE(exact->degraded);
    ASSERT_TRUE(exact->exact_split.has_value());
    EXPECT_FALSE(gpu->exact_split.has_value());
    const TierSplit& split = *exact->exact_split;
    EXPECT_EQ(split.fetch_share, 0.5);
    EXPECT_EQ(split.node_share, 0.5);
    EXPECT_EQ(split.host_entries + split.node_entries, exact->cpu_kv_entries);
    EXPECT_GT(split.host_entries, 0);
    EXPECT_GT(split.node_entries, 0);
    EXPECT_FALSE(split.recompute_reason.empty());
  }
  EXPECT_TRUE(engine_->CloseSession("e").ok());
  EXPECT_TRUE(engine_->CloseSession("g").ok());
  EXPECT_EQ(engine_->nodes().embedded()->node().Stats().sessions(), 0u);
}

TEST_F(ExactEngine, HybridKnobsAreInvalidWithExact) {
  for (int knob = 0; knob < 4; ++knob) {
    GenerateRequest r = Request(AttentionMode::kExact, "", 0);
    if (knob == 0) r.beta = 0.0f;
    if (knob == 1) r.selection = SelectionRule::kPages;
    if (knob == 2) r.select_tokens = 64;
    if (knob == 3) r.dense_layers = 1;
    auto s = engine_->Generate(r);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("exact"), std::string::npos) << s.status();
  }
  EXPECT_TRUE(engine_->Generate(Request(AttentionMode::kExact, "", 0)).ok());  // still serving
  EXPECT_EQ(*ParseAttentionMode("EXACT"), AttentionMode::kExact);
  EXPECT_EQ(AttentionModeName(AttentionMode::kExact), "exact");
}

// An exact tier for a toy f32 geometry (2 layers, 4 query / 2 kv heads of 16, hidden 64, pages
// of 64 tokens) on `pool`, planned with `eo` (its geometry is set here).
absl::StatusOr<std::unique_ptr<ExactTier>> OpenToyTier(Backend& backend, NodePool& pool,
                                                       ExactRateBook& book, const std::string& id,
                                                       ExactTierOptions eo) {
  RemoteKvOptions ro;
  ro.session_id = id;
  ro.num_layers = 2;
  ro.num_q_heads = 4;
  ro.num_kv_heads = 2;
  ro.head_dim = 16;
  ro.kv_dtype = DType::kF32;
  eo.geometry = {2, 2, 16, 64, 4, 4};
  return OpenExactTier(backend, pool, book, ro, {2, 2, 16, DType::kF32}, 64, eo);
}

// Without an accepting CPU node an exact session cannot be planned: UNAVAILABLE, naming offload.
TEST(ExactTierOpen, NoAcceptingNodeIsUnavailable) {
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no backend: " << why;
  NodePoolOptions po;
  po.discovery = []() -> absl::StatusOr<std::vector<std::string>> {
    return std::vector<std::string>{};
  };
  auto pool = NodePool::Create(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->accepting_count(), 0u);
  ExactRateBook book(EvenExactRates());
  auto tier = OpenToyTier(*backend, **pool, book, "none", {});
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kUnavailable) << tier.status();
  EXPECT_NE(tier.status().message().find("offload"), std::string::npos) << tier.status();
}

// A host share beyond the host's available memory is refused before anything is stored.
TEST(ExactTierOpen, HostShareBeyondAvailableMemoryIsResourceExhausted) {
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no backend: " << why;
  NodePoolOptions po;
  po.embedded.pool_bytes = 16ull << 20;
  auto pool = NodePool::Create(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ExactRateBook book(EvenExactRates());
  ExactTierOptions eo;
  eo.plan.force_fetch_share = 1;          // all of it in host pages
  eo.expected_tokens = int64_t{1} << 40;  // 2^40 entries x 256 B per layer
  auto tier = OpenToyTier(*backend, **pool, book, "huge", eo);
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kResourceExhausted) << tier.status();
  EXPECT_NE(tier.status().message().find("host"), std::string::npos) << tier.status();
}

// Nodes that store int8 rows would make the node share approximate: refused.
TEST(ExactTierOpen, Int8NodesAreRefused) {
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no backend: " << why;
  NodePoolOptions po;
  po.embedded.pool_bytes = 16ull << 20;
  po.embedded.kv_dtype = kv_store::KvDType::kInt8;
  auto pool = NodePool::Create(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->accepting_count(), 1u);
  ExactRateBook book(EvenExactRates());
  auto tier = OpenToyTier(*backend, **pool, book, "int8", {});
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kFailedPrecondition) << tier.status();
  EXPECT_NE(tier.status().message().find("int8"), std::string::npos) << tier.status();
}

}  // namespace
}  // namespace tandem::gpu_worker
