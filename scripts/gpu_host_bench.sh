#!/usr/bin/env bash
# Runs on the GPU host (through the device tool): unpacks the bundle built here by
#   ../shared/tools/gpu-bundle.sh build .carry/tandem.tar.xz   (and git rev-parse HEAD > .carry/commit)
# then runs the CPU-side tests and benchmarks there, logs under $OUT (or /tmp/out).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM"
  lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\)|L2|L3)'
  grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
} 2>&1 | tee "$out/host.txt"
{
  kv_store_test --gtest_brief=1
  cpu_attention_kernel_test --gtest_brief=1
  cpu_attention_service_test --gtest_brief=1
} > "$out/tests.txt" 2>&1; grep -E 'PASSED|FAILED' "$out/tests.txt"
# The reference configuration: 32 heads x 32K x 128 (1M entries), then a Llama-3-8B
# layer (8 kv heads, GQA 4) up to 1M entries per head.
tandem-attend-bench --reps 9 2>&1 | tee "$out/attend_32x1.txt"
tandem-attend-bench --heads 8 --group 4 --n 32768,131072,1048576 --reps 7 2>&1 | tee "$out/attend_8x4.txt"
tandem-pool-bench 2>&1 | tee "$out/pool.txt"
