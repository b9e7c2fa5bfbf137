#!/usr/bin/env bash
# One device call, two A/B comparisons of this stop, each pair in one process order
# (old, new, old, new) so drift between lent machines does not enter:
#   1. issue 24: tandem-attend-bench on the host CPU, the AVX2 path forced (TANDEM_CPU_ISA=avx2)
#      with the old and new bf16 row scan, and the native (AVX-512) path beside them;
#   2. issue 27 item 4: gpu-mode decode attention (tandem-kernel-bench decode rows) and the whole
#      decode step (tandem-bench --modes gpu) with the old and new decode kernel; first the new
#      backend_cuda_test's window-attention suites (correctness against f64 on this GPU).
# Prepared here: bin/ holds <name>-old and <name>-new of tandem-attend-bench, tandem-kernel-bench
# and tandem-bench plus backend_cuda_test (new), bundled with ../shared/tools/gpu-bundle.sh into
# $CARRY/tandem.tar.xz with $CARRY/commit. Run through the device tool with carry [".carry"]:
#   bash scripts/gpu_host_decode_ab.sh
# Logs: $OUT/ab.tar.xz (one file per run, packed again after each part) and the summary on stdout. PART picks parts
# (default "attend check decode step").
set -uo pipefail
out=${OUT:-/tmp/out}
carry=${CARRY:-.carry}
logs=$(mktemp -d)
mkdir -p "$out" /tmp/tandem
tar xJf "$carry/tandem.tar.xz" -C /tmp/tandem && source /tmp/tandem/env.sh || exit 1
{
  echo "commit: $(cat "$carry/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'
} | tee "$logs/host.txt"
for part in ${PART:-attend check decode step}; do
case "$part" in
  attend)
    args="--heads 8 --group 4 --n 131072,1048576 --select_tokens 2048 --reps 7"
    i=0
    for run in native:new avx2:old avx2:new avx2:old avx2:new native:new; do
      isa=${run%%:*}; bin=${run##*:}; i=$((i + 1))
      if [ "$isa" = native ]; then env=(); else env=(TANDEM_CPU_ISA=avx2); fi
      env "${env[@]}" timeout 200 tandem-attend-bench-$bin $args > "$logs/attend-$i-$isa-$bin.txt" 2>&1
      echo "== attend $i $isa $bin exit $?"
      grep -E "^memory|^ +[0-9]+ +[0-9]+ |paged Attend" "$logs/attend-$i-$isa-$bin.txt"
    done
    ;;
  check)
    timeout 240 backend_cuda_test --gtest_brief=1 > "$logs/backend_cuda_test.txt" 2>&1
    echo "== backend_cuda_test exit $?"
    grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran' "$logs/backend_cuda_test.txt" | tail -12
    ;;
  decode)
    i=0
    for bin in old new old new; do
      i=$((i + 1))
      timeout 150 tandem-kernel-bench-$bin --prefill=false --page_selection=false --gemv=false \
        --decode_windows=4096,32768,131072,524288 --decode_tokens=1,2,8 --seconds 0.3 \
        > "$logs/decode-$i-$bin.txt" 2>&1
      echo "== kernel decode $i $bin exit $?"
      grep -E '^decode ' "$logs/decode-$i-$bin.txt"
    done
    ;;
  step)
    i=0
    for bin in old new old new old new; do
      i=$((i + 1))
      timeout 200 tandem-bench-$bin --modes gpu --contexts 32768,131072,524288 --batches 1,8 \
        --prefill_tokens 0 ${STEP_ARGS:-} > "$logs/step-$i-$bin.txt" 2>&1
      echo "== step $i $bin exit $?"
      grep -E "^gpu" "$logs/step-$i-$bin.txt"
    done
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
tar cJf "$out/ab.tar.xz" -C "$logs" .
done
