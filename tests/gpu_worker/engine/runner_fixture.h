// A fixture for tests that drive ModelRunner directly on stories260k: the model on the test
// backend, a runner with default options, and a NodePool with one embedded CPU node (64 MiB).
// Skips when the model or the backend is missing.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker::testing {

class Stories260kRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    std::string why;
    backend_ = MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
    auto model = LoadModel(ModelDir("stories260k"));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    auto dm = DeviceModel::Upload(*model_, *backend_);
    ASSERT_TRUE(dm.ok()) << dm.status();
    device_model_ = std::move(*dm);
    auto runner = ModelRunner::Create(*backend_, *device_model_, {});
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = std::move(*runner);
    NodePoolOptions nodes;
    nodes.embedded.pool_bytes = 64ull << 20;
    auto pool = NodePool::Create(nodes);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  // A sequence of `mode` with f32 KV in 16-token blocks: gpu mode keeps every entry in its
  // window; the others a `window`-token window + `sink` sinks (its tier is the caller's to add).
  // Null after a failure, which is reported.
  std::unique_ptr<Sequence> MakeWindowedSequence(AttentionMode mode, const std::string& id,
                                                 int64_t window, int64_t sink = 4) {
    const ModelConfig& c = model_->config;
    const WindowGeometry g{c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32};
    WindowOptions wo;
    wo.block = 16;
    wo.max_chunk = 512;
    wo.max_context = c.max_position_embeddings;
    wo.window = mode == AttentionMode::kGpu ? WindowOptions::kUnlimited : window;
    wo.sink = mode == AttentionMode::kGpu ? 0 : sink;
    auto cache = WindowCache::Create(*backend_, g, wo);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return nullptr;
    return std::make_unique<Sequence>(id, mode, std::move(*cache));
  }

  // Feeds ids to seq; returns the last token's logits (empty after a failure, which is reported).
  std::vector<float> Step(Sequence& seq, const std::vector<int32_t>& ids) {
    absl::Status s = runner_->Forward(seq, ids.data(), static_cast<int64_t>(ids.size()));
    EXPECT_TRUE(s.ok()) << s;
    auto logits = runner_->LastLogitsToHost();
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *logits : std::vector<float>{};
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<DeviceModel> device_model_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<NodePool> pool_;
};

}  // namespace tandem::gpu_worker::testing
