#include "tandem/gpu_worker/model_weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model_test_util.h"
#include "nlohmann/json.hpp"
#include "tandem/common/bf16.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::SharedModelDir;
using testing::TempDir;
using testing::WriteFile;

// Reads a safetensors file without the code under test: its header JSON and the data buffer.
struct RawSafetensors {
  nlohmann::json header;
  std::string data;

  explicit RawSafetensors(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    uint64_t header_bytes = 0;
    in.read(reinterpret_cast<char*>(&header_bytes), 8);  // little-endian host
    std::string text(header_bytes, '\0');
    in.read(text.data(), static_cast<std::streamsize>(header_bytes));
    header = nlohmann::json::parse(text);
    data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // The raw bytes of tensor `name`.
  std::string Bytes(const std::string& name) const {
    const auto& offsets = header.at(name).at("data_offsets");
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    return data.substr(begin, end - begin);
  }
  size_t num_tensors() const { return header.size() - (header.contains("__metadata__") ? 1 : 0); }
};

// Loads the real model `name` and checks it against its config values and its raw file.
void CheckRealModel(const std::string& name, DType dtype, int64_t num_layers, int64_t vocab,
                    int64_t hidden, int64_t q_dim, int64_t kv_dim, int64_t ffn) {
  const auto dir = SharedModelDir(name);
  if (!std::filesystem::exists(dir / "model.safetensors")) GTEST_SKIP() << dir << " is absent";
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelWeights& w = (*model)->weights;
  const RawSafetensors raw(dir / "model.safetensors");

  // Tied models store embed, final norm and 9 tensors per layer; the archive has all of them.
  EXPECT_EQ((*model)->archive->num_tensors(), static_cast<size_t>(2 + 9 * num_layers));
  EXPECT_EQ((*model)->archive->num_tensors(), raw.num_tensors());
  EXPECT_EQ((*model)->archive->total_bytes(), raw.data.size());
  EXPECT_EQ(w.dtype, dtype);
  ASSERT_EQ(w.layers.size(), static_cast<size_t>(num_layers));
  EXPECT_EQ(w.lm_head, w.embed);
  EXPECT_EQ(w.embed->shape, (std::vector<int64_t>{vocab, hidden}));
  EXPECT_EQ(w.final_norm->shape, (std::vector<int64_t>{hidden}));
  for (const LayerWeights& layer : w.layers) {
    EXPECT_EQ(layer.attn_norm->shape, (std::vector<int64_t>{hidden}));
    EXPECT_EQ(layer.ffn_norm->shape, (std::vector<int64_t>{hidden}));
    EXPECT_EQ(layer.q_proj->shape, (std::vector<int64_t>{q_dim, hidden}));
    EXPECT_EQ(layer.k_proj->shape, (std::vector<int64_t>{kv_dim, hidden}));
    EXPECT_EQ(layer.v_proj->shape, (std::vector<int64_t>{kv_dim, hidden}));
    EXPECT_EQ(layer.o_proj->shape, (std::vector<int64_t>{hidden, q_dim}));
    EXPECT_EQ(layer.gate_proj->shape, (std::vector<int64_t>{ffn, hidden}));
    EXPECT_EQ(layer.up_proj->shape, (std::vector<int64_t>{ffn, hidden}));
    EXPECT_EQ(layer.down_proj->shape, (std::vector<int64_t>{hidden, ffn}));
    EXPECT_EQ(layer.q_bias, nullptr);
    EXPECT_EQ(layer.q_proj->dtype, dtype);
  }
  // Names resolve to the right tensors: whole contents equal the raw file's bytes.
  const std::string last = absl::StrCat("model.layers.", num_layers - 1, ".");
  const std::vector<std::pair<const TensorView*, std::string>> checks = {
      {w.embed, "model.embed_tokens.weight"},
      {w.final_norm, "model.norm.weight"},
      {w.layers.back().down_proj, last + "mlp.down_proj.weight"},
      {w.layers.back().k_proj, last + "self_attn.k_proj.weight"},
      {w.layers[0].attn_norm, "model.layers.0.input_layernorm.weight"},
  };
  for (const auto& [view, tensor] : checks) {
    const std::string bytes = raw.Bytes(tensor);
    ASSERT_EQ(view->bytes, bytes.size()) << tensor;
    EXPECT_EQ(std::memcmp(view->data, bytes.data(), bytes.size()), 0) << tensor;
  }
  // The first embedding values, decoded: finite and not all zero (a trained model).
  const std::string embed_bytes = raw.Bytes("model.embed_tokens.weight");
  float first[4];
  for (size_t i = 0; i < 4; ++i) {
    if (dtype == DType::kBF16) {
      bf16_t b;
      std::memcpy(&b, embed_bytes.data() + 2 * i, 2);
      first[i] = Bf16ToFloat(b);
      bf16_t mine;
      std::memcpy(&mine, static_cast<const char*>(w.embed->data) + 2 * i, 2);
      EXPECT_EQ(Bf16ToFloat(mine), first[i]);
    } else {
      std::memcpy(&first[i], embed_bytes.data() + 4 * i, 4);
      float mine;
      std::memcpy(&mine, static_cast<const char*>(w.embed->data) + 4 * i, 4);
      EXPECT_EQ(mine, first[i]);
    }
    EXPECT_TRUE(std::isfinite(first[i]));
  }
  EXPECT_TRUE(first[0] != 0 || first[1] != 0 || first[2] != 0 || first[3] != 0);
}

TEST(ModelWeightsTest, Stories260k) {
  CheckRealModel("stories260k", DType::kF32, 5, 512, 64, 64, 32, 172);
}

TEST(ModelWeightsTest, Gutenberg14m) {
  CheckRealModel("gutenberg-14m", DType::kBF16, 8, 4096, 384, 384, 128, 1024);
}

// A tiny synthetic model: hidden 8, ffn 16, 2 layers, 2 q heads, 1 kv head, head_dim 4,
// vocab 10; every tensor filled with distinct values.
class TinyModel {
 public:
  explicit TinyModel(bool tied, bool qwen2 = false) : tied_(tied), qwen2_(qwen2) {
    Add("model.embed_tokens.weight", {10, 8});
    Add("model.norm.weight", {8});
    if (!tied) Add("lm_head.weight", {10, 8});
    for (int i = 0; i < 2; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      Add(p + "input_layernorm.weight", {8});
      Add(p + "post_attention_layernorm.weight", {8});
      Add(p + "self_attn.q_proj.weight", {8, 8});
      Add(p + "self_attn.k_proj.weight", {4, 8});
      Add(p + "self_attn.v_proj.weight", {4, 8});
      Add(p + "self_attn.o_proj.weight", {8, 8});
      if (qwen2) {
        Add(p + "self_attn.q_proj.bias", {8});
        Add(p + "self_attn.k_proj.bias", {4});
        Add(p + "self_attn.v_proj.bias", {4});
      }
      Add(p + "mlp.gate_proj.weight", {16, 8});
      Add(p + "mlp.up_proj.weight", {16, 8});
      Add(p + "mlp.down_proj.weight", {8, 16});
    }
  }

