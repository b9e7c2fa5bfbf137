// Which memory a RESOURCE_EXHAUSTED status ran short of, carried in the status (a payload) from
// where the room was refused to whoever makes room, so that it frees that memory: the prefix
// cache parks cached sessions in host memory when the device is short, and closes those that
// hold CPU-node or host-page memory when a node's pool or the host pages are (parking frees
// device memory only; kv_cache_manager.h).
#pragma once

#include "absl/status/status.h"

namespace tandem::gpu_worker {

enum class MemoryKind { kDevice, kHost, kNodes };

// `status` marked as short of `kind` when it is RESOURCE_EXHAUSTED; any other status unchanged.
absl::Status MarkShortOf(MemoryKind kind, absl::Status status);

// The memory a RESOURCE_EXHAUSTED status was marked short of; kDevice when unmarked (device
// allocations and the --kv_cache_bytes budget are the common case).
MemoryKind ShortOf(const absl::Status& status);

}  // namespace tandem::gpu_worker
