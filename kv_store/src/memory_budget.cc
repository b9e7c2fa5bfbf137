#include "tandem/kv_store/memory_budget.h"

#include <cassert>

#include "absl/strings/str_cat.h"
#include "tandem/common/byte_size.h"

namespace tandem::kv_store {

absl::Status MemoryBudget::Charge(uint64_t bytes) {
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    // Written as a subtraction so that `used + bytes` cannot overflow.
    if (bytes > capacity_ - used) {
      return absl::ResourceExhaustedError(
          absl::StrCat("memory budget exhausted: charging ", FormatBytes(bytes), " with ",
                       FormatBytes(used), " of ", FormatBytes(capacity_), " used"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed,
                                        std::memory_order_relaxed));
  return absl::OkStatus();
}

void MemoryBudget::Release(uint64_t bytes) {
  [[maybe_unused]] const uint64_t before = used_.fetch_sub(bytes, std::memory_order_relaxed);
  assert(before >= bytes && "MemoryBudget::Release of bytes that were never charged");
}

}  // namespace tandem::kv_store
