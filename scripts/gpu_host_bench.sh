#!/usr/bin/env bash
# Runs issue 4's benchmarks on the GPU host (through the device tool): tandem-bench (gpu /
# offload / hybrid decode at long contexts against the physical limits), the transport round
# trip, and the cuda engine tests for the new modes. Prepared here by:
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA_ARCHS=90
#   ninja -C build-gpu tandem-bench tandem-transport-bench gpu_worker_engine_cuda_test \
#     backend_cuda_test tandem-cpu-attention
#   ../shared/tools/gpu-bundle.sh build-gpu .carry/tandem.tar.xz build-gpu/lib
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models && cp -r ../shared/models/stories260k .carry/shared/models/
# PART selects what runs: "check" (engine tests on cuda + a 32K bench), "bench" (the full
# matrix: BENCH_CONTEXTS, default 32768,131072,524288), "transport". BENCH_ARGS adds flags.
# Logs and JSON go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM"
} 2>&1 | tee "$out/host.txt"
part=${PART:-check}
case "$part" in
  check)
    gpu_worker_engine_cuda_test --gtest_brief=1 > "$out/engine_cuda_test.txt" 2>&1
    tail -4 "$out/engine_cuda_test.txt"
    grep -E "worst|offload:" "$out/engine_cuda_test.txt"
    tandem-bench --contexts 32768 --batches 1 --shares 0.1 --steps 8 --offload_steps 4 \
      --prefill_tokens 0 --json "$out/bench_check.jsonl" ${BENCH_ARGS:-} \
      > "$out/bench_check.txt" 2>&1
    tail -12 "$out/bench_check.txt"
    ;;
  bench)
    tandem-bench --contexts "${BENCH_CONTEXTS:-32768,131072,524288}" \
      --json "$out/bench.jsonl" ${BENCH_ARGS:-} > "$out/bench.txt" 2>&1
    grep '"probe"' "$out/bench.txt"
    sed -n '/^mode /,$p' "$out/bench.txt"
    ;;
  transport)
    tandem-transport-bench ${BENCH_ARGS:-} > "$out/transport.txt" 2>&1
    tail -20 "$out/transport.txt"
    ;;
esac
