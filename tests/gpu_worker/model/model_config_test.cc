#include "tandem/gpu_worker/model_config.h"

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model_test_util.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::SharedModelDir;
using testing::TempDir;
using testing::WriteFile;

// A Llama-3.1-8B config.json as transformers 4.x writes it (top-level rope_theta, rope_scaling).
constexpr char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})";

// The default RoPE frequencies in double: 1 / theta^(2i / head_dim).
std::vector<double> DefaultInvFreq(double theta, int head_dim) {
  std::vector<double> inv(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv[i] = 1.0 / std::pow(theta, 2.0 * i / head_dim);
  return inv;
}

// Llama 3.1's frequency scaling (Meta's reference `apply_scaling`), in double.
std::vector<double> Llama3InvFreq(double theta, int head_dim, double factor, double low,
                                  double high, double old_context) {
  std::vector<double> inv = DefaultInvFreq(theta, head_dim);
  const double low_freq_wavelen = old_context / low;
  const double high_freq_wavelen = old_context / high;
  for (double& f : inv) {
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen < high_freq_wavelen) continue;
    if (wavelen > low_freq_wavelen) {
      f /= factor;
      continue;
    }
    const double smooth = (old_context / wavelen - low) / (high - low);
    f = (1 - smooth) * f / factor + smooth * f;
  }
  return inv;
}

void ExpectRelNear(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << "i = " << i;
  }
}

TEST(ModelConfigTest, Stories260kMatchesItsConfigJson) {
  const auto dir = SharedModelDir("stories260k");
  if (!std::filesystem::exists(dir / "config.json")) GTEST_SKIP() << dir << " is absent";
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->hidden_size, 64);
  EXPECT_EQ(config->intermediate_size, 172);
  EXPECT_EQ(config->num_layers, 5);
  EXPECT_EQ(config->num_q_heads, 8);
  EXPECT_EQ(config->num_kv_heads, 4);
  EXPECT_EQ(config->head_dim, 8);
  EXPECT_EQ(config->vocab_size, 512);
  EXPECT_EQ(config->max_position_embeddings, 512);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 10000.0);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(config->weight_dtype, DType::kF32);
}

TEST(ModelConfigTest, Gutenberg14mReadsRopeParameters) {
  const auto dir = SharedModelDir("gutenberg-14m");
  if (!std::filesystem::exists(dir / "config.json")) GTEST_SKIP() << dir << " is absent";
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 384);
  EXPECT_EQ(config->intermediate_size, 1024);
  EXPECT_EQ(config->num_layers, 8);
  EXPECT_EQ(config->num_q_heads, 6);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->vocab_size, 4096);
  EXPECT_EQ(config->max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(config->rope_theta, 100000.0);  // only inside rope_parameters
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_EQ(config->bos_token_id, 0);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(0));
  EXPECT_EQ(config->weight_dtype, DType::kBF16);
  ExpectRelNear(RopeInvFreq(*config), DefaultInvFreq(100000.0, 64), 1e-6);
}

TEST(ModelConfigTest, OlderFormWithLlama3Scaling) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(kLlama31Config);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head_dim, 128);  // absent: 4096 / 32
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(config->rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(config->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(config->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_EQ(config->bos_token_id, 128000);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(config->weight_dtype, DType::kBF16);

  const std::vector<float> inv = RopeInvFreq(*config);
  const std::vector<double> want = Llama3InvFreq(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
  ExpectRelNear(inv, want, 1e-6);
  // The three regimes are all present: unscaled, interpolated, divided by the factor.
  const std::vector<double> plain = DefaultInvFreq(500000.0, 128);
  EXPECT_NEAR(inv[0], plain[0], 1e-7);
  EXPECT_NEAR(inv[63], plain[63] / 8, 1e-6 * plain[63] / 8);
  int interpolated = 0;
  for (int i = 0; i < 64; ++i) {
    if (want[i] < plain[i] * 0.99 && want[i] > plain[i] / 8 * 1.01) ++interpolated;
  }
  EXPECT_GT(interpolated, 0);
}

TEST(ModelConfigTest, NewerRopeParametersLlama3GivesTheSameFrequencies) {
  const char* text = R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})";
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kLlama3);
  ExpectRelNear(RopeInvFreq(*config), Llama3InvFreq(500000.0, 128, 8.0, 1.0, 4.0, 8192.0), 1e-6);
}

