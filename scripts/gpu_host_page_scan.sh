#!/usr/bin/env bash
# Issue 27 item 1 / issue 24 on the GPU host's CPU (16 cores, AVX-512 + AMX; through the device
# tool): the node's named-page Attend against its dense scan in one process
# (`tandem-attend-bench`, Llama-3-8B layer: 8 kv heads x group 4, head_dim 128, one decode token,
# 2048 selected tokens in 16-token pages), over the attention pool's spin and task split, native
# and with the AVX2 path forced; then the pool's and the paged kernels' tests on 16 cores.
# Prepared by:
#   mkdir -p /tmp/sbundle/bin && cp build/bench/tandem-attend-bench \
#     build/tests/cpu_attention/cpu_attention_{kernel,paged,paged_node}_test /tmp/sbundle/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/sbundle .carry/tandem.tar.xz
#   git rev-parse HEAD > .carry/commit
# and run with carry [".carry"]. VARIANTS="spin:tasks ..." and N (per-head entries) override.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  lscpu | grep -E 'Model name|^CPU\(s\)'
} 2>&1 | tee "$out/host.txt"
n=${N:-131072}
bench() {   # bench LABEL SPIN TASKS [ENV...]
  local label=$1 spin=$2 tasks=$3
  shift 3
  echo "== $label: --pool_spin_us $spin --tasks_per_thread $tasks $*"
  env "$@" timeout 300 tandem-attend-bench --heads 8 --group 4 --n "$n" --select_tokens 2048 \
    --reps 7 --pool_spin_us "$spin" --tasks_per_thread "$tasks" > "$out/bench_$label.jsonl" \
    2> "$out/bench_$label.err"
  grep -E '"bench":"(read|node_attend|node_paged_attend|sparse)' "$out/bench_$label.jsonl" |
    cut -c1-400
}
for v in ${VARIANTS:-0:2 100:2 100:8 1000:8}; do
  bench "s${v%%:*}_t${v##*:}" "${v%%:*}" "${v##*:}"
done
best=${BEST:-100:8}
bench "avx2_s${best%%:*}_t${best##*:}" "${best%%:*}" "${best##*:}" TANDEM_CPU_ISA=avx2
for t in kernel paged paged_node; do
  echo "== cpu_attention_${t}_test"
  timeout 300 "cpu_attention_${t}_test" > "$out/test_$t.txt" 2>&1
  echo "rc $?"; grep -E '^\[  (PASSED|FAILED) ' "$out/test_$t.txt"
done
