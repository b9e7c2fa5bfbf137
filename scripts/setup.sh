#!/usr/bin/env bash
# Installs tandem's build and test dependencies from Debian 12 packages.
# Idempotent: packages already present are skipped, so re-running it costs only a dpkg query.
set -euo pipefail

packages=(
  build-essential cmake pkg-config ninja-build git
  ccache                              # compiler cache (scripts/compiler_cache.sh)
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc
  libprotobuf-dev protobuf-compiler
  libabsl-dev
  libdnnl-dev ocl-icd-opencl-dev opencl-headers   # Debian's oneDNN cmake config needs OpenCL
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  nlohmann-json3-dev
  libspdlog-dev libfmt-dev
  libsentencepiece-dev libpcre2-dev   # tokenizer.model; the byte-level BPE pre-tokenizer regex
  iproute2                            # ip netns / veth / tc for the multi-host tests
  yamllint python3-kubernetes python3-yaml   # deploy/validate.py (ctest -L deploy)
  libcpp-httplib-dev                  # tandem-gateway's HTTP server
  prometheus-cpp-dev                  # /metrics on the worker, the nodes and the gateway
  prometheus                          # promtool check metrics (tests)
  python3-jinja2                      # reference renderings of chat templates (fixtures)
  python3-grpcio python3-protobuf     # the Python SDK and its tests
  nodejs curl                         # the Node SDK, the npm openai e2e test, curl SSE test
  qemu-user                           # the avx2_cpu.* tests: an AVX2-only CPU model (x86-64)
)

missing=()
# Debian's nodejs comes without npm (package npm); NodeSource's nodejs bundles it and conflicts
# with Debian's npm, so npm is asked for only where the command is missing.
command -v npm >/dev/null || packages+=(npm)
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# npm packages of the Node SDK and the e2e tests: every package-lock.json in the tree (outside
# node_modules) is installed with `npm ci` when its node_modules is missing or older than it.
install_npm_packages() {
  local root lock dir
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  while IFS= read -r lock; do
    dir=$(dirname "$lock")
    if [ ! -d "$dir/node_modules" ] || [ "$lock" -nt "$dir/node_modules" ]; then
      echo "setup: npm ci in ${dir#"$root"/}"
      (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error && touch node_modules)
    fi
  done < <(find "$root/clients" "$root/tests" -name package-lock.json -not -path '*/node_modules/*' 2>/dev/null)
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  install_npm_packages
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
install_npm_packages
