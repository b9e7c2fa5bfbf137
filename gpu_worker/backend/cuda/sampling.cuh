// Token sampling from one row of logits, and per-token log-probabilities.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

// backend.h's SampleParams: temperature <= 0 is argmax (lowest index among equal maxima, NaN
// never wins); otherwise p = softmax(logits / temperature), keep the top_k most probable (ties
// by ascending id), then the shortest most-probable prefix of those whose mass reaches
// top_p · (their mass) (at least one token; the cpu backend's reading), and return the first
// id, in ascending id order, at which the kept cumulative mass exceeds uniform · (kept mass).
// Masses are summed in f64.
struct SampleArgs {
  const float* logits = nullptr;  // [vocab]
  int64_t vocab = 0;              // <= INT32_MAX
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float uniform = 0.0f;
  int32_t* result = nullptr;  // [1] device memory: the chosen id
};

// Device workspace LaunchSample needs for `vocab` (probabilities, ids, their sorted copies, the
// keep mask and cub's radix-sort storage).
cudaError_t SampleWorkspaceBytes(int64_t vocab, size_t* bytes);
cudaError_t LaunchSample(const SampleArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

// out[t] = logits[t, targets[t]] - max_t - log Σ exp(logits[t, :] - max_t); NaN for a target
// outside [0, vocab).
struct TokenLogProbsArgs {
  const float* logits = nullptr;     // [num_tokens, vocab]
  const int32_t* targets = nullptr;  // [num_tokens]
  float* out = nullptr;              // [num_tokens]
  int64_t num_tokens = 0;
  int64_t vocab = 0;
};
cudaError_t LaunchTokenLogProbs(const TokenLogProbsArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
