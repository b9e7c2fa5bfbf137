// A fixed pool of worker threads for attention tasks, sized from the cores the process may use
// (sched_getaffinity), not from the machine's core count.
//
// ParallelFor may be called concurrently from several threads: their tasks share the workers,
// and each caller also runs tasks of its own call while it waits, so a call never deadlocks on a
// busy pool. Each worker calls omp_set_num_threads(1) at start: oneDNN (OpenMP runtime on
// Debian) then runs every primitive single-threaded inside the worker, with no oversubscription.
//
// Latency: a node's Attend is one call per layer of ~0.1-1 ms of work, so what a call costs
// beyond its tasks matters. A call is published in a slot the pool owns and its tasks are
// claimed with an atomic counter: workers join a call without any lock, and sleeping workers are
// woken all at once through one futex (std::atomic::wait). The first pool queued calls under a
// mutex that every worker took to join one: on the H200 host's 16 cores, two tasks per thread,
// the median task of a ~150-190 us paged call started 33-43 us into it (20-27 us now), and the
// threads were busy for 55-64% of it; with one task per thread all 16 now start within 3 us
// (BENCHMARKS "Dispatch and prefetch of the paged scan"; the hybrid step, whose node pool does
// not spin, showed no gain there). A worker that finishes a call spins for `spin` (pause, no
// syscall) watching for the next before it sleeps, as the caller does for its workers' last
// tasks: back-to-back calls (the layers of a decode step) then skip the futex wake-ups. A pool
// with more threads than the cores it may use never spins (a spinning thread would hold a core a
// worker needs). Spinning is opt-in (the default is 0): a dedicated CPU node wants it
// (--pool_spin_us); a pool sharing its cores with other work (the worker's embedded node, tests)
// does not.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
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
  // One call in flight. The slots belong to the pool, so a worker that read a slot's state just
  // before its call ended touches only the pool's memory (the call's `fn` only once it has
  // checked, as a counted runner, that the call is still open).
  struct Slot {
    std::atomic<bool> taken{false};      // a caller owns the slot
    std::atomic<uint64_t> state{0};      // odd: a call is open (its generation), even: closed
    std::atomic<const std::function<void(size_t)>*> fn{nullptr};
    std::atomic<size_t> n{0};
    std::atomic<size_t> next{0};         // first index not yet claimed
    std::atomic<int> runners{0};         // workers between their join check and their leaving
  };
  // More concurrent calls than slots run their tasks on their own callers.
  static constexpr size_t kSlots = 8;

  void WorkerLoop(size_t worker);
  // Runs the unclaimed tasks of one open call, looking from slot `first` on; false if none.
  bool JoinSomeCall(size_t first);
  // Runs fn's unclaimed indices of the call `slot` holds (the caller or a counted runner).
  static void RunTasks(Slot& slot, const std::function<void(size_t)>& fn);

  const unsigned num_threads_;
  const std::chrono::microseconds spin_;
  Slot slots_[kSlots];
  std::atomic<uint32_t> calls_opened_{0};   // bumped at each call's open and at stop: the futex
                                            // sleeping workers wait on
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace tandem::cpu_attention
