#include "tandem/gpu_worker/tier_traits.h"

#include <algorithm>
#include <cmath>

#include "tandem/gpu_worker/page_index.h"

namespace tandem::gpu_worker {

SelectionRule SelectionOf(const Sequence& seq) {
  return seq.offload != nullptr && seq.offload->page_policy() != nullptr ? SelectionRule::kPages
                                                                         : SelectionRule::kMaw;
}

TierTraits TraitsOf(const Sequence& seq) { return TraitsOf(seq.mode, SelectionOf(seq)); }

TierTraits TraitsOf(AttentionMode mode, SelectionRule selection) {
  TierTraits t;
  switch (mode) {
    case AttentionMode::kGpu:
      break;
    case AttentionMode::kHybrid:
      t.windowed = true;
      t.page_summaries = selection == SelectionRule::kPages;
      t.node_selected_copies = selection == SelectionRule::kMaw;
      t.entries_on_nodes = true;
      t.spills_prefill = true;
      t.selects = true;
      break;
    case AttentionMode::kOffload:
      t.windowed = true;
      t.entries_on_host = true;
      t.streams_host_pages = true;
      break;
    case AttentionMode::kExact:   // the node session attends densely (no selection)
      t.windowed = true;
      t.entries_on_host = true;
      t.entries_on_nodes = true;
      t.streams_host_pages = true;
      t.measures_rates = true;
      break;
  }
  return t;
}

EntrySplit SplitEntries(const TierTraits& traits, int64_t offloaded, double fetch_share) {
  EntrySplit split;
  const bool both = traits.entries_on_host && traits.entries_on_nodes;
  if (!both || fetch_share < 0) {
    split.host = traits.entries_on_host ? offloaded : 0;
    split.nodes = traits.entries_on_nodes ? offloaded : 0;
    return split;
  }
  const double share = std::min(fetch_share, 1.0);
  split.host = static_cast<int64_t>(std::ceil(share * offloaded));
  split.nodes = offloaded - static_cast<int64_t>(std::floor(share * offloaded));
  return split;
}

uint64_t PageSummaryBytesFor(const TierTraits& traits, const WindowGeometry& geometry,
                             int64_t page_tokens, int64_t offloaded,
                             const LowRankOptions& low_rank) {
  if (!traits.page_summaries) return 0;
  return PageIndex::BytesFor(geometry, page_tokens, offloaded, low_rank);
}

}  // namespace tandem::gpu_worker
