// Geometry presets, key=value overrides (applied and rejected), the config.json round trip and
// the random-tensor enumeration (names, shapes, seeds, scales, values).
#include "tandem/gpu_worker/model_geometry.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/random_values.h"

namespace tandem::gpu_worker {
namespace {

TEST(GeometryPreset, Llama3_8BHasTheModelsNumbers) {
  absl::StatusOr<ModelConfig> c = GeometryPreset("llama3-8b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->num_q_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_GE(c->max_position_embeddings, 131072);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->weight_dtype, DType::kBF16);
  // 8.03e9 parameters: the published size of Llama-3-8B.
  absl::StatusOr<std::vector<RandomTensorSpec>> specs = RandomModelTensors(*c, 0);
  ASSERT_TRUE(specs.ok()) << specs.status();
  int64_t params = 0;
  for (const RandomTensorSpec& s : *specs) params += s.numel();
  EXPECT_EQ(params, 8030261248);
}

TEST(GeometryPreset, UnknownNameIsRejected) {
  absl::StatusOr<ModelConfig> c = GeometryPreset("gpt-2");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("llama3-8b"), absl::string_view::npos) << c.status();
}

TEST(GeometryConfigJson, RoundTripsThroughParseModelConfig) {
  for (const std::string& name : GeometryPresetNames()) {
    absl::StatusOr<ModelConfig> c = GeometryPreset(name);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<std::string> text = GeometryConfigJson(*c);
    ASSERT_TRUE(text.ok()) << text.status();
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(*text);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->hidden_size, c->hidden_size) << name;
    EXPECT_EQ(parsed->intermediate_size, c->intermediate_size) << name;
    EXPECT_EQ(parsed->num_layers, c->num_layers) << name;
    EXPECT_EQ(parsed->num_kv_heads, c->num_kv_heads) << name;
    EXPECT_EQ(parsed->head_dim, c->head_dim) << name;
    EXPECT_EQ(parsed->vocab_size, c->vocab_size) << name;
    EXPECT_EQ(parsed->rope_theta, c->rope_theta) << name;
    EXPECT_EQ(parsed->rms_norm_eps, c->rms_norm_eps) << name;
    EXPECT_EQ(parsed->rope_scaling.type, c->rope_scaling.type) << name;
    EXPECT_EQ(parsed->eos_token_ids, c->eos_token_ids) << name;
    EXPECT_EQ(parsed->weight_dtype, c->weight_dtype) << name;
    EXPECT_EQ(RopeInvFreq(*parsed), RopeInvFreq(*c)) << name;
  }
}

TEST(GeometryOverrides, AppliesEveryKey) {
  ModelConfig c = *GeometryPreset("llama3-8b");
  absl::Status s = ApplyGeometryOverrides(
      "layers=4, hidden=512,ffn=1024,q_heads=8,kv_heads=2,head_dim=64,vocab=1000,"
      "max_positions=65536,rope_theta=10000,rms_norm_eps=1e-6,dtype=f32,tie_embeddings=true,"
      "rope_scaling=none",
      c);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.hidden_size, 512);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.num_q_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.max_position_embeddings, 65536);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.weight_dtype, DType::kF32);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_TRUE(ApplyGeometryOverrides("", c).ok());
  EXPECT_EQ(c.num_layers, 4);
}

