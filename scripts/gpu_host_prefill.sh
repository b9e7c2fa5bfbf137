#!/usr/bin/env bash
# Issue 15 item 1 on the GPU host (through the device tool): TTFT of a long prompt per mode with
# the device prefill (a widened window: every chunk attends on the GPU, the blocks beyond the
# window reach the tier after the first token) against the old path, Llama-3-8B geometry with
# random weights. Prepared here by:
#   flock /tmp/tandem-build.lock cmake --build build --target tandem-bench \
#     gpu_worker_engine_cuda_test
#   mkdir -p /tmp/<you>-gbuild/bin && cp build/bench/tandem-bench \
#     build/tests/gpu_worker/engine/gpu_worker_engine_cuda_test /tmp/<you>-gbuild/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/<you>-gbuild .carry/<you>/tandem.tar.xz build/lib
#   git rev-parse HEAD > .carry/<you>/commit
#   mkdir -p .carry/<you>/shared/models && cp -r ../shared/models/stories260k .carry/<you>/shared/models/
# and run with carry [".carry/<you>"], CARRY=.carry/<you> and PART set.
# PART lists what runs, in order (default "check ttft"):
#   check    the device-prefill engine tests on cuda (DevicePrefill*, Widen*; ~1 min)
#   ttft     TTFT and settle time at 32K and 128K: gpu, offload, hybrid maw and hybrid pages with
#            the device prefill, then the old path (--device_prefill=false) at 32K (offload and
#            hybrid maw; hybrid took 36.6 s there). ~5 min.
#   ttft512  hybrid maw at 512K in a process of its own: the window widens as far as the device
#            allows (~60 GB of KV after the weights), the chunks past that attend through the
#            CPU node; minutes of GPU time (the prefill attention is O(n^2)).
#   ttft256  the same at 256K, where the whole prompt fits the device (a fallback for 512K).
# BENCH_ARGS adds flags to every tandem-bench. Logs and JSON go under $OUT (at most 8 files).
set -uo pipefail
out=${OUT:-/tmp/out}
carry=${CARRY:-.carry}
mkdir -p "$out" /tmp/tandem
tar xJf "$carry/tandem.tar.xz" -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/$carry/shared
{
  echo "commit: $(cat "$carry/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM"
} 2>&1 | tee "$out/host.txt"
# TTFT only: no decode configurations, no bandwidth probes (they time decode limits).
common=(--contexts= --skip_probes --prefill_chunk 4096 --window 4096 --block 64
        --page_tokens 16384 --prefill_beta 1.0)
for part in ${PART:-check ttft}; do
case "$part" in
  check)
    gpu_worker_engine_cuda_test --gtest_brief=1 \
      --gtest_filter='DevicePrefill*:*WindowWiden*:*WindowCache*:Hybrid*:Scheduler*' \
      > "$out/prefill_cuda_test.txt" 2>&1
    tail -4 "$out/prefill_cuda_test.txt"
    ;;
  ttft)
    tandem-bench "${common[@]}" --modes gpu,offload,hybrid --prefill_contexts 32768,131072 \
      --prefill_selections maw,pages --json "$out/ttft.jsonl" ${BENCH_ARGS:-} \
      > "$out/ttft.txt" 2>&1
    grep '^prefill' "$out/ttft.txt"
    tandem-bench "${common[@]}" --modes offload,hybrid --prefill_contexts 32768 \
      --device_prefill=false --json "$out/ttft_old_path.jsonl" ${BENCH_ARGS:-} \
      > "$out/ttft_old_path.txt" 2>&1
    echo "old path (--device_prefill=false):"
    grep '^prefill' "$out/ttft_old_path.txt"
    ;;
  ttft512|ttft256)
    tokens=$([ "$part" = ttft512 ] && echo 524288 || echo 262144)
    tandem-bench "${common[@]}" --modes hybrid --prefill_contexts "$tokens" \
      --prefill_selections maw --json "$out/$part.jsonl" ${BENCH_ARGS:-} \
      > "$out/$part.txt" 2>&1
    grep -E '^prefill|rror' "$out/$part.txt"
    ;;
esac
done
