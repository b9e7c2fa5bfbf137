#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) issue 16's checks and benchmarks of mode=exact
# (ExactTier: the offloaded KV split by the ExactPlanner between pinned host pages streamed over
# PCIe and the CPU node attending densely, merged by LSE):
#   tests  the cuda engine's exact cases (exact == gpu for every split, the served path), the
#          planner's unit test, the cuda probe test (the paths' rates alone and at once) and
#          the cuda step clock test (per-path times of real passes, logits == gpu) and the cuda
#          recompute test (KVPR pages over the upload stream == gpu)
#   gqa    Llama-3-8B geometry at 128K and 512K: offload vs exact side by side in one process
#          per context (the 512K KV, 64 GiB, takes most of the host), the plan (share per path,
#          modelled step, recompute verdict) printed from each exact row; at 128K also the
#          forced splits all-nodes (--exact_fetch_share 0) and all-PCIe (1), which check the
#          planner's model against measured steps
#   mha    a Llama-2-7B-like MHA geometry (32 kv heads, FFN 11008, vocab 32000, no rope
#          scaling) at 32K, 64K and 128K: offload vs exact, with the recompute verdict and
#          modelled gain (KVPR: activations of 4096 x 2 B replace K+V of 2 x 32 x 128 x 2 B);
#          exact runs twice per context, --exact_recompute off and auto (the planner's share
#          of the entries kept as layer inputs and recomputed on the device: exact_recompute.h),
#          side by side in one process
#   gqa512 only the 512K pair of gqa (offload, then exact as planned), one process each (~2
#          min per fill); EXACT_SHARES="0.4 0.5" adds exact runs with those forced fetch shares
#          (a fill each), which check the planned split against its neighbours
# Prepared here as scripts/gpu_host_worker.sh says (bundle with tandem-bench,
# gpu_worker_engine_cuda_test, gpu_worker_exact_planner_test, gpu_worker_exact_probe_cuda_test,
# gpu_worker_exact_step_clock_cuda_test, gpu_worker_exact_recompute_cuda_test in
# .carry/<dir>/tandem.tar.xz;
# stories260k and gutenberg-14m in .carry/shared/models). CARRY (default .carry) names the
# folder, PARTS selects (default: all), STEPS the timed exact/offload steps (default 5),
# BENCH_ARGS adds flags. Logs and JSON lines go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
carry=${CARRY:-.carry}
mkdir -p "$out" /tmp/tandem
tar xJf "$carry/tandem.tar.xz" -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/$carry/shared
parts=${PARTS:-tests gqa mha}
steps=${STEPS:-5}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat "$carry/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

# The plan and the measured step of every exact row of a JSON-lines file.
show_plan() {
  python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") != "decode":
        continue
    if "skipped" in r or "error" in r:
        print(f'{r["mode"]:8} {r["context"]:>8}: {r.get("skipped", r.get("error"))}')
        continue
    p = r.get("exact_plan")
    row = f'{r["mode"]:8} {r["context"]:>8}: {r["decode_ms_median"]:9.1f} ms/token'
    if "exact_recompute" in r:
        row += f' [recompute {r["exact_recompute"]}: {r.get("recompute_entries", 0):.0f} entries]'
    if "combined_limit_ms" in r:
        row += f' (combined limit {r["combined_limit_ms"]:.1f} ms, x{r["ratio_to_combined_limit"]:.2f})'
    print(row)
    if p:
        print(f'         plan: fetch {100*p["fetch_share"]:.1f}% nodes {100*p["node_share"]:.1f}% '
              f'recompute {100*p["recompute_share"]:.1f}% '
              f'modelled {p["modelled_step_ms"]:.1f} ms (fetch only {p["modelled_fetch_only_ms"]:.1f}), '
              f'measured/modelled {p.get("measured_over_modelled", 0):.2f}')
        print(f'         rates GB/s: {r.get("exact_rates_GBps")}')
        print(f'         per step (timed): {r.get("exact_step_ms")}')
        print(f'         recompute: pays={p["recompute_pays"]} gain={100*p["recompute_gain"]:.1f}%: '
              f'{p["recompute_reason"]}')
        print(f'         rates: {r.get("exact_rates")}; breakdown {r.get("breakdown_ms")}')
PY
}

if has tests; then
  timeout 300 gpu_worker_engine_cuda_test --gtest_brief=1 \
    --gtest_filter='ExactMode*:ExactEngine*:ExactTierOpen*:HybridEquivalence.Offload*' \
    > "$out/tests.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran|fetch share|Skipped' "$out/tests.txt"
  timeout 60 gpu_worker_exact_planner_test --gtest_brief=1 >> "$out/tests.txt" 2>&1
  tail -2 "$out/tests.txt"
  timeout 60 gpu_worker_exact_probe_cuda_test > "$out/probe_test.txt" 2>&1
  grep -E 'probed on|OK|FAILED|PASSED|SKIPPED' "$out/probe_test.txt"
  timeout 60 gpu_worker_exact_step_clock_cuda_test > "$out/step_clock_test.txt" 2>&1
  grep -E 'per step|OK|FAILED|PASSED|SKIPPED' "$out/step_clock_test.txt"
  timeout 120 gpu_worker_exact_recompute_cuda_test --gtest_brief=1 > "$out/recompute_test.txt" 2>&1
  grep -E 'worst|FAILED|PASSED|SKIPPED' "$out/recompute_test.txt"
fi

run_bench() {   # name, then tandem-bench flags
  local name=$1; shift
  timeout 540 tandem-bench --batches 1 --prefill_tokens 0 --offload_steps "$steps" \
    --json "$out/$name.jsonl" "$@" ${BENCH_ARGS:-} > "$out/$name.txt" 2>&1
  echo "== $name (exit $?)"
  grep '"probe"' "$out/$name.txt" | cut -c1-300
  show_plan "$out/$name.jsonl"
}

if has gqa; then
  run_bench gqa128k --contexts 131072 --modes offload,exact
  run_bench gqa128k_nodes --contexts 131072 --modes exact --exact_fetch_share 0
  run_bench gqa128k_pcie --contexts 131072 --modes exact --exact_fetch_share 1
  run_bench gqa512k_offload --contexts 524288 --modes offload
  run_bench gqa512k_exact --contexts 524288 --modes exact
fi

if has gqa512; then
  run_bench gqa512k_offload --contexts 524288 --modes offload
  run_bench gqa512k_exact --contexts 524288 --modes exact
  for share in ${EXACT_SHARES:-}; do
    run_bench "gqa512k_exact_f$share" --contexts 524288 --modes exact --exact_fetch_share "$share"
  done
fi

if has mha; then
  mha="kv_heads=32,ffn=11008,vocab=32000,rope_scaling=none,max_positions=262144"
  run_bench mha --set "$mha" --contexts 32768,65536,131072 --modes offload,exact \
    --exact_recompute off,auto
fi
