#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the checks and benchmarks of issue 28 (accuracy
# as the context grows): the page kernels' cuda tests, perplexity of gutenberg-14m-64k at
# CONTEXTS tokens for the bound alone (c0) and the two-score default (c0.5) at 512 / 1024 / 2048
# tokens per (layer, kv head), the captured share of the offloaded softmax mass per layer
# (one book each), needles at 32K and 64K decoded with every offloaded entry on the tier
# (tandem-needle-bench --settle_first), and the 512K step time of both policies (tandem-bench,
# Llama-3-8B geometry). Prepared here as scripts/gpu_host_worker.sh says, with
# gutenberg-14m-64k and the eval books in .carry/shared.
#   PARTS="tests ppl mass needle speed" (default: all), CONTEXTS (default 8192 16384 32768 65536),
#   PPL_BOOKS (default 6), ACCURACY_TIMEOUT (s per accuracy process, default 270; each prints a
#   JSON line per finished configuration), SPEED_TIMEOUT (s per policy, default 150),
#   PPL_PAGES (space-separated --pages lists, one process per list and length; the first also
#   runs full attention and the window alone; a list may end in @flags, flags joined by '+',
#   e.g. "2048 2048@--page_speculate"), NEEDLE_PAGES (--pages of the needle bench),
#   NEEDLE_VARIANTS (space-separated name=flags, one needle process per variant and length;
#   default "base="), NEEDLE_TOKENS (space-separated prompt_tokens:prompts_per_book, default
#   "32000:2 63000:1"),
#   SPEED_CONFIGS (space-separated name=flags, flags joined by '+', e.g.
#   "c0=--centroid_share+0 lowrank=" for tandem-bench at 512K)
# Logs go under $OUT (or /tmp/out).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
model=$TANDEM_SHARED_DIR/models/gutenberg-14m-64k
books=$TANDEM_SHARED_DIR/data/gutenberg-eval
parts=${PARTS:-tests ppl mass needle speed}
contexts=${CONTEXTS:-8192 16384 32768 65536}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

if has tests; then
  ( timeout 200 backend_cuda_test --gtest_brief=1 \
      --gtest_filter='*PageSelect*:*Summarize*:*LowRank*:*KeyGram*:*ProjectKeys*' > "$out/tests.txt" 2>&1
    [ -x "$(command -v gpu_worker_engine_cuda_test)" ] && timeout 200 gpu_worker_engine_cuda_test --gtest_brief=1 \
      --gtest_filter='PageIndex*:PageSelection*:HybridEquivalence*:LowRank*' >> "$out/tests.txt" 2>&1 ) &
fi
ppl() {   # name tokens [flags...]
  local name=$1 tokens=$2; shift 2
  timeout "${ACCURACY_TIMEOUT:-270}" tandem-ppl-bench --model "$model" --books "$books" --tokens "$tokens" --window 512 --sink 4 \
    --chunk 16 --backend cuda --node_threads 1 --betas= "$@" > "$out/ppl_${name}_$tokens.txt" 2>&1
}
if has ppl; then
  for t in $contexts; do
    i=0
    for entry in ${PPL_PAGES:-512:c0,512:c0.5 1024:c0,1024:c0.5,2048:c0,2048:c0.5}; do
      if [ $i -eq 0 ]; then first=(--window_only); else first=(--skip_full); fi
      pages=${entry%%@*}
      extra=""
      [[ $entry == *@* ]] && extra=${entry#*@}
      ppl "p$i" "$t" --max_books "${PPL_BOOKS:-6}" --captured_mass=false "${first[@]}" \
        --pages "$pages" ${extra//+/ } &
      i=$((i + 1))
    done
  done
fi
if has mass; then
  for t in 16384 32768 65536; do
    ppl mass "$t" --max_books 1 --captured_mass --skip_full --pages 512:c0,512:c0.5,2048:c0,2048:c0.5 &
  done
fi
needle() {   # name tokens prompts_per_book [flags...]
  local name=$1 tokens=$2 prompts=$3; shift 3
  timeout "${ACCURACY_TIMEOUT:-270}" tandem-needle-bench --model "$model" --books "$books" --prompt_tokens "$tokens" \
    --prompts_per_book "$prompts" --min_distance 640 --betas= \
    --pages "${NEEDLE_PAGES:-512:c0,512:c0.5,2048:c0,2048:c0.5}" \
    --backend cuda --node_threads 2 --node_pool_gib 8 "$@" > "$out/needle_${name}_$tokens.txt" 2>&1
}
if has needle; then
  for variant in ${NEEDLE_VARIANTS:-base=}; do
    name=${variant%%=*}
    flags=${variant#*=}
    for entry in ${NEEDLE_TOKENS:-32000:2 63000:1}; do
      needle "$name" "${entry%%:*}" "${entry#*:}" ${flags//+/ } &
    done
  done
fi
wait
if has tests; then grep -E 'FAILED|PASSED' "$out/tests.txt"; fi
for f in "$out"/ppl_*.txt; do [ -f "$f" ] && grep -H '"config"' "$f" | sed "s|$out/||" | cut -c1-360; done
for f in "$out"/needle_*.txt; do [ -f "$f" ] && grep -H '"config"' "$f" | sed "s|$out/||" | cut -c1-230; done
if has speed; then
  for config in ${SPEED_CONFIGS:-c0=--centroid_share+0 c0.5=--centroid_share+0.5}; do
    name=${config%%=*}
    flags=${config#*=}
    timeout "${SPEED_TIMEOUT:-150}" tandem-bench --contexts 524288 --batches 1 --modes hybrid \
      --shares= --select_tokens 2048 --window 4096 --prefill_tokens 0 --steps 20 \
      ${flags//+/ } > "$out/speed_$name.txt" 2>&1
    grep -E '"median_ms"|median' "$out/speed_$name.txt" | tail -2 | cut -c1-600
  done
fi
