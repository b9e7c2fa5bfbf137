// --quantization fp8 (LoadOptions::quantization) on a float checkpoint gives the model of the FP8
// checkpoint that QuantizeFp8PerRow makes of the same weights: the same device tensors byte for
// byte (codes + f32 row scales where the backend keeps FP8: cuda with bf16 tables; the
// dequantized floats elsewhere, the cpu backend's choice: FP8's values at the float's size) and
// the same log-probs and logits bit for bit. On the cpu backend and, with
// TANDEM_TEST_BACKEND_CUDA, the cuda one (skipped without a GPU). Also: an FP8 checkpoint is left
// as it is, f16 checkpoints and values other than ""/none/fp8 are refused, and a NaN weight is
// an error naming its tensor.
//
// The float checkpoint is the llama_yarn fixture (rope_fixtures/) with every tensor as `tables`.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fp8_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model_test_util.h"
#include "nlohmann/json.hpp"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/fp8_quantize.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/safetensors.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::AllOf;
using testing::Encode;
using testing::ForwardOf;
using testing::Fp8SourceModel;
using ::testing::HasSubstr;
using testing::Outputs;
using testing::ReadText;
using testing::TempDir;

bool IsProjection(const std::string& name) { return absl::StrContains(name, "_proj.weight"); }

// Writes the fixture to `dir` with every tensor as `tables` (kF32 or kBF16), or all zeros as
// f16 for kF16; `poison` (when non-empty) names a projection whose element 5 becomes NaN.
void WriteFloatCheckpoint(const std::filesystem::path& dir, DType tables,
                          const std::string& poison = "") {
  absl::StatusOr<std::unique_ptr<SafetensorsArchive>> source =
      SafetensorsArchive::Open(Fp8SourceModel());
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<TensorToWrite> tensors;
  std::vector<std::vector<char>> storage;  // keeps every written buffer alive
  for (const TensorView* t : (*source)->tensors()) {
    ASSERT_EQ(t->dtype, DType::kF32) << t->name;
    const size_t n = static_cast<size_t>(t->numel());
    std::vector<float> values(static_cast<const float*>(t->data),
                              static_cast<const float*>(t->data) + n);
    if (t->name == poison) values[5] = std::numeric_limits<float>::quiet_NaN();
    storage.push_back(tables == DType::kF16 ? std::vector<char>(2 * n, 0)
                                            : Encode(values.data(), n, tables));
    tensors.push_back({t->name, tables, t->shape, storage.back().data(), storage.back().size()});
  }
  nlohmann::json config = nlohmann::json::parse(ReadText(Fp8SourceModel() / "config.json"));
  config["torch_dtype"] = tables == DType::kBF16  ? "bfloat16"
                          : tables == DType::kF16 ? "float16"
                                                  : "float32";
  testing::WriteFile(dir / "config.json", config.dump(2));
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
}

// Writes to `fp8_dir` the FP8 checkpoint of the float checkpoint in `float_dir`: each projection
// as QuantizeFp8PerRow's codes with its scales as weight_scale [rows, 1] f32, every other tensor
// as it is, and quantization_config fbgemm_fp8.
void WriteFp8Checkpoint(const std::filesystem::path& float_dir,
                        const std::filesystem::path& fp8_dir) {
  absl::StatusOr<std::unique_ptr<SafetensorsArchive>> source = SafetensorsArchive::Open(float_dir);
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<TensorToWrite> tensors;
  std::vector<std::vector<char>> storage;
  for (const TensorView* t : (*source)->tensors()) {
    if (!IsProjection(t->name)) {
      tensors.push_back({t->name, t->dtype, t->shape, t->data, t->bytes});
      continue;
    }
    const int64_t rows = t->shape[0];
    std::vector<char> codes(static_cast<size_t>(t->numel()));
    std::vector<char> scales(static_cast<size_t>(rows) * sizeof(float));
    ASSERT_TRUE(QuantizeFp8PerRow(*t, reinterpret_cast<f8e4m3_t*>(codes.data()),
                                  reinterpret_cast<float*>(scales.data()))
                    .ok());
    storage.push_back(std::move(codes));
    tensors.push_back(
        {t->name, DType::kF8E4M3, t->shape, storage.back().data(), storage.back().size()});
    storage.push_back(std::move(scales));
    const std::string scale_name = t->name.substr(0, t->name.size() - 7) + ".weight_scale";
    tensors.push_back(
        {scale_name, DType::kF32, {rows, 1}, storage.back().data(), storage.back().size()});
  }
  nlohmann::json config = nlohmann::json::parse(ReadText(float_dir / "config.json"));
  config["quantization_config"] = {{"quant_method", "fbgemm_fp8"},
                                   {"modules_to_not_convert", {"lm_head"}}};
  testing::WriteFile(fp8_dir / "config.json", config.dump(2));
  ASSERT_TRUE(WriteSafetensors(fp8_dir / "model.safetensors", tensors).ok());
}

