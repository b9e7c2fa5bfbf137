#include "tandem/cpu_attention/thread_pool.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

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

ThreadPool::ThreadPool(unsigned num_threads, std::chrono::microseconds spin)
    : num_threads_(num_threads == 0 ? AvailableCores() : num_threads),
      spin_(num_threads_ > AvailableCores() ? std::chrono::microseconds{0} : spin) {
  workers_.reserve(num_threads_ - 1);
  for (unsigned i = 0; i + 1 < num_threads_; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_seq_cst);
  calls_opened_.fetch_add(1, std::memory_order_seq_cst);
  calls_opened_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunTasks(Slot& slot, const std::function<void(size_t)>& fn) {
  const size_t n = slot.n.load(std::memory_order_relaxed);
  for (size_t i = slot.next.fetch_add(1, std::memory_order_relaxed); i < n;
       i = slot.next.fetch_add(1, std::memory_order_relaxed)) {
    fn(i);
  }
}

bool ThreadPool::JoinSomeCall(size_t first) {
  for (size_t k = 0; k < kSlots; ++k) {
    Slot& slot = slots_[(first + k) % kSlots];
    const uint64_t state = slot.state.load(std::memory_order_acquire);
    if (state % 2 == 0 ||
        slot.next.load(std::memory_order_relaxed) >= slot.n.load(std::memory_order_relaxed)) {
      continue;
    }
    // Count ourselves in, then check the call is still the one we saw. seq_cst on both sides
    // (here: add, then load; the caller: close, then load runners): either the caller sees us
    // and waits, or we see it closed and leave without touching its fn.
    slot.runners.fetch_add(1, std::memory_order_seq_cst);
    const bool same_call = slot.state.load(std::memory_order_seq_cst) == state;
    if (same_call) RunTasks(slot, *slot.fn.load(std::memory_order_relaxed));
    if (slot.runners.fetch_sub(1, std::memory_order_seq_cst) == 1) slot.runners.notify_all();
    if (same_call) return true;
  }
  return false;
}

void ThreadPool::WorkerLoop(size_t worker) {
  // oneDNN (OpenMP runtime) must not open parallel regions inside a task: the pool is the
  // parallelism. The call registers this thread with libomp, one thread at a time: LLVM 14's
  // libomp overflowed a heap buffer when many threads registered at once (ASan, one run of the
  // sanitizer suite in two).
  static std::mutex omp_registration;
  {
    std::lock_guard lock(omp_registration);
    omp_set_num_threads(1);
  }
  const size_t first = worker % kSlots;  // concurrent calls spread over the workers
  while (!stop_.load(std::memory_order_relaxed)) {
    // Read the counter before looking: a call opened after the look bumps it, so the wait below
    // returns at once instead of missing that call.
    const uint32_t seen = calls_opened_.load(std::memory_order_seq_cst);
    if (JoinSomeCall(first)) continue;
    if (stop_.load(std::memory_order_relaxed)) break;
    if (spin_.count() > 0 &&
        SpinUntil(Clock::now() + spin_, [&] {
          return calls_opened_.load(std::memory_order_relaxed) != seen;
        })) {
      continue;
    }
    calls_opened_.wait(seen, std::memory_order_seq_cst);
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  // The caller runs tasks too: make oneDNN single-threaded in it for the duration of the call
  // and restore the caller's OpenMP setting afterwards.
  const int saved_omp_threads = omp_get_max_threads();
  if (saved_omp_threads != 1) omp_set_num_threads(1);
  Slot* slot = nullptr;
  if (!workers_.empty() && n > 1) {
    for (Slot& s : slots_) {
      bool free = false;
      if (s.taken.compare_exchange_strong(free, true, std::memory_order_acquire)) {
        slot = &s;
        break;
      }
    }
  }
  if (slot == nullptr) {  // no workers, one task, or every slot in use: all on this thread
    for (size_t i = 0; i < n; ++i) fn(i);
  } else {
    // Open: the fields before the odd state (release), then wake sleeping workers (no syscall
    // when none sleeps).
    slot->fn.store(&fn, std::memory_order_relaxed);
    slot->n.store(n, std::memory_order_relaxed);
    slot->next.store(0, std::memory_order_relaxed);
    const uint64_t open = slot->state.load(std::memory_order_relaxed) + 1;
    slot->state.store(open, std::memory_order_seq_cst);
    calls_opened_.fetch_add(1, std::memory_order_seq_cst);
    calls_opened_.notify_all();
    // Run our own tasks (not other callers'): our latency depends only on our call.
    RunTasks(*slot, fn);
    // Every index is claimed: close, then wait for the workers still in the call. A worker that
    // counts itself in after the close sees it and leaves at once.
    slot->state.store(open + 1, std::memory_order_seq_cst);
    const auto idle = [slot] { return slot->runners.load(std::memory_order_seq_cst) == 0; };
    if (spin_.count() > 0) SpinUntil(Clock::now() + spin_, idle);
    for (int r = slot->runners.load(std::memory_order_seq_cst); r != 0;
         r = slot->runners.load(std::memory_order_seq_cst)) {
      slot->runners.wait(r, std::memory_order_seq_cst);
    }
    slot->taken.store(false, std::memory_order_release);
  }
  if (saved_omp_threads != 1) omp_set_num_threads(saved_omp_threads);
}

}  // namespace tandem::cpu_attention
