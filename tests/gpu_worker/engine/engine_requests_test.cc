// Engine request handling on stories260k: validation (INVALID_ARGUMENT with a message, and the
// engine keeps serving), sessions (multi-turn, close, nothing left on the CPU node), stop
// strings, seeded sampling.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/generation.h"

namespace tandem::gpu_worker {
namespace {

class EngineRequests : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    options.nodes.embedded.pool_bytes = 64ull << 20;
    options.default_window = 32;
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  GenerateRequest Valid() const {
    GenerateRequest r;
    r.prompt_text = "Once upon a time";
    r.max_tokens = 8;
    return r;
  }

  void ExpectInvalid(const GenerateRequest& r, const std::string& needle) {
    auto s = engine_->Generate(r);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find(needle), std::string::npos) << s.status();
    auto ok = engine_->Generate(Valid());   // still serving
    EXPECT_TRUE(ok.ok()) << ok.status();
  }

  v1::StatsResponse NodeStats() { return engine_->nodes().embedded()->node().Stats(); }

  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineRequests, BadRequestsAreInvalidArgument) {
  GenerateRequest r = Valid();
  r.prompt_text.clear();
  ExpectInvalid(r, "prompt");
  r = Valid();
  r.max_tokens = 0;
  ExpectInvalid(r, "max_tokens");
  r.max_tokens = -3;
  ExpectInvalid(r, "max_tokens");
  r = Valid();
  r.prompt_ids = {1, 403, 512};
  ExpectInvalid(r, "512");
  r = Valid();
  r.prompt_ids.assign(600, 5);
  ExpectInvalid(r, "context");
  r = Valid();
  r.beta = -1.0f;
  ExpectInvalid(r, "beta");
  r = Valid();
  r.sampling.temperature = -1.0f;
  ExpectInvalid(r, "temperature");
  r = Valid();
  r.sampling.top_p = 1.5f;
  ExpectInvalid(r, "top_p");
  r = Valid();
  r.window = 4;
  ExpectInvalid(r, "window");
  r = Valid();
  r.session_id = "bad id!";
  ExpectInvalid(r, "session_id");
  auto mode = ParseAttentionMode("fast");
  EXPECT_EQ(mode.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mode.status().message().find("fast"), std::string::npos);
  EXPECT_EQ(*ParseAttentionMode("GPU"), AttentionMode::kGpu);
  EXPECT_EQ(*ParseAttentionMode("hybrid"), AttentionMode::kHybrid);
}

TEST_F(EngineRequests, OneShotHybridRequestLeavesNothingOnTheNode) {
  GenerateRequest r = Valid();
  r.max_tokens = 120;
  r.ignore_eos = true;
  r.mode = AttentionMode::kHybrid;
  auto s = engine_->Generate(r);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->cpu_kv_entries, 0);
  EXPECT_EQ(engine_->open_sessions(), 0u);
  const v1::StatsResponse stats = NodeStats();
  EXPECT_EQ(stats.sessions(), 0u);
  EXPECT_EQ(stats.blocks_in_use(), 0u);
  EXPECT_EQ(stats.used_bytes(), 0u);
}

