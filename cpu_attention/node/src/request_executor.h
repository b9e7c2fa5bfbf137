// A few threads that run RPC handlers off the gRPC callback threads: callback reactors must not
// block, while Attend computes for milliseconds and AppendKv copies megabytes. Tasks run in
// submission order per thread pick-up (no ordering between tasks); a stream keeps its own order
// by submitting its next message only after the previous one finished.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::cpu_attention {

class RequestExecutor {
 public:
  explicit RequestExecutor(unsigned num_threads);
  ~RequestExecutor();  // runs the tasks already queued, then joins
  RequestExecutor(const RequestExecutor&) = delete;
  RequestExecutor& operator=(const RequestExecutor&) = delete;

  void Submit(std::function<void()> task);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::cpu_attention
