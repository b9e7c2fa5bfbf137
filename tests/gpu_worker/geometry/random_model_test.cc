// The random-model contract: the directory WriteRandomModel writes, loaded with LoadModel and
// DeviceModel::Upload, holds byte for byte the device weights of DeviceModel::CreateRandom with
// the same geometry and seed (one file, several shards, tied embeddings, f32), and a forward
// pass of the random tiny model gives finite, O(1) logits, identical for both models.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "geometry_test_util.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/random_model_writer.h"
#include "tandem/gpu_worker/sequence.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

std::vector<char> ToHost(Backend& backend, const void* src, size_t bytes) {
  std::vector<char> out(bytes);
  const absl::Status s = backend.CopyToHost(out.data(), src, bytes);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Compares two device tensors byte for byte; `what` names the tensor in failures.
void ExpectSameTensor(Backend& backend, const DeviceTensor& a, const DeviceTensor& b,
                      const std::string& what) {
  EXPECT_EQ(a.dtype, b.dtype) << what;
  ASSERT_EQ(a.buffer.bytes(), b.buffer.bytes()) << what;
  if (a.buffer.bytes() == 0) return;
  const std::vector<char> ha = ToHost(backend, a.data(), a.buffer.bytes());
  const std::vector<char> hb = ToHost(backend, b.data(), b.buffer.bytes());
  EXPECT_TRUE(std::memcmp(ha.data(), hb.data(), ha.size()) == 0) << what << " differs";
}

void ExpectSameModel(Backend& backend, const DeviceModel& a, const DeviceModel& b) {
  ExpectSameTensor(backend, a.embed(), b.embed(), "embed");
  ExpectSameTensor(backend, a.final_norm(), b.final_norm(), "final_norm");
  const ModelConfig& c = a.config();
  const size_t lm_bytes =
      static_cast<size_t>(c.vocab_size * c.hidden_size) * DTypeBytes(a.lm_head_dtype());
  EXPECT_EQ(a.lm_head_dtype(), b.lm_head_dtype());
  EXPECT_EQ(a.lm_head() == a.embed().data(), b.lm_head() == b.embed().data()) << "tying";
  EXPECT_TRUE(ToHost(backend, a.lm_head(), lm_bytes) == ToHost(backend, b.lm_head(), lm_bytes))
      << "lm_head differs";
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string at = " of layer " + std::to_string(l);
    const DeviceLayer& la = a.layer(l);
    const DeviceLayer& lb = b.layer(l);
    ExpectSameTensor(backend, la.attn_norm, lb.attn_norm, "attn_norm" + at);
    ExpectSameTensor(backend, la.qkv, lb.qkv, "qkv" + at);
    ExpectSameTensor(backend, la.qkv_bias, lb.qkv_bias, "qkv_bias" + at);
    ExpectSameTensor(backend, la.o_proj, lb.o_proj, "o_proj" + at);
    ExpectSameTensor(backend, la.ffn_norm, lb.ffn_norm, "ffn_norm" + at);
    ExpectSameTensor(backend, la.gate_up, lb.gate_up, "gate_up" + at);
    ExpectSameTensor(backend, la.down_proj, lb.down_proj, "down_proj" + at);
    for (const auto& [ta, tb, name] :
         {std::tuple(&la.qkv, &lb.qkv, "qkv"), std::tuple(&la.o_proj, &lb.o_proj, "o_proj"),
          std::tuple(&la.gate_up, &lb.gate_up, "gate_up"),
          std::tuple(&la.down_proj, &lb.down_proj, "down_proj")}) {
      const std::string what = std::string(name) + " scales" + at;
      ASSERT_EQ(ta->scale.bytes(), tb->scale.bytes()) << what;
      if (ta->scale.bytes() > 0) {
        EXPECT_TRUE(ToHost(backend, ta->scale.data(), ta->scale.bytes()) ==
                    ToHost(backend, tb->scale.data(), tb->scale.bytes()))
            << what << " differ";
      }
    }
    ExpectSameTensor(backend, la.q_norm, lb.q_norm, "q_norm" + at);
    ExpectSameTensor(backend, la.k_norm, lb.k_norm, "k_norm" + at);
    EXPECT_EQ(static_cast<bool>(la.q_norm.buffer), c.qk_norm) << "q_norm" << at;
  }
  const size_t inv_bytes = static_cast<size_t>(c.head_dim / 2) * 4;
  EXPECT_TRUE(ToHost(backend, a.inv_freq(), inv_bytes) == ToHost(backend, b.inv_freq(), inv_bytes))
      << "inv_freq differs";
  EXPECT_EQ(a.weight_bytes(), b.weight_bytes());
}

