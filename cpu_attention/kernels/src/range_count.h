// How many ranges one attention call's entries are cut into (SparseAttention, PagedAttention).
#pragma once

#include <algorithm>
#include <cstdint>

namespace tandem::cpu_attention {

// tasks_per_thread × threads ranges at most (more even out threads that start late or run
// slow), each at least `min_entries` long, and no more than leave every range at least as many
// KV bytes to read as the partial state it may keep: `entry_bytes` of K + V per entry against
// `state_bytes` (rows · (head_dim + 1) floats), so multi-token calls take fewer, longer ranges
// instead of holding more partial memory than they read. Decode (a few rows) is never bound by it.
inline uint64_t RangeCount(uint64_t entries, uint64_t min_entries, uint64_t max_ranges,
                           uint64_t entry_bytes, uint64_t state_bytes) {
  const uint64_t by_length = (entries + min_entries - 1) / min_entries;
  const uint64_t by_memory = state_bytes == 0 ? by_length : entries * entry_bytes / state_bytes;
  return std::max<uint64_t>(1, std::min({max_ranges, by_length, by_memory}));
}

}  // namespace tandem::cpu_attention