TEST(ModelConfigTest, LinearScalingDividesByFactor) {
  const char* text = R"({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
    "rope_theta": 10000, "rope_scaling": {"type": "linear", "factor": 4.0}})";
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(config->num_kv_heads, 4);  // absent: num_attention_heads
  EXPECT_EQ(config->head_dim, 64);
  EXPECT_EQ(config->weight_dtype, DType::kF32);  // no dtype given
  EXPECT_EQ(config->bos_token_id, -1);
  EXPECT_TRUE(config->eos_token_ids.empty());
  std::vector<double> want = DefaultInvFreq(10000.0, 64);
  for (double& f : want) f /= 4;
  ExpectRelNear(RopeInvFreq(*config), want, 1e-6);
}

TEST(ModelConfigTest, Qwen2AlwaysHasQkvBiasAndMistralNullHeadDim) {
  absl::StatusOr<ModelConfig> qwen = ParseModelConfig(R"({"architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "rope_theta": 1000000.0, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645})");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->model_type, "qwen2");
  EXPECT_TRUE(qwen->qkv_bias);
  EXPECT_EQ(qwen->head_dim, 64);
  EXPECT_EQ(qwen->max_position_embeddings, 32768);  // Qwen2Config's default
  EXPECT_DOUBLE_EQ(qwen->rope_theta, 1e6);

  absl::StatusOr<ModelConfig> mistral = ParseModelConfig(R"({"model_type": "mistral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": null,
    "vocab_size": 32768, "torch_dtype": "float16", "rope_scaling": null})");
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->head_dim, 128);
  EXPECT_FALSE(mistral->qkv_bias);
  EXPECT_EQ(mistral->weight_dtype, DType::kF16);

  absl::StatusOr<ModelConfig> llama_bias = ParseModelConfig(R"({"model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 32, "attention_bias": true})");
  ASSERT_TRUE(llama_bias.ok()) << llama_bias.status();
  EXPECT_TRUE(llama_bias->qkv_bias);
}

// Qwen3-8B's config.json (transformers 4.51): q/k norms, no biases, head_dim 128.
TEST(ModelConfigTest, Qwen3HasQkNormsAndNoBiases) {
  absl::StatusOr<ModelConfig> qwen3 = ParseModelConfig(R"({"architectures": ["Qwen3ForCausalLM"],
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_EQ(qwen3->model_type, "qwen3");
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen3->qkv_bias);
  EXPECT_EQ(qwen3->head_dim, 128);
  EXPECT_EQ(qwen3->sliding_window, 0);
  EXPECT_EQ(qwen3->max_position_embeddings, 40960);

  // Qwen3-0.6B's shape without head_dim: Qwen3Config's 128, not hidden / heads (64).
  absl::StatusOr<ModelConfig> small = ParseModelConfig(R"({"model_type": "qwen3",
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936})");
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->head_dim, 128);
  EXPECT_EQ(small->max_position_embeddings, 32768);
  EXPECT_FALSE(small->qkv_bias);

  // No other family member has the norms.
  absl::StatusOr<ModelConfig> qwen2 = ParseModelConfig(R"({"model_type": "qwen2",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 32})");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  EXPECT_FALSE(qwen2->qk_norm);
}