// Two turns of a kept session in hybrid mode with beta 0 produce the same tokens as the same
// two turns in gpu mode; the second turn re-selects (Reselect) and the session's blocks stay on
// the node until CloseSession.
TEST_F(EngineRequests, MultiTurnHybridMatchesGpuAndCloses) {
  std::vector<std::vector<int32_t>> outputs[2];
  for (int m = 0; m < 2; ++m) {
    const std::string id = m == 0 ? "chat-gpu" : "chat-hybrid";
    for (const char* prompt : {"Once upon a time", " The dog said"}) {
      GenerateRequest r;
      r.session_id = id;
      r.prompt_text = prompt;
      r.max_tokens = 60;
      r.ignore_eos = true;
      r.mode = m == 0 ? AttentionMode::kGpu : AttentionMode::kHybrid;
      r.beta = 0.0f;
      auto s = engine_->Generate(r);
      ASSERT_TRUE(s.ok()) << s.status();
      outputs[m].push_back(s->token_ids);
      EXPECT_EQ(s->session_id, id);
    }
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  EXPECT_EQ(engine_->open_sessions(), 2u);
  EXPECT_GT(NodeStats().blocks_in_use(), 0u);
  EXPECT_TRUE(engine_->CloseSession("chat-hybrid").ok());
  EXPECT_TRUE(engine_->CloseSession("chat-gpu").ok());
  EXPECT_EQ(engine_->CloseSession("chat-gpu").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(NodeStats().blocks_in_use(), 0u);
  EXPECT_EQ(NodeStats().sessions(), 0u);
}

// A continued turn that ends before any of its feed entered the model (e.g. cancelled while it
// waited for its first prefill chunk) leaves the session as the turn before left it, pending
// token and widened window included: the next turn gives what it gives without the stopped one.
TEST_F(EngineRequests, AContinuedTurnStoppedBeforeItsFirstChunkKeepsTheSession) {
  for (AttentionMode mode : {AttentionMode::kGpu, AttentionMode::kHybrid}) {
    SCOPED_TRACE(static_cast<int>(mode));
    auto turn = [&](const std::string& id, const char* prompt,
                    int max_tokens) -> absl::StatusOr<GenerateSummary> {
      GenerateRequest r;
      r.session_id = id;
      r.prompt_text = prompt;
      r.max_tokens = max_tokens;
      r.ignore_eos = true;
      r.mode = mode;
      r.beta = 0.0f;
      return engine_->Generate(r);
    };
    // A prompt of 40+ tokens past the 32-token window: its turn widens the window.
    const char* long_prompt =
        " The dog said that the cat and the bird went to the park to play in the sun with a "
        "big red ball and a little blue kite, and they were very happy all day long";
    ASSERT_TRUE(turn("stopped", "Once upon a time", 9).ok());
    GenerateRequest stopped;
    stopped.session_id = "stopped";
    stopped.prompt_text = long_prompt;
    stopped.max_tokens = 4;
    GenerateCallbacks gone;
    gone.cancelled = [] { return true; };
    auto g = engine_->Begin(stopped, gone, Generation::Clock::now());
    ASSERT_TRUE(g.ok()) << g.status();
    auto ended = engine_->End(**g);
    ASSERT_TRUE(ended.ok()) << ended.status();
    EXPECT_EQ(ended->finish_reason, FinishReason::kCancelled);
    EXPECT_EQ(ended->completion_tokens, 0);
    ASSERT_EQ(engine_->open_sessions(), 1u);
    auto continued = turn("stopped", long_prompt, 12);
    ASSERT_TRUE(continued.ok()) << continued.status();
    // The same two turns in a session that saw no stopped one.
    ASSERT_TRUE(turn("plain", "Once upon a time", 9).ok());
    auto reference = turn("plain", long_prompt, 12);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_EQ(continued->token_ids, reference->token_ids);
    EXPECT_TRUE(engine_->CloseSession("stopped").ok());
    EXPECT_TRUE(engine_->CloseSession("plain").ok());
  }
}

TEST_F(EngineRequests, ContinuedSessionKeepsItsMode) {
  GenerateRequest r = Valid();
  r.session_id = "keep";
  r.mode = AttentionMode::kGpu;
  ASSERT_TRUE(engine_->Generate(r).ok());
  r.mode = AttentionMode::kHybrid;
  auto s = engine_->Generate(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine_->CloseSession("keep").ok());
}

// Every windowed mode keeps the window and sink it was opened with (TierTraits::windowed): a
// continued turn that names others is refused, one that repeats them or names none goes on.
TEST_F(EngineRequests, ContinuedWindowedSessionKeepsItsWindowAndSink) {
  for (AttentionMode mode : {AttentionMode::kHybrid, AttentionMode::kOffload}) {
    SCOPED_TRACE(std::string(AttentionModeName(mode)));
    GenerateRequest r = Valid();
    r.session_id = "window";
    r.mode = mode;
    r.window = 32;
    r.sink = 4;
    ASSERT_TRUE(engine_->Generate(r).ok());
    GenerateRequest other = r;
    other.window = 64;
    ExpectInvalid(other, "keeps its window and sink");
    other = r;
    other.sink = 0;
    ExpectInvalid(other, "keeps its window and sink");
    EXPECT_TRUE(engine_->Generate(r).ok());
    r.window.reset();
    r.sink.reset();
    EXPECT_TRUE(engine_->Generate(r).ok());
    EXPECT_TRUE(engine_->CloseSession("window").ok());
  }
}

TEST_F(EngineRequests, StopStringEndsTheTextBeforeIt) {
  GenerateRequest r = Valid();
  r.max_tokens = 60;
  r.mode = AttentionMode::kGpu;
  auto full = engine_->Generate(r);
  ASSERT_TRUE(full.ok());
  const size_t at = full->text.find("Lily");
  ASSERT_NE(at, std::string::npos) << full->text;
  r.stop = {"Lily"};
  std::string streamed;
  GenerateCallbacks cb;
  cb.on_token = [&](const TokenEvent& e) {
    streamed += e.text;
    return true;
  };
  auto cut = engine_->Generate(r, cb);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->finish_reason, FinishReason::kStop);
  EXPECT_EQ(cut->text, full->text.substr(0, at));
  EXPECT_EQ(streamed, cut->text);
}

TEST_F(EngineRequests, SeededSamplingIsReproducibleAndCancellable) {
  GenerateRequest r = Valid();
  r.max_tokens = 40;
  r.sampling.temperature = 1.0f;
  r.sampling.top_p = 0.9f;
  r.sampling.top_k = 40;
  r.sampling.seed = 1234;
  r.ignore_eos = true;
  auto a = engine_->Generate(r);
  auto b = engine_->Generate(r);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->token_ids, b->token_ids);
  GenerateCallbacks cb;
  cb.on_token = [](const TokenEvent& e) { return e.index < 4; };
  auto c = engine_->Generate(r, cb);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(c->completion_tokens, 5);
}

TEST_F(EngineRequests, InfoDescribesTheModel) {
  const ModelInfo info = engine_->info();
  EXPECT_EQ(info.num_layers, 5);
  EXPECT_EQ(info.num_q_heads, 8);
  EXPECT_EQ(info.num_kv_heads, 4);
  EXPECT_EQ(info.head_dim, 8);
  EXPECT_EQ(info.vocab_size, 512);
  EXPECT_EQ(info.max_context, 512);
  EXPECT_EQ(info.kv_dtype, "f32");
  EXPECT_EQ(info.cpu_nodes, 1u);
  EXPECT_EQ(info.backend, testing::TestBackendName());
}

}  // namespace
}  // namespace tandem::gpu_worker
