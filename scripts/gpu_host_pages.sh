#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the checks and benchmarks of query-aware page
# selection (issue 11): the page kernels' and engine's cuda tests, the selection kernel bench,
# the perplexity table (one process per configuration, in parallel: the model is tiny and each
# run is latency-bound), the needle benchmark and tandem-bench at long contexts. Prepared here
# as scripts/gpu_host_worker.sh says, with gutenberg-14m-niah in .carry/shared/models too.
#   PARTS="tests kernel probe ppl needle speed" (default: all but probe), PPL_CHUNK (default 1),
#   PPL_BOOKS (0 = all 12), SPEED_CONTEXTS (default 131072,524288,1048576)
# Logs go under $OUT (or /tmp/out).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
models=$TANDEM_SHARED_DIR/models
books=$TANDEM_SHARED_DIR/data/gutenberg-eval
parts=${PARTS:-tests kernel ppl needle speed}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

if has tests; then
  timeout 200 backend_cuda_test --gtest_brief=1 > "$out/tests.txt" 2>&1
  tail -3 "$out/tests.txt"
  timeout 200 gpu_worker_engine_cuda_test --gtest_brief=1 \
    --gtest_filter='PageIndex*:PageSelection*:HybridEquivalence*:EngineGolden*' \
    >> "$out/tests.txt" 2>&1
  grep -E 'FAILED|PASSED|mean max' "$out/tests.txt"
fi
if has kernel; then
  tandem-kernel-bench --decode_windows= --prefill=false --page_query_tokens=1,8 > "$out/kernel.txt" 2>&1
  tail -8 "$out/kernel.txt"
fi
if has probe; then   # time per decode step of the ppl runs (any gutenberg-14m-shaped model)
  ( time tandem-ppl-bench --model "$models/${PROBE_MODEL:-gutenberg-14m}" --books "$books" \
      --max_books 1 --tokens 2048 --window 512 --chunk 1 --backend cuda --node_threads 2 \
      --betas 1 --pages 512 ) > "$out/probe.txt" 2>&1
  tail -8 "$out/probe.txt"
fi
if has ppl; then
  common=(--model "$models/gutenberg-14m" --books "$books" --tokens 8192 --window 512 --sink 4
          --chunk "${PPL_CHUNK:-1}" --backend cuda --node_threads 2
          --max_books "${PPL_BOOKS:-0}")
  run_ppl() { name=$1; shift; tandem-ppl-bench "${common[@]}" "$@" > "$out/ppl_$name.txt" 2>&1; }
  run_ppl full --betas= --window_only &
  run_ppl maw --skip_full --betas 0.5,1 &
  run_ppl p256 --skip_full --betas= --pages 256 &
  run_ppl p512 --skip_full --betas= --pages 512 &
  run_ppl p1024 --skip_full --betas= --pages 1024 &
  run_ppl p512d1 --skip_full --betas= --pages 512:d1 &
  run_ppl p256d1 --skip_full --betas= --pages 256:d1 &
  wait
  grep -h '"config"' "$out"/ppl_*.txt | cut -c1-400
fi
if has needle; then
  timeout "${NEEDLE_TIMEOUT:-240}" tandem-needle-bench --model "$models/gutenberg-14m-niah" --books "$books" \
    --prompts_per_book 4 --betas 1 --pages 256,512,512:d1 --backend cuda \
    > "$out/needle.txt" 2>&1
  tail -9 "$out/needle.txt"
fi
if has speed; then
  timeout "${SPEED_TIMEOUT:-300}" tandem-bench --contexts "${SPEED_CONTEXTS:-131072,524288,1048576}" --batches 1 \
    --modes hybrid --shares "${SPEED_SHARES:-}" --select_tokens 2048 --window 4096 \
    --prefill_tokens 0 --steps 20 --json "$out/speed.json" > "$out/speed.txt" 2>&1
  tail -12 "$out/speed.txt"
fi
