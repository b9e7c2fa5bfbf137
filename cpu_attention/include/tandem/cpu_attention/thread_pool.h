// A fixed pool of worker threads for attention tasks, sized from the cores the process may use
// (sched_getaffinity), not from the machine's core count.
//
// ParallelFor may be called concurrently from several threads: their tasks share the workers,
// and each caller also runs tasks of its own call while it waits, so a call never deadlocks on a
// busy pool. Each worker calls omp_set_num_threads(1) at start: oneDNN (OpenMP runtime on
// Debian) then runs every primitive single-threaded inside the worker, with no oversubscription.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::cpu_attention {

// Cores this process may run on (>= 1).
unsigned AvailableCores();

class ThreadPool {
 public:
  // num_threads == 0: AvailableCores(). The calling thread of ParallelFor counts as one of the
  // runners, so num_threads - 1 workers are started (none for 1: the caller runs every task).
  explicit ThreadPool(unsigned num_threads = 0);
  ~ThreadPool();  // joins the workers; ParallelFor calls must have returned
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs fn(i) for i in [0, n) across the pool and the caller; returns when all are done.
  // fn must not throw. The caller's OpenMP thread count is set to 1 for the duration of the
  // call (oneDNN runs single-threaded in fn on every runner) and restored on return.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  unsigned num_threads() const { return num_threads_; }

 private:
  struct Job;
  void WorkerLoop();
  // Runs one pending task of any job; false if none is queued.
  bool RunOneTask(std::unique_lock<std::mutex>& lock);

  const unsigned num_threads_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Job*> jobs_;  // jobs with tasks not yet started
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace tandem::cpu_attention
