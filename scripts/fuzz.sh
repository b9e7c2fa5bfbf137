#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, ASan + UBSan, CUDA off) in build-fuzz and
# runs each one from its checked-in seed corpus, with the allocation limits a request must stay
# under. Prints one line per target (executions, exec/s, new corpus inputs, result) and exits
# non-zero when any target found a crash, leak, timeout or over-limit allocation; the input that
# did it is written to $FUZZ_WORK/<target>/crash-* (replay: <build>/tests/fuzz/<target> <file>).
#
#   scripts/fuzz.sh [--no-build] [-runs=N | -max_total_time=S] [target ...]
#                                     default: build, then -runs=1000000 of every target
#
# Env: FUZZ_BUILD_DIR (default <repo>/build-fuzz), JOBS (build parallelism, default nproc),
# FUZZ_WORK (default <build>/fuzz-work: the corpora that grow during the run; the checked-in seeds
# in tests/fuzz/corpus are only read), NICE (default 19: the build and runs yield to other work).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/compiler_cache.sh"
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
work=${FUZZ_WORK:-$build/fuzz-work}
jobs=${JOBS:-$(nproc)}
nice_level=${NICE:-19}
all_targets=(safetensors_fuzzer model_config_fuzzer tokenizer_json_fuzzer
  generate_request_fuzzer node_requests_fuzzer shm_request_fuzzer)

limit=-runs=1000000
targets=()
build_first=1
for arg in "$@"; do
  case "$arg" in
    --no-build) build_first=0 ;;
    -runs=*|-max_total_time=*) limit=$arg ;;
    *) targets+=("$arg") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

if [ "$build_first" = 1 ] && [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1" -DTANDEM_ENABLE_CUDA=OFF -DTANDEM_BUILD_BENCH=OFF \
    -DTANDEM_BUILD_FUZZERS=ON "${compiler_launcher[@]}"
fi
if [ "$build_first" = 1 ]; then
  nice -n "$nice_level" cmake --build "$build" -j "$jobs" --target "${targets[@]}"
fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
failed=0
printf '%-26s %12s %10s %8s %8s  %s\n' target executions exec/s seconds corpus result
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  log="$work/$t.log"
  start=$(date +%s)
  # The first corpus directory receives new inputs; the seeds are read only.
  if nice -n "$nice_level" "$build/tests/fuzz/$t" -rss_limit_mb=2048 -malloc_limit_mb=512 \
      -timeout=30 -print_final_stats=1 "$limit" -artifact_prefix="$work/$t/" \
      "$work/$t" "$root/tests/fuzz/corpus/$t" >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see $log)"
    failed=1
  fi
  seconds=$(( $(date +%s) - start ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  corpus=$(find "$work/$t" -maxdepth 1 -type f ! -name 'crash-*' ! -name 'leak-*' \
    ! -name 'timeout-*' ! -name 'oom-*' | wc -l)
  printf '%-26s %12s %10s %8s %8s  %s\n' "$t" "${runs:-?}" "${rate:-?}" "$seconds" "$corpus" \
    "$result"
done
echo "commit $commit, limit $limit, -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=30"
exit $failed
