// The engine against the real models' goldens (../shared/models/*/golden.json), in `gpu` mode
// (all KV on the device) and in `hybrid` mode with beta = 0 (every offloaded entry selected, so
// hybrid attention is exact): stories260k's greedy story, gutenberg-14m's greedy_32 and its
// perplexity at 8192 tokens over the 12 eval books.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/engine.h"

namespace tandem::gpu_worker {
namespace {

using testing::ModelDir;
using testing::ReadJson;
using testing::ReadText;
using testing::SharedDir;

std::unique_ptr<Engine> MakeEngine(const std::string& model, int64_t chunk = 512) {
  EngineOptions options;
  options.model_dir = ModelDir(model).string();
  options.backend = testing::TestBackendName();
  options.prefill_chunk = chunk;
  options.nodes.embedded.pool_bytes = 256ull << 20;
  auto engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

std::vector<int32_t> Ids(const nlohmann::json& array) {
  std::vector<int32_t> ids;
  for (const auto& v : array) ids.push_back(v.get<int32_t>());
  return ids;
}

class Stories260k : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
    golden_ = ReadJson(ModelDir("stories260k") / "golden.json");
    engine_ = MakeEngine("stories260k");
    ASSERT_NE(engine_, nullptr);
  }

  // The golden continuation after "Once upon a time" (the prompt is its first 5 ids).
  std::vector<int32_t> Continuation() const {
    std::vector<int32_t> all = Ids(golden_["greedy_ids"]);
    return {all.begin() + 5, all.end()};
  }

  nlohmann::json golden_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(Stories260k, PromptTokenizesToTheGoldenPrefix) {
  auto ids = engine_->Tokenize("Once upon a time", true);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, Ids(golden_["prompt_text_equivalent_ids"]));
}

TEST_F(Stories260k, GpuModeContinuesWithTheGoldenStory) {
  GenerateRequest request;
  request.prompt_text = "Once upon a time";
  request.max_tokens = static_cast<int64_t>(Continuation().size());
  request.mode = AttentionMode::kGpu;
  std::string streamed;
  GenerateCallbacks callbacks;
  callbacks.on_token = [&](const TokenEvent& e) {
    streamed += e.text;
    return true;
  };
  auto summary = engine_->Generate(request, callbacks);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->token_ids, Continuation());
  const std::string golden_text = golden_["greedy_text"].get<std::string>();
  EXPECT_EQ(summary->text, golden_text.substr(std::string("Once upon a time").size()));
  EXPECT_EQ(streamed, summary->text);
  EXPECT_EQ(summary->prompt_tokens, 5);
  EXPECT_EQ(summary->finish_reason, FinishReason::kLength);
  EXPECT_EQ(summary->cpu_kv_entries, 0);
}

TEST_F(Stories260k, HybridBetaZeroContinuesWithTheGoldenStory) {
  GenerateRequest request;
  request.prompt_text = "Once upon a time";
  request.max_tokens = static_cast<int64_t>(Continuation().size());
  request.mode = AttentionMode::kHybrid;
  request.beta = 0.0f;
  request.window = 16;
  request.sink = 4;
  auto summary = engine_->Generate(request);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->token_ids, Continuation());
  EXPECT_GT(summary->cpu_kv_entries, 0);
  EXPECT_LE(summary->device_kv_entries, 4 + 16);
  EXPECT_FALSE(summary->degraded);
}

class Gutenberg14m : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
    TANDEM_SKIP_WITHOUT_DATA("gutenberg-eval");  // the golden prompts are taken from its books
    TANDEM_SKIP_WITHOUT_BACKEND();
    golden_ = ReadJson(ModelDir("gutenberg-14m") / "golden.json");
    engine_ = MakeEngine("gutenberg-14m");
    ASSERT_NE(engine_, nullptr);
  }

  std::vector<int32_t> BookTokens(const std::string& book, size_t count) {
    const std::string text = ReadText(SharedDir() / "data" / "gutenberg-eval" / book);
    auto ids = engine_->Tokenize(text, /*add_bos=*/false);
    EXPECT_TRUE(ids.ok()) << ids.status();
    if (!ids.ok() || ids->size() < count) return {};
    ids->resize(count);
    return *ids;
  }

  nlohmann::json golden_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(Gutenberg14m, GpuModeReproducesGreedy32) {
  const nlohmann::json& g = golden_["golden_prompt"];
  GenerateRequest request;
  request.prompt_ids = BookTokens(g["book"].get<std::string>(), g["first_tokens"].get<size_t>());
  ASSERT_FALSE(request.prompt_ids.empty());
  request.max_tokens = 32;
  request.ignore_eos = true;
  request.mode = AttentionMode::kGpu;
  auto summary = engine_->Generate(request);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->token_ids, Ids(g["greedy_32"]));
}

TEST_F(Gutenberg14m, HybridBetaZeroReproducesGreedy32) {
  const nlohmann::json& g = golden_["golden_prompt"];
  GenerateRequest request;
  request.prompt_ids = BookTokens(g["book"].get<std::string>(), g["first_tokens"].get<size_t>());
  ASSERT_FALSE(request.prompt_ids.empty());
  request.max_tokens = 32;
  request.ignore_eos = true;
  request.mode = AttentionMode::kHybrid;
  request.beta = 0.0f;
  request.window = 64;
  request.sink = 4;
  auto summary = engine_->Generate(request);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->token_ids, Ids(g["greedy_32"]));
  // 544 positions, at most 4 + 64 on the device: >= 80% of the KV is on the CPU node.
  const double total = summary->cpu_kv_entries + summary->device_kv_entries;
  EXPECT_GE(summary->cpu_kv_entries / total, 0.8);
}

// Full attention over the first 8192 tokens of each eval book: the perplexity of golden.json
// (Hugging Face transformers, bf16) within 1%.
TEST_F(Gutenberg14m, GpuModePerplexityAt8192MatchesGolden) {
  double nll = 0.0;
  int64_t predictions = 0;
  for (const auto& book : golden_["eval_books"]) {
    EvaluateRequest request;
    request.ids = BookTokens(book.get<std::string>(), 8192);
    ASSERT_EQ(request.ids.size(), 8192u) << book;
    request.mode = AttentionMode::kGpu;
    auto result = engine_->Evaluate(request);
    ASSERT_TRUE(result.ok()) << result.status();
    nll += result->nll_sum;
    predictions += result->predictions;
  }
  EXPECT_EQ(predictions, golden_["ppl_tokens"].get<int64_t>());
  const double ppl = std::exp(nll / predictions);
  const double golden = golden_["ppl_at_8192"].get<double>();
  std::printf("perplexity %.4f, golden %.4f (%+.3f%%)\n", ppl, golden,
              100.0 * (ppl / golden - 1.0));
  EXPECT_NEAR(ppl / golden, 1.0, 0.01);
}

}  // namespace
}  // namespace tandem::gpu_worker
