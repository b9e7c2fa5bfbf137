#include "tandem/gpu_worker/sequence.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<AttentionMode> ParseAttentionMode(std::string_view name) {
  const absl::string_view n(name.data(), name.size());
  if (absl::EqualsIgnoreCase(n, "gpu")) return AttentionMode::kGpu;
  if (absl::EqualsIgnoreCase(n, "hybrid")) return AttentionMode::kHybrid;
  if (absl::EqualsIgnoreCase(n, "offload")) return AttentionMode::kOffload;
  if (absl::EqualsIgnoreCase(n, "exact")) return AttentionMode::kExact;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention mode '", n, "'; expected gpu, hybrid, offload or exact"));
}

absl::Status Sequence::ReserveOffloaded(int64_t tokens) {
  return offload ? offload->Reserve(tokens) : absl::OkStatus();
}

void Sequence::MaintainOffloaded() {
  if (offload == nullptr) return;
  if (absl::Status s = offload->Maintain(); !s.ok()) {
    spdlog::warn("session {}: placement: {}", id, std::string(s.message()));
  }
}

absl::Status Sequence::CloseOffloaded() { return offload ? offload->Close() : absl::OkStatus(); }

std::vector<double> Sequence::MeanSelectedShare() const {
  return offload ? offload->MeanSelectedShare() : std::vector<double>{};
}

std::string_view AttentionModeName(AttentionMode mode) {
  switch (mode) {
    case AttentionMode::kGpu:
      return "gpu";
    case AttentionMode::kHybrid:
      return "hybrid";
    case AttentionMode::kOffload:
      return "offload";
    case AttentionMode::kExact:
      return "exact";
  }
  return "unknown";
}

absl::Status Sequence::TruncateTo(int64_t positions) {
  if (positions > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, ": truncate to ", positions,
                                                   " of ", tokens.size(), " tokens"));
  }
  TANDEM_RETURN_IF_ERROR(window.Truncate(positions));
  tokens.resize(static_cast<size_t>(positions));
  pending_token.reset();
  prefill_end = std::min(prefill_end, positions);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Fork(std::string fork_id, int64_t positions,
                                                         int64_t max_context,
                                                         const TierForkFor& tier_fork) const {
  if (positions < 0 || positions > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, ": fork of ", positions,
                                                   " of ", tokens.size(), " tokens"));
  }
  TANDEM_ASSIGN_OR_RETURN(WindowCache fork_window, window.Fork(positions, max_context));
  auto fork = std::make_unique<Sequence>(std::move(fork_id), mode, std::move(fork_window));
  fork->tokens.assign(tokens.begin(), tokens.begin() + positions);
  fork->prefill_end = std::min(prefill_end, positions);
  if (offload != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(fork->offload, offload->Fork(tier_fork(*fork)));
  }
  return fork;
}

absl::Status Sequence::Park(ParkingPool& pool) {
  TANDEM_RETURN_IF_ERROR(window.Park(pool));
  if (offload != nullptr) {
    if (absl::Status parked = offload->ParkDevice(pool); !parked.ok()) {
      // Back as it was; a failed upload of what just left is a device failure to report.
      TANDEM_RETURN_IF_ERROR(window.Unpark());
      return parked;
    }
  }
  parked_in_ = &pool;
  return absl::OkStatus();
}

absl::Status Sequence::Unpark() {
  if (!window.parked()) return absl::FailedPreconditionError("sequence: not parked");
  TANDEM_RETURN_IF_ERROR(window.Unpark());
  if (offload != nullptr) {
    if (absl::Status unparked = offload->UnparkDevice(); !unparked.ok()) {
      // Parked again as it was (into the pages the window just gave back).
      TANDEM_RETURN_IF_ERROR(window.Park(*parked_in_));
      return unparked;
    }
  }
  parked_in_ = nullptr;
  return absl::OkStatus();
}

size_t Sequence::ParkBytes() const {
  return window.ParkBytes() + (offload != nullptr ? offload->ParkBytes() : 0);
}

size_t Sequence::resident_bytes() const {
  return window.resident_bytes() + (offload != nullptr ? offload->resident_bytes() : 0);
}

size_t Sequence::device_bytes() const {
  return window.device_bytes() + (offload != nullptr ? offload->footprint().device : 0);
}

void Sequence::EndPrefillSpill() {
  if (offload == nullptr) return;
  if (std::unique_ptr<OffloadTier> stays = offload->ReleaseAfterPrefill()) {
    offload = std::move(stays);
  }
}

size_t Sequence::parked_bytes() const {
  return window.parked_bytes() + (offload != nullptr ? offload->parked_bytes() : 0);
}

}  // namespace tandem::gpu_worker
