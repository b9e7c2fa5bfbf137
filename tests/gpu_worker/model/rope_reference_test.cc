// tandem's forward pass of tiny Llama / Qwen2 / Mistral / Qwen3 models with the long-context RoPE
// scalings (yarn, dynamic NTK) against reference forwards of the same weights
// (rope_fixtures/<model>/, written by rope_reference.py; 100-token prompts past the 64
// original positions):
//   reference.json         transformers 5.17 (LlamaForCausalLM / Qwen2ForCausalLM /
//                          MistralForCausalLM, f32, eager attention) on the random prompt of
//                          prompt.json, computed on the GPU host
//   python_reference.json  the script's plain-Python f64 forward on the same prompt (its rope
//                          tables and its logits were checked against transformers' first)
// (dropping yarn's attention factor or dynamic's per-sequence frequencies fails both)
// each as one forward of the whole prompt ("single") and as a DynamicCache-style run in chunks
// 48, 32, then one token at a time ("chunked"): dynamic NTK recomputes the frequencies of every
// forward from its last position + 1 while cached keys keep theirs.
// Compared: log p(prompt[t+1] | prompt[..t]) at every position and the last logits, within
// kTolerance (f32 here against f32 / f64 there, logits of magnitude up to ~30).
// The same source builds a cpu-backend test and, with TANDEM_TEST_BACKEND_CUDA, a cuda one
// (label gpu) that skips without a GPU.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

// The checkout's fixtures, or TANDEM_ROPE_FIXTURES_DIR (a test executable run on another host).
std::filesystem::path Fixtures() {
  const char* dir = std::getenv("TANDEM_ROPE_FIXTURES_DIR");
  return dir != nullptr ? std::filesystem::path(dir) : std::filesystem::path(TANDEM_ROPE_FIXTURES);
}
// Absolute, plus this share of the value (f32 rounding grows with the logit's magnitude).
constexpr double kTolerance = 2e-4;
constexpr double kRelativeTolerance = 2e-5;

nlohmann::json ReadJsonFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::vector<int32_t> Ints(const nlohmann::json& array) {
  std::vector<int32_t> out;
  for (const auto& v : array) out.push_back(v.get<int32_t>());
  return out;
}

void ExpectClose(const std::vector<float>& got, const nlohmann::json& want, size_t offset,
                 const std::string& what) {
  ASSERT_LE(offset + got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want[offset + i].get<double>();
    EXPECT_NEAR(got[i], w, kTolerance + kRelativeTolerance * std::abs(w))
        << what << " [" << offset + i << "]";
  }
}

// log p(target) from one row of logits, in double.
double LogProb(const float* logits, int64_t vocab, int32_t target) {
  double m = logits[0];
  for (int64_t i = 1; i < vocab; ++i) m = std::max(m, static_cast<double>(logits[i]));
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) z += std::exp(logits[i] - m);
  return logits[target] - m - std::log(z);
}

class RopeReference : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend =
#ifdef TANDEM_TEST_BACKEND_CUDA
        CreateCudaBackend(0);
#else
        CreateCpuBackend(0);
#endif
    if (!backend.ok()) GTEST_SKIP() << "no backend: " << backend.status();
    backend_ = std::move(*backend);
    dir_ = Fixtures() / GetParam();
    auto model = LoadModel(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    auto dm = DeviceModel::Upload(*model_, *backend_);
    ASSERT_TRUE(dm.ok()) << dm.status();
    device_model_ = std::move(*dm);
    RunnerOptions options;
    options.max_chunk = 128;
    auto runner = ModelRunner::Create(*backend_, *device_model_, options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner);
  }

  std::unique_ptr<Sequence> MakeSequence(const std::string& id) {
    const ModelConfig& c = model_->config;
    WindowOptions wo;
    wo.block = 16;
    wo.max_chunk = 128;
    wo.max_context = 128;
    wo.window = WindowOptions::kUnlimited;
    wo.sink = 0;
    auto cache =
        WindowCache::Create(*backend_, {c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, wo);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return nullptr;
    return std::make_unique<Sequence>(id, AttentionMode::kGpu, std::move(*cache));
  }

  // Feeds `prompt` to a fresh sequence in `chunks` (one Forward each) and compares every
  // position's target log-prob and the last logits with want["target_logprobs"/"last_logits"].
  void RunAndCompare(const std::vector<int32_t>& prompt, const std::vector<int32_t>& chunks,
                     const nlohmann::json& want, const std::string& what) {
    std::unique_ptr<Sequence> seq = MakeSequence(what);
    ASSERT_NE(seq, nullptr);
    std::vector<int32_t> targets(prompt.begin() + 1, prompt.end());
    targets.push_back(-1);
    std::vector<float> logprobs(prompt.size());
    size_t start = 0;
    for (int32_t n : chunks) {
      ForwardOptions options;
      options.targets = targets.data() + start;
      options.logprobs = logprobs.data() + start;
      absl::Status s = runner_->Forward(*seq, prompt.data() + start, n, options);
      ASSERT_TRUE(s.ok()) << what << ": " << s;
      start += static_cast<size_t>(n);
    }
    ASSERT_EQ(start, prompt.size());
    logprobs.pop_back();  // the last position has no target
    ExpectClose(logprobs, want["target_logprobs"], 0, what + " target logprobs");
    absl::StatusOr<std::vector<float>> last = runner_->LastLogitsToHost();
    ASSERT_TRUE(last.ok()) << last.status();
    ExpectClose(*last, want["last_logits"], 0, what + " last logits");
  }

  std::unique_ptr<Backend> backend_;
  std::filesystem::path dir_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<DeviceModel> device_model_;
  std::unique_ptr<ModelRunner> runner_;
};

