// Which offloaded entries a hybrid step attends over on the CPU nodes (DESIGN "Selection").
//
//   kMaw    HGCA: entries whose moving-average attention weight in the window passed β when
//           they were evicted (re-selected after a new turn). Query-agnostic.
//   kPages  Quest-style: the offloaded KV of each (layer, kv head) is cut into pages of
//           page_tokens entries; the GPU keeps each page's elementwise min/max/mean key
//           (PageIndex) and, every step and layer, picks pages within a token budget: a share by
//           the highest upper bound of q·k (Quest), the rest among the others by an estimate of
//           each page's softmax mass from its keys' low-rank coordinates (Loki; LowRankIndex) or,
//           where the session keeps none, by q·mean (PagePolicy). The nodes attend exactly over
//           the named pages.
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
  // Share of the pages chosen by the second score (below) after the rest were chosen by
  // Quest's bound, in [0, 1]; 0 = the bound alone. The bound finds the pages that hold the
  // largest keys, the second score the pages whose bulk of keys is close to q: both kinds carry
  // softmax mass, and the bound alone spends budget on pages of spread keys. Measured on
  // gutenberg-14m-64k (BENCHMARKS "Accuracy as the context grows"): 0.5 at 2048 tokens halves
  // the perplexity loss of the bound alone at 32K (with q·mean as the second score).
  double centroid_share = 0.5;
  // The second score: the logsumexp of the page's keys' low-rank scores (PageScore::kLowRank)
  // where the session keeps low-rank keys (the worker's page key rank) and the layer's basis is
  // made (its first calib_tokens keys offloaded), q·mean (kCentroid) elsewhere; false: q·mean
  // always.
  bool low_rank = true;

  // How `per_head` pages per (token, kv head) divide between the two scores (the bound's first,
  // then the centroid's among the rest); either may be 0 (one pass).
  struct Split {
    int64_t bound = 0;
    int64_t centroid = 0;
  };
  Split SplitPages(int64_t per_head) const {
    const auto centroid = static_cast<int64_t>(static_cast<double>(per_head) * centroid_share);
    return {per_head - centroid, centroid};
  }
};

}  // namespace tandem::gpu_worker