std::vector<char> ToHost(Backend& backend, const DeviceBuffer& buffer) {
  std::vector<char> host(buffer.bytes());
  if (!host.empty()) {
    EXPECT_TRUE(backend.CopyToHost(host.data(), buffer.data(), host.size()).ok());
  }
  return host;
}

// Every weight tensor of `a` and `b` has the same dtype and bytes, scales included.
void ExpectSameDeviceWeights(Backend& backend, const DeviceModel& a, const DeviceModel& b) {
  auto same = [&](const DeviceTensor& x, const DeviceTensor& y, const std::string& what) {
    EXPECT_EQ(x.dtype, y.dtype) << what;
    EXPECT_TRUE(ToHost(backend, x.buffer) == ToHost(backend, y.buffer)) << what;
    EXPECT_EQ(static_cast<bool>(x.scale), static_cast<bool>(y.scale)) << what;
    if (x.scale && y.scale) {
      EXPECT_TRUE(ToHost(backend, x.scale) == ToHost(backend, y.scale)) << what;
    }
  };
  same(a.embed(), b.embed(), "embed");
  same(a.final_norm(), b.final_norm(), "final_norm");
  ASSERT_EQ(a.config().num_layers, b.config().num_layers);
  for (int64_t l = 0; l < a.config().num_layers; ++l) {
    const DeviceLayer& x = a.layer(l);
    const DeviceLayer& y = b.layer(l);
    const std::string at = absl::StrCat("layer ", l, " ");
    same(x.attn_norm, y.attn_norm, at + "attn_norm");
    same(x.qkv, y.qkv, at + "qkv");
    same(x.o_proj, y.o_proj, at + "o_proj");
    same(x.ffn_norm, y.ffn_norm, at + "ffn_norm");
    same(x.gate_up, y.gate_up, at + "gate_up");
    same(x.down_proj, y.down_proj, at + "down_proj");
  }
}

std::vector<int32_t> Prompt() {
  return nlohmann::json::parse(ReadText(Fp8SourceModel() / "prompt.json"))
      .get<std::vector<int32_t>>();
}

class QuantizeAtLoad : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizeAtLoad, IsTheFp8CheckpointOfTheSameQuantizer) {
  const DType tables = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> backend = testing::Fp8TestBackend();
  if (!backend.ok()) GTEST_SKIP() << "no backend: " << backend.status();
  TempDir float_dir, fp8_dir;
  ASSERT_FALSE(float_dir.path().empty());
  ASSERT_FALSE(fp8_dir.path().empty());
  WriteFloatCheckpoint(float_dir.path(), tables);
  WriteFp8Checkpoint(float_dir.path(), fp8_dir.path());

  absl::StatusOr<std::unique_ptr<Model>> quantized =
      LoadModel(float_dir.path(), {.quantization = "fp8"});
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  EXPECT_EQ((*quantized)->config.quantization, "fp8");
  EXPECT_TRUE((*quantized)->weights.quantize_at_load);
  EXPECT_EQ((*quantized)->weights.stored_projection_dtype, tables);
  // The FP8 checkpoint with --quantization fp8 too: a no-op.
  absl::StatusOr<std::unique_ptr<Model>> fp8 = LoadModel(fp8_dir.path(), {.quantization = "fp8"});
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_FALSE((*fp8)->weights.quantize_at_load);
  EXPECT_EQ((*fp8)->weights.stored_projection_dtype, DType::kF8E4M3);

  absl::StatusOr<std::unique_ptr<DeviceModel>> dq = DeviceModel::Upload(**quantized, **backend);
  ASSERT_TRUE(dq.ok()) << dq.status();
  absl::StatusOr<std::unique_ptr<DeviceModel>> d8 = DeviceModel::Upload(**fp8, **backend);
  ASSERT_TRUE(d8.ok()) << d8.status();
  ExpectSameDeviceWeights(**backend, **dq, **d8);
  EXPECT_EQ((*dq)->weight_bytes(), (*d8)->weight_bytes());
  EXPECT_EQ((*dq)->weight_bytes(), DeviceModel::WeightBytes((*quantized)->weights, **backend));

