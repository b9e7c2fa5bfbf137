#include "tandem/gpu_worker/memory_shortage.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"

namespace tandem::gpu_worker {
namespace {

constexpr char kPayloadUrl[] = "tandem.dev/memory-short-of";

}  // namespace

absl::Status MarkShortOf(MemoryKind kind, absl::Status status) {
  if (!absl::IsResourceExhausted(status)) return status;
  const char* name = kind == MemoryKind::kNodes ? "nodes" : kind == MemoryKind::kHost ? "host"
                                                                                       : "device";
  status.SetPayload(kPayloadUrl, absl::Cord(name));
  return status;
}

MemoryKind ShortOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayloadUrl);   // absl::optional<absl::Cord>
  if (!payload.has_value()) return MemoryKind::kDevice;
  if (*payload == "nodes") return MemoryKind::kNodes;
  if (*payload == "host") return MemoryKind::kHost;
  return MemoryKind::kDevice;
}

}  // namespace tandem::gpu_worker
