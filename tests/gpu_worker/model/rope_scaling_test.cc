// The long-context RoPE scalings (yarn, dynamic) and sliding windows of config.json: parsing,
// and the inverse frequencies and attention factor against the values transformers 5.17 computed
// for the fixture models (rope_fixtures/*/reference.json, written by rope_reference.py).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/gpu_worker/model_config.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::HasSubstr;

const std::filesystem::path kFixtures = TANDEM_ROPE_FIXTURES;

nlohmann::json ReadJsonFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

// A small config of `model_type` with `extra` fields appended (each starting with a comma).
std::string Config(const std::string& model_type, const std::string& extra) {
  return absl::StrCat(R"({"model_type": ")", model_type, R"(", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 4096)",
                      extra, "}");
}

ModelConfig Parse(const std::string& text) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

// Relative difference within `rel` (f32 math on both sides; pow may differ by an ulp or two).
void ExpectNear(const std::vector<float>& got, const nlohmann::json& want, double rel,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = want[i].get<double>();
    EXPECT_NEAR(got[i], w, rel * std::abs(w)) << what << " [" << i << "]";
  }
}

class FixtureRope : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureRope, FrequenciesAndScalingMatchTransformers) {
  const std::filesystem::path dir = kFixtures / GetParam();
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const nlohmann::json reference = ReadJsonFile(dir / "reference.json");
  const nlohmann::json& rope = reference["rope"];
  // The table before any forward, and after one forward of the whole prompt (dynamic
  // recomputes it for the prompt's length; the others keep it).
  ExpectNear(RopeInvFreq(*config), rope["inv_freq_init"], 2e-7, "init");
  const int64_t prompt = static_cast<int64_t>(reference["prompt"].size());
  ExpectNear(RopeInvFreq(*config, prompt), rope["inv_freq_after_single"], 2e-7, "after");
  EXPECT_NEAR(RopeAttentionScaling(*config), rope["attention_scaling"].get<double>(), 1e-7);
  EXPECT_EQ(RopeDependsOnLength(*config), GetParam() == "mistral_dynamic");
}

INSTANTIATE_TEST_SUITE_P(Models, FixtureRope,
                         ::testing::Values("qwen2_yarn", "llama_yarn", "mistral_dynamic"));

TEST(RopeScalingTest, Qwen25YarnReadsAsTransformers5) {
  // Qwen2.5-7B-Instruct's README asks for exactly this block for contexts past 32768.
  const ModelConfig c = Parse(Config("qwen2", R"(, "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})"));
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_TRUE(c.rope_scaling.truncate);
  // 0.1 · ln(4) + 1, both q and k scaled by it.
  EXPECT_NEAR(RopeAttentionScaling(c), 0.1 * std::log(4.0) + 1.0, 1e-7);
  // max_position_embeddings 4096 here, but yarn extends original · factor = 131072.
  EXPECT_EQ(ModelContextLimit(c), 131072);
}

TEST(RopeScalingTest, YarnWithoutOriginalLengthUsesMaxPositions) {
  const ModelConfig c =
      Parse(Config("llama", R"(, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
        "rope_theta": 10000.0, "attention_factor": 1.25, "beta_fast": 0})"));
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);  // transformers: `beta_fast or 32`
  EXPECT_FLOAT_EQ(RopeAttentionScaling(c), 1.25f);
  EXPECT_EQ(ModelContextLimit(c), 8192);
}

TEST(RopeScalingTest, YarnNullFactorAndTopLevelOriginalLength) {
  // "factor": null: max_position_embeddings / original (transformers' DeepSeek-V3 branch).
  const ModelConfig ratio = Parse(Config("llama", R"(, "rope_scaling": {"type": "yarn",
    "factor": null, "original_max_position_embeddings": 1024})"));
  EXPECT_EQ(ratio.rope_scaling.factor, 4.0);
  // A top-level original_max_position_embeddings (Phi-3 style) wins over the scaling's.
  const ModelConfig top = Parse(Config("llama", R"(, "original_max_position_embeddings": 2048,
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024})"));
  EXPECT_EQ(top.rope_scaling.original_max_position_embeddings, 2048);
  EXPECT_EQ(ModelContextLimit(top), 4096);
}

