#!/usr/bin/env bash
# The main job: builds tandem and generates a story with the whole system in one process, on
# stories260k (../shared/models): the GPU worker (the cuda backend when a GPU is usable, else the
# cpu backend) with a 64-token device window + 4 sink tokens, and the embedded CPU attention node
# holding the rest of the KV cache (hybrid attention, beta = 1). It streams the story and ends
# with the summary line (tokens, TTFT, tok/s, KV on the device and on the CPU node).
#   scripts/demo.sh [extra flags for `tandem generate`, e.g. --temperature=0.8 --seed=7]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
model=${MODEL_DIR:-$root/../shared/models/stories260k}
bash "$root/scripts/build.sh" >/dev/null
[ -f "$model/config.json" ] || { echo "model not found: $model (set MODEL_DIR)"; exit 1; }
"$build/services/tandem" generate --model="$model" --prompt="Once upon a time" \
  --max-tokens=300 --mode=hybrid --beta=1 --window=64 --sink=4 --ignore-eos "$@"
