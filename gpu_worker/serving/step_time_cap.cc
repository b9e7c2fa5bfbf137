#include "tandem/gpu_worker/step_time_cap.h"

#include <algorithm>

namespace tandem::gpu_worker {
namespace {

// Weight of the newest step in the average: recent enough to follow the prefix's growth (a
// chunk adds a few percent to it), smooth enough to ride out one slow step.
constexpr double kNewest = 0.5;

}  // namespace

StepTimeCap::StepTimeCap(double max_step_ms, int64_t min_tokens)
    : max_step_seconds_(max_step_ms / 1e3), min_tokens_(std::max<int64_t>(min_tokens, 1)) {}

void StepTimeCap::Observe(int64_t prompt_tokens, double seconds) {
  if (max_step_seconds_ <= 0.0 || prompt_tokens < min_tokens_ || seconds <= 0.0) return;
  const double per_token = seconds / static_cast<double>(prompt_tokens);
  seconds_per_token_ = seconds_per_token_ == 0.0
                           ? per_token
                           : kNewest * per_token + (1.0 - kNewest) * seconds_per_token_;
}

int64_t StepTimeCap::Cap(int64_t budget) const {
  if (max_step_seconds_ <= 0.0 || seconds_per_token_ == 0.0) return budget;
  const double fits = max_step_seconds_ / seconds_per_token_;
  const int64_t tokens = fits >= static_cast<double>(budget) ? budget : static_cast<int64_t>(fits);
  return std::min(budget, std::max(min_tokens_, tokens));
}

}  // namespace tandem::gpu_worker
