// FreeMemoryReleaser: a thread that hands a KvStore's idle free memory back to the kernel.
//
// A KV block freed and soon reused (the next turn of a conversation, a migration's target)
// should keep its pages; one left free for `after` should not keep the node's resident memory
// up, or a memory-based autoscaler (the Kubernetes HPA of deploy/) never sees a node empty out.
// The thread wakes every `period` and calls KvStore::ReleaseFreeMemory(now - after), as an
// allocator's decay of dirty pages does.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>

#include "tandem/kv_store/kv_store.h"

namespace tandem::kv_store {

class FreeMemoryReleaser {
 public:
  // `store` must outlive this object. `after` >= 0 (negative counts as 0). `period` > 0;
  // unset: after / 2, within [10 ms, 1 s].
  FreeMemoryReleaser(KvStore& store, std::chrono::milliseconds after,
                     std::optional<std::chrono::milliseconds> period = std::nullopt);
  ~FreeMemoryReleaser();   // stops and joins the thread
  FreeMemoryReleaser(const FreeMemoryReleaser&) = delete;
  FreeMemoryReleaser& operator=(const FreeMemoryReleaser&) = delete;

  uint64_t released_bytes() const;   // block bytes released so far
  uint64_t passes() const;           // ReleaseFreeMemory calls so far
  std::chrono::milliseconds period() const { return period_; }

 private:
  void Loop();

  KvStore& store_;
  const std::chrono::milliseconds after_;
  const std::chrono::milliseconds period_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;           // guarded by mu_
  uint64_t released_ = 0;       // guarded by mu_
  uint64_t passes_ = 0;         // guarded by mu_
  std::thread thread_;          // last: starts after the members it reads
};

}  // namespace tandem::kv_store