// Writes `config` with `seed` (shards of at most shard_bytes), loads and uploads it, and
// compares it with CreateRandom.
void CheckWrittenEqualsCreated(const ModelConfig& config, uint64_t seed, uint64_t shard_bytes,
                               size_t expected_files) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  testing::TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  RandomModelWriteOptions options;
  options.seed = seed;
  options.max_shard_bytes = shard_bytes;
  options.slice_bytes = 4096;  // many slices per tensor: the slicing must not show
  options.threads = 3;
  absl::StatusOr<RandomModelWriteResult> written = WriteRandomModel(config, dir.path(), options);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->weight_files.size(), expected_files);
  EXPECT_EQ(std::filesystem::exists(dir.path() / "model.safetensors.index.json"),
            expected_files > 1);

  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->archive->total_bytes(), written->weight_bytes);
  absl::StatusOr<std::unique_ptr<DeviceModel>> uploaded = DeviceModel::Upload(**model, *backend);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  absl::StatusOr<std::unique_ptr<DeviceModel>> created =
      DeviceModel::CreateRandom(config, *backend, seed);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ((*created)->weight_bytes(), written->weight_bytes);
  ExpectSameModel(*backend, **uploaded, **created);

  // Another seed changes every random tensor (the comparison above can fail).
  absl::StatusOr<std::unique_ptr<DeviceModel>> other =
      DeviceModel::CreateRandom(config, *backend, seed + 1);
  ASSERT_TRUE(other.ok()) << other.status();
  const DeviceTensor& a = (*uploaded)->layer(0).down_proj;
  const DeviceTensor& b = (*other)->layer(0).down_proj;
  EXPECT_FALSE(ToHost(*backend, a.data(), a.buffer.bytes()) ==
               ToHost(*backend, b.data(), b.buffer.bytes()));
}

TEST(RandomModel, WrittenDirectoryEqualsCreateRandom) {
  CheckWrittenEqualsCreated(*GeometryPreset("tiny"), 42, uint64_t{1} << 30, 1);
}

TEST(RandomModel, ShardedDirectoryEqualsCreateRandom) {
  ModelConfig c = *GeometryPreset("tiny");
  ASSERT_TRUE(ApplyGeometryOverrides("layers=3", c).ok());
  // Shards of <= 40000 bytes, filled greedily in enumeration order: 10 shards (embed + norm,
  // lm_head + a norm, then about half a layer (74 KB of bf16) each).
  CheckWrittenEqualsCreated(c, 5, 40000, 10);
}

TEST(RandomModel, TiedF32ModelEqualsCreateRandom) {
  ModelConfig c = *GeometryPreset("tiny");
  ASSERT_TRUE(ApplyGeometryOverrides("tie_embeddings=true,dtype=f32,rope_scaling=none", c).ok());
  CheckWrittenEqualsCreated(c, 9, uint64_t{1} << 30, 1);
}

TEST(RandomModel, Llama3ScaledRopeEqualsCreateRandom) {
  // The llama3-8b preset's RoPE scaling and GQA ratio at a small size.
  ModelConfig c = *GeometryPreset("llama3-8b");
  ASSERT_TRUE(ApplyGeometryOverrides(
                  "layers=1,hidden=256,ffn=512,q_heads=8,kv_heads=2,head_dim=32,vocab=512", c)
                  .ok());
  CheckWrittenEqualsCreated(c, 1, uint64_t{1} << 30, 1);
}

TEST(RandomModel, Qwen3WithQkNormsEqualsCreateRandom) {
  // The qwen3-8b preset (q/k norms of [head_dim] after each layer's down projection) small.
  ModelConfig c = *GeometryPreset("qwen3-8b");
  ASSERT_TRUE(c.qk_norm);
  ASSERT_TRUE(ApplyGeometryOverrides(
                  "layers=2,hidden=256,ffn=512,q_heads=8,kv_heads=2,head_dim=32,vocab=512", c)
                  .ok());
  CheckWrittenEqualsCreated(c, 3, uint64_t{1} << 30, 1);
}

