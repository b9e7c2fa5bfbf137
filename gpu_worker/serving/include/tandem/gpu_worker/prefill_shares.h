// How one scheduler step divides its prompt-token budget among the prefilling generations
// (chunked prefill interleaved with decode, Scheduler::StepOnce).
//
// Order: prefills passed over for aging_steps steps first (oldest first), then the shortest
// remaining prompt, ties first come first served. Each takes what is left of the budget up to
// its remaining prompt. First tokens come first: once a prompt completes within the step, a
// prompt that would not complete gets nothing this step unless it has aged, so a short request
// arriving during a long prefill gets its first token after a step of its own size, not after
// a step that also carries the long prompt's chunk; the long prompt loses that one short step,
// and aging bounds how often.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tandem::gpu_worker {

struct PrefillCandidate {
  int64_t remaining = 0;      // prompt tokens not yet fed (> 0)
  int64_t skipped_steps = 0;  // consecutive steps it got no tokens
  uint64_t order = 0;         // admission order
};

// Prompt tokens for each candidate this step (same indices as `candidates`; 0 = passed over),
// summing to at most `budget` (negative counts as 0). aging_steps >= 1.
std::vector<int64_t> PrefillShares(std::span<const PrefillCandidate> candidates, int64_t budget,
                                   int64_t aging_steps);

}  // namespace tandem::gpu_worker
