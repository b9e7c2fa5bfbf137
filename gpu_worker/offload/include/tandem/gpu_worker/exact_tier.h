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
// Recompute (KVPR; exact_recompute.h): with a model (ExactTierOptions::model) and
// plan.allow_recompute, the plan's recompute share r of the entries keeps layer inputs instead
// of K/V: while r > 0 the tier asks the runner for every layer's x̂ rows (wants_layer_inputs /
// TakeLayerInputs), and of every block of entries that leaves the window the first ones go to
// recompute (as long as their rows are there), the next to the host pages, the rest to the
// nodes, keeping round(r · total) and round((r + f) · total) of all offloaded entries. At each
// layer the device recomputes their K/V, attends and merges, queued before the fetched pages
// while the nodes work. The planner's verdict decides r: GQA (Llama-3-8B: an activation row of
// 8 KiB against 2 KiB of K+V) gets r = 0; MHA gets r > 0 when the GEMM keeps up.
//
// A lost CPU node (exact_rebuild.h): the tier records the positions of the entries it sends to
// the nodes, and Rebuild() recomputes the K/V of those positions (set_recompute: a gpu-mode
// forward pass over the tokens, kv_recompute.h) and re-homes the lost shards on the surviving
// nodes as hybrid mode does (RemoteKv::RebuildLost), or, when no node can take them, moves every
// node entry into the host pages and goes on without nodes (fetch and recompute shares only,
// frozen). Until then the lost shards' attends are degraded (flagged in the response). The same
// forward pass rewrites the K/V and layer inputs of the positions that degraded steps computed
// (still in the window), so that afterwards the tier attends exactly again; where such
// positions already left the window, every later attend is flagged degraded instead.
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <memory>
#include <vector>

#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/exact_rebuild.h"
#include "tandem/gpu_worker/exact_recompute.h"
#include "tandem/gpu_worker/exact_step_clock.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {

struct ExactTierOptions {
  ExactGeometry geometry;
  ExactPlanOptions plan;        // force_fetch_share >= 0: a fixed split (tests, benchmarks)
  int64_t expected_tokens = 0;  // offloaded entries per (layer, kv head) by the request's end
  int replan_every_steps = 16;  // Maintain() calls between re-plans; 0 = never
  // Passes between passes timed per path (ExactStepClock: one extra wait for the device per
  // layer, after the nodes' reply); their times correct the rates at Maintain(). 0 = never.
  int time_every_steps = 4;
  // The model whose K/V rows recompute uses (outlives the tier); null: no recompute (the plan
  // then has r = 0 whatever plan.allow_recompute says).
  const DeviceModel* model = nullptr;
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

  int64_t offloaded_tokens() const override {
    return host_tokens() + node_tokens() + recompute_tokens();
  }
  bool wants_maw() const override { return false; }  // everything is attended
  // K and V bytes the nodes scan per query row (all layers).
  double off_device_work() const override;

  absl::Status BeginPass(TierContext& context, size_t stream) override;
  // While the plan has a recompute share: x̂ of every row, kept until its entry leaves.
  bool wants_layer_inputs() const override;
  absl::Status TakeLayerInputs(TierContext& context, int64_t layer, const float* xn, int64_t rows,
                               int64_t first_pos) override;
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
  // Node loss (exact_rebuild.h): the recompute of positions that rebuilds what a lost CPU node
  // held (the engine's; until set, lost entries stay degraded).
  void set_recompute(RecomputeAt recompute) { recovery_.recompute = std::move(recompute); }
  // A lost shard, or positions computed from degraded attends to repair (exact_rebuild.h).
  bool needs_rebuild() const override;
  // RebuildExactNodes; when it gives the nodes up, the plan is frozen at fetch = 1 - r.
  absl::StatusOr<bool> Rebuild() override;
  absl::Status Close() override { return remote_->Close(); }
  std::vector<double> MeanSelectedShare() const override { return {}; }
  std::optional<TierSplit> split() const override;
  TierFootprint footprint() const override;

  // Entries kept as layer inputs given directly (tandem-bench's synthetic contexts; the serving
  // path takes them from the runner): rows [n, hidden] host, of
  // ExactRecompute::ActivationDType of the model's weights, the same for every layer, at
  // positions first_pos, ...; `max_rows`: query rows per attend. FAILED_PRECONDITION without a
  // model or for a model recompute does not support.
  absl::Status AppendRecomputeRows(Backend& backend, int64_t max_rows, const void* rows, int64_t n,
                                   int64_t first_pos);

  const ExactPlan& plan() const { return plan_; }
  int64_t host_tokens() const;  // entries per (layer, kv head) in host pages
  int64_t node_tokens() const { return recovery_.on_host ? 0 : remote_->offloaded_tokens(); }
  // Entries per (layer, kv head) kept as layer inputs and recomputed every step.
  int64_t recompute_tokens() const { return recompute_ ? recompute_->tokens() : 0; }
  const OffloadedKv& host() const { return *host_; }
  const RemoteKv& remote() const { return *remote_; }
  // The timed steps' per-path times, summed over the tier's life (exact_step_clock.h).
  const ExactStepTimes& measured_steps() const { return clock_.total(); }
  // Attends of this tier in which a CPU node did not answer.
  uint64_t degraded_attends() const { return remote_->degraded_attends(); }

 private:
  ExactTier(std::unique_ptr<OffloadedKv> host, std::unique_ptr<RemoteKv> remote,
            ExactRateBook* rates, const ExactTierOptions& options);
  void Replan(int64_t tokens);
  // Entries of a batch of `blocks` (`tokens` entries) that go to recompute (the first ones)
  // and to the host pages (the next); the rest go to the nodes.
  struct BatchSplit {
    int64_t recompute = 0, host = 0;
  };
  BatchSplit SplitBatch(const std::vector<EvictedBlock>& blocks, int64_t tokens) const;
  // Moves the recompute part's layer inputs into pages and forgets the others of the batch.
  absl::Status KeepInputs(const std::vector<EvictedBlock>& blocks, int64_t recompute);

  static constexpr int kMinNodeSamples = 8;  // attends before a session's node rate counts

  std::unique_ptr<OffloadedKv> host_;
  std::unique_ptr<RemoteKv> remote_;
  // Makes recompute_ (the model's K/V rows for recompute) unless it exists: FAILED_PRECONDITION
  // without a model, else ExactRecompute::Create's errors.
  absl::Status EnsureRecompute(Backend& backend, int64_t max_rows);
  std::unique_ptr<ExactRecompute> recompute_;  // made at the first TakeLayerInputs
  ExactRateBook* rates_;
  ExactTierOptions options_;
  ExactPlan plan_;
  bool nodes_attending_ = false;  // the attend in flight went to the nodes
  int steps_since_plan_ = 0;
  uint64_t node_attends_ = 0;
  ExactStepClock clock_;  // per-path times of the timed passes
  bool timing_ = false;   // this pass is timed
  uint64_t passes_ = 0;
  std::vector<char> host_k_, host_v_, node_k_, node_v_;  // one layer's split of a batch
  std::vector<float> node_maw_;
  ExactNodeRecovery recovery_;  // the node entries' positions; what rebuilds them
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
