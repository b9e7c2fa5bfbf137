#!/usr/bin/env bash
# Runs on the GPU host (through the device tool): unpacks the bundle built here by
#   ../shared/tools/gpu-bundle.sh build .carry/tandem.tar.xz
# and runs the CPU-side benchmarks and tests there, writing logs to $OUT (or /tmp/out).
#   bash scripts/gpu_host_bench.sh [attend-bench flags]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
{
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
  lscpu | grep -E 'Model name|Socket|Core|Thread|NUMA node|L2|L3|Flags' | sed 's/Flags:.*\(avx512_bf16\|amx_bf16\).*/Flags: has \1/' | cut -c1-160
  echo "commit: $(cat .carry/commit 2>/dev/null)"
} | tee "$out/host.txt"
tandem-attend-bench "$@" 2>&1 | tee "$out/attend_bench.txt"
tandem-pool-bench 2>&1 | tee "$out/pool_bench.txt"
