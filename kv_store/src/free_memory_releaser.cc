#include "tandem/kv_store/free_memory_releaser.h"

#include <algorithm>

namespace tandem::kv_store {
namespace {

std::chrono::milliseconds PeriodFor(std::chrono::milliseconds after,
                                    std::optional<std::chrono::milliseconds> period) {
  using std::chrono::milliseconds;
  if (period.has_value()) return std::max(*period, milliseconds(1));
  return std::clamp<milliseconds>(after / 2, milliseconds(10), milliseconds(1000));
}

}  // namespace

FreeMemoryReleaser::FreeMemoryReleaser(KvStore& store, std::chrono::milliseconds after,
                                       std::optional<std::chrono::milliseconds> period)
    : store_(store),
      after_(std::max(after, std::chrono::milliseconds(0))),
      period_(PeriodFor(after_, period)),
      thread_([this] { Loop(); }) {}

FreeMemoryReleaser::~FreeMemoryReleaser() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t FreeMemoryReleaser::released_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_;
}

uint64_t FreeMemoryReleaser::passes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return passes_;
}

void FreeMemoryReleaser::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    const uint64_t released =
        store_.ReleaseFreeMemory(std::chrono::steady_clock::now() - after_);
    lock.lock();
    released_ += released;
    ++passes_;
  }
}

}  // namespace tandem::kv_store
