#include "tandem/kv_store/block_warmer.h"

#include <sys/resource.h>
#include <unistd.h>

#include "tandem/kv_store/kv_store.h"

namespace tandem::kv_store {
namespace {

// Blocks' bytes faulted in per pool and call: large runs for MADV_POPULATE_WRITE, short
// enough that the blocks in transit are back in the free list within milliseconds.
constexpr uint64_t kBatchBytes = 8ull << 20;

}  // namespace

BlockWarmer::BlockWarmer(KvStore& store) : store_(store), thread_([this] { Loop(); }) {}

BlockWarmer::~BlockWarmer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BlockWarmer::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_one();
}

uint64_t BlockWarmer::warmed_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return warmed_;
}

void BlockWarmer::Loop() {
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 10);   // best effort
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || woken_; });
    if (stop_) return;
    woken_ = false;
    lock.unlock();
    for (;;) {
      const uint64_t pass = store_.WarmFreeBlocks(kBatchBytes);
      if (pass == 0) break;
      std::lock_guard<std::mutex> check(mu_);
      warmed_ += pass;
      if (stop_) break;
    }
    lock.lock();
  }
}

}  // namespace tandem::kv_store