// FP8 projections (quantization=fp8): the written checkpoint (e4m3 codes, weight_scale rows,
// quantization_config) uploads to what CreateRandom makes, where the backend keeps FP8; a
// backend that does not multiply FP8 refuses random FP8 weights.
TEST(RandomModel, Fp8ProjectionsEqualCreateRandom) {
  ModelConfig c = *GeometryPreset("llama3-8b");
  ASSERT_TRUE(ApplyGeometryOverrides(
                  "layers=2,hidden=256,ffn=512,q_heads=8,kv_heads=2,head_dim=32,vocab=512,"
                  "quantization=fp8",
                  c)
                  .ok());
  ASSERT_EQ(c.quantization, "fp8");
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  if (!backend->SupportsFp8Weights()) {
    absl::StatusOr<std::unique_ptr<DeviceModel>> created =
        DeviceModel::CreateRandom(c, *backend, 1);
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument) << created.status();
    return;
  }
  CheckWrittenEqualsCreated(c, 4, uint64_t{1} << 30, 1);
  absl::StatusOr<std::unique_ptr<DeviceModel>> created = DeviceModel::CreateRandom(c, *backend, 4);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ((*created)->layer(1).gate_up.dtype, DType::kF8E4M3);
  EXPECT_EQ((*created)->layer(1).gate_up.scale.bytes(), 2u * 512 * 4);
  // The bytes the memory plan counts: codes + f32 row scales.
  absl::StatusOr<size_t> planned = DeviceModel::WeightBytes(c);
  ASSERT_TRUE(planned.ok());
  EXPECT_EQ((*created)->weight_bytes(), *planned);
}

TEST(RandomModel, SeedsGiveDifferentWeights) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  const ModelConfig c = *GeometryPreset("tiny");
  auto a = DeviceModel::CreateRandom(c, *backend, 1);
  auto b = DeviceModel::CreateRandom(c, *backend, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  const DeviceTensor& qa = (*a)->layer(0).qkv;
  const DeviceTensor& qb = (*b)->layer(0).qkv;
  EXPECT_FALSE(ToHost(*backend, qa.data(), qa.buffer.bytes()) ==
               ToHost(*backend, qb.data(), qb.buffer.bytes()));
}

TEST(RandomModel, RejectsUnsupportedConfigs) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  ModelConfig c = *GeometryPreset("tiny");
  c.qkv_bias = true;
  EXPECT_EQ(DeviceModel::CreateRandom(c, *backend, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  testing::TempDir dir;
  EXPECT_EQ(WriteRandomModel(c, dir.path(), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Runs `ids` through `model` in gpu mode and returns the last token's logits.
std::vector<float> LastLogits(Backend& backend, const DeviceModel& model,
                              const std::vector<int32_t>& ids) {
  const ModelConfig& c = model.config();
  auto runner = ModelRunner::Create(backend, model, {});
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return {};
  WindowOptions wo;
  wo.window = WindowOptions::kUnlimited;
  wo.sink = 0;
  wo.max_context = 256;
  auto cache =
      WindowCache::Create(backend, {c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, wo);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  Sequence seq("random", AttentionMode::kGpu, std::move(*cache));
  const absl::Status s = (*runner)->Forward(seq, ids.data(), static_cast<int64_t>(ids.size()));
  EXPECT_TRUE(s.ok()) << s;
  auto logits = (*runner)->LastLogitsToHost();
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *logits : std::vector<float>{};
}

TEST(RandomModel, ForwardPassGivesFiniteOrderOneLogits) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  const ModelConfig c = *GeometryPreset("tiny");
  constexpr uint64_t kSeed = 11;
  auto created = DeviceModel::CreateRandom(c, *backend, kSeed);
  ASSERT_TRUE(created.ok()) << created.status();
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 1) % static_cast<int32_t>(c.vocab_size));
  const std::vector<float> logits = LastLogits(*backend, **created, ids);
  ASSERT_EQ(logits.size(), static_cast<size_t>(c.vocab_size));
  double sum = 0, sum2 = 0;
  for (float x : logits) {
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sum2 += double{x} * x;
  }
  const double n = static_cast<double>(logits.size());
  const double sd = std::sqrt(sum2 / n - (sum / n) * (sum / n));
  // lm_head rows have unit-variance dot products with the unit-RMS final hidden state, so the
  // logits' spread is of order 1: neither collapsed nor exploded.
  EXPECT_GT(sd, 0.1);
  EXPECT_LT(sd, 10.0);
  std::printf("logits of the random tiny model: mean %.3f, standard deviation %.3f\n", sum / n, sd);

  // The same weights loaded from disk give the same logits, bit for bit.
  testing::TempDir dir;
  RandomModelWriteOptions options;
  options.seed = kSeed;
  ASSERT_TRUE(WriteRandomModel(c, dir.path(), options).ok());
  auto model = LoadModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  auto uploaded = DeviceModel::Upload(**model, *backend);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(LastLogits(*backend, **uploaded, ids), logits);
}

}  // namespace
}  // namespace tandem::gpu_worker
