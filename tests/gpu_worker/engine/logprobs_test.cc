// Generate's logprobs on stories260k (vocab 512): ComputeStepLogprobs on hand-made rows, then the
// engine's per-token logprob / top_logprobs against an independent double-precision log-softmax of
// the logits a separate ModelRunner computes for the same tokens (gpu mode, f32 KV on both sides),
// for greedy and for temperature sampling (the values are those of the raw logits either way).
#include "tandem/gpu_worker/logprobs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "runner_fixture.h"
#include "tandem/gpu_worker/engine.h"

namespace tandem::gpu_worker {
namespace {

// log_softmax(row) in double, the reference.
std::vector<double> LogSoftmax(const std::vector<float>& row) {
  double max = -std::numeric_limits<double>::infinity();
  for (float x : row) max = std::max(max, static_cast<double>(x));
  double sum = 0.0;
  for (float x : row) sum += std::exp(static_cast<double>(x) - max);
  std::vector<double> out(row.size());
  for (size_t i = 0; i < row.size(); ++i) out[i] = row[i] - max - std::log(sum);
  return out;
}

TEST(ComputeStepLogprobs, SmallRowWithTies) {
  // logits 1, 3, 2, 3: lse = log(e + 2e^3 + e^2).
  const std::vector<float> row = {1.0f, 3.0f, 2.0f, 3.0f};
  const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  auto lp = ComputeStepLogprobs(row.data(), 4, /*sampled=*/2, /*top_n=*/3);
  ASSERT_TRUE(lp.ok()) << lp.status();
  EXPECT_NEAR(lp->sampled, 2.0 - lse, 1e-6);
  ASSERT_EQ(lp->top.size(), 3u);
  EXPECT_EQ(lp->top[0].token_id, 1);  // equal logits: lower id first
  EXPECT_EQ(lp->top[1].token_id, 3);
  EXPECT_EQ(lp->top[2].token_id, 2);
  EXPECT_NEAR(lp->top[0].logprob, 3.0 - lse, 1e-6);
  EXPECT_NEAR(lp->top[2].logprob, 2.0 - lse, 1e-6);

  auto none = ComputeStepLogprobs(row.data(), 4, 0, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->top.empty());
  EXPECT_NEAR(none->sampled, 1.0 - lse, 1e-6);
}

TEST(ComputeStepLogprobs, LargeLogitsDoNotOverflow) {
  // exp(1000) overflows a double: the max is subtracted first.
  const std::vector<float> row = {1000.0f, 1000.0f};
  auto lp = ComputeStepLogprobs(row.data(), 2, 1, 2);
  ASSERT_TRUE(lp.ok()) << lp.status();
  EXPECT_NEAR(lp->sampled, -std::log(2.0), 1e-6);
  EXPECT_NEAR(lp->top[1].logprob, -std::log(2.0), 1e-6);
}

TEST(ComputeStepLogprobs, BadInputsAreErrors) {
  std::vector<float> row(30, 0.5f);
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 30, 30, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 30, -1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 30, 0, kMaxTopLogprobs + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 3, 0, 4).status().code(),  // more than the vocab
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 0, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  row[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 30, 0, 2).status().code(), absl::StatusCode::kInternal);
  row[7] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ComputeStepLogprobs(row.data(), 30, 0, 2).status().code(), absl::StatusCode::kInternal);
}

