// ThreadPool: every index runs exactly once, concurrent callers share the workers, n = 0 and
// n = 1 work, and tasks see single-threaded OpenMP (so oneDNN does not oversubscribe); spinning
// workers give the same results, stop at once and are off in an oversubscribed pool.
#include "tandem/cpu_attention/thread_pool.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace tandem::cpu_attention {
namespace {

TEST(ThreadPool, AvailableCoresIsPositive) {
  EXPECT_GE(AvailableCores(), 1u);
  EXPECT_LE(AvailableCores(), std::max(1u, std::thread::hardware_concurrency()));
}

TEST(ThreadPool, DefaultSizeIsAvailableCores) {
  ThreadPool pool;
  EXPECT_EQ(pool.num_threads(), AvailableCores());
}

TEST(ThreadPool, RunsEveryIndexOnce) {
  for (std::chrono::microseconds spin :
       {std::chrono::microseconds{0}, std::chrono::microseconds{100}}) {
    for (unsigned threads : {1u, 2u, 4u, 7u}) {
      ThreadPool pool(threads, spin);
      for (size_t n : {1u, 2u, 3u, 10u, 1000u}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "i=" << i << " n=" << n;
      }
    }
  }
}

// Back-to-back calls reach workers that are still spinning from the last one (no wake-up), and
// a call's results are all visible to its caller when it returns, however it waited.
TEST(ThreadPool, BackToBackCallsSeeEveryResult) {
  for (std::chrono::microseconds spin :
       {std::chrono::microseconds{0}, std::chrono::microseconds{2000}}) {
    ThreadPool pool(std::min(4u, AvailableCores()), spin);
    std::vector<long> out(64);
    for (int call = 0; call < 2000; ++call) {
      const size_t n = 1 + call % 64;
      pool.ParallelFor(n, [&](size_t i) { out[i] = call * 1000L + static_cast<long>(i); });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], call * 1000L + static_cast<long>(i));
    }
  }
}

// A pool spinning for a long time still stops at once, and one with more threads than cores
// never spins (its spinning threads would hold the cores the others need).
TEST(ThreadPool, SpinIsBoundedAndOffWhenOversubscribed) {
  const auto start = std::chrono::steady_clock::now();
  {
    ThreadPool pool(2, std::chrono::microseconds{5'000'000});
    pool.ParallelFor(8, [](size_t) {});
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(ThreadPool(AvailableCores() + 1, std::chrono::microseconds{100}).spin().count(), 0);
  EXPECT_EQ(ThreadPool(1, std::chrono::microseconds{100}).spin().count(), 100);
}

TEST(ThreadPool, ZeroTasksCallsNothing) {
  ThreadPool pool(3);
  bool called = false;
  pool.ParallelFor(0, [&](size_t) { called = true; });
  EXPECT_FALSE(called);
}

TEST(ThreadPool, UsesSeveralThreads) {
  ThreadPool pool(4);
  std::mutex mu;
  std::condition_variable entered;
  std::set<std::thread::id> ids;
  pool.ParallelFor(64, [&](size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
    entered.notify_all();
    // Task 0 (claimed first) holds its thread until a second thread has run a task: without the
    // wait, one thread (the caller) may run all 64 tasks before a descheduled worker wakes up on
    // a loaded machine. Indices are claimed one at a time, so the others stay free to claim; a
    // pool that never runs a task elsewhere fails after 10 s.
    if (i == 0) {
      entered.wait_for(lock, std::chrono::seconds(10), [&] { return ids.size() > 1; });
    }
  });
  EXPECT_GT(ids.size(), 1u);
  EXPECT_LE(ids.size(), 4u);
}

TEST(ThreadPool, OneThreadRunsEverythingOnTheCaller) {
  ThreadPool pool(1);
  const auto caller = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  pool.ParallelFor(50, [&](size_t) {
    if (std::this_thread::get_id() != caller) elsewhere.fetch_add(1);
  });
  EXPECT_EQ(elsewhere.load(), 0);
}

// `callers` threads each make `rounds` calls of 1..40 tasks; every index runs once per call.
void CheckConcurrentCallers(ThreadPool& pool, int callers, int rounds) {
  std::vector<std::thread> threads;
  std::vector<std::atomic<long>> sums(callers);
  for (int c = 0; c < callers; ++c) {
    threads.emplace_back([&, c] {
      for (int round = 0; round < rounds; ++round) {
        const size_t n = 1 + (round * 7 + c) % 40;
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, [&](size_t i) {
          hits[i].fetch_add(1);
          sums[c].fetch_add(static_cast<long>(i));
        });
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int c = 0; c < callers; ++c) {
    long expect = 0;
    for (int round = 0; round < rounds; ++round) {
      const long n = 1 + (round * 7 + c) % 40;
      expect += n * (n - 1) / 2;
    }
    EXPECT_EQ(sums[c].load(), expect);
  }
}

TEST(ThreadPool, ConcurrentCallersFromFourThreads) {
  ThreadPool pool(3, std::chrono::microseconds{200});
  CheckConcurrentCallers(pool, 4, 50);
}

// More concurrent callers than threads and than the pool's 8 call slots (callers beyond them run
// their tasks themselves), with and without the spin: every call completes with every index run
// once.
TEST(ThreadPool, MoreConcurrentCallersThanThreads) {
  using std::chrono::microseconds;
  for (microseconds spin : {microseconds{0}, microseconds{50}}) {
    ThreadPool pool(std::min(4u, AvailableCores()), spin);
    CheckConcurrentCallers(pool, 12, 100);
  }
}

// Calls spaced further apart than the spin reach workers asleep on the futex; each call still
// sees all of its tasks run.
TEST(ThreadPool, CallsAfterTheWorkersSleptSeeEveryResult) {
  ThreadPool pool(std::min(4u, AvailableCores()), std::chrono::microseconds{20});
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(std::chrono::microseconds(round % 2 == 0 ? 200 : 0));
    std::vector<std::atomic<int>> hits(64);
    pool.ParallelFor(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
    for (const auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(ThreadPool, NestedCallsDoNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.ParallelFor(4, [&](size_t) { pool.ParallelFor(4, [&](size_t) { count.fetch_add(1); }); });
  EXPECT_EQ(count.load(), 16);
}

TEST(ThreadPool, TasksRunWithSingleThreadedOpenMp) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(2);
  ThreadPool pool(3);
  std::atomic<int> not_one{0};
  pool.ParallelFor(32, [&](size_t) {
    if (omp_get_max_threads() != 1) not_one.fetch_add(1);
  });
  EXPECT_EQ(not_one.load(), 0);
  EXPECT_EQ(omp_get_max_threads(), 2);  // the caller's setting is restored
  omp_set_num_threads(before);
}

}  // namespace
}  // namespace tandem::cpu_attention
