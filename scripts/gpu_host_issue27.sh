#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) issue 27's benchmark table in one call, one
# process per row, one after the other (Llama-3-8B geometry, random weights, batch 1 unless a
# row says otherwise, pages with a 2048-token budget, window 4096, one embedded CPU node):
#   attend  tandem-attend-bench's paged-scan rows (the node's CPU alone: random, contiguous,
#           warm and gathered pages against the dense scan and the read rate)
#   steps   gpu mode at 32K / 128K / 512K; hybrid bf16 at 128K and 512K; hybrid int8 at 512K
#           (each step's breakdown: round trip, node handling and compute, CPU wait, q wait)
#   batch   8 sessions x 64K against one session (one pass and two micro-batches), for each
#           node KV dtype of BATCH_DTYPES (default "bf16")
# PARTS selects (default: all); STEP_FLAGS are added to every tandem-bench row (an A/B of a
# flag). Prepared here with the bundle in .carry/tandem.tar.xz (tandem-bench,
# tandem-attend-bench). Logs under $OUT (or /tmp/out); each row's JSON line is printed.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf "${BUNDLE:-.carry/tandem.tar.xz}" -C /tmp/tandem && source /tmp/tandem/env.sh
parts=${PARTS:-attend steps batch}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

if has attend; then
  timeout "${ATTEND_TIMEOUT:-150}" tandem-attend-bench --heads 8 --group 4 --n 131072 \
    --select_tokens 2048 --reps 25 --tasks_per_thread 2 > "$out/attend.txt" 2>&1
  grep -E '"bench": *"(memory|sparse_attention|paged_kernel|node_attend_paged)' "$out/attend.txt" |
    cut -c1-400
fi
bench() {   # name contexts batches modes [flags...]
  local name=$1 ctx=$2 batches=$3 modes=$4; shift 4
  timeout "${STEP_TIMEOUT:-200}" tandem-bench --contexts "$ctx" --batches "$batches" \
    --modes "$modes" --shares= --select_tokens 2048 --window 4096 --prefill_tokens 0 --steps 20 \
    ${STEP_FLAGS:-} "$@" > "$out/step_$name.txt" 2>&1
  echo "== $name: $ctx x $batches $modes $* ${STEP_FLAGS:-}"
  grep -E 'decode_ms_median' "$out/step_$name.txt" | cut -c1-1500
}
if has steps; then
  bench gpu 32768,131072,524288 1 gpu --micro_batches 1
  bench hybrid_bf16 131072,524288 1 hybrid --micro_batches 1
  bench hybrid_int8 524288 1 hybrid --micro_batches 1 --node_kv_dtype int8
fi
if has batch; then
  for dtype in ${BATCH_DTYPES:-bf16}; do
    STEP_TIMEOUT=${BATCH_TIMEOUT:-260} bench "batch_$dtype" 65536 1,8 hybrid --micro_batches 1,2 \
      --skip_probes --node_kv_dtype "$dtype"
  done
fi
