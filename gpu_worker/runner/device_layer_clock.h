// Device marks along the layers of one micro-batch (RunnerOptions::device_marks, benchmarks):
// where the device's time goes between a layer's q leaving for the CPU nodes and the next
// layer's q being ready on the host.
//
//   host:   Sent ..... (the nodes' round trip) ..... Answered -> launches -> HeadQueued -> q sync
//   device: [window attention, next layer's selection] ...  [merge, tail, next layer's head]
//
// Sent is marked right after q's download synchronised the device, so the device reaches it at
// once and device times from it compare with host times from the same moment: the device
// reached Answered later than the host did when the layer-ahead selection still ran.
#pragma once

#include <chrono>

#include "absl/status/status.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/model_runner.h"

namespace tandem::gpu_worker {

class DeviceLayerClock {
 public:
  explicit DeviceLayerClock(Backend& backend) : backend_(backend) {}

  // A pass begins: marks are taken only when `active`.
  void Start(bool active);
  absl::Status Sent();        // the layer's q went to the nodes (after StartAttend)
  absl::Status Speculated();  // the window attention and next layer's selection are queued
  absl::Status Answered();    // the nodes' answer is on the host, before its merge is queued
  absl::Status HeadQueued();  // the next layer's head is queued, before q's download
  // After q's download (the device passed every mark): adds the layer's times to `profile`.
  absl::Status Collect(RunnerProfile& profile);

 private:
  using Clock = std::chrono::steady_clock;
  enum Mark { kSent, kSpeculated, kAnswered, kHeadQueued };

  Backend& backend_;
  bool active_ = false;
  bool sent_ = false, speculated_ = false, answered_ = false, head_queued_ = false;
  Clock::time_point sent_at_, answered_at_, head_queued_at_;
};

}  // namespace tandem::gpu_worker
