#!/usr/bin/env bash
# The main job: builds tandem and generates a story with the whole system in one process, on
# stories260k (../shared/models): the GPU worker (the cuda backend when a GPU is usable, else the
# cpu backend) with a 64-token device window + 4 sink tokens, and the embedded CPU attention node
# holding the rest of the KV cache (hybrid attention, beta = 1). It streams the story and ends
# with the summary line (tokens, TTFT, tok/s, KV on the device and on the CPU node).
#   scripts/demo.sh [extra flags for `tandem generate`, e.g. --temperature=0.8 --seed=7]
# Only the `tandem` CLI is built here (scripts/build.sh builds everything); the build's progress
# shows as one updating line on a terminal, as ninja's own lines otherwise, and compiler errors
# in full.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
model=${MODEL_DIR:-$root/../shared/models/stories260k}

echo "demo: checking build dependencies (scripts/setup.sh)..." >&2
bash "$root/scripts/setup.sh" >&2
if [ ! -f "$build/CMakeCache.txt" ]; then
  echo "demo: configuring $build (Release)..." >&2
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
  echo "demo: building tandem (first time: about 2-10 minutes, depending on cores;" \
    "later runs rebuild only what changed)..." >&2
else
  echo "demo: building tandem (only what changed since the last build)..." >&2
fi

# Ninja prints "[done/total] Building CXX object ..." per step: on a terminal those become one
# line rewritten in place ("[  37/110]  33%  model_runner.cc"); every other line (warnings,
# errors) passes through whole.
progress() {
  if [ -t 2 ]; then
    local width
    width=$(tput cols 2>/dev/null || echo 100)
    awk -v width="$width" '
      /^\[[0-9]+\/[0-9]+\] / {
        split(substr($1, 2, length($1) - 2), n, "/")
        file = substr($0, length($1) + 2)  # "Building CXX object DIR/CMakeFiles/T.dir/F.cc.o"
        if (file ~ /\.o$/) {
          file = $NF; sub(/.*CMakeFiles\/[^\/]*\.dir\//, "", file); sub(/\.o$/, "", file)
        }
        line = sprintf("[%4d/%d] %3d%%  %s", n[1], n[2], n[2] ? 100 * n[1] / n[2] : 100, file)
        printf "\r\033[K%s", substr(line, 1, width - 1) > "/dev/stderr"; fflush("/dev/stderr")
        next
      }
      { printf "\r\033[K%s\n", $0 > "/dev/stderr"; fflush("/dev/stderr") }
      END { printf "\r\033[K" > "/dev/stderr" }'
  else
    cat >&2
  fi
}
start=$SECONDS
cmake --build "$build" --target tandem --parallel "$(nproc)" 2>&1 | progress
echo "demo: tandem built in $((SECONDS - start)) s" >&2

[ -f "$model/config.json" ] || { echo "model not found: $model (set MODEL_DIR)"; exit 1; }
"$build/services/tandem" generate --model="$model" --prompt="Once upon a time" \
  --max-tokens=300 --mode=hybrid --beta=1 --window=64 --sink=4 --ignore-eos "$@"
