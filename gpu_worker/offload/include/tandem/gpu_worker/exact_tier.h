// ExactTier: the offload tier of `exact` sequences (DESIGN "Attention modes"; issue 16). Their KV
// beyond the device window is split by the ExactPlanner (exact_planner.h) between
//
//   host pages (OffloadedKv)  streamed over PCIe every step by the pass's KvStreamer and
//                             attended on the device, as HostTier does (offload mode);
//   CPU nodes (RemoteKv)      attending densely (no selection: every entry, exact) where the KV
//                             lives, as NodeTier does with β = 0.
//
// The split is by entries: of every block of entries that leaves the window, the first ones go
// to the host pages and the rest to the nodes so that the host keeps fetch_share of all
// offloaded entries (the same split in every layer). Both sides hold every (layer, kv head),
// so at each layer the nodes attend over their entries while the device attends over the
// uploaded pages (and the streamer uploads the next pages): the two partial states are merged
// into the window's by the exact LSE merge, in any order. Splitting by entries rather than by
// kv heads keeps the nodes' shards whole (the placement planner balances them as in hybrid
// mode) and the split fine (a block, not a head); attention is exact either way.
//
// The plan is made for the entries the session is expected to reach (Reserve) from the rates
// of the engine's ExactRateBook (measured at start-up, corrected by every tier's measured node
// rates), and re-made every kReplanSteps steps in Maintain(): later evictions follow the new
// shares; entries already placed stay where they are.
//
// Recompute (KVPR) is planned (the verdict and its modelled gain are part of the plan) but not
// executed: the plan this tier follows has no recompute share.
//
// A lost CPU node leaves its entries' attends degraded (flagged in the response); they are not
// rebuilt (the node side holds a subset of positions that the engine's recompute, which yields
// a prefix of positions, does not address).
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <memory>
#include <vector>

#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {

struct ExactTierOptions {
  ExactGeometry geometry;
  ExactPlanOptions plan;        // force_fetch_share >= 0: a fixed split (tests, benchmarks)
  int64_t expected_tokens = 0;  // offloaded entries per (layer, kv head) by the request's end
  int replan_every_steps = 16;  // Maintain() calls between re-plans; 0 = never
};

class ExactTier final : public OffloadTier {
 public:
  // `host`: the host pages (geometry of the window); `remote`: the session on the nodes,
  // opened with SelectionRule::kPages (no selected copy; attends name no pages: dense);
  // `rates` outlives the tier. INVALID_ARGUMENT for a null part or a MAW session.
  static absl::StatusOr<std::unique_ptr<ExactTier>> Create(std::unique_ptr<OffloadedKv> host,
                                                           std::unique_ptr<RemoteKv> remote,
                                                           ExactRateBook* rates,
                                                           const ExactTierOptions& options);

  int64_t offloaded_tokens() const override { return host_tokens() + node_tokens(); }
  bool wants_maw() const override { return false; }  // everything is attended
  // K and V bytes the nodes scan per query row (all layers).
  double off_device_work() const override;

  absl::Status BeginPass(TierContext& context, size_t stream) override;
  absl::Status PrepareAttend(TierContext& context, const AttendRows& rows) override;
  absl::Status StartAttend(TierContext& context, const AttendRows& rows) override;
  absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) override;
  void CancelAttend(TierContext& context, const AttendRows& rows) override;
  absl::Status Append(TierContext& context, WindowCache& window,
                      const std::vector<EvictedBlock>& blocks) override;

  // Re-plans for `tokens` and checks room: the nodes for their share (RemoteKv::Reserve) and
  // the host for its share against the memory the system has available (RESOURCE_EXHAUSTED).
  absl::Status Reserve(int64_t tokens) override;
  absl::Status Maintain() override;
  absl::Status Close() override { return remote_->Close(); }
  std::vector<double> MeanSelectedShare() const override { return {}; }

  const ExactPlan& plan() const { return plan_; }
  int64_t host_tokens() const;  // entries per (layer, kv head) in host pages
  int64_t node_tokens() const { return remote_->offloaded_tokens(); }
  const OffloadedKv& host() const { return *host_; }
  const RemoteKv& remote() const { return *remote_; }
  // Attends of this tier in which a CPU node did not answer.
  uint64_t degraded_attends() const { return remote_->degraded_attends(); }

 private:
  ExactTier(std::unique_ptr<OffloadedKv> host, std::unique_ptr<RemoteKv> remote,
            ExactRateBook* rates, const ExactTierOptions& options);
  void Replan(int64_t tokens);
  // Entries of a batch of `tokens` that go to the host pages (the rest to the nodes).
  int64_t HostPart(int64_t tokens) const;

  static constexpr int kMinNodeSamples = 8;  // attends before a session's node rate counts

  std::unique_ptr<OffloadedKv> host_;
  std::unique_ptr<RemoteKv> remote_;
  ExactRateBook* rates_;
  ExactTierOptions options_;
  ExactPlan plan_;
  bool nodes_attending_ = false;  // the attend in flight went to the nodes
  int steps_since_plan_ = 0;
  uint64_t node_attends_ = 0;
  std::vector<char> host_k_, host_v_, node_k_, node_v_;  // one layer's split of a batch
  std::vector<float> node_maw_;
};

// Plans the split for options.expected_tokens, opens the node session for the nodes' share
// (`ro` gives its identity, geometry, deadlines and placement; selection and expected_tokens are
// set here) and the host pages of `geometry` (pages of page_tokens), and makes the tier.
// UNAVAILABLE when no CPU node accepts (exact mode plans over the nodes; offload mode streams
// everything without them); FAILED_PRECONDITION when an accepting node stores int8 rows (not
// exact); RESOURCE_EXHAUSTED when the nodes' share does not fit them or the host share does
// not fit the host's available memory (Reserve); RemoteKv::Open's and OffloadedKv::Create's
// errors otherwise.
absl::StatusOr<std::unique_ptr<ExactTier>> OpenExactTier(Backend& backend, NodePool& pool,
                                                         ExactRateBook& rates, RemoteKvOptions ro,
                                                         const WindowGeometry& geometry,
                                                         int64_t page_tokens,
                                                         const ExactTierOptions& options);

}  // namespace tandem::gpu_worker