  const std::vector<int32_t> prompt = Prompt();
  const Outputs at_load = ForwardOf(**backend, float_dir.path(), prompt, {.quantization = "fp8"});
  const Outputs checkpoint = ForwardOf(**backend, fp8_dir.path(), prompt);
  const Outputs unquantized = ForwardOf(**backend, float_dir.path(), prompt);
  ASSERT_EQ(at_load.logprobs.size(), prompt.size() - 1);
  ASSERT_FALSE(at_load.last_logits.empty());
  EXPECT_EQ(at_load.logprobs, checkpoint.logprobs);
  EXPECT_EQ(at_load.last_logits, checkpoint.last_logits);

  const bool kept = (*backend)->SupportsFp8Weights() && tables == DType::kBF16;
  EXPECT_EQ(DeviceModel::KeepsFp8((*quantized)->weights, **backend), kept);
  EXPECT_EQ((*dq)->layer(0).gate_up.dtype, kept ? DType::kF8E4M3 : tables);
  if (kept) {
    // Codes (1 byte) + a 4-byte scale per row against 2 bytes a weight.
    EXPECT_LT(at_load.weight_bytes, unquantized.weight_bytes);
  } else {
    EXPECT_EQ(at_load.weight_bytes, unquantized.weight_bytes);
  }
  // The quantization is real: not the float model's log-probs, but close to them.
  ASSERT_EQ(unquantized.logprobs.size(), at_load.logprobs.size());
  double differ = 0;
  for (size_t i = 0; i < unquantized.logprobs.size(); ++i) {
    differ = std::max(differ, std::abs(double{unquantized.logprobs[i]} - at_load.logprobs[i]));
  }
  EXPECT_GT(differ, 1e-4);
  EXPECT_LT(differ, 0.5);
}

INSTANTIATE_TEST_SUITE_P(Tables, QuantizeAtLoad, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(QuantizeAtLoadRefusals, ValuesOtherThanNoneAndFp8) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  WriteFloatCheckpoint(dir.path(), DType::kBF16);
  for (const std::string value : {"int8", "FP8", "fp8_e5m2"}) {
    absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path(), {.quantization = value});
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(std::string(model.status().message()),
                AllOf(HasSubstr("--quantization \"" + value + "\""), HasSubstr("fp8")));
  }
  for (const std::string value : {"", "none"}) {
    absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path(), {.quantization = value});
    ASSERT_TRUE(model.ok()) << value << ": " << model.status();
    EXPECT_FALSE((*model)->weights.quantize_at_load) << value;
    EXPECT_EQ((*model)->config.quantization, "") << value;
  }
}

TEST(QuantizeAtLoadRefusals, F16Checkpoints) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  WriteFloatCheckpoint(dir.path(), DType::kF16);
  ASSERT_TRUE(LoadModel(dir.path()).ok());
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path(), {.quantization = "fp8"});
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(model.status().message()),
              AllOf(HasSubstr("--quantization fp8"), HasSubstr("f16")));
}

TEST(QuantizeAtLoadRefusals, ANonFiniteWeightNamesItsTensor) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = testing::Fp8TestBackend();
  if (!backend.ok()) GTEST_SKIP() << "no backend: " << backend.status();
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string poisoned = "model.layers.1.self_attn.o_proj.weight";
  WriteFloatCheckpoint(dir.path(), DType::kBF16, poisoned);
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path(), {.quantization = "fp8"});
  ASSERT_TRUE(model.ok()) << model.status();  // weights are read at upload
  absl::StatusOr<std::unique_ptr<DeviceModel>> dm = DeviceModel::Upload(**model, **backend);
  EXPECT_EQ(dm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dm.status().message()),
              AllOf(HasSubstr("--quantization fp8"), HasSubstr("\"" + poisoned + "\""),
                    HasSubstr("NaN at row 0, column 5")));
  // Unquantized, the same weights upload (the NaN is the model's business).
  absl::StatusOr<std::unique_ptr<Model>> plain = LoadModel(dir.path());
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(DeviceModel::Upload(**plain, **backend).ok());
}

}  // namespace
}  // namespace tandem::gpu_worker