class EngineLogprobs : public testing::Stories260kRunnerTest {
 protected:
  void SetUp() override {
    Stories260kRunnerTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    options.default_mode = AttentionMode::kGpu;
    options.nodes.embedded.pool_bytes = 16ull << 20;
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  // Runs `request`, returns its token events.
  std::vector<TokenEvent> Run(const GenerateRequest& request) {
    std::vector<TokenEvent> events;
    GenerateCallbacks callbacks;
    callbacks.on_token = [&](const TokenEvent& e) {
      events.push_back(e);
      return true;
    };
    auto summary = engine_->Generate(request, callbacks);
    EXPECT_TRUE(summary.ok()) << summary.status();
    return events;
  }

  // The logits after each prefix prompt + generated[0..i), i = 0..generated.size()-1, from a
  // fresh gpu-mode sequence on this fixture's own runner.
  std::vector<std::vector<float>> ReferenceRows(const std::vector<int32_t>& prompt,
                                                const std::vector<int32_t>& generated) {
    const ModelConfig& c = model_->config;
    WindowOptions wo;
    wo.block = 16;
    wo.max_chunk = 512;
    wo.max_context = c.max_position_embeddings;
    wo.window = WindowOptions::kUnlimited;
    wo.sink = 0;
    auto cache = WindowCache::Create(
        *backend_, WindowGeometry{c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, wo);
    EXPECT_TRUE(cache.ok()) << cache.status();
    std::vector<std::vector<float>> rows;
    if (!cache.ok()) return rows;
    Sequence seq("reference", AttentionMode::kGpu, std::move(*cache));
    rows.push_back(Step(seq, prompt));
    for (size_t i = 0; i + 1 < generated.size(); ++i) rows.push_back(Step(seq, {generated[i]}));
    return rows;
  }

  // Every event against the reference: the sampled token's value, the candidates' ids (up to
  // ties) and values, their order, their text.
  void ExpectMatchesReference(const GenerateRequest& request,
                              const std::vector<TokenEvent>& events) {
    auto prompt = engine_->Tokenize(request.prompt_text, /*add_bos=*/true);
    ASSERT_TRUE(prompt.ok()) << prompt.status();
    std::vector<int32_t> generated;
    for (const TokenEvent& e : events) generated.push_back(e.token_id);
    const std::vector<std::vector<float>> rows = ReferenceRows(*prompt, generated);
    ASSERT_EQ(rows.size(), events.size());
    for (size_t i = 0; i < events.size(); ++i) {
      SCOPED_TRACE("token " + std::to_string(i));
      const TokenEvent& e = events[i];
      const std::vector<double> ref = LogSoftmax(rows[i]);
      ASSERT_TRUE(e.logprob.has_value());
      EXPECT_NEAR(*e.logprob, ref[e.token_id], 1e-4);
      EXPECT_LE(*e.logprob, 0.0f);
      std::vector<double> sorted = ref;
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      ASSERT_EQ(e.top_logprobs.size(), static_cast<size_t>(request.top_logprobs));
      for (size_t k = 0; k < e.top_logprobs.size(); ++k) {
        const TokenAlternative& t = e.top_logprobs[k];
        EXPECT_NEAR(t.logprob, sorted[k], 1e-4) << "rank " << k;
        EXPECT_NEAR(t.logprob, ref[t.token_id], 1e-4) << "rank " << k;
        if (k > 0) {
          EXPECT_GE(e.top_logprobs[k - 1].logprob, t.logprob);
        }
        const TokenPiece piece = DescribeToken(engine_->tokenizer(), t.token_id);
        EXPECT_EQ(t.raw, piece.raw);
        EXPECT_EQ(t.text, piece.text);
      }
    }
  }

  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineLogprobs, GreedyTokenIsTopOneAndValuesMatchReference) {
  GenerateRequest r;
  r.prompt_text = "Once upon a time";
  r.max_tokens = 8;
  r.ignore_eos = true;
  r.logprobs = true;
  r.top_logprobs = 5;
  const std::vector<TokenEvent> events = Run(r);
  ASSERT_EQ(events.size(), 8u);
  for (const TokenEvent& e : events) {
    ASSERT_FALSE(e.top_logprobs.empty());
    EXPECT_EQ(e.top_logprobs[0].token_id, e.token_id);  // greedy = argmax = top-1
    EXPECT_EQ(e.top_logprobs[0].logprob, *e.logprob);
  }
  ExpectMatchesReference(r, events);
}

// The values are the raw logits' log-softmax: temperature, top_k and top_p change which token is
// drawn, not the reported numbers.
TEST_F(EngineLogprobs, SampledTokensReportRawLogitValues) {
  GenerateRequest r;
  r.prompt_text = "The little dog";
  r.max_tokens = 10;
  r.ignore_eos = true;
  r.sampling.temperature = 1.7f;
  r.sampling.top_k = 40;
  r.sampling.top_p = 0.9f;
  r.sampling.seed = 1234;
  r.logprobs = true;
  r.top_logprobs = kMaxTopLogprobs;
  ExpectMatchesReference(r, Run(r));
}

// Over the whole vocabulary the reported probabilities sum to one (each token's value taken as
// the "sampled" one from the same logits row).
TEST_F(EngineLogprobs, ProbabilitiesOverTheVocabularySumToOne) {
  auto prompt = engine_->Tokenize("Lily saw a bird", true);
  ASSERT_TRUE(prompt.ok());
  const std::vector<std::vector<float>> rows = ReferenceRows(*prompt, {0});
  ASSERT_EQ(rows.size(), 1u);
  const std::vector<float>& row = rows[0];
  double sum = 0.0;
  for (int32_t id = 0; id < static_cast<int32_t>(row.size()); ++id) {
    auto lp = ComputeStepLogprobs(row.data(), static_cast<int64_t>(row.size()), id, 0);
    ASSERT_TRUE(lp.ok()) << lp.status();
    sum += std::exp(static_cast<double>(lp->sampled));
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
}

TEST_F(EngineLogprobs, OffByDefaultAndValidated) {
  GenerateRequest r;
  r.prompt_text = "Once upon a time";
  r.max_tokens = 3;
  for (const TokenEvent& e : Run(r)) {
    EXPECT_FALSE(e.logprob.has_value());
    EXPECT_TRUE(e.top_logprobs.empty());
  }
  r.logprobs = true;  // logprobs alone: the sampled token's value, no candidates
  for (const TokenEvent& e : Run(r)) {
    EXPECT_TRUE(e.logprob.has_value());
    EXPECT_TRUE(e.top_logprobs.empty());
  }
  for (const int32_t bad : {-1, kMaxTopLogprobs + 1}) {
    r.top_logprobs = bad;
    auto s = engine_->Generate(r);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("top_logprobs"), std::string::npos) << s.status();
  }
  r.logprobs = false;
  r.top_logprobs = 2;
  auto s = engine_->Generate(r);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("requires logprobs"), std::string::npos) << s.status();
}

}  // namespace
}  // namespace tandem::gpu_worker
