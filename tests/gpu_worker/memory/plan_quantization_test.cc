// --quantization fp8 in the memory plan (PlanSetupFromOptions, as tandem-gpu-worker --plan and
// Engine::Create's check before the weights go up): a preset's weights are planned as the FP8
// geometry's and the cuda workspace gains the FP8 dequantization slab; a checkpoint's weights
// are planned as exactly what DeviceModel::Upload then allocates (FP8 codes + row scales on cuda
// with bf16 tables; the dequantized floats on the cpu backend); other values are refused by name.
// Built twice: cpu backend, and cuda (TANDEM_TEST_BACKEND_CUDA; skipped without a GPU).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/random_model_writer.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::HasSubstr;

#ifdef TANDEM_TEST_BACKEND_CUDA
constexpr char kBackend[] = "cuda";
#else
constexpr char kBackend[] = "cpu";
#endif

absl::StatusOr<std::unique_ptr<Backend>> TestBackend() {
#ifdef TANDEM_TEST_BACKEND_CUDA
  return CreateCudaBackend(0);
#else
  return CreateCpuBackend(1);
#endif
}

uint64_t ItemBytes(const MemoryTier& tier, const std::string& name) {
  for (const MemoryItem& item : tier.items) {
    if (item.name == name) return item.bytes;
  }
  ADD_FAILURE() << "no item " << name;
  return 0;
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class ScratchDir {
 public:
  ScratchDir()
      : path_(std::filesystem::temp_directory_path() /
              ("tandem_plan_q_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(PlanQuantization, APresetIsPlannedAsItsFp8Geometry) {
  if (!TestBackend().ok()) GTEST_SKIP() << "no " << kBackend << " backend";
  absl::StatusOr<ModelConfig> preset = GeometryPreset("llama3-8b");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EngineOptions options;
  options.backend = kBackend;
  absl::StatusOr<MemoryPlanSetup> bf16 = PlanSetupFromOptions(options, &*preset);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  options.quantization = "fp8";
  absl::StatusOr<MemoryPlanSetup> fp8 = PlanSetupFromOptions(options, &*preset);
  ASSERT_TRUE(fp8.ok()) << fp8.status();

  EXPECT_EQ(fp8->config.quantization, "fp8");
  ModelConfig fp8_config = *preset;
  fp8_config.quantization = "fp8";
  absl::StatusOr<size_t> fp8_bytes = DeviceModel::WeightBytes(fp8_config);
  ASSERT_TRUE(fp8_bytes.ok()) << fp8_bytes.status();
  EXPECT_EQ(fp8->weight_bytes, *fp8_bytes);
  // 6.98 B projection weights at 1 byte (+ row scales) instead of 2; 1.05 B of tables stay bf16.
  EXPECT_EQ(bf16->weight_bytes, 16060522496u);
  EXPECT_LT(fp8->weight_bytes, 9200000000u);
  EXPECT_GT(fp8->weight_bytes, 9000000000u);

  // The cuda workspace line holds the dequantized FP8 slab, doubled by Reserve's growth.
  MemoryPlanRequest request = MemoryPlanRequest::Defaults(options);
  request.mode = AttentionMode::kGpu;
  request.context = 4096;
  for (MemoryPlanSetup* s : {&*bf16, &*fp8}) s->backend = "cuda";
  absl::StatusOr<MemoryPlan> plan_bf16 = EstimateMemory(*bf16, request);
  absl::StatusOr<MemoryPlan> plan_fp8 = EstimateMemory(*fp8, request);
  ASSERT_TRUE(plan_bf16.ok()) << plan_bf16.status();
  ASSERT_TRUE(plan_fp8.ok()) << plan_fp8.status();
  EXPECT_EQ(ItemBytes(plan_fp8->device, "cuda workspace") -
                ItemBytes(plan_bf16->device, "cuda workspace"),
            2 * kCudaFp8SlabBytes);
  EXPECT_EQ(ItemBytes(plan_fp8->device, "weights"), *fp8_bytes);
}

TEST(PlanQuantization, ACheckpointIsPlannedAsUploadAllocatesIt) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = TestBackend();
  if (!backend.ok()) GTEST_SKIP() << "no " << kBackend << " backend: " << backend.status();
  absl::StatusOr<ModelConfig> tiny = GeometryPreset("tiny");  // bf16
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  ScratchDir dir;
  ASSERT_TRUE(WriteRandomModel(*tiny, dir.path(), {.seed = 3}).ok());

  EngineOptions options;
  options.backend = kBackend;
  options.model_dir = dir.path().string();
  absl::StatusOr<MemoryPlanSetup> bf16 = PlanSetupFromOptions(options, nullptr);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  options.quantization = "fp8";
  absl::StatusOr<MemoryPlanSetup> fp8 = PlanSetupFromOptions(options, nullptr);
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ(fp8->config.quantization, "fp8");

  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir.path(), {.quantization = "fp8"});
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<DeviceModel>> uploaded = DeviceModel::Upload(**model, **backend);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(fp8->weight_bytes, (*uploaded)->weight_bytes());
  if ((*backend)->SupportsFp8Weights()) {
    // Per layer: 36864 projection weights at 1 byte + 4 bytes a row (512 rows) instead of 2.
    EXPECT_EQ(bf16->weight_bytes - fp8->weight_bytes, 2u * (36864 - 512 * 4));
  } else {
    EXPECT_EQ(fp8->weight_bytes, bf16->weight_bytes);  // dequantized to bf16 on upload
  }
}

TEST(PlanQuantization, OtherValuesAreRefusedByName) {
  if (!TestBackend().ok()) GTEST_SKIP() << "no " << kBackend << " backend";
  absl::StatusOr<ModelConfig> preset = GeometryPreset("tiny");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EngineOptions options;
  options.backend = kBackend;
  options.quantization = "int4";
  absl::StatusOr<MemoryPlanSetup> setup = PlanSetupFromOptions(options, &*preset);
  EXPECT_EQ(setup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(setup.status().message()), HasSubstr("--quantization \"int4\""));
}

}  // namespace
}  // namespace tandem::gpu_worker
