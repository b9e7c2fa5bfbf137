// Shared by exact mode's model tests (../engine/exact_mode_test.cc, exact_recompute_test.cc): a
// model on the test backend with its runner and one embedded CPU node, a sequence of either mode
// over it (exact: an ExactTier with the given split), one forward step to host logits, and the
// rates of a balanced machine for forced splits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../engine/engine_test_util.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker::testing {

// Exact sequences keep a window of kExactWindow entries after kExactSink sinks (gpu: all).
inline constexpr int64_t kExactWindow = 64, kExactSink = 4;

struct ExactRig {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;  // null for random weights
  std::unique_ptr<DeviceModel> device_model;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<NodePool> pool;
  ModelConfig config;
};

// Loads `model_dir`, or random weights of `config` drawn from `seed` when model_dir is empty;
// one embedded node of 64 MiB. No backend: an error with the reason in *skip (the caller skips).
inline absl::StatusOr<ExactRig> MakeExactRig(const std::string& model_dir,
                                             const ModelConfig& config, uint64_t seed,
                                             std::string* skip) {
  ExactRig rig;
  rig.backend = MakeTestBackend(skip);
  if (rig.backend == nullptr) return absl::UnavailableError("no backend");
  if (model_dir.empty()) {
    rig.config = config;
    auto dm = DeviceModel::CreateRandom(config, *rig.backend, seed);
    if (!dm.ok()) return dm.status();
    rig.device_model = std::move(*dm);
  } else {
    auto model = LoadModel(model_dir);
    if (!model.ok()) return model.status();
    rig.model = std::move(*model);
    rig.config = rig.model->config;
    auto dm = DeviceModel::Upload(*rig.model, *rig.backend);
    if (!dm.ok()) return dm.status();
    rig.device_model = std::move(*dm);
  }
  auto runner = ModelRunner::Create(*rig.backend, *rig.device_model, {});
  if (!runner.ok()) return runner.status();
  rig.runner = std::move(*runner);
  NodePoolOptions nodes;
  nodes.embedded.pool_bytes = 64ull << 20;
  auto pool = NodePool::Create(nodes);
  if (!pool.ok()) return pool.status();
  rig.pool = std::move(*pool);
  return rig;
}

// The planner's geometry of `c` with 4-byte K/V and activation elements (f32).
inline ExactGeometry ExactGeometryOf(const ModelConfig& c) {
  return {c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, 4, 4};
}

// Rates of a balanced machine (the forced splits do not depend on them).
inline ExactPathRates EvenExactRates() {
  ExactPathRates r;
  r.pcie_bytes_per_second = 20e9;
  r.device_attend_bytes_per_second = 1e12;
  r.gemm_flops_per_second = 1e13;
  r.node_bytes_per_second = 20e9;
  r.node_overhead_seconds = 100e-6;
  r.nodes = 1;
  return r;
}

// How an exact sequence's tier plans: forced shares (fetch >= 0) or the book's plan; recompute
// only where allowed (the tier always has the rig's model).
struct ExactSplit {
  double fetch = -1, recompute = -1;
  bool allow_recompute = true;
  int time_every_steps = 4;  // ExactTierOptions::time_every_steps
};

// A sequence of `mode` on the rig (f32 window cache, blocks of 16, chunks up to 512); exact
// sequences get an ExactTier planned for 400 tokens, re-planned every 4 steps, with 48-token
// host pages. nullptr (and a test failure) when either cannot be made; `book` may be null for gpu.
inline std::unique_ptr<Sequence> MakeExactTestSequence(ExactRig& rig, AttentionMode mode,
                                                       const std::string& id, ExactRateBook* book,
                                                       const ExactSplit& split) {
  const ModelConfig& c = rig.config;
  WindowOptions wo;
  wo.block = 16;
  wo.max_chunk = 512;
  wo.max_context = std::min<int64_t>(c.max_position_embeddings, 2048);
  wo.window = mode == AttentionMode::kGpu ? WindowOptions::kUnlimited : kExactWindow;
  wo.sink = mode == AttentionMode::kGpu ? 0 : kExactSink;
  const WindowGeometry geometry{c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32};
  auto cache = WindowCache::Create(*rig.backend, geometry, wo);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return nullptr;
  auto seq = std::make_unique<Sequence>(id, mode, std::move(*cache));
  if (mode == AttentionMode::kExact) {
    RemoteKvOptions ro;
    ro.session_id = id;
    ro.num_layers = c.num_layers;
    ro.num_q_heads = c.num_q_heads;
    ro.num_kv_heads = c.num_kv_heads;
    ro.head_dim = c.head_dim;
    ro.kv_dtype = DType::kF32;
    ro.block_tokens = 16;
    ExactTierOptions eo;
    eo.geometry = ExactGeometryOf(c);
    eo.expected_tokens = 400;
    eo.plan.force_fetch_share = split.fetch;
    eo.plan.force_recompute_share = split.recompute;
    eo.plan.allow_recompute = split.allow_recompute;
    eo.model = rig.device_model.get();
    eo.replan_every_steps = 4;
    eo.time_every_steps = split.time_every_steps;
    // Small pages so that a few hundred entries span several pages and the slots cycle.
    auto tier = OpenExactTier(*rig.backend, *rig.pool, *book, ro, geometry, 48, eo);
    EXPECT_TRUE(tier.ok()) << tier.status();
    if (!tier.ok()) return nullptr;
    seq->offload = std::move(*tier);
  }
  return seq;
}

// Feeds `ids` to `seq` in one forward call; the last row's logits [vocab] on the host.
inline std::vector<float> StepLogits(ExactRig& rig, Sequence& seq,
                                     const std::vector<int32_t>& ids) {
  absl::Status s = rig.runner->Forward(seq, ids.data(), static_cast<int64_t>(ids.size()));
  EXPECT_TRUE(s.ok()) << s;
  auto logits = rig.runner->LastLogitsToHost();
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *logits : std::vector<float>{};
}

// max |a - b| over equal-length logit rows (1e30 when a is empty).
inline float MaxLogitDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return a.empty() ? 1e30f : d;
}

inline int32_t ArgmaxToken(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

}  // namespace tandem::gpu_worker::testing
