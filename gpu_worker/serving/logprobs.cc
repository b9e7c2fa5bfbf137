#include "tandem/gpu_worker/logprobs.h"

#include <algorithm>
#include <cmath>
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
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs must be in 0..",
                                                   std::min<int64_t>(kMaxTopLogprobs, vocab),
                                                   ", got ", top_n));
  }
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    // NaN fails both comparisons: caught below through the sum.
    if (logits[i] > max) max = logits[i];
  }
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
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
