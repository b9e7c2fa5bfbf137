// The offload tier of a new sequence, by attention mode: the one place that knows which tier each
// mode keeps its KV beyond the device window in (the engine's sessions and tandem-bench's prefill
// runs open theirs here).
//
//   gpu      none: every position stays in the device window
//   hybrid   NodeTier: a session on the CPU nodes (RemoteKv), with page summaries on the device
//            (PageIndex) when it selects by pages
//   offload  HostTier: pinned host pages streamed to the device every step
//   exact    ExactTier: host pages and a dense node session, split by the exact planner
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/exact_rebuild.h"
#include "tandem/gpu_worker/exact_tier.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

struct TierSpec {
  AttentionMode mode = AttentionMode::kGpu;
  WindowGeometry geometry;   // the sequence's device window
  // hybrid, exact: the session on the CPU nodes (its name, the model's heads, the KV dtype,
  // blocks, deadlines; hybrid: β, selection, page_tokens; expected_tokens: the offloaded entries
  // per (layer, kv head) the nodes should have room for).
  RemoteKvOptions node;
  // hybrid with node.selection = pages: summaries of node.page_tokens-token pages, with room for
  // `summary_tokens` offloaded entries per (layer, kv head).
  int64_t summary_tokens = 0;
  // ... and the offloaded keys' low-rank coordinates (off unless enabled).
  LowRankOptions low_rank;
  // offload, exact: tokens per host page (one upload).
  int64_t host_page_tokens = 4096;
  // exact: the split's plan and the rates it is planned with (outlive the tier).
  ExactTierOptions exact;
  ExactRateBook* exact_rates = nullptr;
  // What rebuilds the entries a lost CPU node held (hybrid: RecomputeKv; exact: RecomputeAt);
  // empty: they stay lost (attends degraded).
  RecomputeKv node_recompute;
  RecomputeAt exact_recompute;
  // What a new hybrid or offload tier starts with (benches that make a context without a
  // prefill, bench/synthetic_context.h; empty for sessions, whose tiers start empty): called
  // once each part exists, before it is wrapped in its tier.
  std::function<absl::Status(RemoteKv&)> seed_nodes;
  std::function<absl::Status(PageIndex&)> seed_pages;
  std::function<absl::Status(OffloadedKv&)> seed_host;
};

// Null for gpu mode. INVALID_ARGUMENT when a mode that needs CPU nodes has none or exact has no
// rates; the errors of the page summaries, the node session and the host pages
// (RESOURCE_EXHAUSTED when memory runs out).
absl::StatusOr<std::unique_ptr<OffloadTier>> OpenOffloadTier(Backend& backend, NodePool* nodes,
                                                             const TierSpec& spec);

}  // namespace tandem::gpu_worker