// quantization_config: the FP8 weight schemes load (weight-only: dequantized on upload); every
// other scheme is refused by name rather than read as float weights.
TEST(ModelConfigTest, Fp8QuantizationConfigsAreReadAndOthersRefused) {
  const std::string base = R"({"model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "vocab_size": 32, "torch_dtype": "bfloat16", "quantization_config": )";
  struct Case {
    const char* name;
    const char* quantization_config;
    const char* refusal_part;  // nullptr: loads as "fp8"
  };
  const std::vector<Case> cases = {
      {"fbgemm", R"({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["lm_head"]})",
       nullptr},
      {"compressed-tensors channel", R"({"quant_method": "compressed-tensors",
          "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {"group_0": {
          "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
          "strategy": "channel", "symmetric": true, "dynamic": false},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
          "dynamic": true}}}})",
       nullptr},
      {"fp8 per tensor", R"({"quant_method": "fp8", "activation_scheme": "dynamic"})", nullptr},
      {"fp8 block-wise", R"({"quant_method": "fp8", "weight_block_size": [128, 128]})",
       "weight_block_size"},
      {"int4", R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int",
          "strategy": "group", "group_size": 128}}}})",
       "group_0"},
      {"gptq", R"({"quant_method": "gptq", "bits": 4})", "gptq"},
      {"no method", R"({"bits": 4})", "quant_method"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> config =
        ParseModelConfig(absl::StrCat(base, c.quantization_config, "}"));
    if (c.refusal_part == nullptr) {
      ASSERT_TRUE(config.ok()) << c.name << ": " << config.status();
      EXPECT_EQ(config->quantization, "fp8") << c.name;
      EXPECT_EQ(config->weight_dtype, DType::kBF16) << c.name;
    } else {
      ASSERT_FALSE(config.ok()) << c.name;
      EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
      EXPECT_NE(config.status().message().find(c.refusal_part), absl::string_view::npos)
          << c.name << ": " << config.status();
    }
  }
  absl::StatusOr<ModelConfig> plain = ParseModelConfig(base.substr(0, base.rfind(',')) + "}");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->quantization, "");
}

struct BadConfig {
  const char* name;
  std::string json;
  const char* message_part;  // the error must say what is wrong
};

// A valid small config with `patch` spliced in after the opening brace (later keys override).
std::string Patched(const std::string& patch) {
  return absl::StrCat(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 32)",
                      patch, "}");
}

TEST(ModelConfigTest, BadConfigsAreInvalidArgument) {
  const std::vector<BadConfig> cases = {
      {"not json", "{\"hidden_size\": 64,", "not valid JSON"},
      {"array", "[1, 2]", "expected a JSON object"},
      {"gpt2", R"({"model_type": "gpt2", "n_embd": 768})", "gpt2"},
      {"gpt2 arch", Patched(R"(, "architectures": ["GPT2LMHeadModel"])"), "GPT2LMHeadModel"},
      {"no type", R"({"hidden_size": 64})", "model_type"},
      {"missing hidden", R"({"model_type": "llama", "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32})",
       "hidden_size"},
      {"missing vocab", R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4})",
       "vocab_size"},
      {"odd head_dim", Patched(R"(, "head_dim": 7)"), "head_dim"},
      {"heads not divisible", Patched(R"(, "num_key_value_heads": 3)"), "num_key_value_heads"},
      {"string size", Patched(R"(, "hidden_size": "64")"), "hidden_size"},
      {"float size", Patched(R"(, "hidden_size": 64.5)"), "hidden_size"},
      {"negative size", Patched(R"(, "num_hidden_layers": -1)"), "num_hidden_layers"},
      {"huge vocab", Patched(R"(, "vocab_size": 100000000)"), "vocab_size"},
      {"huge int", Patched(R"(, "hidden_size": 18446744073709551615)"), "hidden_size"},
      {"gelu", Patched(R"(, "hidden_act": "gelu")"), "hidden_act"},
      {"longrope", Patched(R"(, "rope_scaling": {"rope_type": "longrope", "factor": 4})"),
       "longrope"},
      {"yarn no factor", Patched(R"(, "rope_scaling": {"type": "yarn"})"), "factor"},
      {"dynamic no factor", Patched(R"(, "rope_scaling": {"type": "dynamic"})"), "factor"},
      {"yarn negative beta", Patched(R"(, "rope_scaling": {"type": "yarn", "factor": 4,
        "beta_fast": -1})"),
       "beta_fast"},
      {"yarn truncate not bool", Patched(R"(, "rope_scaling": {"type": "yarn", "factor": 4,
        "truncate": 1})"),
       "truncate"},
      {"llama3 no factor", Patched(R"(, "rope_scaling": {"rope_type": "llama3",
        "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192})"),
       "factor"},
      {"llama3 high <= low", Patched(R"(, "rope_parameters": {"rope_type": "llama3",
        "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
        "original_max_position_embeddings": 8192})"),
       "high_freq_factor"},
      {"zero theta", Patched(R"(, "rope_theta": 0)"), "rope_theta"},
      {"bad dtype", Patched(R"(, "torch_dtype": "int8")"), "int8"},
      {"bad eos", Patched(R"(, "eos_token_id": [1, "x"])"), "eos_token_id"},
      {"negative bos", Patched(R"(, "bos_token_id": -5)"), "bos_token_id"},
      {"tie not bool", Patched(R"(, "tie_word_embeddings": 1)"), "tie_word_embeddings"},
  };
  for (const BadConfig& c : cases) {
    absl::StatusOr<ModelConfig> config = ParseModelConfig(c.json);
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(config.status().message(), HasSubstr(c.message_part)) << c.name;
    EXPECT_THAT(config.status().message(), HasSubstr("config.json")) << c.name;
  }
  // The unpatched base is valid, so each failure above comes from its patch.
  EXPECT_TRUE(ParseModelConfig(Patched("")).ok());
}

