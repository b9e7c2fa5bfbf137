#!/usr/bin/env bash
# Continuous batching on the cpu backend (issue 12): tandem-load against a tandem-gpu-worker
# serving gutenberg-14m in gpu mode, one stream and then 16 concurrent streams (closed loop),
# for two workloads: 128-token prompts with 64-token outputs, and 32-token prompts with
# 256-token outputs. Prints one line per run and keeps the JSON under $OUT (default
# /tmp/bench_serving_cpu).
#   BUILD_DIR (default build), WAIT_POLICY (OMP_WAIT_POLICY of the worker; default active, as
#   OpenMP's own default; passive when other work shares the cores: spinning OpenMP threads
#   then take them from the client)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
out=${OUT:-/tmp/bench_serving_cpu}
mkdir -p "$out"
model=$root/../shared/models/gutenberg-14m

OMP_WAIT_POLICY=${WAIT_POLICY:-active} "$build/services/tandem-gpu-worker" --model "$model" \
  --backend cpu --mode gpu --address 127.0.0.1:0 > "$out/worker.log" 2>&1 &
wpid=$!
trap 'kill $wpid 2>/dev/null || true' EXIT
port=
for _ in $(seq 1 120); do
  port=$(awk '/^LISTENING/ {print $2}' "$out/worker.log")
  [[ -n "$port" ]] && break
  sleep 0.25
done
[[ -n "$port" ]] || { echo "the worker did not start:"; tail -5 "$out/worker.log"; exit 1; }

for workload in "128 64" "32 256"; do
  read -r prompt output <<< "$workload"
  for c in 1 16; do
    name=p${prompt}_o${output}_c$c
    "$build/bench/tandem-load" --target "127.0.0.1:$port" --concurrency "$c" \
      --num_requests $((c * 4)) --warmup 2 --prompt_tokens "$prompt" --output_tokens "$output" \
      --json_out "$out/$name.json" > "$out/$name.txt"
    python3 - "$out/$name.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>14}: {r['completed']} ok, {r['failed']} failed, "
      f"output {r['output_throughput']:8.1f} tok/s, TTFT p50 {r['median_ttft_ms']:6.1f} ms, "
      f"ITL p50 {r['median_itl_ms']:5.2f} ms p99 {r['p99_itl_ms']:6.2f} ms")
EOF
  done
done
