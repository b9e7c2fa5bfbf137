#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the perplexity table of issue 28: gutenberg-14m-64k
# at 8K, 16K, 32K and 64K tokens (BOOKS_8K / BOOKS_LONG eval books: the first by name that are
# long enough), window 512 + 4 sinks, chunk 16, pages of 16 tokens at 512 / 1024 / 2048 tokens
# per (layer, kv head), Quest's bound alone (c0) and the two-score default (c0.5); one process
# per (length, policy), all at once. Every finished configuration's JSON line goes to
# $OUT/ppl_vs_context.jsonl. Prepared as scripts/gpu_host_accuracy_vs_context.sh says.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem /tmp/ppl
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
model=$PWD/.carry/shared/models/gutenberg-14m-64k
books=$PWD/.carry/shared/data/gutenberg-eval
run() {   # tokens books [flags...]
  local tokens=$1 n=$2; shift 2
  timeout "${PPL_TIMEOUT:-360}" tandem-ppl-bench --model "$model" --books "$books" --tokens "$tokens" \
    --window 512 --sink 4 --chunk 16 --backend cuda --node_threads 1 --betas= --max_books "$n" \
    --captured_mass=false "$@" > "$(mktemp -p /tmp/ppl)" 2>&1
}
for t in 8192 16384 32768 65536; do
  n=$([ "$t" -le 16384 ] && echo "${BOOKS_8K:-3}" || echo "${BOOKS_LONG:-2}")
  run "$t" "$n" --pages 512:c0 &
  for p in 512:c0.5 1024:c0 1024:c0.5 2048:c0 2048:c0.5; do run "$t" "$n" --skip_full --pages "$p" & done
done
wait
grep -h '"config"' /tmp/ppl/* > "$out/ppl_vs_context.jsonl"
wc -l "$out/ppl_vs_context.jsonl"
