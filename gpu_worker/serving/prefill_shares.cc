#include "tandem/gpu_worker/prefill_shares.h"

#include <algorithm>
#include <numeric>

namespace tandem::gpu_worker {

std::vector<int64_t> PrefillShares(std::span<const PrefillCandidate> candidates, int64_t budget,
                                   int64_t aging_steps) {
  std::vector<size_t> by_priority(candidates.size());
  std::iota(by_priority.begin(), by_priority.end(), size_t{0});
  auto aged = [&](size_t i) { return candidates[i].skipped_steps >= aging_steps; };
  std::sort(by_priority.begin(), by_priority.end(), [&](size_t a, size_t b) {
    if (aged(a) != aged(b)) return aged(a);
    if (!aged(a) && candidates[a].remaining != candidates[b].remaining) {
      return candidates[a].remaining < candidates[b].remaining;
    }
    return candidates[a].order < candidates[b].order;
  });
  std::vector<int64_t> shares(candidates.size(), 0);
  bool completes_a_prompt = false;
  for (size_t i : by_priority) {
    if (budget <= 0) break;
    const int64_t take = std::min(budget, candidates[i].remaining);
    const bool completes = take == candidates[i].remaining;
    if (!completes && completes_a_prompt && !aged(i)) continue;  // first tokens first
    shares[i] = take;
    budget -= take;
    completes_a_prompt = completes_a_prompt || completes;
  }
  return shares;
}

}  // namespace tandem::gpu_worker