  // Replaces tensor `name` (or adds it) with random contents of `shape` and `dtype`.
  void Replace(const std::string& name, const std::vector<int64_t>& shape,
               DType dtype = DType::kF32) {
    Remove(name);
    Add(name, shape, dtype);
  }
  void Remove(const std::string& name) {
    std::erase_if(tensors_, [&](const Tensor& t) { return t.name == name; });
  }

  // Writes config.json and model.safetensors into `dir`.
  void Write(const std::filesystem::path& dir) const {
    WriteFile(dir / "config.json", absl::StrCat(R"({"model_type": ")", qwen2_ ? "qwen2" : "llama",
                                                R"(", "hidden_size": 8, "intermediate_size": 16,
                           "num_hidden_layers": 2, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
                           "tie_word_embeddings": )",
                                                tied_ ? "true" : "false", "}"));
    std::vector<TensorToWrite> list;
    for (const Tensor& t : tensors_) {
      list.push_back({t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
    }
    ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", list).ok());
  }

 private:
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  void Add(const std::string& name, const std::vector<int64_t>& shape, DType dtype = DType::kF32) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    Tensor t{name, dtype, shape, std::vector<uint8_t>(numel * DTypeBytes(dtype))};
    for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<uint8_t>(rng_());
    tensors_.push_back(std::move(t));
  }

  bool tied_;
  bool qwen2_;
  std::mt19937 rng_{7};
  std::vector<Tensor> tensors_;
};

