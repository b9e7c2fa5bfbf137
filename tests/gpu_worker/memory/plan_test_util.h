// Helpers shared by the memory-plan tests.
#pragma once

#include <string>

#include "tandem/gpu_worker/memory_plan.h"

namespace tandem::gpu_worker::testing {

// The tier's item named `name`, or null.
inline const MemoryItem* FindItem(const MemoryTier& tier, const std::string& name) {
  for (const MemoryItem& item : tier.items) {
    if (item.name == name) return &item;
  }
  return nullptr;
}

}  // namespace tandem::gpu_worker::testing
