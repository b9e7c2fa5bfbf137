#!/usr/bin/env bash
# Runs issue 4's benchmarks on the GPU host (through the device tool): tandem-bench (gpu /
# offload / hybrid decode at long contexts against the physical limits), the transport round
# trip, and the cuda engine tests for the new modes. Prepared here by:
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA_ARCHS=90
#   ninja -C build-gpu tandem-bench tandem-transport-bench gpu_worker_engine_cuda_test \
#     gpu_worker_random_model_cuda_test tandem-cpu-attention
#   ../shared/tools/gpu-bundle.sh build-gpu .carry/tandem.tar.xz build-gpu/lib
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models && cp -r ../shared/models/stories260k .carry/shared/models/
# PART lists what runs, in order (e.g. PART="check transport bench"): "check" (engine tests on cuda + a 32K bench), "bench" (the full
# matrix: 32K and 128K, batch 1 and 8, then 512K per mode), "transport" (tandem-transport-bench
# against a tandem-cpu-attention process). BENCH_ARGS adds flags.
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
for part in ${PART:-check}; do
case "$part" in
  check)
    gpu_worker_engine_cuda_test --gtest_brief=1 > "$out/engine_cuda_test.txt" 2>&1
    tail -4 "$out/engine_cuda_test.txt"
    gpu_worker_random_model_cuda_test --gtest_brief=1 > "$out/random_model_cuda_test.txt" 2>&1
    tail -2 "$out/random_model_cuda_test.txt"
    grep -E "worst|offload:" "$out/engine_cuda_test.txt"
    tandem-bench --contexts 32768 --batches 1 --shares 0.1 --steps 8 --offload_steps 4 \
      --prefill_tokens 0 --json "$out/bench_check.jsonl" ${BENCH_ARGS:-} \
      > "$out/bench_check.txt" 2>&1
    tail -12 "$out/bench_check.txt"
    ;;
  bench)
    # 32K and 128K in one process (with TTFT at 32K); each 512K configuration in a process of
    # its own, because the CPU node's block pool keeps freed blocks for reuse and a 512K
    # context takes most of the host's memory.
    tandem-bench --contexts 32768,131072 --prefill_tokens 32768 \
      --json "$out/bench.jsonl" ${BENCH_ARGS:-} > "$out/bench.txt" 2>&1
    grep '"probe"' "$out/bench.txt"
    sed -n '/^mode /,$p' "$out/bench.txt"
    for cfg in "offload 0.1" "hybrid 0.1" "hybrid 0.05" "hybrid 0.3"; do
      set -- $cfg
      tandem-bench --contexts 524288 --batches 1 --modes "$1" --shares "$2" --prefill_tokens 0 \
        --json "$out/bench512_$1_$2.jsonl" ${BENCH_ARGS:-} > "$out/bench512_$1_$2.txt" 2>&1
      grep '"probe"' "$out/bench512_$1_$2.txt"
      grep -o '"breakdown_ms":{[^}]*}' "$out/bench512_$1_$2.jsonl"
      sed -n '/^mode /,$p' "$out/bench512_$1_$2.txt" | tail -n +2
    done
    ;;
  transport)
    tandem-transport-bench --cpu_attention_bin "$(command -v tandem-cpu-attention)" \
      ${BENCH_ARGS:-} > "$out/transport.txt" 2>&1
    tail -20 "$out/transport.txt"
    ;;
esac
done
