// Device prefill (issue 15 item 1) on stories260k: a prompt many windows long in hybrid (MAW
// and pages, beta > 0) and offload mode is prefilled with the window widened, so the first
// token's distribution equals gpu mode's (exact: every chunk attends over the whole prompt on
// the device, the CPU node attends nothing), and the KV beyond the window reaches the tier
// after the first token (the node holds it, decode goes on through it). Also: the old path with
// --device_prefill off; a budget that holds only part of the prompt (still exact in offload
// mode, never over the budget); two concurrent long prompts under a small budget (no
// over-commit, both finish with their solo results).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "runner_fixture.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/host_page_streams.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/logprobs.h"
#include "tandem/gpu_worker/scheduler.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

constexpr float kLogprobTolerance = 1e-4f;
constexpr int64_t kWindow = 16, kSink = 4, kChunk = 64, kPrompt = 300;

EngineOptions Options(bool device_prefill, size_t kv_cap) {
  EngineOptions options;
  options.model_dir = testing::ModelDir("stories260k").string();
  options.backend = testing::TestBackendName();
  options.nodes.embedded.pool_bytes = 64ull << 20;
  options.default_window = kWindow;
  options.default_sink = kSink;
  options.prefill_chunk = kChunk;
  options.offload_page_tokens = 16;
  options.device_prefill = device_prefill;
  options.kv_cache_bytes = kv_cap;
  return options;
}

std::unique_ptr<Engine> MakeEngine(bool device_prefill, size_t kv_cap = 0) {
  auto engine = Engine::Create(Options(device_prefill, kv_cap));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

GenerateRequest Request(AttentionMode mode, const std::vector<int32_t>& prompt) {
  GenerateRequest r;
  r.prompt_ids = prompt;
  r.max_tokens = 6;
  r.ignore_eos = true;
  r.mode = mode;
  r.logprobs = true;
  r.top_logprobs = kMaxTopLogprobs;
  return r;
}

// The first token's top log-probabilities by token id.
struct FirstToken {
  std::map<int32_t, float> top;
};

// Runs `r` on `engine`, recording the first token's top log-probabilities and the largest
// DeviceKvBytes seen after any prefill chunk.
absl::StatusOr<GenerateSummary> RunRequest(Engine& engine, const GenerateRequest& r, FirstToken* first,
                                           size_t* peak_kv = nullptr) {
  GenerateCallbacks callbacks;
  callbacks.on_token = [first](const TokenEvent& e) {
    if (e.index == 0) {
      for (const TokenAlternative& a : e.top_logprobs) first->top[a.token_id] = a.logprob;
    }
    return true;
  };
  callbacks.on_prefill = [&engine, peak_kv](const PrefillProgress&) {
    if (peak_kv != nullptr) *peak_kv = std::max(*peak_kv, engine.DeviceKvBytes());
  };
  return engine.Generate(r, callbacks);
}

void ExpectSameFirstToken(const FirstToken& got, const FirstToken& want, const char* what) {
  ASSERT_EQ(got.top.size(), want.top.size()) << what;
  for (const auto& [id, logprob] : want.top) {
    auto it = got.top.find(id);
    ASSERT_NE(it, got.top.end()) << what << ": token " << id << " not among the top";
    EXPECT_NEAR(it->second, logprob, kLogprobTolerance) << what << ": token " << id;
  }
}

// Whether the engine's runner holds the host tiers' page streamer.
bool HasHostStreams(const Engine& engine) {
  return HostPageStreams::Find(engine.runner().tier_context()) != nullptr;
}

class DevicePrefill : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
  }
  static v1::StatsResponse NodeStats(Engine& e) { return e.nodes().embedded()->node().Stats(); }
};