TEST(ModelConfigTest, GenerationConfigOverridesSpecialTokens) {
  TempDir dir;
  WriteFile(dir.path() / "config.json", Patched(R"(, "bos_token_id": 1, "eos_token_id": 2)"));
  absl::StatusOr<ModelConfig> plain = LoadModelConfig(dir.path());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->bos_token_id, 1);
  EXPECT_THAT(plain->eos_token_ids, ElementsAre(2));

  WriteFile(dir.path() / "generation_config.json",
            R"({"bos_token_id": 5, "eos_token_id": [2, 7]})");
  absl::StatusOr<ModelConfig> overridden = LoadModelConfig(dir.path());
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ(overridden->bos_token_id, 5);
  EXPECT_THAT(overridden->eos_token_ids, ElementsAre(2, 7));

  WriteFile(dir.path() / "generation_config.json", "{broken");
  absl::StatusOr<ModelConfig> broken = LoadModelConfig(dir.path());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(broken.status().message(), HasSubstr("generation_config.json"));
}

// generation_config.json's recommended sampling becomes sampling_defaults; absent fields stay
// unset, and a value out of range is INVALID_ARGUMENT naming it.
TEST(ModelConfigTest, GenerationConfigSamplingDefaults) {
  TempDir dir;
  WriteFile(dir.path() / "config.json", Patched(""));
  absl::StatusOr<ModelConfig> none = LoadModelConfig(dir.path());
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->sampling_defaults.temperature.has_value());
  EXPECT_FALSE(none->sampling_defaults.top_p.has_value());
  EXPECT_FALSE(none->sampling_defaults.top_k.has_value());

  WriteFile(dir.path() / "generation_config.json",
            R"({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20})");
  absl::StatusOr<ModelConfig> some = LoadModelConfig(dir.path());
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_FLOAT_EQ(*some->sampling_defaults.temperature, 0.6f);
  EXPECT_FLOAT_EQ(*some->sampling_defaults.top_p, 0.9f);
  EXPECT_EQ(*some->sampling_defaults.top_k, 20);

  WriteFile(dir.path() / "generation_config.json", R"({"temperature": 0.7, "top_p": null})");
  absl::StatusOr<ModelConfig> partial = LoadModelConfig(dir.path());
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_FLOAT_EQ(*partial->sampling_defaults.temperature, 0.7f);
  EXPECT_FALSE(partial->sampling_defaults.top_p.has_value());

  for (const char* bad : {R"({"top_p": 0})", R"({"top_p": 1.5})", R"({"temperature": -1})",
                          R"({"top_k": -3})", R"({"temperature": "hot"})"}) {
    WriteFile(dir.path() / "generation_config.json", bad);
    absl::StatusOr<ModelConfig> refused = LoadModelConfig(dir.path());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(refused.status().message(), HasSubstr("generation_config.json")) << bad;
  }
}

TEST(ModelConfigTest, MissingConfigIsNotFound) {
  TempDir dir;
  EXPECT_EQ(LoadModelConfig(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tandem::gpu_worker
