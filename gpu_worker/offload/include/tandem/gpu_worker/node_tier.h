// NodeTier: the offload tier of `hybrid` sequences: their KV beyond the window lives on CPU
// attention nodes (RemoteKv), which attend where it lives; only q goes out and (O, LSE) come
// back (DESIGN "One decode step, one layer").
//
// Per layer: PrepareAttend queues q's download and, under selection = pages, the choice of
// pages (the page summaries are this tier's: PageIndex on the device, scored against q) and
// their ids' download; StartAttend re-selects after a new turn (MAW) and sends q (with the ids)
// to the nodes; FinishAttend waits for their answers and queues the upload and merge of the
// partial state into the window's. Evicted blocks are
// summarised into the page index (selection = pages) and appended to the nodes, MAW included,
// so that page p of the index names the entries the nodes number p·page_tokens...
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "tandem/gpu_worker/memory_shortage.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/remote_kv.h"

namespace tandem::gpu_worker {

class NodeTier final : public OffloadTier {
 public:
  // `remote`: the session on the nodes (non-null). `pages`: the page summaries of a session
  // with selection = pages (its RemoteKv opened with kPages), null for MAW selection.
  NodeTier(std::unique_ptr<RemoteKv> remote, std::unique_ptr<PageIndex> pages);

  int64_t offloaded_tokens() const override { return remote_->offloaded_tokens(); }
  // MAW drives MAW selection only: a pages session skips its update (its nodes keep no
  // selected copy and ignore MAW), so its window attention can join the batched decode launch.
  bool wants_maw() const override { return pages_ == nullptr; }
  double off_device_work() const override;

  absl::Status BeginPass(TierContext& context, size_t stream) override;
  absl::Status PrepareAttend(TierContext& context, const AttendRows& rows) override;
  absl::Status StartAttend(TierContext& context, const AttendRows& rows) override;
  absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) override;
  void CancelAttend(TierContext& context, const AttendRows& rows) override;
  // Selection = pages: the next layer's pages chosen from a guess of its queries (queued on the
  // device; PrepareAttend of that layer downloads their ids with its true q).
  bool speculates() const override { return pages_ != nullptr; }
  absl::Status Speculate(TierContext& context, const AttendRows& next) override;
  absl::Status Append(TierContext& context, WindowCache& window,
                      const std::vector<EvictedBlock>& blocks) override;
  absl::StatusOr<int64_t> AppendLimit() override;

  // Lost shards (remote_kv.h, "Failure model") are rebuilt from K/V that `recompute` produces
  // (the engine's GPU prefill of the sequence's tokens); without one they stay degraded.
  void set_recompute(RecomputeKv recompute) { recompute_ = std::move(recompute); }
  bool needs_rebuild() const override { return remote_->needs_rebuild(); }
  // RemoteKv::RebuildLost; true when shards were rebuilt. After a failure the next attempt
  // waits kRebuildRetry.
  absl::StatusOr<bool> Rebuild() override;

  // (A new turn: first finds nodes an idle session lost, RemoteKv::CheckNodes.) Room short is
  // the nodes' (MarkShortOf).
  absl::Status Reserve(int64_t tokens) override {
    remote_->CheckNodes();
    return MarkShortOf(MemoryKind::kNodes, remote_->Reserve(tokens));
  }
  absl::Status Maintain() override { return remote_->Maintain(); }
  absl::Status Close() override { return remote_->Close(); }
  // RemoteKv::Fork (the nodes share the blocks) and a device copy of the page summaries.
  absl::StatusOr<std::unique_ptr<OffloadTier>> Fork(const TierFork& fork) const override;
  bool can_fork() const override { return true; }
  std::vector<double> MeanSelectedShare() const override { return remote_->MeanSelectedShare(); }
  TierFootprint footprint() const override;

  // Device bytes page selection takes for a pass of `num_tokens` query rows over `num_pages`
  // pages per (layer, kv head), `per_head` chosen: this tier's page ids plus the scoring
  // scratch (the TierContext's, one per pass). The memory estimator's; no allocation.
  static size_t SelectionBytesFor(int64_t num_tokens, int64_t num_kv_heads, int64_t num_pages,
                                  int64_t per_head);

  RemoteKv& remote() { return *remote_; }
  const RemoteKv& remote() const { return *remote_; }
  PageIndex* page_index() override { return pages_.get(); }   // null unless selection = pages
  // The page budget (selection = pages; null for MAW selection): PagePolicy's defaults until the
  // engine sets it; a fork starts with this tier's.
  PagePolicy* page_policy() override { return pages_ != nullptr ? &policy_ : nullptr; }
  // Parking moves the page summaries (the tier's only device memory).
  absl::Status ParkDevice(ParkingPool& pool) override;
  absl::Status UnparkDevice() override;
  size_t ParkBytes() const override;
  size_t parked_bytes() const override;
  size_t resident_bytes() const override;

 private:
  // Selection = pages: queues the choice of the pages of `rows` (by rows.window.q, the true
  // queries or a guess) on the device, into selected_; returns the pages per (token, kv head),
  // 0 when the layer attends over every page (a dense layer, or a budget that covers all).
  absl::StatusOr<int64_t> ChoosePages(TierContext& context, const AttendRows& rows);
  // Queues the download of the ids ChoosePages chose for `num_tokens` rows into page_ids_ and
  // points selection_ at them.
  void DownloadPages(TierContext& context, int64_t num_tokens, int64_t num_kv_heads,
                     int64_t per_head);
  // measure_captured_mass: the share of the offloaded softmax mass the chosen pages captured;
  // selected_lse [n, H_q] of the pages just attended.
  absl::Status MeasureCapturedMass(const AttendRows& rows, const float* selected_lse);

  // Query rows per SelectPages call of an unbatched selection, so that its scores stay within
  // kMaxSelectScratchBytes.
  static int64_t SelectRowsPerCall(int64_t num_tokens, int64_t num_kv_heads, int64_t num_pages);

  // Scores of one SelectPages call stay below this (a prefill chunk over a long context is
  // split into several calls).
  static constexpr size_t kMaxSelectScratchBytes = size_t{256} << 20;
  // Selections whose scratch fits this (decode, short chunks) are queued in the TierContext and
  // run batched; each queued one holds its scratch until the flush.
  static constexpr size_t kMaxBatchedSelectScratchBytes = size_t{4} << 20;

  static constexpr std::chrono::milliseconds kRebuildRetry{200};

  std::unique_ptr<RemoteKv> remote_;
  std::unique_ptr<PageIndex> pages_;
  RecomputeKv recompute_;
  std::chrono::steady_clock::time_point next_rebuild_{};
  bool paged_ = false;                     // the attend in flight names pages
  std::chrono::steady_clock::time_point attend_sent_{};   // StartAttend's (OffloadProfile)
  // The pages Speculate chose for a layer ahead (layer -1: none); PrepareAttend of that layer
  // with as many rows downloads them instead of choosing. BeginPass forgets them.
  struct Speculated {
    int64_t layer = -1;
    int64_t num_tokens = 0;
    int64_t per_head = 0;   // ChoosePages' result
  };
  Speculated speculated_;
  DeviceBuffer selected_;                  // chosen page ids [n, H_kv, per_head] (device)
  DeviceBuffer first_;                     // the bound's pick before the centroid's [n, H_kv, ·]
  std::vector<int32_t> page_ids_;          // their host copy
  PageSelection selection_;
  PagePolicy policy_;
  std::vector<float> dense_o_, dense_lse_;   // measure_captured_mass
};

}  // namespace tandem::gpu_worker
