#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the test suite (clang, CUDA off, benches
# off, undefined behaviour fatal) in build-asan, then ctest on it with the checked-in suppressions
# of tests/sanitizers/. Exits non-zero when a test fails, i.e. on any sanitizer report.
#
#   scripts/sanitize.sh [ctest args]       default: -L unit (see SANITIZE_CTEST below)
#
# Env: SANITIZE_BUILD_DIR (default <repo>/build-asan), JOBS (default nproc), NICE (default 19),
# SANITIZE_TARGETS (targets to build, default all).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SANITIZE_BUILD_DIR:-$root/build-asan}
jobs=${JOBS:-$(nproc)}
nice_level=${NICE:-19}

if [ ! -f "$build/CMakeCache.txt" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # -O1 -g1: ASan's recommended optimisation, line tables for symbolized reports; NDEBUG is not
  # defined, so the code's own assertions run too.
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1" -DTANDEM_ENABLE_CUDA=OFF -DTANDEM_BUILD_BENCH=OFF \
    -DTANDEM_SANITIZE=ON "${launcher[@]}"
fi
targets=()
for t in ${SANITIZE_TARGETS:-}; do targets+=(--target "$t"); done
nice -n "$nice_level" cmake --build "$build" -j "$jobs" "${targets[@]}"

supp=$root/tests/sanitizers
# Child processes the tests start (the real binaries) inherit these.
export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:suppressions=$supp/asan.supp${ASAN_EXTRA:+:$ASAN_EXTRA}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
cd "$build"
if [ $# -eq 0 ]; then set -- -L unit; fi
nice -n "$nice_level" ctest --output-on-failure --timeout 900 -j "$jobs" "$@"
