#include "tandem/gpu_worker/logprobs.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker {

absl::StatusOr<StepLogprobs> ComputeStepLogprobs(const float* logits, int64_t vocab,
                                                 int32_t sampled, int32_t top_n) {
  if (logits == nullptr || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs of an empty row (vocab ", vocab, ")"));
  }
  if (sampled < 0 || sampled >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampled token ", sampled, " is outside the vocabulary [0, ", vocab, ")"));
  }
  if (top_n < 0 || top_n > std::min<int64_t>(kMaxTopLogprobs, vocab)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_logprobs must be in 0..", std::min<int64_t>(kMaxTopLogprobs, vocab), ", got ", top_n));
  }
  // 8 partial maxima, so the loop vectorises; a NaN is never taken here but makes the sum NaN.
  float partial_max[8];
  std::fill(std::begin(partial_max), std::end(partial_max),
            -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = logits[i];
    partial_max[i & 7] = x > partial_max[i & 7] ? x : partial_max[i & 7];
  }
  float max = partial_max[0];
  for (const float m : partial_max) max = m > max ? m : max;
  // NOTE: f32 exp (within an ulp, the precision of the f32 logits and results) into 8
  // independent f64 partial sums: ~0.2 ms for a 128K row where one f64 chain of f64 exps takes
  // ~0.5 ms (the per-token cost of a logprobs request on the scheduler thread).
  double partial[8] = {};
  for (int64_t i = 0; i < vocab; ++i) partial[i & 7] += std::exp(logits[i] - max);
  double sum = 0.0;
  for (const double p : partial) sum += p;
  const double lse = static_cast<double>(max) + std::log(sum);
  if (!std::isfinite(lse) || std::isnan(sum)) {
    return absl::InternalError("the model's logits are not finite (NaN or +inf): no logprobs");
  }

  StepLogprobs result;
  result.sampled = static_cast<float>(static_cast<double>(logits[sampled]) - lse);
  if (top_n == 0) return result;
  // top[0..kept) sorted by (logit desc, id asc). Scanning ids in ascending order, a logit equal
  // to the worst kept one does not enter, so equal logits keep the lower id.
  std::vector<LogprobCandidate>& top = result.top;
  top.reserve(static_cast<size_t>(top_n));
  std::vector<float> kept_logits;
  kept_logits.reserve(static_cast<size_t>(top_n));
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = logits[i];
    if (static_cast<int32_t>(top.size()) == top_n && !(x > kept_logits.back())) continue;
    if (static_cast<int32_t>(top.size()) == top_n) {
      top.pop_back();
      kept_logits.pop_back();
    }
    // First kept position whose logit is smaller than x: after every equal (lower-id) one.
    const size_t at = static_cast<size_t>(
        std::upper_bound(kept_logits.begin(), kept_logits.end(), x, std::greater<float>()) -
        kept_logits.begin());
    kept_logits.insert(kept_logits.begin() + static_cast<std::ptrdiff_t>(at), x);
    top.insert(top.begin() + static_cast<std::ptrdiff_t>(at),
               LogprobCandidate{static_cast<int32_t>(i), 0.0f});
  }
  for (size_t k = 0; k < top.size(); ++k) {
    top[k].logprob = static_cast<float>(static_cast<double>(kept_logits[k]) - lse);
  }
  return result;
}

}  // namespace tandem::gpu_worker
