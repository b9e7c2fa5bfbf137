// TierTraits: what each attention mode's tier asks of device, host and nodes (tier_traits.h),
// which the memory plan and the engine read instead of the mode.
#include "tandem/gpu_worker/tier_traits.h"

#include <gtest/gtest.h>

#include "tandem/gpu_worker/page_index.h"

namespace tandem::gpu_worker {
namespace {

TEST(TierTraitsTest, EachModeSaysWhereItsEntriesLiveAndWhatItNeeds) {
  const TierTraits gpu = TraitsOf(AttentionMode::kGpu, SelectionRule::kPages);
  EXPECT_FALSE(gpu.windowed);
  EXPECT_FALSE(gpu.entries_on_host || gpu.entries_on_nodes || gpu.page_summaries ||
               gpu.streams_host_pages || gpu.spills_prefill || gpu.measures_rates || gpu.selects);

  const TierTraits pages = TraitsOf(AttentionMode::kHybrid, SelectionRule::kPages);
  EXPECT_TRUE(pages.windowed && pages.entries_on_nodes && pages.page_summaries && pages.selects &&
              pages.spills_prefill);
  EXPECT_FALSE(pages.entries_on_host || pages.node_selected_copies || pages.streams_host_pages ||
               pages.measures_rates);
  const TierTraits maw = TraitsOf(AttentionMode::kHybrid, SelectionRule::kMaw);
  EXPECT_TRUE(maw.node_selected_copies);
  EXPECT_FALSE(maw.page_summaries);

  const TierTraits offload = TraitsOf(AttentionMode::kOffload, SelectionRule::kPages);
  EXPECT_TRUE(offload.windowed && offload.entries_on_host && offload.streams_host_pages);
  EXPECT_FALSE(offload.entries_on_nodes || offload.page_summaries || offload.selects ||
               offload.spills_prefill || offload.measures_rates);

  // Exact attends densely whatever selection the request names.
  for (SelectionRule rule : {SelectionRule::kMaw, SelectionRule::kPages}) {
    const TierTraits exact = TraitsOf(AttentionMode::kExact, rule);
    EXPECT_TRUE(exact.windowed && exact.entries_on_host && exact.entries_on_nodes &&
                exact.streams_host_pages && exact.measures_rates);
    EXPECT_FALSE(exact.page_summaries || exact.node_selected_copies || exact.selects ||
                 exact.spills_prefill);
  }
}

TEST(TierTraitsTest, SplitEntriesSizesEachSideForWhatItMayHold) {
  const TierTraits offload = TraitsOf(AttentionMode::kOffload, SelectionRule::kMaw);
  const TierTraits hybrid = TraitsOf(AttentionMode::kHybrid, SelectionRule::kMaw);
  const TierTraits exact = TraitsOf(AttentionMode::kExact, SelectionRule::kMaw);
  const TierTraits gpu = TraitsOf(AttentionMode::kGpu, SelectionRule::kMaw);
  EXPECT_EQ(SplitEntries(offload, 1000, 0.3).host, 1000);   // a one-sided tier ignores the share
  EXPECT_EQ(SplitEntries(offload, 1000, 0.3).nodes, 0);
  EXPECT_EQ(SplitEntries(hybrid, 1000, -1).host, 0);
  EXPECT_EQ(SplitEntries(hybrid, 1000, -1).nodes, 1000);
  EXPECT_EQ(SplitEntries(gpu, 1000, -1).host + SplitEntries(gpu, 1000, -1).nodes, 0);
  // Planned at run time: each side may be given all of them.
  EXPECT_EQ(SplitEntries(exact, 1000, -1).host, 1000);
  EXPECT_EQ(SplitEntries(exact, 1000, -1).nodes, 1000);
  // Forced: the host rounds up and the nodes keep the rest of the rounded-down share, so a
  // fraction of an entry is on both sides rather than on neither.
  EXPECT_EQ(SplitEntries(exact, 10, 0.25).host, 3);
  EXPECT_EQ(SplitEntries(exact, 10, 0.25).nodes, 8);
  EXPECT_EQ(SplitEntries(exact, 10, 0.5).host, 5);
  EXPECT_EQ(SplitEntries(exact, 10, 0.5).nodes, 5);
  EXPECT_EQ(SplitEntries(exact, 10, 3.0).host, 10);   // a share above 1 is all of them
  EXPECT_EQ(SplitEntries(exact, 10, 3.0).nodes, 0);
}

TEST(TierTraitsTest, OnlyAPagesTierKeepsSummariesOnTheDevice) {
  const WindowGeometry g{4, 2, 64, DType::kBF16};
  const LowRankOptions low_rank{LowRankOptions::kHalfHeadDim, 1024};
  EXPECT_EQ(PageSummaryBytesFor(TraitsOf(AttentionMode::kHybrid, SelectionRule::kPages), g, 16,
                                4096, low_rank),
            PageIndex::BytesFor(g, 16, 4096, low_rank));
  EXPECT_GT(PageIndex::BytesFor(g, 16, 4096), 0u);
  // The low-rank keys add coordinates (32 + 4 bytes a key), a basis and the staged keys.
  EXPECT_EQ(PageIndex::BytesFor(g, 16, 4096, low_rank) - PageIndex::BytesFor(g, 16, 4096),
            size_t{4} * 2 * (4096 * 36 + 64 * 32 * 4 + 1024 * 64 * 2));
  EXPECT_EQ(PageSummaryBytesFor(TraitsOf(AttentionMode::kHybrid, SelectionRule::kMaw), g, 16,
                                4096, low_rank),
            0u);
  EXPECT_EQ(PageSummaryBytesFor(TraitsOf(AttentionMode::kExact, SelectionRule::kPages), g, 16,
                                4096, low_rank),
            0u);
}

}  // namespace
}  // namespace tandem::gpu_worker