TEST(GeometryOverrides, BadOverridesAreRejectedAndChangeNothing) {
  const ModelConfig before = *GeometryPreset("llama3-8b");
  for (const char* bad : {"layers", "layers=0", "layers=-3", "layers=x", "depth=3",
                          "kv_heads=3",     // 32 query heads are not a multiple of 3
                          "head_dim=7",     // odd: RoPE pairs
                          "hidden=100000",  // above the config parser's bound
                          "dtype=f16", "dtype=int8", "tie_embeddings=yes", "rope_scaling=yarn",
                          "rope_theta=-1", "rms_norm_eps=nan", "layers=2,vocab=0"}) {
    ModelConfig c = before;
    absl::Status s = ApplyGeometryOverrides(bad, c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_EQ(c.num_layers, before.num_layers) << bad;
    EXPECT_EQ(c.num_kv_heads, before.num_kv_heads) << bad;
    EXPECT_EQ(c.vocab_size, before.vocab_size) << bad;
  }
}

TEST(RandomModelTensors, EnumeratesTheHuggingFaceLayout) {
  ModelConfig c = *GeometryPreset("tiny");
  absl::StatusOr<std::vector<RandomTensorSpec>> specs = RandomModelTensors(c, 7);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 3u + 9u * c.num_layers);
  EXPECT_EQ((*specs)[0].name, "model.embed_tokens.weight");
  EXPECT_EQ((*specs)[0].shape, (std::vector<int64_t>{c.vocab_size, c.hidden_size}));
  EXPECT_EQ((*specs)[1].name, "model.norm.weight");
  EXPECT_EQ((*specs)[1].init, RandomTensorSpec::Init::kOnes);
  EXPECT_EQ((*specs)[2].name, "lm_head.weight");
  const RandomTensorSpec& k = (*specs)[3 + 9 + 2];  // layer 1's k_proj
  EXPECT_EQ(k.name, "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(k.shape, (std::vector<int64_t>{c.num_kv_heads * c.head_dim, c.hidden_size}));
  EXPECT_EQ(k.seed, TensorSeed(7, 3 + 9 + 2));
  EXPECT_FLOAT_EQ(k.scale, std::sqrt(3.0f / c.hidden_size));
  const RandomTensorSpec& down = (*specs)[3 + 9 + 8];
  EXPECT_EQ(down.name, "model.layers.1.mlp.down_proj.weight");
  EXPECT_FLOAT_EQ(down.scale, std::sqrt(3.0f / c.intermediate_size));
  // Every tensor seed distinct.
  std::set<uint64_t> seeds;
  for (const RandomTensorSpec& s : *specs) {
    if (s.init == RandomTensorSpec::Init::kUniform) {
      EXPECT_TRUE(seeds.insert(s.seed).second) << s.name;
    }
  }

  // Tying drops lm_head and changes no other tensor's seed.
  c.tie_word_embeddings = true;
  absl::StatusOr<std::vector<RandomTensorSpec>> tied = RandomModelTensors(c, 7);
  ASSERT_TRUE(tied.ok());
  ASSERT_EQ(tied->size(), specs->size() - 1);
  EXPECT_EQ((*tied)[2].name, "model.layers.0.input_layernorm.weight");
  EXPECT_EQ((*tied)[3].seed, (*specs)[4].seed);
}

TEST(RandomModelTensors, SliceValuesAreRandomFillsValues) {
  const ModelConfig c = *GeometryPreset("tiny");
  const RandomTensorSpec q = (*RandomModelTensors(c, 3))[4];  // layer 0 q_proj
  std::vector<bf16_t> slice(100);
  FillRandomTensorSlice(q, 1000, slice.size(), slice.data());
  for (size_t i = 0; i < slice.size(); ++i) {
    ASSERT_EQ(slice[i], FloatToBf16(RandomSigned(q.seed, 1000 + i, q.scale))) << i;
  }
  // Uniform in [-scale, scale): standard deviation scale / sqrt(3) = 1 / sqrt(in_features).
  std::vector<bf16_t> all(static_cast<size_t>(q.numel()));
  FillRandomTensorSlice(q, 0, all.size(), all.data());
  double sum = 0, sum2 = 0;
  for (bf16_t b : all) {
    const double x = Bf16ToFloat(b);
    ASSERT_LE(std::fabs(x), q.scale * 1.004);  // bf16 rounding may reach the bound
    sum += x;
    sum2 += x * x;
  }
  const double n = static_cast<double>(all.size());
  const double sd = std::sqrt(sum2 / n - (sum / n) * (sum / n));
  EXPECT_NEAR(sd, 1.0 / std::sqrt(static_cast<double>(c.hidden_size)), 0.03 * sd);
  EXPECT_NEAR(sum / n, 0.0, 0.05 * sd);
  // Norms are ones.
  const RandomTensorSpec norm = (*RandomModelTensors(c, 3))[1];
  std::vector<bf16_t> ones(static_cast<size_t>(norm.numel()));
  FillRandomTensorSlice(norm, 0, ones.size(), ones.data());
  for (bf16_t b : ones) ASSERT_EQ(Bf16ToFloat(b), 1.0f);
}

TEST(RandomModelTensors, UnsupportedConfigsAreRejected) {
  ModelConfig c = *GeometryPreset("tiny");
  c.qkv_bias = true;
  EXPECT_EQ(RandomModelTensors(c, 0).status().code(), absl::StatusCode::kInvalidArgument);
  c = *GeometryPreset("tiny");
  c.weight_dtype = DType::kF16;
  EXPECT_EQ(RandomModelTensors(c, 0).status().code(), absl::StatusCode::kInvalidArgument);
  c = *GeometryPreset("tiny");
  c.hidden_size = int64_t{1} << 40;
  EXPECT_EQ(RandomModelTensors(c, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
