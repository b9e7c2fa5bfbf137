// HostTier: the offload tier of `offload` sequences: their KV beyond the window lives in
// page-locked host memory (OffloadedKv) and crosses PCIe at every step (HeadInfer / FlexGen:
// exact). Its attention runs on the device: at FinishAttend the pass's KvStreamer (shared by
// every host tier of the pass, TierContext::streamer) attends the rows over each uploaded page
// and merges the page's state into the window's, while later pages are still uploading.
// Nothing runs off the device, so PrepareAttend and StartAttend do nothing and
// off_device_work() is 0.
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <memory>
#include <vector>

#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/offloaded_kv.h"

namespace tandem::gpu_worker {

class HostTier final : public OffloadTier {
 public:
  explicit HostTier(std::unique_ptr<OffloadedKv> kv) : kv_(std::move(kv)) {}

  int64_t offloaded_tokens() const override {
    return kv_->tokens(kv_->geometry().num_layers - 1);
  }
  bool wants_maw() const override { return false; }   // everything is attended: no selection
  double off_device_work() const override { return 0.0; }

  // Adds this tier's pages to the pass's streaming plan (when it has any).
  absl::Status BeginPass(TierContext& context, size_t stream) override;
  absl::Status PrepareAttend(TierContext&, const AttendRows&) override {
    return absl::OkStatus();
  }
  absl::Status StartAttend(TierContext&, const AttendRows&) override { return absl::OkStatus(); }
  absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) override;
  // The pages planned for these rows stay unread; the next pass's plan drops them.
  void CancelAttend(TierContext&, const AttendRows&) override {}
  absl::Status Append(TierContext& context, WindowCache& window,
                      const std::vector<EvictedBlock>& blocks) override;

  // Host pages are allocated as entries arrive (RESOURCE_EXHAUSTED then).
  absl::Status Reserve(int64_t) override { return absl::OkStatus(); }
  absl::Status Maintain() override { return absl::OkStatus(); }
  absl::Status Close() override { return absl::OkStatus(); }
  // A copy of the host pages (OffloadedKv::Clone).
  absl::StatusOr<std::unique_ptr<OffloadTier>> Fork(const TierFork& fork) const override;
  bool can_fork() const override { return true; }
  std::vector<double> MeanSelectedShare() const override { return {}; }
  TierFootprint footprint() const override { return {0, kv_->host_bytes(), 0}; }

  const OffloadedKv& kv() const { return *kv_; }
  OffloadedKv& kv() { return *kv_; }

 private:
  std::unique_ptr<OffloadedKv> kv_;
};

}  // namespace tandem::gpu_worker
