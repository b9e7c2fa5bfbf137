#!/usr/bin/env bash
# The main job for now: builds tandem, starts a CPU attention node on a free local port, runs
# the tandem CLI's attention round trip against it (stream KV, Attend every layer, check against
# a reference, re-select, close), prints results and timings, and stops the node.
#   scripts/demo.sh [extra flags for `tandem attend`, e.g. --tokens=65536 --beta=1]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/scripts/build.sh" >/dev/null
log=$(mktemp)
"$build/services/tandem-cpu-attention" --address=127.0.0.1:0 --pool_bytes=4GiB >"$log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null; wait $node 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  port=$(sed -n 's/^LISTENING \([0-9]*\)$/\1/p' "$log")
  [ -n "$port" ] && break
  kill -0 $node 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { echo "node did not start"; cat "$log"; exit 1; }
echo "CPU attention node pid $node on 127.0.0.1:$port"
"$build/services/tandem" attend --server="127.0.0.1:$port" "$@"
echo "--- dense (beta = 0) above; now sparse (beta = 1) ---"
"$build/services/tandem" attend --server="127.0.0.1:$port" --beta=1 "$@"
