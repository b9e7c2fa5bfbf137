#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the speed side of layer-ahead page selection
# (issue 27 item 2, RunnerOptions::speculate_pages): the engine's page-selection cuda tests, then
# tandem-bench decode steps at CONTEXTS (default 131072 524288; Llama-3-8B geometry, batch 1,
# pages with a 2048-token budget, window 4096) in gpu mode and in hybrid mode with the pages
# chosen from the true queries (--page_speculate=false) and from the layer-ahead guess (the
# default since it was measured), with bf16 node
# KV and, at the last context, int8 node KV. One process per row, one after the other. Prepared
# here as scripts/gpu_host_worker.sh says (tandem-bench and gpu_worker_engine_cuda_test in
# .carry/tandem.tar.xz, stories260k in .carry/shared). Logs under $OUT (or /tmp/out); the JSON
# line of each configuration is printed.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
contexts=${CONTEXTS:-131072 524288}
last=${contexts##* }
echo "commit: $(cat .carry/commit 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
if [ -x "$(command -v gpu_worker_engine_cuda_test)" ]; then
  timeout 200 gpu_worker_engine_cuda_test --gtest_brief=1 \
    --gtest_filter='PageIndex*:PageSelection*:HybridEquivalence*:LowRank*' > "$out/tests.txt" 2>&1
  grep -E 'FAILED|PASSED|Failure' "$out/tests.txt" | head -20
fi
bench() {   # name contexts modes [flags...]
  local name=$1 ctx=$2 modes=$3; shift 3
  timeout "${SPEED_TIMEOUT:-200}" tandem-bench --contexts "$ctx" --batches 1 --modes "$modes" \
    --shares= --select_tokens 2048 --window 4096 --prefill_tokens 0 --steps 20 --micro_batches 1 \
    "$@" > "$out/speed_$name.txt" 2>&1
  echo "== $name: $*"
  grep -E '"median_ms"' "$out/speed_$name.txt" | cut -c1-900
}
bench gpu "${contexts// /,}" gpu
bench exact_q "${contexts// /,}" hybrid --page_speculate=false
bench ahead "${contexts// /,}" hybrid --page_speculate
bench int8_exact_q "$last" hybrid --node_kv_dtype int8 --page_speculate=false
bench int8_ahead "$last" hybrid --node_kv_dtype int8 --page_speculate
