#!/usr/bin/env bash
# Issue 15 item 3 on the GPU host (through the device tool): gpu-mode decode against its HBM
# limit. Runs (1) the cuda backend tests of the kernels it tunes (every GEMV variant incl.
# k = 14336, the decode attention at every swept split density, MatMul; < 1 min), (2) the
# tandem-kernel-bench sweep: every gemv.cuh variant and cuBLAS on the Llama-3-8B decode shapes
# (m = 1, 2) and the decode attention at 4K/32K/128K slots, 1 and 8 query tokens, with the plan's
# decode_waves 1, 2, 4, 8 (< 2 min), (3) tandem-bench gpu-mode decode at 32K and 128K, batch 1
# and 8 (< 1.5 min). Then set gemv.cuh's kGemvVariant / kGemvLongKVariant / kGemvMaxK and
# window_attention.cuh's kDecodeWaves from sweep.txt's table (the fastest "ok" row per shape).
# Prepared here by:
#   flock /tmp/tandem-build.lock cmake --build build --target tandem-bench tandem-kernel-bench \
#     backend_cuda_test
#   mkdir -p /tmp/<you>-gbuild/bin && cp build/bench/tandem-bench build/bench/tandem-kernel-bench \
#     build/tests/gpu_worker/backend_cuda/backend_cuda_test /tmp/<you>-gbuild/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/<you>-gbuild .carry/<you>/tandem.tar.xz build/lib
#   git rev-parse HEAD > .carry/<you>/commit
# and run with carry [".carry/<you>"] and CARRY=.carry/<you>:
#   CARRY=.carry/<you> bash scripts/gpu_host_decode.sh
# PART lists what runs, in order (default "check sweep bench"). KB_ARGS / BENCH_ARGS add flags to
# tandem-kernel-bench / tandem-bench. Logs go under $OUT: tests.txt (with the host line),
# sweep.txt, sweep.err, bench.txt (4 files).
set -uo pipefail
out=${OUT:-/tmp/out}
carry=${CARRY:-.carry}
mkdir -p "$out" /tmp/tandem
tar xJf "$carry/tandem.tar.xz" -C /tmp/tandem && source /tmp/tandem/env.sh || exit 1
{
  echo "commit: $(cat "$carry/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
} 2>&1 | tee "$out/tests.txt"
for part in ${PART:-check sweep bench}; do
case "$part" in
  check)
    timeout 90 backend_cuda_test --gtest_brief=1 \
      --gtest_filter='GemvPlan*:*CudaGemv*:*DecodeWaves*:*MatMul*' >> "$out/tests.txt" 2>&1
    echo "backend_cuda_test exit $?"
    grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran' "$out/tests.txt" | tail -12
    ;;
  sweep)
    timeout 150 tandem-kernel-bench --prefill=false --page_selection=false \
      --decode_windows=4096,32768,131072 --decode_tokens=1,8 --decode_waves=1,2,4,8 \
      --seconds 0.2 ${KB_ARGS:-} > "$out/sweep.txt" 2> "$out/sweep.err"
    echo "tandem-kernel-bench exit $?"; tail -3 "$out/sweep.err"
    grep -E '^(gemv|decode) ' "$out/sweep.txt"
    ;;
  bench)
    timeout 120 tandem-bench --modes gpu --contexts 32768,131072 --batches 1,8 \
      --prefill_tokens 0 ${BENCH_ARGS:-} > "$out/bench.txt" 2>&1
    echo "tandem-bench exit $?"
    tail -25 "$out/bench.txt"
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
done
