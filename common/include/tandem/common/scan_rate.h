// The smallest Attend scan that measures a CPU node's scan rate (bytes per second of compute).
// Smaller calls are dominated by fixed per-call costs (thread wake-up, oneDNN primitive
// lookup, merging): 10 KB in 50 µs reads as 200 MB/s on a node that scans 20 GB/s, and a
// planner that believed it would move every shard off that node. The node (Stats) and the
// worker (Attend replies) both skip such calls.
#pragma once

#include <cstdint>

namespace tandem {

inline constexpr uint64_t kMinTimedScanBytes = uint64_t{1} << 20;

}  // namespace tandem
