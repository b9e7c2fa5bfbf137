// Helpers of the FP8 weight tests (fp8_checkpoint_test, fp8_quantize_at_load_test): the
// llama_yarn fixture they derive their checkpoints from, float encodings, and one forward of a
// model directory on a backend (log-probs of the prompt and the last logits).
#pragma once

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/model_weights.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker::testing {

// The f32 llama_yarn fixture (rope_fixtures/; TANDEM_ROPE_FIXTURES_DIR overrides the folder).
inline std::filesystem::path Fp8SourceModel() {
  const char* dir = std::getenv("TANDEM_ROPE_FIXTURES_DIR");
  return (dir != nullptr ? std::filesystem::path(dir)
                         : std::filesystem::path(TANDEM_ROPE_FIXTURES)) /
         "llama_yarn";
}

inline std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `values` (f32) as the bytes of `dtype` (kF32 or kBF16).
inline std::vector<char> Encode(const float* values, size_t n, DType dtype) {
  std::vector<char> out(n * DTypeBytes(dtype));
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kBF16) {
      const bf16_t b = FloatToBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    }
  }
  return out;
}

// The backend these tests run on: cuda with TANDEM_TEST_BACKEND_CUDA (an error without a GPU:
// the caller skips), else cpu.
inline absl::StatusOr<std::unique_ptr<Backend>> Fp8TestBackend() {
#ifdef TANDEM_TEST_BACKEND_CUDA
  return CreateCudaBackend(0);
#else
  return CreateCpuBackend(0);
#endif
}

// The log-probs of every prompt token and the last logits of one forward of `prompt`.
struct Outputs {
  std::vector<float> logprobs;
  std::vector<float> last_logits;
  size_t weight_bytes = 0;
};

// Loads `dir` with `options`, uploads it to `backend` (checking that WeightBytes predicted the
// bytes) and runs `prompt` through it, `tokens_per_call` tokens per Forward (0: all in one, the
// prompt's prefill; 1: token by token, decode's matrix-vector shapes); failures are test
// failures and leave fields empty.
inline Outputs ForwardOf(Backend& backend, const std::filesystem::path& dir,
                         const std::vector<int32_t>& prompt, const LoadOptions& load = {},
                         int32_t tokens_per_call = 0) {
  Outputs out;
  absl::StatusOr<std::unique_ptr<Model>> model = LoadModel(dir, load);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return out;
  absl::StatusOr<std::unique_ptr<DeviceModel>> dm = DeviceModel::Upload(**model, backend);
  EXPECT_TRUE(dm.ok()) << dm.status();
  if (!dm.ok()) return out;
  out.weight_bytes = (*dm)->weight_bytes();
  EXPECT_EQ(out.weight_bytes, DeviceModel::WeightBytes((*model)->weights, backend));
  RunnerOptions options;
  options.max_chunk = 128;
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = ModelRunner::Create(backend, **dm, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return out;
  const ModelConfig& c = (*model)->config;
  WindowOptions wo;
  wo.block = 16;
  wo.max_chunk = 128;
  wo.max_context = 128;
  wo.window = WindowOptions::kUnlimited;
  wo.sink = 0;
  auto cache =
      WindowCache::Create(backend, {c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32}, wo);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return out;
  Sequence seq("fp8", AttentionMode::kGpu, std::move(*cache));
  std::vector<int32_t> targets(prompt.begin() + 1, prompt.end());
  targets.push_back(-1);
  out.logprobs.resize(prompt.size());
  const auto total = static_cast<int32_t>(prompt.size());
  const int32_t step = tokens_per_call > 0 ? tokens_per_call : total;
  for (int32_t at = 0; at < total; at += step) {
    ForwardOptions fo;
    fo.targets = targets.data() + at;
    fo.logprobs = out.logprobs.data() + at;
    const absl::Status s =
        (*runner)->Forward(seq, prompt.data() + at, std::min(step, total - at), fo);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) break;
  }
  out.logprobs.pop_back();
  absl::StatusOr<std::vector<float>> last = (*runner)->LastLogitsToHost();
  EXPECT_TRUE(last.ok()) << last.status();
  if (last.ok()) out.last_logits = *std::move(last);
  return out;
}

}  // namespace tandem::gpu_worker::testing
