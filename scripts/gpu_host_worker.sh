#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the GPU worker's checks with the cuda backend:
# the cuda kernels against the cpu backend, the engine goldens and hybrid == gpu (label gpu),
# a generation, and the hybrid perplexity benchmark. Prepared here by:
#   cmake -S . -B build -G Ninja -DTANDEM_CUDA_ARCHS=90 && ninja -C build
#   cp -L /lib/x86_64-linux-gnu/libsentencepiece.so.0 build/lib/   # see below
#   ../shared/tools/gpu-bundle.sh build .carry/tandem.tar.xz build/lib
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models .carry/shared/data
#   cp -r ../shared/models/{stories260k,gutenberg-14m} .carry/shared/models/
#   cp -r ../shared/data/gutenberg-eval .carry/shared/data/
# build/lib carries libtandem_sentencepiece.so, which the tokenizer loads at run time (so the
# bundler's ldd does not see it), and it needs Debian's libsentencepiece.so.0 beside it: the
# GPU host's own (Ubuntu's) has another ABI and crashes in SentencePieceProcessor::Normalize
# (seen as a segfault in DevicePrefill.* of the engine suite).
# Logs go under $OUT (or /tmp/out). PPL_CHUNK / PPL_BETAS / SKIP_PPL tune the benchmark part.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores"
} 2>&1 | tee "$out/host.txt"
backend_cuda_test --gtest_brief=1 > "$out/backend_cuda_test.txt" 2>&1
tail -3 "$out/backend_cuda_test.txt"
gpu_worker_engine_cuda_test > "$out/engine_cuda_test.txt" 2>&1
grep -E '^\[ +(OK|FAILED|PASSED|SKIPPED) +\]|perplexity|worst' "$out/engine_cuda_test.txt"
tandem generate --model .carry/shared/models/stories260k --backend cuda \
  --prompt "Once upon a time" --max-tokens 200 --mode hybrid --beta 1 --window 64 --sink 4 \
  > "$out/generate.txt" 2>&1
tail -3 "$out/generate.txt"
if [ -z "${SKIP_PPL:-}" ]; then
  tandem-ppl-bench --model .carry/shared/models/gutenberg-14m \
    --books .carry/shared/data/gutenberg-eval --tokens 8192 --window 512 --sink 4 \
    --betas "${PPL_BETAS:-0.5,1,2}" --chunk "${PPL_CHUNK:-1}" --backend cuda \
    2>&1 | tee "$out/ppl_bench.txt"
fi