TEST(RopeScalingTest, YarnRampKeepsFastDimensionsAndInterpolatesSlowOnes) {
  const ModelConfig c = Parse(Config("llama", R"(, "rope_scaling": {"rope_type": "yarn",
    "factor": 8.0, "original_max_position_embeddings": 4096})"));
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  const std::vector<float> yarn = RopeInvFreq(c), base = RopeInvFreq(plain);
  // head_dim 16: dims below floor(16·ln(4096/(64π))/(2 ln 10⁴)) = 2 rotate > 32 times in the
  // original context and are kept; those past ceil(16·ln(4096/2π)/(2 ln 10⁴)) = 6 are divided
  // by the factor.
  EXPECT_EQ(yarn[0], base[0]);
  EXPECT_EQ(yarn[1], base[1]);
  EXPECT_LT(yarn[3], base[3]);
  EXPECT_GT(yarn[3], base[3] / 8);
  EXPECT_FLOAT_EQ(yarn[7], base[7] / 8);
}

TEST(RopeScalingTest, DynamicIsPlainUpToMaxPositionsThenGrowsTheBase) {
  const ModelConfig c = Parse(Config("llama", R"(, "rope_scaling": {"type": "dynamic",
    "factor": 2.0})"));
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  EXPECT_EQ(RopeInvFreq(c), RopeInvFreq(plain));
  EXPECT_EQ(RopeInvFreq(c, 4096), RopeInvFreq(plain));
  // Past 4096 the base is theta · (2·L/4096 - 1)^(16/14): lower frequencies, first one kept.
  plain.rope_theta = 10000.0 * std::pow(2.0 * 8192 / 4096 - 1, 16.0 / 14.0);
  const std::vector<float> grown = RopeInvFreq(c, 8192), want = RopeInvFreq(plain);
  for (size_t i = 0; i < grown.size(); ++i) EXPECT_NEAR(grown[i], want[i], 1e-6 * want[i]);
  EXPECT_EQ(grown[0], 1.0f);
  EXPECT_TRUE(RopeDependsOnLength(c));
  EXPECT_FLOAT_EQ(RopeAttentionScaling(c), 1.0f);
  EXPECT_EQ(ModelContextLimit(c), 8192);
}

TEST(RopeScalingTest, FactorsBeyondAnyModelAreInvalidArgument) {
  // model_config_fuzzer's find: a dynamic factor of 3e118 made every frequency NaN.
  for (const std::string& scaling :
       {std::string(R"({"type": "dynamic", "factor": 3e118})"),
        std::string(R"({"type": "linear", "factor": 2e6})"),
        std::string(R"({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1e9})")}) {
    absl::StatusOr<ModelConfig> c =
        ParseModelConfig(Config("llama", absl::StrCat(R"(, "rope_scaling": )", scaling)));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << scaling;
    EXPECT_THAT(c.status().message(), HasSubstr("rope_scaling.")) << scaling;
  }
  // The largest real ones still load.
  const ModelConfig c = Parse(Config("llama", R"(, "rope_scaling": {"type": "dynamic",
    "factor": 64.0})"));
  for (float f : RopeInvFreq(c, 1 << 30)) EXPECT_TRUE(std::isfinite(f) && f >= 0.0f);
}

