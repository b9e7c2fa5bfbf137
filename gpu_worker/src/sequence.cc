#include "tandem/gpu_worker/sequence.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker {

absl::StatusOr<AttentionMode> ParseAttentionMode(std::string_view name) {
  const absl::string_view n(name.data(), name.size());
  if (absl::EqualsIgnoreCase(n, "gpu")) return AttentionMode::kGpu;
  if (absl::EqualsIgnoreCase(n, "hybrid")) return AttentionMode::kHybrid;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention mode '", n, "'; expected gpu or hybrid"));
}

std::string_view AttentionModeName(AttentionMode mode) {
  return mode == AttentionMode::kGpu ? "gpu" : "hybrid";
}

}  // namespace tandem::gpu_worker
