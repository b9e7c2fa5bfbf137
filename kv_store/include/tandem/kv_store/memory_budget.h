// A byte budget shared by everything a CPU attention node stores for sessions: KV blocks of
// every pool and the contiguous selected copies. Charging past the capacity fails with
// RESOURCE_EXHAUSTED and charges nothing. Thread-safe (atomics, lock-free).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kv_store {

class MemoryBudget {
 public:
  explicit MemoryBudget(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Reserves `bytes`; RESOURCE_EXHAUSTED (with used/capacity in the message) if it would exceed
  // the capacity.
  absl::Status Charge(uint64_t bytes);
  // Returns `bytes` previously charged.
  void Release(uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t free() const { return capacity_ - used(); }

 private:
  const uint64_t capacity_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace tandem::kv_store