TEST_P(RopeReference, MatchesTransformers) {
  const nlohmann::json ref = ReadJsonFile(dir_ / "reference.json");
  const std::vector<int32_t> prompt = Ints(ref["prompt"]);
  RunAndCompare(prompt, {static_cast<int32_t>(prompt.size())}, ref["single"], "hf single");
  RunAndCompare(prompt, Ints(ref["chunks"]), ref["chunked"], "hf chunked");
}

TEST_P(RopeReference, MatchesThePythonForwardOnARandomPrompt) {
  const nlohmann::json ref = ReadJsonFile(dir_ / "python_reference.json");
  const std::vector<int32_t> prompt = Ints(ref["prompt"]);
  RunAndCompare(prompt, {static_cast<int32_t>(prompt.size())}, ref["single"], "py single");
  RunAndCompare(prompt, Ints(ref["chunks"]), ref["chunked"], "py chunked");
}

// Two sequences in one pass at different lengths: a length-dependent RoPE (dynamic) gives each
// sequence's rows its own frequencies. A feeds chunks 48, 32 (ending at 48 < 64, then 80); B
// 70, 30 in the same passes; each pass's last row per sequence is checked.
TEST_P(RopeReference, BatchedSequencesKeepTheirOwnLengths) {
  const nlohmann::json ref = ReadJsonFile(dir_ / "python_reference.json");
  const std::vector<int32_t> prompt = Ints(ref["prompt"]);
  const std::vector<int32_t> chunks_a = {48, 32};
  const std::vector<int32_t> chunks_b = Ints(ref["chunks_b"]);
  ASSERT_EQ(chunks_b.size(), 2u);
  std::unique_ptr<Sequence> a = MakeSequence("a"), b = MakeSequence("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int64_t vocab = model_->config.vocab_size;
  size_t start_a = 0, start_b = 0;
  for (size_t step = 0; step < 2; ++step) {
    const std::vector<ModelRunner::BatchEntry> entries = {
        {a.get(), prompt.data() + start_a, chunks_a[step]},
        {b.get(), prompt.data() + start_b, chunks_b[step]}};
    absl::Status s = runner_->Step(entries);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<float> logits(2 * static_cast<size_t>(vocab));
    ASSERT_TRUE(
        backend_->CopyToHost(logits.data(), runner_->batch_logits(), logits.size() * 4).ok());
    start_a += static_cast<size_t>(chunks_a[step]);
    start_b += static_cast<size_t>(chunks_b[step]);
    if (start_a < prompt.size()) {
      const double want = ref["chunked"]["target_logprobs"][start_a - 1].get<double>();
      EXPECT_NEAR(LogProb(logits.data(), vocab, prompt[start_a]), want,
                  kTolerance + kRelativeTolerance * std::abs(want))
          << "a at " << start_a;
    }
    if (start_b < prompt.size()) {
      const double want = ref["chunked_b"]["target_logprobs"][start_b - 1].get<double>();
      EXPECT_NEAR(LogProb(logits.data() + vocab, vocab, prompt[start_b]), want,
                  kTolerance + kRelativeTolerance * std::abs(want))
          << "b at " << start_b;
    } else {
      std::vector<float> last(logits.begin() + vocab, logits.end());
      ExpectClose(last, ref["chunked_b"]["last_logits"], 0, "b last logits");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, RopeReference,
                         ::testing::Values("qwen2_yarn", "llama_yarn", "mistral_dynamic",
                                           "qwen3_yarn"));

}  // namespace
}  // namespace tandem::gpu_worker
