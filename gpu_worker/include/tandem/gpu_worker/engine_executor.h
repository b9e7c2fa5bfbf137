// EngineExecutor: the one thread that owns an Engine (and with it the backend's device context
// and streams). Callers on any thread post jobs; jobs run one at a time, in the order posted
// (llama.cpp's server_queue). RPC handlers post a job and return, so no gRPC reactor blocks.
//
// Thread-safe. Destruction stops accepting jobs, runs the ones already queued, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "tandem/gpu_worker/engine.h"

namespace tandem::gpu_worker {

class EngineExecutor {
 public:
  explicit EngineExecutor(std::unique_ptr<Engine> engine);
  ~EngineExecutor();
  EngineExecutor(const EngineExecutor&) = delete;
  EngineExecutor& operator=(const EngineExecutor&) = delete;

  // Queues `job`. Returns false (and drops the job) after Stop().
  bool Post(std::function<void(Engine&)> job);

  // Runs `job` on the executor thread and waits for its result.
  template <typename Fn>
  auto Run(Fn&& job) -> decltype(job(std::declval<Engine&>())) {
    using R = decltype(job(std::declval<Engine&>()));
    auto task = std::make_shared<std::packaged_task<R(Engine&)>>(std::forward<Fn>(job));
    std::future<R> result = task->get_future();
    if (!Post([task](Engine& engine) { (*task)(engine); })) {
      std::packaged_task<R(Engine&)> fallback(
          [](Engine&) -> R { return absl::UnavailableError("the engine is shutting down"); });
      result = fallback.get_future();
      fallback(*engine_);
    }
    return result.get();
  }

  // Jobs waiting (not counting the running one).
  size_t queued() const;
  // Stops accepting jobs; queued jobs still run. Idempotent.
  void Stop();

 private:
  void Loop();

  std::unique_ptr<Engine> engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(Engine&)>> jobs_;   // guarded by mu_
  bool stopping_ = false;                           // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem::gpu_worker
