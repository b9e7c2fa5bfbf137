#include "request_executor.h"

#include <algorithm>

namespace tandem::cpu_attention {

RequestExecutor::RequestExecutor(unsigned num_threads) {
  num_threads = std::max(1u, num_threads);
  threads_.reserve(num_threads);
  for (unsigned i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Loop(); });
}

RequestExecutor::~RequestExecutor() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void RequestExecutor::Submit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void RequestExecutor::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace tandem::cpu_attention
