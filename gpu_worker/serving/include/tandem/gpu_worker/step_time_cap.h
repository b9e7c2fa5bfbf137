// A cap on the prompt tokens of a scheduler step, so that a step (and with it the wait of a
// request that arrives while it runs, and the inter-token latency of decoding requests) stays
// near max_step_ms however long the prefix of a prompt being prefilled has grown. The seconds
// per prompt token of recent prefill steps (an exponential average) predict the next step's;
// they grow with the prefix the chunks attend over, so the chunks shrink as a long prompt
// proceeds. Not thread-safe (the scheduler's thread).
#pragma once

#include <cstdint>

namespace tandem::gpu_worker {

class StepTimeCap {
 public:
  // max_step_ms = 0: no cap. min_tokens >= 1: a step may always feed that many (prefill always
  // progresses, and steps that small are not timed).
  StepTimeCap(double max_step_ms, int64_t min_tokens);

  // After a step that fed `prompt_tokens` prompt tokens in `seconds` (wall time of the step).
  void Observe(int64_t prompt_tokens, double seconds);

  // Prompt tokens the next step may feed out of `budget`: `budget` when off or before a prefill
  // step was timed, else min(budget, max(min_tokens, max_step_ms / seconds per prompt token)).
  int64_t Cap(int64_t budget) const;

  double seconds_per_token() const { return seconds_per_token_; }

 private:
  double max_step_seconds_;
  int64_t min_tokens_;
  double seconds_per_token_ = 0.0;  // 0: not yet timed
};

}  // namespace tandem::gpu_worker
