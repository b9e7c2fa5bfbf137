// A cap on the prompt tokens of a scheduler step, so that a step (and with it the wait of a
// request that arrives while it runs, and the inter-token latency of decoding requests) stays
// near max_step_ms however long the prefix of a prompt being prefilled has grown.
//
// A step's time is modelled as fixed + per_token · prompt tokens. The fixed part (weights read
// once per step, launches: ~5 ms for an 8B model on an H200, next to ~40 µs per prompt token at
// a 16K prefix) is the average time of decode steps, and of steps with fewer than min_tokens
// prompt tokens less those tokens at the current per-token cost; the per-token part is the
// average of (time - fixed) / prompt tokens over the larger steps. Both averages
// weight the newest step 0.5, so the per-token part follows the prefix as it grows and the
// chunks shrink as a long prompt proceeds. Without a decode step seen yet, fixed is 0 (the whole
// time is per token, which makes the first chunks smaller than they need be). Not thread-safe
// (the scheduler's thread).
#pragma once

#include <cstdint>

namespace tandem::gpu_worker {

class StepTimeCap {
 public:
  // max_step_ms = 0: no cap. min_tokens >= 1: a step may always feed that many (prefill always
  // progresses); steps with fewer prompt tokens time the fixed part.
  StepTimeCap(double max_step_ms, int64_t min_tokens);

  // After a step that fed `prompt_tokens` prompt tokens in `seconds` (wall time of the step).
  void Observe(int64_t prompt_tokens, double seconds);

  // Prompt tokens the next step may feed out of `budget`: `budget` when off or before a prompt
  // step was timed, else min(budget, max(min_tokens, (max_step - fixed) / per_token)).
  int64_t Cap(int64_t budget) const;

  double fixed_seconds() const { return fixed_seconds_; }
  double seconds_per_token() const { return seconds_per_token_; }

 private:
  double max_step_seconds_;
  int64_t min_tokens_;
  double fixed_seconds_ = 0.0;      // 0: no small step timed yet
  double seconds_per_token_ = 0.0;  // 0: no prompt step timed yet
};

}  // namespace tandem::gpu_worker