TEST(ModelWeightsTest, TinyUntiedModelBindsLmHead) {
  TempDir dir;
  TinyModel(/*tied=*/false).Write(dir.path());
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelWeights& w = (*model)->weights;
  EXPECT_NE(w.lm_head, w.embed);
  EXPECT_EQ(w.lm_head->name, "lm_head.weight");
  EXPECT_EQ(w.layers[1].k_proj->name, "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(w.layers[1].k_proj->shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(w.layers[0].down_proj->name, "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(w.layers[0].ffn_norm->name, "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_EQ((*model)->config.num_kv_heads, 1);
}

TEST(ModelWeightsTest, Qwen2BiasesAreBound) {
  TempDir dir;
  TinyModel(/*tied=*/true, /*qwen2=*/true).Write(dir.path());
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  const LayerWeights& layer = (*model)->weights.layers[1];
  ASSERT_NE(layer.q_bias, nullptr);
  EXPECT_EQ(layer.q_bias->name, "model.layers.1.self_attn.q_proj.bias");
  EXPECT_THAT(layer.k_bias->shape, ElementsAre(4));
  EXPECT_THAT(layer.v_bias->shape, ElementsAre(4));
  EXPECT_EQ((*model)->weights.lm_head, (*model)->weights.embed);
}

TEST(ModelWeightsTest, BadWeightsNameTheTensor) {
  struct Case {
    const char* name;
    std::function<void(TinyModel&)> damage;
    bool tied;
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases = {
      {"wrong shape",
       [](TinyModel& m) {
         m.Replace("model.layers.1.self_attn.k_proj.weight", {8, 8});
       },
       true,
       {"model.layers.1.self_attn.k_proj.weight", "[8, 8]", "expected [4, 8]"}},
      {"transposed",
       [](TinyModel& m) {
         m.Replace("model.layers.0.mlp.down_proj.weight", {16, 8});
       },
       true,
       {"model.layers.0.mlp.down_proj.weight", "[16, 8]", "expected [8, 16]"}},
      {"missing norm",
       [](TinyModel& m) { m.Remove("model.norm.weight"); },
       true,
       {"model.norm.weight", "missing"}},
      {"untied without lm_head",
       [](TinyModel& m) { m.Remove("lm_head.weight"); },
       false,
       {"lm_head.weight", "missing"}},
      {"mixed dtypes",
       [](TinyModel& m) {
         m.Replace("model.layers.1.mlp.up_proj.weight", {16, 8}, DType::kBF16);
       },
       true,
       {"model.layers.1.mlp.up_proj.weight", "bf16", "one dtype"}},
      {"integer norm",
       [](TinyModel& m) { m.Replace("model.layers.0.input_layernorm.weight", {8}, DType::kI32); },
       true,
       {"model.layers.0.input_layernorm.weight", "i32"}},
  };
  for (const Case& c : cases) {
    TempDir dir;
    TinyModel model(c.tied);
    c.damage(model);
    model.Write(dir.path());
    absl::StatusOr<std::unique_ptr<Model>> loaded = LoadModel(dir.path());
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    for (const std::string& part : c.message_parts) {
      EXPECT_THAT(loaded.status().message(), HasSubstr(part)) << c.name;
    }
  }
  // Undamaged, both variants load, so each failure comes from its damage.
  for (bool tied : {true, false}) {
    TempDir dir;
    TinyModel(tied).Write(dir.path());
    EXPECT_TRUE(LoadModel(dir.path()).ok());
  }
}

// The projections of a TinyModel as FP8 codes with a weight_scale each: per row in layer 0, per
// tensor in layer 1 (the two forms real FP8 checkpoints use).
void MakeFp8(TinyModel& m) {
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::vector<std::pair<std::string, std::vector<int64_t>>> projections = {
        {"self_attn.q_proj", {8, 8}}, {"self_attn.k_proj", {4, 8}}, {"self_attn.v_proj", {4, 8}},
        {"self_attn.o_proj", {8, 8}}, {"mlp.gate_proj", {16, 8}},   {"mlp.up_proj", {16, 8}},
        {"mlp.down_proj", {8, 16}}};
    for (const auto& [name, shape] : projections) {
      m.Replace(p + name + ".weight", shape, DType::kF8E4M3);
      m.Replace(p + name + ".weight_scale",
                i == 0 ? std::vector<int64_t>{shape[0], 1} : std::vector<int64_t>{1});
    }
  }
}

TEST(ModelWeightsTest, Fp8ProjectionsBindWithTheirScales) {
  TempDir dir;
  TinyModel model(/*tied=*/false);
  MakeFp8(model);
  model.Write(dir.path());
  absl::StatusOr<std::unique_ptr<Model>> loaded = LoadModel(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const ModelWeights& w = (*loaded)->weights;
  EXPECT_EQ(w.dtype, DType::kF32);  // the tables'
  EXPECT_EQ(w.stored_projection_dtype, DType::kF8E4M3);
  EXPECT_EQ(w.fp8_scales.size(), 14u);
  const TensorView* scale = w.fp8_scales.at(w.layers[0].gate_proj);
  EXPECT_EQ(scale->name, "model.layers.0.mlp.gate_proj.weight_scale");
  EXPECT_THAT(scale->shape, ElementsAre(16, 1));
  EXPECT_THAT(w.fp8_scales.at(w.layers[1].down_proj)->shape, ElementsAre(1));
}

// A checkpoint whose ignore list left modules float (here layer 1's attention and layer 0's
// o_proj) binds them beside the FP8 ones: IsFp8 tells each apart.
TEST(ModelWeightsTest, FloatModulesBesideFp8OnesBind) {
  TempDir dir;
  TinyModel model(/*tied=*/false);
  MakeFp8(model);
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"model.layers.1.self_attn.q_proj.weight", {8, 8}},
           {"model.layers.1.self_attn.k_proj.weight", {4, 8}},
           {"model.layers.1.self_attn.v_proj.weight", {4, 8}},
           {"model.layers.0.self_attn.o_proj.weight", {8, 8}}}) {
    model.Replace(name, shape);
    model.Remove(name + "_scale");
  }
  model.Write(dir.path());
  absl::StatusOr<std::unique_ptr<Model>> loaded = LoadModel(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const ModelWeights& w = (*loaded)->weights;
  EXPECT_EQ(w.stored_projection_dtype, DType::kF8E4M3);
  EXPECT_EQ(w.fp8_scales.size(), 10u);
  EXPECT_TRUE(w.IsFp8(w.layers[0].q_proj));
  EXPECT_FALSE(w.IsFp8(w.layers[0].o_proj));
  EXPECT_FALSE(w.IsFp8(w.layers[1].k_proj));
  EXPECT_TRUE(w.IsFp8(w.layers[1].o_proj));
  EXPECT_EQ(w.fp8_scales.count(w.layers[1].q_proj), 0u);
}

TEST(ModelWeightsTest, BadFp8WeightsNameTheTensor) {
  struct Case {
    const char* name;
    std::function<void(TinyModel&)> damage;
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases = {
      {"no scale",
       [](TinyModel& m) { m.Remove("model.layers.1.mlp.up_proj.weight_scale"); },
       {"model.layers.1.mlp.up_proj.weight", "weight_scale"}},
      {"block-wise scale",
       [](TinyModel& m) {
         m.Replace("model.layers.0.mlp.down_proj.weight_scale", {1, 2});
       },
       {"model.layers.0.mlp.down_proj.weight_scale", "[1, 2]", "block-wise"}},
      {"integer scale",
       [](TinyModel& m) {
         m.Replace("model.layers.0.self_attn.q_proj.weight_scale", {8, 1}, DType::kI32);
       },
       {"model.layers.0.self_attn.q_proj.weight_scale", "i32"}},
      {"a float projection fused with FP8 ones",
       [](TinyModel& m) {
         m.Replace("model.layers.1.self_attn.k_proj.weight", {4, 8});
       },
       {"model.layers.1.self_attn.k_proj.weight", "f32", "f8e4m3", "fused"}},
      {"a float projection of another dtype than the tables",
       [](TinyModel& m) {
         m.Replace("model.layers.1.self_attn.o_proj.weight", {8, 8}, DType::kBF16);
       },
       {"model.layers.1.self_attn.o_proj.weight", "bf16", "f32"}},
      {"FP8 embedding",
       [](TinyModel& m) {
         m.Replace("model.embed_tokens.weight", {10, 8}, DType::kF8E4M3);
       },
       {"model.embed_tokens.weight", "f8e4m3"}},
  };
  for (const Case& c : cases) {
    TempDir dir;
    TinyModel model(/*tied=*/true);
    MakeFp8(model);
    c.damage(model);
    model.Write(dir.path());
    absl::StatusOr<std::unique_ptr<Model>> loaded = LoadModel(dir.path());
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    for (const std::string& part : c.message_parts) {
      EXPECT_THAT(loaded.status().message(), HasSubstr(part)) << c.name << ": " << loaded.status();
    }
  }
}

TEST(ModelWeightsTest, MissingWeightsFileIsNotFound) {
  TempDir dir;
  TinyModel(/*tied=*/true).Write(dir.path());
  std::filesystem::remove(dir.path() / "model.safetensors");
  EXPECT_EQ(LoadModel(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tandem::gpu_worker
