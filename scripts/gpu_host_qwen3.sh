#!/usr/bin/env bash
# Issue 30 item 1 on the GPU host (through the device tool): the cuda backend's tests of what
# Qwen3 adds (the strided per-head RmsNorm, the tiny Qwen3 model against transformers, the random
# qwen3 geometry against its written directory), then the qwen3-8b geometry's decode beside
# llama3-8b's in one process each. Prepared here by:
#   mkdir -p /tmp/q3/bin && cp build/tests/gpu_worker/backend_cuda/backend_cuda_test \
#     build/tests/gpu_worker/model/gpu_worker_rope_reference_cuda_test \
#     build/tests/gpu_worker/geometry/gpu_worker_random_model_cuda_test \
#     build/bench/tandem-bench /tmp/q3/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/q3 .carry/tandem.tar.xz && git rev-parse HEAD > .carry/commit
# and run with carry [".carry"].
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_ROPE_FIXTURES_DIR=$PWD/tests/gpu_worker/model/rope_fixtures
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  backend_cuda_test --gtest_filter='*RmsNorm*' 2>&1 | tail -4
  gpu_worker_rope_reference_cuda_test 2>&1 | grep -E '^\[  (PASSED|FAILED|  OK|SKIPPED)|FAILED' | tail -20
  gpu_worker_random_model_cuda_test 2>&1 | grep -E 'PASSED|FAILED|SKIPPED' | tail -6
  for preset in llama3-8b qwen3-8b; do
    echo "== tandem-bench --preset $preset"
    tandem-bench --preset "$preset" --contexts 32768 --batches 1,8 --modes gpu --prefill_tokens 32768 \
      --steps 20 --skip_probes 2>&1 | tail -12
  done
} 2>&1 | tee "$out/qwen3.txt"
