// What the offload tier of an attention mode (tier_factory.h) asks of each memory and of the
// engine, as data. The memory plan (memory_plan.h), the engine's admission and its sessions read
// these instead of branching on the mode, so a tier's needs are written down once, here.
//
//   mode     device window     device extras            offloaded entries     host streamer
//   gpu      every position    -                        -                     -
//   hybrid   sink + window     page summaries (pages)   CPU nodes             a spilled prefill
//   offload  sink + window     -                        pinned host pages     from the open
//   exact    sink + window     rate probe (first)       host and nodes split  from the open
#pragma once

#include <cstdint>

#include "tandem/gpu_worker/low_rank_index.h"
#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/sequence.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

struct TierTraits {
  // Positions beyond sink + window leave the device for the tier. False (gpu mode): the window
  // holds every position and grows in place as a session continues.
  bool windowed = false;
  // Page summaries (PageIndex, min/max keys per page) live on the device and each decode row
  // selects pages from them (hybrid with pages).
  bool page_summaries = false;
  // The nodes keep a copy of the entries a MAW selection picked (hybrid with MAW).
  bool node_selected_copies = false;
  // Where the offloaded entries are kept. Both (exact): the exact planner splits them at run time.
  bool entries_on_host = false;
  bool entries_on_nodes = false;
  // The runner's host page streamer (HostPageStreams::Of) is made when a session
  // opens, before its prompt widens the window (offload, exact).
  bool streams_host_pages = false;
  // A new session's prompt that fits the device only in part spills to pinned host pages while
  // it is prefilled (PrefillSpillTier), through the host page streamer (hybrid).
  bool spills_prefill = false;
  // The first session measures the PCIe, attention and GEMM rates its split is planned with
  // (ExactRateBook::Measure, exact).
  bool measures_rates = false;
  // Attends over a selection of the offloaded entries (MAW or pages, the tier's rule),
  // chosen afresh for a continuing turn's query rows; the others attend over all (hybrid).
  bool selects = false;
};

TierTraits TraitsOf(AttentionMode mode, SelectionRule selection);
// The selection rule of a sequence's tier: kPages when it has a page budget
// (OffloadTier::page_policy), kMaw otherwise (a sequence without a tier included).
SelectionRule SelectionOf(const Sequence& seq);
// TraitsOf(seq.mode, SelectionOf(seq)).
TierTraits TraitsOf(const Sequence& seq);

// How many of a sequence's `offloaded` entries per (layer, kv head) each side keeps. A split
// tier with `fetch_share` < 0 (planned at run time) sizes each side for all of them, the most it
// may be given; otherwise the host takes ceil(share · offloaded) and the nodes the rest of
// floor(share · offloaded), so that rounding never leaves either side short.
struct EntrySplit {
  int64_t host = 0;
  int64_t nodes = 0;
};
EntrySplit SplitEntries(const TierTraits& traits, int64_t offloaded, double fetch_share);

// Device bytes of a sequence's page summaries with room for `offloaded` entries per (layer,
// kv head) in `page_tokens`-token pages; 0 for a tier without them.
uint64_t PageSummaryBytesFor(const TierTraits& traits, const WindowGeometry& geometry,
                             int64_t page_tokens, int64_t offloaded,
                             const LowRankOptions& low_rank);

}  // namespace tandem::gpu_worker
