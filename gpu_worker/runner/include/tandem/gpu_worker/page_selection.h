// Which offloaded entries a hybrid step attends over on the CPU nodes (DESIGN "Selection").
//
//   kMaw    HGCA: entries whose moving-average attention weight in the window passed β when
//           they were evicted (re-selected after a new turn). Query-agnostic.
//   kPages  Quest-style: the offloaded KV of each (layer, kv head) is cut into pages of
//           page_tokens entries; the GPU keeps each page's elementwise min/max key (PageIndex)
//           and, every step and layer, picks the pages with the highest upper bound of q·k
//           within a token budget. The nodes attend exactly over the named pages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::gpu_worker {

enum class SelectionRule { kMaw, kPages };

// "maw" / "pages" (case-insensitive) -> rule; INVALID_ARGUMENT otherwise.
absl::StatusOr<SelectionRule> ParseSelectionRule(std::string_view name);
std::string_view SelectionRuleName(SelectionRule rule);

// The pages one Attend names (host memory, owned by the caller until FinishAttend). Page p of a
// (layer, kv head) shard is its offloaded entries [p·page_tokens, (p+1)·page_tokens).
//   ids: [num_tokens, num_kv_heads, per_head] int32, each row ascending, -1 = no page (padding
//        after the real ids). Every kv head of the model has a row; a node reads its own heads.
struct PageSelection {
  const int32_t* ids = nullptr;
  int64_t per_head = 0;
};

// The budget policy of `pages` selection for one sequence.
struct PagePolicy {
  int64_t select_tokens = 512;   // offloaded entries attended per (layer, kv head, query token)
  int64_t dense_layers = 0;      // the first dense_layers layers attend over every page
};

}  // namespace tandem::gpu_worker
