#include "cpu_sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"
#include "cpu_vector_kernels.h"

namespace tandem::gpu_worker::cpu {
namespace {

// The lowest index among the largest finite-or-infinite logits (NaN is never chosen), -1 when
// every logit is NaN.
int64_t ArgMax(const float* logits, int64_t vocab) {
  int64_t best = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = i;
  }
  return best;
}

}  // namespace

absl::StatusOr<int32_t> RunSample(const SampleParams& p) {
  if (p.logits == nullptr) return absl::InvalidArgumentError("Sample: logits must not be null");
  if (p.vocab <= 0 || p.vocab > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Sample: vocab %d must be in [1, 2^31)", p.vocab));
  }
  if (std::isnan(p.temperature) || std::isnan(p.top_p)) {
    return absl::InvalidArgumentError("Sample: temperature and top_p must not be NaN");
  }
  if (!(p.uniform >= 0.0f && p.uniform < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Sample: uniform %g must be in [0, 1)", p.uniform));
  }
  const int64_t best = ArgMax(p.logits, p.vocab);
  if (best < 0) return absl::InvalidArgumentError("Sample: every logit is NaN");
  if (p.ArgmaxOnly() || p.logits[best] == -std::numeric_limits<float>::infinity()) {
    return static_cast<int32_t>(best);
  }
  if (std::isinf(p.logits[best])) return static_cast<int32_t>(best);  // +inf takes all mass

  // p_i ∝ exp((l_i - max) / temperature); NaN logits get no mass.
  const double max = p.logits[best];
  const double temperature = p.temperature;
  std::vector<double> prob(static_cast<size_t>(p.vocab));
  double total = 0.0;
  for (int64_t i = 0; i < p.vocab; ++i) {
    const double l = p.logits[i];
    prob[i] = std::isnan(l) ? 0.0 : std::exp((l - max) / temperature);
    total += prob[i];
  }
  for (double& x : prob) x /= total;

  // Most probable first, the lower id first among equal probabilities.
  std::vector<int32_t> order(static_cast<size_t>(p.vocab));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = p.vocab;
  if (p.top_k > 0) keep = std::min<int64_t>(keep, p.top_k);
  const bool cut = keep < p.vocab || p.top_p < 1.0f;
  auto more_probable = [&prob](int32_t a, int32_t b) {
    return prob[a] != prob[b] ? prob[a] > prob[b] : a < b;
  };
  if (cut) {
    std::sort(order.begin(), order.end(), more_probable);
    if (p.top_p < 1.0f) {
      double top_k_mass = 0.0;
      for (int64_t i = 0; i < keep; ++i) top_k_mass += prob[order[i]];
      const double target = static_cast<double>(p.top_p) * top_k_mass;
      double mass = 0.0;
      int64_t n = 0;
      while (n < keep) {
        mass += prob[order[n]];
        ++n;
        if (mass >= target) break;  // the most probable token is always kept (n >= 1)
      }
      keep = n;
    }
  }

  // The kept tokens in ascending id order; the first whose cumulative mass exceeds u · kept.
  std::vector<int32_t> kept;
  if (cut) {
    kept.assign(order.begin(), order.begin() + keep);
    std::sort(kept.begin(), kept.end());
  } else {
    kept = std::move(order);
  }
  double kept_mass = 0.0;
  for (int32_t id : kept) kept_mass += prob[id];
  const double threshold = static_cast<double>(p.uniform) * kept_mass;
  double cumulative = 0.0;
  for (int32_t id : kept) {
    cumulative += prob[id];
    if (cumulative > threshold) return id;
  }
  // Rounding left the threshold unreached: the last kept token with mass.
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
    if (prob[*it] > 0.0) return *it;
  }
  return static_cast<int32_t>(best);
}

absl::Status RunTokenLogProbs(const TokenLogProbParams& p) {
  if (p.logits == nullptr || p.targets == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("TokenLogProbs: logits, targets and out must not be null");
  }
  if (p.num_tokens <= 0 || p.vocab <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TokenLogProbs: num_tokens (%d) and vocab (%d) must be positive", p.num_tokens, p.vocab));
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.targets[t] < 0 || p.targets[t] >= p.vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "TokenLogProbs: targets[%d] = %d is outside [0, %d)", t, p.targets[t], p.vocab));
    }
  }
  constexpr float kLog2e = std::numbers::log2e_v<float>;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* row = p.logits + t * p.vocab;
    const float max = RowMax(row, p.vocab);
    if (!std::isfinite(max)) {  // every logit -inf, or one +inf: undefined, as in torch
      p.out[t] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // Σ exp(l - max) = Σ 2^((l - max) · log2e) >= 1 (the largest term is 1).
    const float sum = SumExp2Shifted(row, p.vocab, max, kLog2e);
    p.out[t] = (row[p.targets[t]] - max) - std::log(sum);
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
