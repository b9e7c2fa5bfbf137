#include "device_layer_clock.h"

#include <algorithm>

#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

void DeviceLayerClock::Start(bool active) {
  active_ = active;
  sent_ = speculated_ = answered_ = head_queued_ = false;
}

absl::Status DeviceLayerClock::Sent() {
  if (!active_) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(backend_.MarkDevice(kSent));
  sent_at_ = Clock::now();
  sent_ = true;
  speculated_ = answered_ = head_queued_ = false;
  return absl::OkStatus();
}

absl::Status DeviceLayerClock::Speculated() {
  if (!active_ || !sent_) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(backend_.MarkDevice(kSpeculated));
  speculated_ = true;
  return absl::OkStatus();
}

absl::Status DeviceLayerClock::Answered() {
  if (!active_ || !sent_) return absl::OkStatus();
  answered_at_ = Clock::now();
  TANDEM_RETURN_IF_ERROR(backend_.MarkDevice(kAnswered));
  answered_ = true;
  return absl::OkStatus();
}

absl::Status DeviceLayerClock::HeadQueued() {
  if (!active_ || !answered_) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(backend_.MarkDevice(kHeadQueued));
  head_queued_at_ = Clock::now();
  head_queued_ = true;
  return absl::OkStatus();
}

absl::Status DeviceLayerClock::Collect(RunnerProfile& profile) {
  if (!active_ || !head_queued_) return absl::OkStatus();
  if (speculated_) {
    TANDEM_ASSIGN_OR_RETURN(const double speculate, backend_.DeviceSeconds(kSent, kSpeculated));
    profile.device_speculate_s += speculate;
  }
  TANDEM_ASSIGN_OR_RETURN(const double reach, backend_.DeviceSeconds(kSent, kAnswered));
  TANDEM_ASSIGN_OR_RETURN(const double tail_head, backend_.DeviceSeconds(kAnswered, kHeadQueued));
  profile.device_answer_stall_s += std::max(0.0, reach - Seconds(answered_at_ - sent_at_));
  profile.device_tail_head_s += tail_head;
  profile.host_tail_head_launch_s += Seconds(head_queued_at_ - answered_at_);
  ++profile.device_marked_layers;
  sent_ = speculated_ = answered_ = head_queued_ = false;
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
