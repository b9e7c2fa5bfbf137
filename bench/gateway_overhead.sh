#!/usr/bin/env bash
# The gateway's overhead (issue 13): tandem-gateway-bench sends the same greedy requests
# (256 random prompt ids, 64 tokens generated past EOS) to a tandem-gpu-worker serving
# gutenberg-14m on the cpu backend, directly over gRPC and through tandem-gateway over HTTP
# (SSE), with 1 and 4 concurrent clients, and prints TTFT, TPOT and tokens/s of both paths and
# their ratios. Logs go to $OUT (default /tmp/gateway_overhead).
#   BUILD_DIR (default build), MODEL_DIR (default ../shared/models/gutenberg-14m),
#   CONCURRENCY (default 1,4), REQUESTS (per row, default 16), PROMPT (256), OUTPUT (64),
#   WAIT_POLICY (the worker's OMP_WAIT_POLICY; default passive: the gateway and the client
#   share the cores with it), WORKER_THREADS (the worker's --cpu_threads; default 0 = every
#   core; on a small machine, one core fewer leaves the gateway and the client a core)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
model=${MODEL_DIR:-$root/../shared/models/gutenberg-14m}
out=${OUT:-/tmp/gateway_overhead}
mkdir -p "$out"

pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

# Starts "$@" with stdout+stderr in $out/$name.log; sets $port from its LISTENING line.
start() {
  local name=$1
  shift
  "$@" > "$out/$name.log" 2>&1 &
  pids+=($!)
  port=
  for _ in $(seq 1 240); do
    port=$(awk '/^LISTENING/ {print $2}' "$out/$name.log")
    [[ -n "$port" ]] && return 0
    sleep 0.25
  done
  echo "$name did not start:"
  tail -5 "$out/$name.log"
  exit 1
}

OMP_WAIT_POLICY=${WAIT_POLICY:-passive} start worker "$build/services/tandem-gpu-worker" \
  --model "$model" --backend cpu --cpu_threads "${WORKER_THREADS:-0}" --mode gpu \
  --address 127.0.0.1:0 --log_level warn
worker_port=$port
start gateway "$build/services/tandem-gateway" --workers "127.0.0.1:$worker_port" \
  --address 127.0.0.1:0 --log_level warn
gateway_port=$port

"$build/bench/tandem-gateway-bench" --worker "127.0.0.1:$worker_port" \
  --gateway "127.0.0.1:$gateway_port" --concurrency "${CONCURRENCY:-1,4}" \
  --num_requests "${REQUESTS:-16}" --warmup 2 --prompt_tokens "${PROMPT:-256}" \
  --output_tokens "${OUTPUT:-64}" | tee "$out/result.txt"
