#!/usr/bin/env bash
# Resident memory of one tandem-cpu-attention process before, during and after a session:
# loads a 32K-token session (4 layers x 8 kv heads x head_dim 128, bf16, beta 0: ~1 GiB of
# blocks + selected copies) with `tandem attend`, closes it, and prints the node's VmRSS once
# a second for 9 s after the close.
#   scripts/node_memory_release.sh BIN_DIR RELEASE_FREE_AFTER_S
#   e.g. scripts/node_memory_release.sh build/services 3
set -euo pipefail
bin=$1
after=$2
log=$(mktemp)
"$bin/tandem-cpu-attention" --address=127.0.0.1:0 --pool_bytes=4GiB --threads=1 \
  --release_free_after_s="$after" > "$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q LISTENING "$log" && break; sleep 0.1; done
port=$(awk '/LISTENING/ {print $2}' "$log")
rss() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$pid/status"; }
echo "release_free_after_s=$after idle: $(rss) MiB"
"$bin/tandem" attend --server="127.0.0.1:$port" --layers=4 --kv_heads=8 --head_dim=128 \
  --tokens=32768 --decode_steps=1 --deadline_ms=300000 | grep "stats loaded"
line="after close (MiB):"
for t in $(seq 0 8); do
  line="$line t+${t}s=$(rss)"
  sleep 1
done
echo "$line"
