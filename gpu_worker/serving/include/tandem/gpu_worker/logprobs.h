// Log-probabilities of one sampling step, for Generate's `logprobs` / `top_logprobs` (OpenAI's
// and vLLM's default meaning): the log-softmax of the model's raw logits of that step, before
// temperature, top_k and top_p, so the numbers do not depend on the sampling settings.
//
// Thread-safe (pure functions).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::gpu_worker {

// Most candidates one step may report (OpenAI's limit).
inline constexpr int32_t kMaxTopLogprobs = 20;

struct LogprobCandidate {
  int32_t token_id = 0;
  float logprob = 0.0f;  // natural log, <= 0
};

struct StepLogprobs {
  float sampled = 0.0f;               // log p(the sampled token)
  std::vector<LogprobCandidate> top;  // most likely first; equal logits: lower id first
};

// logits: host memory, [vocab] f32. lse = max + log Σ exp(logit - max), each exp in f32 and the
// sum accumulated in f64; logprob(i) = logit_i - lse, rounded to f32. top: the top_n largest by one
// pass over the row (O(vocab · top_n) worst case, O(vocab) typically; allocates O(top_n) only).
// INVALID_ARGUMENT when vocab < 1, sampled is outside [0, vocab) or top_n is outside
// 0..min(kMaxTopLogprobs, vocab); INTERNAL when the row has a NaN or +inf (a broken model).
absl::StatusOr<StepLogprobs> ComputeStepLogprobs(const float* logits, int64_t vocab,
                                                 int32_t sampled, int32_t top_n);

}  // namespace tandem::gpu_worker