TEST_F(DevicePrefill, FirstTokenEqualsGpuModeInHybridAndOffload) {
  std::unique_ptr<Engine> engine = MakeEngine(true);
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 11);
  FirstToken gpu;
  auto reference = RunRequest(*engine, Request(AttentionMode::kGpu, prompt), &gpu);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(gpu.top.size(), static_cast<size_t>(kMaxTopLogprobs));

  struct Case {
    const char* name;
    AttentionMode mode;
    SelectionRule selection;
  };
  for (const Case& c : {Case{"hybrid maw", AttentionMode::kHybrid, SelectionRule::kMaw},
                        Case{"hybrid pages", AttentionMode::kHybrid, SelectionRule::kPages},
                        Case{"offload", AttentionMode::kOffload, SelectionRule::kMaw}}) {
    GenerateRequest r = Request(c.mode, prompt);
    r.session_id = std::string("s-") + (c.selection == SelectionRule::kPages ? "pages" : "maw") +
                   (c.mode == AttentionMode::kOffload ? "-offload" : "");
    if (c.mode == AttentionMode::kHybrid) {
      r.selection = c.selection;
      if (c.selection == SelectionRule::kMaw) r.beta = 1.0f;   // a real selection, not all
      if (c.selection == SelectionRule::kPages) r.select_tokens = 32;
    }
    const uint64_t attends_before = NodeStats(*engine).attend_calls();
    size_t peak = 0;
    FirstToken first;
    GenerateRequest one = r;
    one.max_tokens = 1;   // the prefill pass only
    auto summary = RunRequest(*engine, one, &first, &peak);
    ASSERT_TRUE(summary.ok()) << c.name << ": " << summary.status();
    ExpectSameFirstToken(first, gpu, c.name);
    // The prompt was whole on the device (a widened window) and the CPU node attended nothing;
    // the blocks beyond the window reached the tier after the first token.
    WindowOptions configured;
    configured.sink = kSink;
    configured.window = kWindow;
    configured.block = 16;
    configured.max_chunk = kChunk;
    configured.max_context = 512;
    EXPECT_GT(peak, WindowCache::BytesFor({5, 4, 8, DType::kF32}, configured)) << c.name;
    EXPECT_EQ(NodeStats(*engine).attend_calls(), attends_before) << c.name;
    EXPECT_LE(summary->device_kv_entries, kSink + kWindow) << c.name;
    EXPECT_EQ(summary->device_kv_entries + summary->cpu_kv_entries, kPrompt) << c.name;
    if (c.mode == AttentionMode::kHybrid) {
      EXPECT_GT(NodeStats(*engine).blocks_in_use(), 0u);
    }
    // The next turn decodes through the tier (the node attends now).
    GenerateRequest next = r;
    next.prompt_ids = {403, 407};
    auto turn = engine->Generate(next);
    ASSERT_TRUE(turn.ok()) << c.name << ": " << turn.status();
    EXPECT_EQ(turn->completion_tokens, 6);
    EXPECT_EQ(turn->device_kv_entries + turn->cpu_kv_entries, kPrompt + 1 + 2 + 5) << c.name;
    if (c.mode == AttentionMode::kHybrid) {
      EXPECT_GT(NodeStats(*engine).attend_calls(), attends_before) << c.name;
    }
    ASSERT_TRUE(engine->CloseSession(r.session_id).ok());
  }
  EXPECT_EQ(NodeStats(*engine).blocks_in_use(), 0u);

  // One-shot offload with decode steps: the following tokens are gpu mode's (exact tiers).
  FirstToken first;
  auto offload = RunRequest(*engine, Request(AttentionMode::kOffload, prompt), &first);
  ASSERT_TRUE(offload.ok()) << offload.status();
  EXPECT_EQ(offload->token_ids, reference->token_ids);
}

// --device_prefill=false: the window keeps its size, so the chunks attend over the evicted
// part through the tier (the CPU node attends during the prefill); offload stays exact.
TEST_F(DevicePrefill, OffKeepsTheOldPath) {
  std::unique_ptr<Engine> engine = MakeEngine(false);
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 5);
  FirstToken gpu, offload;
  ASSERT_TRUE(RunRequest(*engine, Request(AttentionMode::kGpu, prompt), &gpu).ok());
  ASSERT_TRUE(RunRequest(*engine, Request(AttentionMode::kOffload, prompt), &offload).ok());
  ExpectSameFirstToken(offload, gpu, "offload, device prefill off");
  GenerateRequest r = Request(AttentionMode::kHybrid, prompt);
  r.max_tokens = 1;
  r.beta = 0.0f;
  FirstToken hybrid;
  size_t peak = 0;
  ASSERT_TRUE(RunRequest(*engine, r, &hybrid, &peak).ok());
  ExpectSameFirstToken(hybrid, gpu, "hybrid beta 0, device prefill off");
  EXPECT_GT(NodeStats(*engine).attend_calls(), 0u);
}

