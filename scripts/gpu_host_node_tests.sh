#!/usr/bin/env bash
# Issue 24 on the GPU host's CPU (AVX-512 + AMX; through the device tool): the CPU node's test
# executables, natively and with each lesser instruction-set path forced (TANDEM_CPU_ISA=avx2,
# portable) where they have kernel tests, plus the cpu backend's engine tests (gutenberg-14m's
# golden greedy ids with bf16 weights), built here (Debian, AVX2) and run there. Prepared by:
#   mkdir -p /tmp/nbundle/bin && cp build/tests/cpu_attention/cpu_attention_*_test \
#     build/tests/kv_store/*_test build/tests/gpu_worker/engine/gpu_worker_engine_test \
#     build/services/tandem-cpu-attention /tmp/nbundle/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/nbundle .carry/tandem.tar.xz
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models .carry/shared/data/gutenberg-eval
#   cp -r ../shared/models/gutenberg-14m ../shared/models/stories260k .carry/shared/models/
#   cp ../shared/data/gutenberg-eval/{10101,10146,10315,10321,10533,10576,10633,10659,10675,\
#     10717,10840,10978}.txt .carry/shared/data/gutenberg-eval/   # golden.json's eval books
#   mkdir -p .carry/lib && cp -L build/lib/* .carry/lib/   # SentencePiece, loaded at run time
# and run with carry [".carry"]. Prints each executable's GoogleTest summary; logs under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
export LD_LIBRARY_PATH="$PWD/.carry/lib:$LD_LIBRARY_PATH"
# The node tests start tandem-cpu-attention from the build tree's path compiled into them.
mkdir -p build/services && ln -sf /tmp/tandem/bin/tandem-cpu-attention build/services/
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  lscpu | grep -E 'Model name|^CPU\(s\)'
  echo "flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} 2>&1 | tee "$out/host.txt"
run() {   # run LOG ENV... BINARY: one executable; prints its summary lines
  local log=$1
  shift
  env "$@" --gtest_brief=1 > "$out/$log.log" 2>&1
  echo "[$log] exit $? | $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$log.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$log.log" | head -5
}
for t in /tmp/tandem/bin/*_test; do
  name=$(basename "$t")
  run "$name" "$t"
  case $name in
    cpu_attention_kernel_test|cpu_attention_int8_test|cpu_attention_paged_test)
      run "${name}_avx2" TANDEM_CPU_ISA=avx2 "$t"
      run "${name}_portable" TANDEM_CPU_ISA=portable "$t" ;;
  esac
done
