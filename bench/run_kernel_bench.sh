#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the window-attention kernel benchmark and torch
# SDPA on the same prefill shapes, and prints one comparison table. Prepared here by:
#   cmake -S . -B build-kb -G Ninja -DTANDEM_ENABLE_CUDA=ON -DTANDEM_CUDA_ARCHS=90
#   ninja -C build-kb tandem-kernel-bench backend_cuda_test
#   ../shared/tools/gpu-bundle.sh build-kb .carry/kb/kb.tar.xz; git rev-parse HEAD > .carry/kb/commit
# (or, from the shared build: copy those executables to a folder of their own, bin/, and bundle
# that folder; issue 15's run used .carry/h2/tandem.tar.xz)
# then, there:   bash bench/run_kernel_bench.sh [.carry/kb/kb.tar.xz]
# Logs and JSON lines go under $OUT (or /tmp/out). SKIP_TESTS=1 skips backend_cuda_test;
# KB_ARGS passes flags to tandem-kernel-bench, SDPA_ARGS to sdpa_reference.py.
set -uo pipefail
bundle=${1:-.carry/kb/kb.tar.xz}
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem-kb
tar xJf "$bundle" -C /tmp/tandem-kb && source /tmp/tandem-kb/env.sh || exit 1
{
  echo "commit: $(cat "$(dirname "$bundle")/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
} 2>&1 | tee "$out/host.txt"
if command -v cuobjdump > /dev/null; then  # instruction mix of the attention kernels
  cuobjdump -sass "$(command -v tandem-kernel-bench)" > "$out/sass.txt" 2>&1
  awk '/Function :/{f=$3} /HMMA/{h[f]++} /LDSM/{l[f]++} /LDGSTS/{c[f]++} /LDL|STL/{s[f]++}
       END{for (f in h) printf "sass %s: HMMA %d LDSM %d LDGSTS %d local %d\n",
       substr(f, index(f, "Kernel") - 20, 60),
       h[f], l[f], c[f], s[f]}' "$out/sass.txt"
fi
tandem-kernel-bench ${KB_ARGS:-} > "$out/kernel_bench.txt" 2> "$out/kernel_bench.err"
echo "tandem-kernel-bench exit $?"; tail -3 "$out/kernel_bench.err"
PYTHONUNBUFFERED=1 python3 bench/sdpa_reference.py ${SDPA_ARGS:-} > "$out/sdpa.txt" \
  2> "$out/sdpa.err"
echo "sdpa_reference exit $?"; grep -v Warning "$out/sdpa.err" | tail -3
if [ -z "${SKIP_TESTS:-}" ]; then  # after the timings, so a slow or failing test cannot cost them
  timeout "${TEST_TIMEOUT:-300}" backend_cuda_test --gtest_brief=1 > "$out/backend_cuda_test.txt" 2>&1
  echo "backend_cuda_test exit $?"
  grep -E '^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran' "$out/backend_cuda_test.txt" | tail -12
fi
python3 - "$out/kernel_bench.txt" "$out/sdpa.txt" <<'EOF'
import json, sys
ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
sdpa = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
copy = next((r for r in ours if r["bench"] == "copy"), None)
env = next((r for r in sdpa if r["bench"] == "sdpa_env"), {})
print(f"\ndevice {copy['device'] if copy else '?'}; torch {env.get('torch', '?')}")
if copy:
    print(f"D2D copy bandwidth (read + write): {copy['gbps']:.0f} GB/s")
print("\nDecode window attention (Hq 32, Hkv 8, D 128, bf16 cache)")
print(f"{'window':>7} {'tokens':>6} {'maw':>4} {'us':>9} {'GB/s':>7} {'%copy':>6} "
      f"{'backend us':>10} {'splits':>6}")
for r in ours:
    if r["bench"] == "decode":
        print(f"{r['window']:>7} {r['tokens']:>6} {'on' if r['maw'] else 'off':>4} "
              f"{r['us']:>9.1f} {r['gbps']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{r['backend_us']:>10.1f} {r['splits']:>6}")
print("\nPrefill attention, TFLOPS = 4*Hq*D*(visible pairs)/time. ours: the backend's plan (the "
      "fast kernel, bf16 q and p, default warp layout); flash0/1: its two warp layouts; exact: "
      "the hi+lo split kernel (f32-accurate). SDPA: torch's default choice and the best of its "
      "backends. o/lse err: the fast kernel (default layout) against the exact kernel, max abs.")
print(f"{'chunk':>6} {'prefix':>6} {'ours ms':>8} {'ours TF':>8} {'sdpa TF':>8} {'ratio':>6} "
      f"{'best TF':>8} {'ratio':>6} {'flash0':>7} {'flash1':>7} {'exact':>7} {'o err':>8} "
      f"{'lse err':>8}  best backend")
for r in ours:
    if r["bench"] != "prefill":
        continue
    cands = [s for s in sdpa if s["bench"] == "sdpa" and s["chunk"] == r["chunk"]
             and s["prefix"] == r["prefix"] and "tflops" in s]
    fd = f"flash{r.get('flash_default', 0)}"
    extra = (f"{r.get('flash0_tflops', 0):>7.1f} {r.get('flash1_tflops', 0):>7.1f} "
             f"{r.get('exact_tflops', 0):>7.1f} {r.get(fd + '_o_max_abs', -1):>8.1e} "
             f"{r.get(fd + '_lse_max_abs', -1):>8.1e}")
    if not cands:
        print(f"{r['chunk']:>6} {r['prefix']:>6} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
              f"{'-':>8} {'-':>6} {'-':>8} {'-':>6} {extra}  (no sdpa)")
        continue
    best = max(cands, key=lambda s: s["tflops"])
    default = next((s for s in cands if s["backend"] == "default"), best)
    print(f"{r['chunk']:>6} {r['prefix']:>6} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
          f"{default['tflops']:>8.1f} {r['tflops'] / default['tflops']:>6.2f} "
          f"{best['tflops']:>8.1f} {r['tflops'] / best['tflops']:>6.2f} {extra}  "
          f"{best['backend']}/{best['gqa']}/{best['mask']}")
EOF