// Without --kv_cache_bytes a widened prompt takes what the device has left: the page streamer
// that offload and exact decode steps (and a hybrid prompt's spill to host pages) need is made
// when an offload session opens, or before a hybrid prompt beyond the window widens it, not at
// the first pass that streams (where it could find no memory left).
TEST_F(DevicePrefill, TheOffloadStreamerIsMadeBeforeThePromptWidensTheWindow) {
  // Every prefill chunk of `r` sees the streamer made.
  auto streamer_in_every_chunk = [](Engine& engine, const GenerateRequest& r) {
    int chunks = 0, chunks_with_streamer = 0;
    GenerateCallbacks callbacks;
    callbacks.on_prefill = [&](const PrefillProgress&) {
      ++chunks;
      chunks_with_streamer += HasHostStreams(engine) ? 1 : 0;
    };
    auto summary = engine.Generate(r, callbacks);
    EXPECT_TRUE(summary.ok()) << summary.status();
    EXPECT_GT(chunks, 1);
    EXPECT_EQ(chunks_with_streamer, chunks);
  };
  std::unique_ptr<Engine> engine = MakeEngine(true);
  ASSERT_NE(engine, nullptr);
  EXPECT_FALSE(HasHostStreams(*engine));
  FirstToken first;
  ASSERT_TRUE(RunRequest(*engine, Request(AttentionMode::kHybrid, testing::SyntheticPrompt(12, 4)),
                         &first)
                  .ok());
  EXPECT_FALSE(HasHostStreams(*engine)) << "a prompt within the window";
  streamer_in_every_chunk(*engine,
                          Request(AttentionMode::kOffload, testing::SyntheticPrompt(kPrompt, 6)));

  std::unique_ptr<Engine> hybrid_only = MakeEngine(true);
  ASSERT_NE(hybrid_only, nullptr);
  streamer_in_every_chunk(*hybrid_only,
                          Request(AttentionMode::kHybrid, testing::SyntheticPrompt(kPrompt, 7)));
}

// A budget that holds only part of the prompt: the window widens as far as it fits, the older
// blocks leave during the prefill and later chunks attend over them from host pages (offload's
// tier; hybrid's PrefillSpillTier). Both stay exact; the device KV never passes the budget.
TEST_F(DevicePrefill, APartlyFittingPromptStaysWithinTheBudget) {
  std::unique_ptr<Engine> reference = MakeEngine(true);
  ASSERT_NE(reference, nullptr);
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 23);
  FirstToken gpu;
  ASSERT_TRUE(RunRequest(*reference, Request(AttentionMode::kGpu, prompt), &gpu).ok());
  reference.reset();

  constexpr size_t kCap = 300 << 10;   // ~220 tokens of stories260k's f32 KV (1364 B a token)
  std::unique_ptr<Engine> engine = MakeEngine(true, kCap);
  ASSERT_NE(engine, nullptr);
  size_t peak = 0;
  FirstToken offload;
  auto summary = RunRequest(*engine, Request(AttentionMode::kOffload, prompt), &offload, &peak);
  ASSERT_TRUE(summary.ok()) << summary.status();
  ExpectSameFirstToken(offload, gpu, "offload, partly widened");
  EXPECT_LE(peak, kCap);
  EXPECT_GT(peak, kCap / 2);   // it did widen
  // Hybrid (MAW, beta 1): the part that left during the prefill is attended from host pages
  // on the device (PrefillSpillTier), so the first token is exact too and the CPU node attends
  // nothing until the decode steps.
  GenerateRequest r = Request(AttentionMode::kHybrid, prompt);
  r.beta = 1.0f;
  r.max_tokens = 1;
  r.session_id = "spill";
  peak = 0;
  FirstToken hybrid;
  summary = RunRequest(*engine, r, &hybrid, &peak);
  ASSERT_TRUE(summary.ok()) << summary.status();
  ExpectSameFirstToken(hybrid, gpu, "hybrid, partly widened");
  EXPECT_LE(peak, kCap);
  EXPECT_EQ(NodeStats(*engine).attend_calls(), 0u);
  EXPECT_EQ(summary->device_kv_entries + summary->cpu_kv_entries, kPrompt);
  r.prompt_ids = {403};
  r.max_tokens = 6;
  summary = engine->Generate(r);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->completion_tokens, 6);
  EXPECT_GT(NodeStats(*engine).attend_calls(), 0u);   // decode attends on the node
}

