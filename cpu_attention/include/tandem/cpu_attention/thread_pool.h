// A fixed pool of worker threads for attention tasks, sized from the cores the process may use
// (sched_getaffinity), not from the machine's core count.
//
// ParallelFor may be called concurrently from several threads: their tasks share the workers,
// and each caller also runs tasks of its own call while it waits, so a call never deadlocks on a
// busy pool. Each worker calls omp_set_num_threads(1) at start: oneDNN (OpenMP runtime on
// Debian) then runs every primitive single-threaded inside the worker, with no oversubscription.
//
// Latency: a node's Attend is one call per layer of ~0.1-1 ms of work, so what a call costs
// beyond its tasks matters. Tasks are claimed with an atomic counter (no lock per task), and a
// worker that finishes a call spins for `spin` (pause, no syscall) watching for the next before it
// sleeps on the condition variable, as the caller does for its workers' last tasks: back-to-back
// calls (the layers of a decode step) then skip the futex wake-ups. A pool with more threads
// than the cores it may use never spins (a spinning thread would hold a core a worker needs).
// Spinning is opt-in (the default is 0): a dedicated CPU node wants it (--pool_spin_us); a pool
// sharing its cores with other work (the worker's embedded node, tests) does not.
#pragma once

#include <atomic>
#include <chrono>
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
  explicit ThreadPool(unsigned num_threads = 0,
                      std::chrono::microseconds spin = std::chrono::microseconds{0});
  ~ThreadPool();  // joins the workers; ParallelFor calls must have returned
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs fn(i) for i in [0, n) across the pool and the caller; returns when all are done.
  // fn must not throw. The caller's OpenMP thread count is set to 1 for the duration of the
  // call (oneDNN runs single-threaded in fn on every runner) and restored on return.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  unsigned num_threads() const { return num_threads_; }
  std::chrono::microseconds spin() const { return spin_; }

 private:
  struct Job;
  void WorkerLoop();
  // Removes `job` from jobs_ if it is still there. Caller holds mu_.
  void UnqueueLocked(Job* job);

  const unsigned num_threads_;
  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable work_cv_;   // workers: a job was queued, or stop_
  std::condition_variable idle_cv_;   // callers: a job's last worker let go of it
  std::deque<Job*> jobs_;             // jobs that may have tasks not yet claimed (under mu_)
  std::atomic<size_t> queued_{0};     // jobs_.size(), read by spinning workers without mu_
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace tandem::cpu_attention
