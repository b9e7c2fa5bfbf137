#!/usr/bin/env bash
# Issue 29 on the GPU host (through the device tool): A/B of prefill attention builds in one
# call. Each VARIANT is a tandem-kernel-bench-<v> (and, for TTFT, a tandem-bench-<v>) built here
# from its own source state; the rounds alternate the variants so drift shows as spread.
# Prepared here by copying those executables into a folder's bin/ and:
#   ../shared/tools/gpu-bundle.sh FOLDER .carry/tandem.tar.xz; git rev-parse HEAD > .carry/commit
# and run with carry [".carry"]. Settings (environment):
#   VARIANTS   kernel-bench variants, in order (default "base"; empty: none, for TTFT or tests only)
#   ROUNDS     times each is run (default 2)
#   CASES      chunk:prefix list (default the issue's seven shapes)
#   SDPA=1     also time torch SDPA on CASES (its best backend per shape)
#   NCU_VARIANT / NCU_CASE  one Nsight Compute profile of the Hopper kernel (clock control off)
#   TTFT_RUNS  TTFT with tandem-bench-<v>: "v:contexts:chunk:modes" entries (below)
#   TESTS      a gtest filter for backend_cuda_test (run first, when it is in the bundle)
#   ENGINE_TESTS  a gtest filter for gpu_worker_engine_cuda_test: the bundle's shared/ (models,
#              data) is TANDEM_SHARED_DIR and its lib2/ (the sentencepiece libraries) joins
#              LD_LIBRARY_PATH
# Prints one line per (round, variant, case): the Hopper kernel's (flash2) TFLOP/s and its error
# against the exact kernel; full logs go under $OUT in one tar.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem /tmp/ab
trap 'tar czf "$out/ab.tgz" -C /tmp ab' EXIT TERM
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh || exit 1
cases=${CASES:-2048:0,2048:8192,2048:32768,4096:0,16384:0,16384:16384,16384:114688}
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
} 2>&1 | tee /tmp/ab/host.txt
if command -v cuobjdump > /dev/null; then  # the Hopper kernel's instruction mix, per variant
  for v in ${VARIANTS-base}; do
    cuobjdump -sass "$(command -v tandem-kernel-bench-$v)" |
      awk '/Function :/{inside = ($0 ~ /HopperAttentionKernel/)} inside' > "/tmp/ab/sass_$v.txt"
    awk -v v="$v" '/HGMMA/{h++} /MUFU.EX2/{e++} /LDL|STL/{l++} /FENCE/{f++} {n++}
      END{printf "sass %s: lines %d HGMMA %d MUFU.EX2 %d local %d fences %d\n", v, n, h, e, l, f}' \
      "/tmp/ab/sass_$v.txt"
  done
fi
if [ -n "${TESTS:-}" ] && command -v backend_cuda_test > /dev/null; then
  timeout 300 backend_cuda_test --gtest_brief=1 --gtest_filter="$TESTS" > /tmp/ab/tests.txt 2>&1
  echo "backend_cuda_test exit $?"
  grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran' /tmp/ab/tests.txt | tail -8
fi
if [ -n "${ENGINE_TESTS:-}" ] && command -v gpu_worker_engine_cuda_test > /dev/null; then
  TANDEM_SHARED_DIR=/tmp/tandem/shared LD_LIBRARY_PATH="/tmp/tandem/lib2:$LD_LIBRARY_PATH" \
    timeout 400 gpu_worker_engine_cuda_test --gtest_brief=1 --gtest_filter="$ENGINE_TESTS" \
    > /tmp/ab/engine_tests.txt 2>&1
  echo "gpu_worker_engine_cuda_test exit $?"
  grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran|perplexity' /tmp/ab/engine_tests.txt | tail -12
fi
kb=(--decode_windows= --page_selection=false --gemv=false --gemv_fp8=false --seconds=${KB_SECONDS:-0.1})
for round in $(seq "${ROUNDS:-2}"); do
  for v in ${VARIANTS-base}; do
    log=/tmp/ab/kb_${v}_$round.txt
    "tandem-kernel-bench-$v" "${kb[@]}" --prefill_cases="$cases" > "$log" 2> "$log.err"
    python3 - "$log" "$v" "$round" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("bench") != "prefill":
        continue
    print(f"round {sys.argv[3]} {sys.argv[2]:>6} {r['chunk']:>6}:{r['prefix']:<7} "
          f"hopper {r.get('flash2_tflops', 0):6.1f} TFLOP/s  o err {r.get('flash2_o_max_abs', -1):.1e}"
          f"  lse err {r.get('flash2_lse_max_abs', -1):.1e}  bad {r.get('flash2_bad', -1)}")
EOF
  done
done
if [ -n "${SDPA:-}" ]; then
  PYTHONUNBUFFERED=1 python3 bench/sdpa_reference.py --seconds 0.15 --cases "$cases" \
    > /tmp/ab/sdpa.txt 2> /tmp/ab/sdpa.err
  python3 - /tmp/ab/sdpa.txt <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        if r.get("bench") == "sdpa" and "tflops" in r:
            key = (r["chunk"], r["prefix"])
            best.setdefault(key, {})[r["backend"]] = max(best.get(key, {}).get(r["backend"], 0),
                                                          r["tflops"])
for (c, p), b in best.items():
    print(f"sdpa {c:>6}:{p:<7} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(b.items())))
EOF
fi
if [ -n "${NCU_VARIANT:-}" ] && command -v ncu > /dev/null; then
  timeout 300 ncu --clock-control none -k regex:HopperAttention --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section ComputeWorkloadAnalysis --section Occupancy \
    "tandem-kernel-bench-$NCU_VARIANT" "${kb[@]}" --seconds=0.01 \
    --prefill_cases="${NCU_CASE:-16384:16384}" > /tmp/ab/ncu.txt 2>&1
  echo "ncu exit $?"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Stall|Warp Cycles Per Issued|Executed Ipc A|No Eligible|Issued Warp" \
    /tmp/ab/ncu.txt | head -40
fi
# TTFT_RUNS: "variant:contexts:chunk:modes" entries, e.g. "v4:131072:8192:gpu,hybrid".
for run in ${TTFT_RUNS:-}; do
  IFS=: read -r v contexts chunk modes <<< "$run"
  log="/tmp/ab/ttft_${v}_${contexts//,/-}_$chunk.txt"
  "tandem-bench-$v" --contexts= --skip_probes --window 4096 --block 64 --page_tokens 16384 \
    --prefill_beta 1.0 --modes "${modes:-gpu}" --prefill_chunk "$chunk" \
    --prefill_contexts "$contexts" > "$log" 2>&1
  echo "ttft $run exit $?"
  grep '^prefill' "$log"
done