// Two long prompts at once under a budget that holds one widened prompt: the widened bytes
// count while held, so the two never over-commit, and both finish with their solo tokens.
TEST_F(DevicePrefill, ConcurrentLongPromptsDoNotOverCommit) {
  const std::vector<int32_t> prompts[2] = {testing::SyntheticPrompt(kPrompt, 3), testing::SyntheticPrompt(kPrompt - 40, 7)};
  std::vector<int32_t> solo[2];
  {
    std::unique_ptr<Engine> engine = MakeEngine(true);
    ASSERT_NE(engine, nullptr);
    for (int i = 0; i < 2; ++i) {
      FirstToken first;
      auto s = RunRequest(*engine, Request(AttentionMode::kGpu, prompts[i]), &first);
      ASSERT_TRUE(s.ok()) << s.status();
      solo[i] = s->token_ids;
    }
  }
  constexpr size_t kCap = 600 << 10;
  auto engine = Engine::Create(Options(true, kCap));
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine* raw = engine->get();   // read on the scheduler's thread only (its callbacks)
  auto scheduler = Scheduler::Create(std::move(*engine), SchedulerOptions{});
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  std::mutex mu;
  std::condition_variable cv;
  size_t peak = 0;
  int done = 0;
  absl::StatusOr<GenerateSummary> results[2];
  for (int i = 0; i < 2; ++i) {
    GenerateCallbacks callbacks;
    callbacks.on_prefill = [raw, &mu, &peak](const PrefillProgress&) {
      std::lock_guard<std::mutex> lock(mu);
      peak = std::max(peak, raw->DeviceKvBytes());
    };
    GenerateRequest r = Request(AttentionMode::kOffload, prompts[i]);
    r.logprobs = false;
    r.top_logprobs = 0;
    ASSERT_TRUE((*scheduler)
                    ->Submit(r, callbacks,
                             [&, i](absl::StatusOr<GenerateSummary> s) {
                               std::lock_guard<std::mutex> lock(mu);
                               results[i] = std::move(s);
                               ++done;
                               cv.notify_all();
                             })
                    .ok());
  }
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return done == 2; }));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->token_ids, solo[i]) << "request " << i;
  }
  EXPECT_LE(peak, kCap);
  EXPECT_GT(peak, kCap / 2);
}

// The runner's side: a widened hybrid (MAW, beta 1) prefill leaves the blocks beyond the window
// on the device after its last pass (the node holds nothing yet), SettleEvictions moves them
// with the MAW the last pass gave them, and the decode steps select part of them by that MAW
// (a MAW of 0, i.e. never updated, would select none with beta > 0).
class DevicePrefillRunner : public testing::Stories260kRunnerTest {};

TEST_F(DevicePrefillRunner, SettledBlocksCarryTheLastPassMaw) {
  const ModelConfig& c = model_->config;
  WindowOptions wo;
  wo.block = 16;
  wo.max_chunk = 512;
  wo.max_context = c.max_position_embeddings;
  wo.window = 32;
  wo.sink = 4;
  auto cache = WindowCache::Create(*backend_, {c.num_layers, c.num_kv_heads, c.head_dim,
                                               DType::kF32}, wo);
  ASSERT_TRUE(cache.ok()) << cache.status();
  Sequence seq("maw", AttentionMode::kHybrid, std::move(*cache));
  RemoteKvOptions ro;
  ro.session_id = "maw";
  ro.num_layers = c.num_layers;
  ro.num_q_heads = c.num_q_heads;
  ro.num_kv_heads = c.num_kv_heads;
  ro.head_dim = c.head_dim;
  ro.kv_dtype = DType::kF32;
  ro.beta = 1.0f;
  ro.block_tokens = 16;
  auto remote = RemoteKv::Open(*pool_, ro);
  ASSERT_TRUE(remote.ok()) << remote.status();
  seq.offload = std::make_unique<NodeTier>(std::move(*remote), nullptr);

  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 31);
  seq.prefill_end = kPrompt;
  ASSERT_TRUE(seq.window.Widen(kPrompt).ok());
  // Chunks of 100: passes that neither end the prompt nor evict do not update MAW.
  for (int64_t i = 0; i < kPrompt; i += 100) {
    const std::vector<int32_t> chunk(prompt.begin() + i, prompt.begin() + i + 100);
    ASSERT_FALSE(Step(seq, chunk).empty());
  }
  EXPECT_EQ(seq.offloaded_entries(), 0);
  EXPECT_FALSE(seq.window.widened());
  EXPECT_FALSE(seq.window.PendingEvictions().empty());
  ASSERT_TRUE(runner_->SettleEvictions(seq).ok());
  EXPECT_FALSE(seq.window.relaid());
  EXPECT_EQ(seq.offloaded_entries() + seq.device_entries(), kPrompt);
  EXPECT_LE(seq.device_entries(), 4 + 32);
  for (int step = 0; step < 3; ++step) ASSERT_FALSE(Step(seq, {403}).empty());
  const std::vector<double> share = seq.MeanSelectedShare();
  ASSERT_EQ(share.size(), static_cast<size_t>(c.num_layers));
  for (size_t l = 0; l < share.size(); ++l) {
    EXPECT_GT(share[l], 0.0) << "layer " << l;
    EXPECT_LT(share[l], 1.0) << "layer " << l;
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
