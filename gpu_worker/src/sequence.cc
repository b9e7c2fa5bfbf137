#include "tandem/gpu_worker/sequence.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker {

absl::StatusOr<AttentionMode> ParseAttentionMode(std::string_view name) {
  const absl::string_view n(name.data(), name.size());
  if (absl::EqualsIgnoreCase(n, "gpu")) return AttentionMode::kGpu;
  if (absl::EqualsIgnoreCase(n, "hybrid")) return AttentionMode::kHybrid;
  if (absl::EqualsIgnoreCase(n, "offload")) return AttentionMode::kOffload;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown attention mode '", n, "'; expected gpu, hybrid or offload"));
}

std::string_view AttentionModeName(AttentionMode mode) {
  switch (mode) {
    case AttentionMode::kGpu:
      return "gpu";
    case AttentionMode::kHybrid:
      return "hybrid";
    case AttentionMode::kOffload:
      return "offload";
  }
  return "unknown";
}

}  // namespace tandem::gpu_worker
