#include "tandem/gpu_worker/step_time_cap.h"

#include <algorithm>

namespace tandem::gpu_worker {
namespace {

// Weight of the newest step in the averages: recent enough to follow the prefix's growth (a
// chunk adds a few percent to it), smooth enough to ride out one slow step.
constexpr double kNewest = 0.5;
// The share of a prompt step's time that is always counted per token, however large the fixed
// part measured on decode steps (a prompt step overlaps some of it).
constexpr double kMinPerTokenShare = 0.25;

double Average(double average, double sample) {
  return average == 0.0 ? sample : kNewest * sample + (1.0 - kNewest) * average;
}

}  // namespace

StepTimeCap::StepTimeCap(double max_step_ms, int64_t min_tokens)
    : max_step_seconds_(max_step_ms / 1e3), min_tokens_(std::max<int64_t>(min_tokens, 1)) {}

void StepTimeCap::Observe(int64_t prompt_tokens, double seconds) {
  if (max_step_seconds_ <= 0.0 || seconds <= 0.0 || prompt_tokens < 0) return;
  if (prompt_tokens < min_tokens_) {
    // A decode step is all fixed part; a small prompt share (a prompt's last chunk) is too,
    // less its tokens at the current per-token cost, which at a long prefix is most of it.
    if (prompt_tokens > 0 && seconds_per_token_ == 0.0) return;
    const double fixed =
        std::max(0.0, seconds - seconds_per_token_ * static_cast<double>(prompt_tokens));
    fixed_seconds_ = Average(fixed_seconds_, fixed);
    return;
  }
  const double per_token_seconds = std::max(seconds - fixed_seconds_, kMinPerTokenShare * seconds);
  seconds_per_token_ =
      Average(seconds_per_token_, per_token_seconds / static_cast<double>(prompt_tokens));
}

int64_t StepTimeCap::Cap(int64_t budget) const {
  if (max_step_seconds_ <= 0.0 || seconds_per_token_ == 0.0) return budget;
  // (+ 1e-6: a quotient that is whole in decimal but not in binary still counts whole)
  const double fits = std::max(0.0, max_step_seconds_ - fixed_seconds_) / seconds_per_token_ + 1e-6;
  const int64_t tokens = fits >= static_cast<double>(budget) ? budget : static_cast<int64_t>(fits);
  return std::min(budget, std::max(min_tokens_, tokens));
}

}  // namespace tandem::gpu_worker
