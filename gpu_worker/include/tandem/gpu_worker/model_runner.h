// ModelRunner: the Llama forward pass of one sequence over the backend, with hybrid attention.
//
// Forward() feeds tokens at the sequence's next positions in chunks of at most max_chunk tokens
// (chunked prefill, HeadInfer §2: activation memory is bounded by the chunk, whatever the prompt
// length). Per chunk and layer:
//   x̂ = RMSNorm(x); [q|k|v] = x̂·Wqkvᵀ; RoPE(q, k); k, v -> the window's new slots
//   hybrid: q -> CPU nodes (Attend over the offloaded, selected entries) in the background
//   (O, LSE) = window attention (causal by position; updates MAW in hybrid mode)
//   hybrid: merge the CPU partial state into (O, LSE) (the exact LSE merge)
//   x += O·Woᵀ; x += down(SwiGLU(RMSNorm(x)·Wgate_upᵀ))
// then the final norm and lm_head, and the eviction of window blocks beyond the window to the
// CPU nodes, with their MAW (they arrive before the next Attend of their layer).
//
// Not thread-safe: the engine's executor thread owns the runner, its backend and sequences.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

struct RunnerOptions {
  int64_t max_chunk = 512;   // tokens per forward chunk (prefill activation bound)
  float maw_alpha = 0.1f;    // MAW moving-average factor α: maw = (1-α)·maw + α·a
};

struct ForwardOptions {
  // Optional [n] next-token targets: logprobs[i] = log p(targets[i] | tokens[..i]); a target
  // of -1 is skipped (logprobs[i] = 0). Needs logprobs.
  const int32_t* targets = nullptr;
  float* logprobs = nullptr;   // host, [n]
  // Called after each chunk with (tokens processed so far, n).
  std::function<void(int64_t, int64_t)> on_chunk;
};

class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(Backend& backend,
                                                             const DeviceModel& model,
                                                             const RunnerOptions& options);

  // Feeds ids[0..n) (each in [0, vocab); the caller validates) through the model. Afterwards
  // last_logits() holds the logits of the last token. Errors leave the sequence unusable
  // (the engine closes it).
  absl::Status Forward(Sequence& sequence, const int32_t* ids, int64_t n,
                       const ForwardOptions& options = {});

  const float* last_logits() const { return last_logits_; }   // device, [vocab]
  absl::StatusOr<std::vector<float>> LastLogitsToHost();

  Backend& backend() { return backend_; }
  const DeviceModel& model() const { return model_; }
  const RunnerOptions& options() const { return options_; }

 private:
  ModelRunner(Backend& backend, const DeviceModel& model, const RunnerOptions& options)
      : backend_(backend), model_(model), options_(options) {}
  absl::Status ForwardChunk(Sequence& sequence, const int32_t* ids, int64_t n,
                            const int32_t* targets, float* logprobs);
  absl::Status Attention(Sequence& sequence, int64_t layer, int64_t n);
  absl::Status Evict(Sequence& sequence);

  Backend& backend_;
  const DeviceModel& model_;
  RunnerOptions options_;

  // Activations of one chunk (device).
  DeviceBuffer x_, xn_, qkv_, attn_, lse_, gate_up_, ffn_, cpu_o_, cpu_lse_;
  DeviceBuffer ids_, positions_, slots_, targets_, logprobs_;
  DeviceBuffer logits_;       // [max_chunk, vocab] when log-probs are asked for, else [1, vocab]
  int64_t logits_rows_ = 0;
  const float* last_logits_ = nullptr;
  // Host staging.
  std::vector<float> q_host_, o_host_, lse_host_;
  std::vector<char> evict_k_, evict_v_;
  std::vector<float> evict_maw_;
};

}  // namespace tandem::gpu_worker
