#!/usr/bin/env bash
# Builds tandem and runs every test that this machine can run (GPU tests skip with a message
# where there is no GPU). Prints ctest's summary; exits non-zero if any test fails.
#   scripts/test.sh [ctest args, e.g. -L unit]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/scripts/build.sh"
cd "$build"
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