TEST(RopeScalingTest, BasesAtOrBelowOneOrBeyondAnyModelAreInvalidArgument) {
  // model_config_fuzzer's finds: rope_theta 1e-300 (f32 base 0: infinite frequencies) and a yarn
  // base of 1 (ln 1 = 0 in the correction range: NaN frequencies).
  for (const std::string& extra :
       {std::string(R"(, "rope_theta": 1e-300)"), std::string(R"(, "rope_theta": 0.5)"),
        std::string(R"(, "rope_theta": 1e300)"),
        std::string(R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0,
          "factor": 4.0, "original_max_position_embeddings": 1024})")}) {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(Config("qwen2", extra));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << extra;
    EXPECT_THAT(c.status().message(), HasSubstr("rope_theta")) << extra;
  }
  // Bases just above 1 and the largest real ones load with finite frequencies.
  for (const std::string& theta : {std::string("1.0001"), std::string("5e8")}) {
    const ModelConfig c = Parse(Config("qwen2", absl::StrCat(R"(, "rope_parameters":
      {"rope_type": "yarn", "rope_theta": )", theta, R"(, "factor": 4.0,
      "original_max_position_embeddings": 1024})")));
    for (float f : RopeInvFreq(c, 4096)) EXPECT_TRUE(std::isfinite(f) && f >= 0.0f) << theta;
  }
}

TEST(RopeScalingTest, ContextLimitOfTheOtherTypes) {
  EXPECT_EQ(ModelContextLimit(Parse(Config("llama", ""))), 4096);
  EXPECT_EQ(ModelContextLimit(Parse(Config("llama", R"(, "rope_scaling": {"type": "linear",
    "factor": 4.0})"))),
            16384);
  EXPECT_EQ(ModelContextLimit(Parse(Config("llama", R"(, "rope_scaling": {"rope_type": "llama3",
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512})"))),
            4096);
}

TEST(RopeScalingTest, GeometryConfigJsonWritesTheScalingsBack) {
  for (const std::string& scaling :
       {std::string(R"({"type": "dynamic", "factor": 2.5})"),
        std::string(R"({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
          "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.2, "truncate": false})"),
        std::string(R"({"rope_type": "yarn", "factor": 8.0, "mscale": 1.0,
          "mscale_all_dim": 0.5})")}) {
    const ModelConfig c = Parse(Config("llama", absl::StrCat(R"(, "rope_scaling": )", scaling)));
    absl::StatusOr<std::string> text = GeometryConfigJson(c);
    ASSERT_TRUE(text.ok()) << text.status();
    const ModelConfig back = Parse(*text);
    EXPECT_EQ(RopeInvFreq(back, 9000), RopeInvFreq(c, 9000)) << scaling;
    EXPECT_EQ(RopeAttentionScaling(back), RopeAttentionScaling(c)) << scaling;
    EXPECT_EQ(ModelContextLimit(back), ModelContextLimit(c)) << scaling;
  }
}

TEST(SlidingWindowTest, MistralWindowCapsTheContext) {
  // Mistral-7B-v0.1: a 4096-token window over 32768 positions.
  const ModelConfig v01 = Parse(Config("mistral", R"(, "sliding_window": 1024)"));
  EXPECT_EQ(v01.sliding_window, 1024);
  EXPECT_EQ(ModelContextLimit(v01), 1024);
  // Absent means MistralConfig's default 4096; null (v0.2 and later) means full attention.
  EXPECT_EQ(Parse(Config("mistral", "")).sliding_window, 4096);
  const ModelConfig v02 = Parse(Config("mistral", R"(, "sliding_window": null)"));
  EXPECT_EQ(v02.sliding_window, 0);
  EXPECT_EQ(ModelContextLimit(v02), 4096);
  // A window longer than the positions changes nothing.
  EXPECT_EQ(ModelContextLimit(Parse(Config("mistral", R"(, "sliding_window": 100000)"))), 4096);
}

TEST(SlidingWindowTest, Qwen2WindowOnlyWithUseSlidingWindow) {
  // Qwen2-7B-Instruct ships use_sliding_window false with a window of 131072: ignored.
  const ModelConfig off = Parse(Config("qwen2", R"(, "use_sliding_window": false,
    "sliding_window": 1024, "max_window_layers": 2)"));
  EXPECT_EQ(off.sliding_window, 0);
  EXPECT_EQ(ModelContextLimit(off), 4096);
  const ModelConfig on = Parse(Config("qwen2", R"(, "use_sliding_window": true,
    "sliding_window": 1024, "max_window_layers": 2)"));
  EXPECT_EQ(on.sliding_window, 1024);
  EXPECT_EQ(ModelContextLimit(on), 1024);
  // Windows start at layer max_window_layers: with 4 layers and 4 full ones, none has one.
  EXPECT_EQ(Parse(Config("qwen2", R"(, "use_sliding_window": true, "sliding_window": 1024,
    "max_window_layers": 4)"))
                .sliding_window,
            0);
  // Llama has no sliding window; a stray field is not read.
  EXPECT_EQ(Parse(Config("llama", R"(, "sliding_window": 16)")).sliding_window, 0);
}

TEST(SlidingWindowTest, BadWindowsAreInvalidArgument) {
  for (const std::string& extra :
       {std::string(R"(, "sliding_window": 0)"), std::string(R"(, "sliding_window": "4k")")}) {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(Config("mistral", extra));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << extra;
    EXPECT_THAT(c.status().message(), HasSubstr("sliding_window")) << extra;
  }
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Config("qwen2", R"(, "use_sliding_window": "yes", "sliding_window": 16)"));
  EXPECT_THAT(c.status().message(), HasSubstr("use_sliding_window"));
}

}  // namespace
}  // namespace tandem::gpu_worker
