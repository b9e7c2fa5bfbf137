#include "tandem/cpu_attention/thread_pool.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace tandem::cpu_attention {

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

// One ParallelFor call. Lives on the caller's stack; guarded by ThreadPool::mu_.
struct ThreadPool::Job {
  const std::function<void(size_t)>* fn = nullptr;
  size_t n = 0;
  size_t next = 0;  // first index not yet claimed
  size_t done = 0;  // indices finished
  std::condition_variable done_cv;
};

ThreadPool::ThreadPool(unsigned num_threads)
    : num_threads_(num_threads == 0 ? AvailableCores() : num_threads) {
  workers_.reserve(num_threads_ - 1);
  for (unsigned i = 0; i + 1 < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  // oneDNN (OpenMP runtime) must not open parallel regions inside a task: the pool is the
  // parallelism.
  omp_set_num_threads(1);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_ and nothing left
    RunOneTask(lock);
  }
}

bool ThreadPool::RunOneTask(std::unique_lock<std::mutex>& lock) {
  if (jobs_.empty()) return false;
  Job* job = jobs_.front();
  const size_t index = job->next++;
  if (job->next == job->n) jobs_.pop_front();
  lock.unlock();
  (*job->fn)(index);
  lock.lock();
  // Notify under the lock: the caller cannot observe done == n (and destroy the job) before
  // this thread has released mu_.
  if (++job->done == job->n) job->done_cv.notify_all();
  return true;
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
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.push_back(&job);
    if (n - 1 >= workers_.size()) {
      work_cv_.notify_all();
    } else {
      for (size_t i = 0; i + 1 < n; ++i) work_cv_.notify_one();
    }
    // Run our own tasks (not other callers'): our latency depends only on our job.
    while (job.next < job.n) {
      const size_t index = job.next++;
      if (job.next == job.n) jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
      lock.unlock();
      fn(index);
      lock.lock();
      ++job.done;
    }
    job.done_cv.wait(lock, [&job] { return job.done == job.n; });
  }
  if (saved_omp_threads != 1) omp_set_num_threads(saved_omp_threads);
}

}  // namespace tandem::cpu_attention
