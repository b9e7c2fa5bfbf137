// Help texts of families that more than one process kind exports (one text per name, so that
// a registry holding both sides merges them).
#pragma once

namespace tandem::metrics::internal {

inline constexpr char kKvCacheUsageHelp[] =
    "Share of a KV tier in use (0..1). gpu: device KV of running requests' sequences over the "
    "worker's --kv_cache_bytes; cpu: a CPU node's pool.";

}  // namespace tandem::metrics::internal
