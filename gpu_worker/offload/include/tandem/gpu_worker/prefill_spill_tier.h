// PrefillSpillTier: a hybrid sequence's tier while a prompt larger than the device KV budget is
// prefilled (issue 15 item 1, HeadInfer-style). The widened window holds what fits; the blocks
// that must leave during the prefill go to the CPU nodes as always (`inner`, with their MAW or
// page summaries) and also to pinned host pages (`spill`), and the prefill's chunks attend over
// them from the host pages, streamed to the device and attended there exactly, instead of on
// the nodes (whose prompt attention is a compute-bound GEMM on their cores). Once the prompt is
// in, the sequence takes `inner` back (ReleaseAfterPrefill) and drops the host copy: decode attends on the
// nodes as usual.
//
// Only for a tier that held nothing when the prompt started (a new session): the host pages
// then hold exactly what the nodes hold, so attending over them is attending over the tier.
// Everything but the attention (reserve, upkeep, rebuilds, close, selection statistics) is the
// inner tier's.
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <memory>
#include <vector>

#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/offload_tier.h"

namespace tandem::gpu_worker {

class PrefillSpillTier final : public OffloadTier {
 public:
  // `inner` must hold no entries yet.
  PrefillSpillTier(std::unique_ptr<OffloadTier> inner, std::unique_ptr<HostTier> spill)
      : inner_(std::move(inner)), spill_(std::move(spill)) {}

  // The tier this one wraps (this one is then empty and must be dropped).
  std::unique_ptr<OffloadTier> ReleaseAfterPrefill() override { return std::move(inner_); }
  // Tokens per (layer, kv head) in the host copy.
  int64_t spilled_tokens() const { return spill_->offloaded_tokens(); }

  int64_t offloaded_tokens() const override { return inner_->offloaded_tokens(); }
  bool wants_maw() const override { return inner_->wants_maw(); }
  double off_device_work() const override { return spill_->off_device_work(); }

  // The attention: over the host copy (FAILED_PRECONDITION if it differs from the inner tier).
  absl::Status BeginPass(TierContext& context, size_t stream) override;
  absl::Status PrepareAttend(TierContext& context, const AttendRows& rows) override {
    return spill_->PrepareAttend(context, rows);
  }
  absl::Status StartAttend(TierContext& context, const AttendRows& rows) override {
    return spill_->StartAttend(context, rows);
  }
  absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) override {
    return spill_->FinishAttend(context, rows);
  }
  void CancelAttend(TierContext& context, const AttendRows& rows) override {
    spill_->CancelAttend(context, rows);
  }
  // To the inner tier, then the host copy.
  absl::Status Append(TierContext& context, WindowCache& window,
                      const std::vector<EvictedBlock>& blocks) override;

  absl::StatusOr<int64_t> AppendLimit() override { return inner_->AppendLimit(); }
  absl::Status Reserve(int64_t tokens) override { return inner_->Reserve(tokens); }
  absl::Status Maintain() override { return inner_->Maintain(); }
  bool needs_rebuild() const override { return inner_->needs_rebuild(); }
  absl::StatusOr<bool> Rebuild() override { return inner_->Rebuild(); }
  absl::Status Close() override { return inner_->Close(); }
  std::vector<double> MeanSelectedShare() const override { return inner_->MeanSelectedShare(); }
  PagePolicy* page_policy() override { return inner_->page_policy(); }
  // The inner tier's, plus the host copy while it exists.
  TierFootprint footprint() const override;

 private:
  std::unique_ptr<OffloadTier> inner_;
  std::unique_ptr<HostTier> spill_;
};

}  // namespace tandem::gpu_worker
