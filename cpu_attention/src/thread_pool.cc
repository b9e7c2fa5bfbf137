#include "tandem/cpu_attention/thread_pool.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace tandem::cpu_attention {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

using Clock = std::chrono::steady_clock;

// Spins until done() or `until` (checking the clock every 64 polls); returns done().
template <typename Pred>
bool SpinUntil(Clock::time_point until, Pred done) {
  for (uint32_t i = 1;; ++i) {
    if (done()) return true;
    CpuRelax();
    if (i % 64 == 0 && Clock::now() >= until) return done();
  }
}

}  // namespace

unsigned AvailableCores() {
  // Grow the mask until it covers the kernel's CPU numbering (hosts with > 1024 CPUs).
  for (int cpus = CPU_SETSIZE; cpus <= (1 << 16); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      const int count = CPU_COUNT_S(bytes, set);
      CPU_FREE(set);
      return count > 0 ? static_cast<unsigned>(count) : 1u;
    }
    CPU_FREE(set);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// One ParallelFor call. Lives on the caller's stack, which returns only once no worker holds it:
// a worker takes it (++runners) only under mu_ while it is queued, and lets go under mu_; the
// caller unqueues it and waits for runners == 0 under mu_.
struct ThreadPool::Job {
  const std::function<void(size_t)>* fn = nullptr;
  size_t n = 0;
  std::atomic<size_t> next{0};   // first index not yet claimed
  std::atomic<int> runners{0};   // workers inside the job (written under mu_)

  // Claims and runs indices until none is left.
  void RunTasks() {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      (*fn)(i);
    }
  }
};

ThreadPool::ThreadPool(unsigned num_threads, std::chrono::microseconds spin)
    : num_threads_(num_threads == 0 ? AvailableCores() : num_threads),
      spin_(num_threads_ > AvailableCores() ? std::chrono::microseconds{0} : spin) {
  workers_.reserve(num_threads_ - 1);
  for (unsigned i = 0; i + 1 < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_relaxed);
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::UnqueueLocked(Job* job) {
  auto it = std::find(jobs_.begin(), jobs_.end(), job);
  if (it == jobs_.end()) return;
  jobs_.erase(it);
  queued_.store(jobs_.size(), std::memory_order_relaxed);
}

void ThreadPool::WorkerLoop() {
  // oneDNN (OpenMP runtime) must not open parallel regions inside a task: the pool is the
  // parallelism.
  omp_set_num_threads(1);
  auto has_work = [this] {
    return stop_.load(std::memory_order_relaxed) || queued_.load(std::memory_order_relaxed) > 0;
  };
  while (true) {
    Job* job = nullptr;
    {
      // Spin for the budget; a job that others used up before this worker got the lock does
      // not end the spin (the next call is likely to come within it), only the budget does.
      const Clock::time_point until = Clock::now() + spin_;
      std::unique_lock<std::mutex> lock(mu_);
      while (spin_.count() > 0 && jobs_.empty() && !stop_.load(std::memory_order_relaxed) &&
             Clock::now() < until) {
        lock.unlock();
        SpinUntil(until, has_work);
        lock.lock();
      }
      work_cv_.wait(lock, [this] { return stop_.load(std::memory_order_relaxed) || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and nothing left
      job = jobs_.front();
      job->runners.fetch_add(1, std::memory_order_relaxed);
    }
    job->RunTasks();
    std::lock_guard<std::mutex> lock(mu_);
    UnqueueLocked(job);   // every index is claimed: no other worker needs to take it
    // Release: the caller that reads 0 (spinning, without mu_) sees the tasks' writes.
    if (job->runners.fetch_sub(1, std::memory_order_release) == 1) idle_cv_.notify_all();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  // The caller runs tasks too: make oneDNN single-threaded in it for the duration of the call
  // and restore the caller's OpenMP setting afterwards.
  const int saved_omp_threads = omp_get_max_threads();
  if (saved_omp_threads != 1) omp_set_num_threads(1);
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
  } else {
    Job job;
    job.fn = &fn;
    job.n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(&job);
      queued_.store(jobs_.size(), std::memory_order_relaxed);
    }
    // Sleeping workers need a wake-up; spinning ones see queued_ (notify is then no syscall).
    if (n - 1 >= workers_.size()) {
      work_cv_.notify_all();
    } else {
      for (size_t i = 0; i + 1 < n; ++i) work_cv_.notify_one();
    }
    // Run our own tasks (not other callers'): our latency depends only on our job.
    job.RunTasks();
    // Every index is claimed; wait for the workers still running theirs. A worker that takes
    // the job after the spin finds nothing to claim and lets go at once.
    if (spin_.count() > 0) {
      SpinUntil(Clock::now() + spin_,
                [&job] { return job.runners.load(std::memory_order_acquire) == 0; });
    }
    std::unique_lock<std::mutex> lock(mu_);
    UnqueueLocked(&job);
    idle_cv_.wait(lock, [&job] { return job.runners.load(std::memory_order_acquire) == 0; });
  }
  if (saved_omp_threads != 1) omp_set_num_threads(saved_omp_threads);
}

}  // namespace tandem::cpu_attention
