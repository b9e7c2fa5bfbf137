// SummarizePages and SelectPages of the cpu backend (private to backend/cpu), as specified in
// backend.h: per-page min/max keys, and the top pages of each (token, kv head) by the Quest
// upper bound of q·k, the centroid's q·mean or the low-rank estimate (cpu_low_rank_keys.h).
//
// Method: SelectPages writes every f32 score into the caller's scratch ([T, Hkv, num_pages],
// rows scored in parallel over page ranges), then picks each row's best `select` pages with
// nth_element on page ids and sorts them ascending. Scores are ordered by the same
// order-preserving uint32 key as the cuda backend (-0 counts as +0), so ties, and even NaN scores,
// are broken the same way on both backends: higher key first, then the lower page id.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "cpu_scratch.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

// INVALID_ARGUMENT when p breaks the SummarizePagesParams contract: null pointers, sizes < 1,
// a dtype other than f32/bf16, pages outside the cache's slots or the summaries' pages.
absl::Status ValidateSummarizePages(const SummarizePagesParams& p);
// INVALID_ARGUMENT when p breaks the SelectPagesParams contract: null pointers (scratch
// included), sizes < 1, num_pages > max_pages or > INT32_MAX, num_q_heads not a multiple of
// num_kv_heads, q_row_stride < num_q_heads·head_dim, a dtype other than f32/bf16; for kLowRank
// (whose summaries may be null) ValidateLowRankKeys.
absl::Status ValidateSelectPages(const SelectPagesParams& p);

// Runs validated calls on up to `threads` OpenMP threads. Not thread-safe (one owner).
class PageSelectRunner {
 public:
  explicit PageSelectRunner(int threads) : threads_(threads < 1 ? 1 : threads) {}

  absl::Status Summarize(const SummarizePagesParams& p);
  // RESOURCE_EXHAUSTED when the per-thread id lists cannot be allocated.
  absl::Status Select(const SelectPagesParams& p);

 private:
  int threads_;
  ScratchBuffer ids_;  // [threads, num_pages] int32: one candidate list per thread
};

}  // namespace tandem::gpu_worker::cpu
