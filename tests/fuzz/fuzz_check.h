// FUZZ_CHECK(cond, what): an invariant of the code under fuzzing. When it does not hold the
// target prints `what` and aborts, which libFuzzer records as a crash with the input that caused
// it (a sanitizer report does the same for memory errors, leaks and undefined behaviour).
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)
