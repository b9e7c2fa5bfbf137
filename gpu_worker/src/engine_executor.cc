#include "tandem/gpu_worker/engine_executor.h"

namespace tandem::gpu_worker {

EngineExecutor::EngineExecutor(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {
  thread_ = std::thread([this] { Loop(); });
}

EngineExecutor::~EngineExecutor() {
  Stop();
  if (thread_.joinable()) thread_.join();
}

bool EngineExecutor::Post(std::function<void(Engine&)> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

size_t EngineExecutor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

void EngineExecutor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void EngineExecutor::Loop() {
  for (;;) {
    std::function<void(Engine&)> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;   // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job(*engine_);
  }
}

}  // namespace tandem::gpu_worker
