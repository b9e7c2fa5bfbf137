#!/usr/bin/env bash
# Issue 27 item 1 / issue 24 on the GPU host (through the device tool): the paged scan with
# ranges claimed by streams (each pool thread claims ranges in order and prefetches on into the
# next) against the fixed one-range-per-task split, old and new binaries alternating in one call:
#   attend: tandem-attend-bench (Llama-3-8B layer: 8 kv heads x group 4, head_dim 128, one decode
#           token, 2048 selected tokens in 16-token pages) over tasks per thread, native and AVX2
#           (ATTEND_RUNS="isa:bin:tasks ...");
#   step:   tandem-bench's hybrid 512K bf16 decode step (one embedded node, layer-ahead pages);
#           STEP_RUNS="bin:tasks:threads:pool_spin_us:shm_spin_us[:--flag=v+--flag=v] ..." picks
#           binaries and node flags (threads 0 = all cores; the old binary takes no tasks flag)
#           and further tandem-bench flags (a later --contexts wins), STEPS the steps;
#   tests:  the paged kernels' tests on 16 cores.
# Prepared here: bin/ holds tandem-attend-bench-{old,new}, tandem-bench-{old,new},
# cpu_attention_paged_test and cpu_attention_paged_node_test, bundled with
# ../shared/tools/gpu-bundle.sh into .carry/tandem.tar.xz (+ .carry/commit). Run with carry
# [".carry"]: bash scripts/gpu_host_scan_streams.sh  (PART picks parts: "attend step tests").
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh || exit 1
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'
} 2>&1 | tee "$out/host.txt"

summarize() {   # JSON rows on stdin -> one compact line each
  python3 -c '
import json, sys
keys = ("pages", "kv_gbs", "ratio_to_read", "wall_us", "task_start_p50_us", "last_task_end_us",
        "task_us", "busy_share", "decode_ms_median", "decode_ms_p99", "context")
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    b = r.get("bench", r.get("mode", "?"))
    if b in ("config", "memory") or (b == "paged_kernel" and r.get("pages") == "page_major"):
        continue
    f = " ".join(f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                 for k in keys if k in r)
    bd = r.get("breakdown_ms")
    if isinstance(bd, dict):
        f += " | " + " ".join(f"{k}={v:.2f}" for k, v in bd.items() if isinstance(v, (int, float)))
    print(f"  {b}: {f}")
'
}

for part in ${PART:-attend step tests}; do
  case "$part" in
    attend)
      i=0
      for run in ${ATTEND_RUNS:-native:old:2 native:new:2 native:new:4 native:new:8 native:old:2
                                native:new:2 native:new:4 native:new:8 avx2:old:2 avx2:new:4
                                avx2:old:2 avx2:new:4}; do
        IFS=: read -r isa bin tasks <<< "$run"
        i=$((i + 1))
        if [ "$isa" = native ]; then env=(); else env=(TANDEM_CPU_ISA=avx2); fi
        echo "== attend $i $isa $bin tasks $tasks"
        env "${env[@]}" timeout 120 "tandem-attend-bench-$bin" --heads 8 --group 4 --n 131072 \
          --select_tokens 2048 --reps 25 --tasks_per_thread "$tasks" \
          > "$out/attend-$i-$isa-$bin-$tasks.jsonl" 2> "$out/attend-$i.err"
        grep -E '"bench":"(read|sparse_attention|paged_kernel|node_paged_attend)' \
          "$out/attend-$i-$isa-$bin-$tasks.jsonl" | summarize
      done
      ;;
    step)
      args="--batches 1 --shares= --select_tokens 2048 --window 4096 --prefill_tokens 0
            --steps ${STEPS:-20} --micro_batches 1 --skip_probes --modes hybrid --contexts 524288"
      i=0
      for run in ${STEP_RUNS:-old:2:0:0:10 new:2:0:0:10 new:4:0:0:10 old:2:0:0:10 new:2:0:0:10
                              new:4:0:0:10 old:2:0:0:10 new:2:0:0:10 new:4:0:0:10}; do
        IFS=: read -r bin tasks threads pool_spin shm_spin flags <<< "$run"
        i=$((i + 1))
        extra=(--node_threads "$threads" --node_pool_spin_us "$pool_spin" --shm_spin_us "$shm_spin")
        [ -n "${flags:-}" ] && extra+=(${flags//+/ })
        [ "$bin" != old ] && extra+=(--node_tasks_per_thread "$tasks")
        echo "== step $i $run"
        # shellcheck disable=SC2086
        timeout 150 "tandem-bench-$bin" $args "${extra[@]}" > "$out/step-$i-$bin.jsonl" \
          2> "$out/step-$i.err"
        grep -E '^\{' "$out/step-$i-$bin.jsonl" | summarize
      done
      ;;
    tests)
      for t in paged paged_node; do
        timeout 200 "cpu_attention_${t}_test" > "$out/test_$t.txt" 2>&1
        echo "== cpu_attention_${t}_test rc $?"
        grep -E '^\[  (PASSED|FAILED) ' "$out/test_$t.txt"
      done
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
