// CPU time for the speed checks of tests. CI runs the suite on a loaded 2-core machine (ctest
// -j2, then the sanitizer build under nice -n 19), where a wall-clock bound measures the
// scheduler as much as the code: a test that bounds how long single-threaded work takes measures
// the calling thread's CPU time instead, takes the best of a few rounds, and multiplies its
// bound by kSanitizerSlowdown, since the ASan + UBSan builds of scripts/sanitize.sh and
// scripts/fuzz.sh run the same code several times slower.
#pragma once

#include <time.h>

namespace tandem::test_timing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// Factor for CPU-time bounds in a sanitizer build (ASan at -O1 with UBSan and, in the fuzz
// build, coverage counters: 3-10x slower than Release on these tests); 1 otherwise.
inline constexpr double kSanitizerSlowdown = kSanitized ? 10.0 : 1.0;

// CPU time the calling thread has used, in milliseconds (CLOCK_THREAD_CPUTIME_ID: time the
// thread was descheduled does not count). Only work done on the calling thread is measured.
inline double ThreadCpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

}  // namespace tandem::test_timing
