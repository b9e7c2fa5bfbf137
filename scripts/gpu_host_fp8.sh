#!/usr/bin/env bash
# Issue 30 item 2 on the GPU host (through the device tool): the cuda tests of the FP8 path (the
# FP8 MatMul, an FP8 checkpoint against its dequantization, random FP8 models written == created),
# tandem-kernel-bench's FP8 sweep (GEMV variants and the FP8 GEMM against bf16 cuBLAS on the 8B
# and 70B projection shapes), then decode and prefill of FP8 against bf16 projections (Llama-3-8B
# geometry, gpu mode), then the Llama-3.1-70B geometry with FP8 projections. Prepared here by:
#   mkdir -p /tmp/f8/bin && cp build/tests/gpu_worker/backend_cuda/backend_cuda_test \
#     build/tests/gpu_worker/model/gpu_worker_fp8_checkpoint_cuda_test \
#     build/tests/gpu_worker/model/gpu_worker_rope_reference_cuda_test \
#     build/tests/gpu_worker/geometry/gpu_worker_random_model_cuda_test \
#     build/bench/tandem-bench build/bench/tandem-kernel-bench /tmp/f8/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/f8 .carry/tandem.tar.xz && git rev-parse HEAD > .carry/commit
# (and for the ppl part tandem-ppl-bench, with shared/models/gutenberg-14m and
# shared/data/gutenberg-eval copied under .carry/shared/) and run with carry [".carry"]. PARTS
# (default "tests sweep 8b 70b"; "ppl" adds the perplexity runs) picks the parts; BENCH_70B
# the 70B runs' extra flags. Each part's output goes to its own file under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
parts=${PARTS:-tests sweep 8b 70b}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_ROPE_FIXTURES_DIR=$PWD/tests/gpu_worker/model/rope_fixtures
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [[ " $parts " == *" tests "* ]]; then
    backend_cuda_test > "$out/backend_test.txt" 2>&1
    grep -E '^\[  (PASSED|FAILED)|Failure' "$out/backend_test.txt" | tail -12
    for t in gpu_worker_fp8_checkpoint_cuda_test gpu_worker_fp8_quantize_at_load_cuda_test \
      gpu_worker_plan_quantization_cuda_test; do
      $t 2>&1 | grep -E 'PASSED|FAILED|Failure|Expected|Which' | tail -8
    done
    gpu_worker_rope_reference_cuda_test 2>&1 | grep -E '^\[  (PASSED|FAILED)' | tail -4
    gpu_worker_random_model_cuda_test 2>&1 | grep -E '^\[  (PASSED|FAILED)|Failure' | tail -6
  fi
  if [[ " $parts " == *" sweep "* ]]; then
    tandem-kernel-bench --gemv=false --prefill=false --page_selection=false --decode_windows= \
      --gemv_shapes=6144x4096,4096x4096,28672x4096,4096x14336,10240x8192,8192x8192,57344x8192,8192x28672 \
      --gemv_fp8_rows=1,2,4,8,64,1024 2>&1 | grep -v '^{' > "$out/sweep.txt"
    grep -E 'default|bf16-cublas' "$out/sweep.txt" | grep -E ' m +(1|4|1024) '
  fi
  if [[ " $parts " == *" ppl "* ]]; then
    # A real model's perplexity with FP8 projections: token by token (the GEMV, bf16
    # activations) and in 512-token chunks (the FP8 GEMM, per-token e4m3 activations).
    for chunk in 1 512; do
      for q in none fp8; do
        echo "== gutenberg-14m perplexity, chunk $chunk, quantization=$q"
        tandem-ppl-bench --model .carry/shared/models/gutenberg-14m \
          --books .carry/shared/data/gutenberg-eval --max_books 3 --tokens 8192 \
          --chunk "$chunk" --betas= --backend cuda --quantization "$q" 2>&1 | grep -E '^full'
      done
    done
  fi
  if [[ " $parts " == *" 8b "* ]]; then
    for q in none fp8; do
      echo "== llama3-8b quantization=$q, gpu mode"
      tandem-bench --preset llama3-8b --set "quantization=$q" --contexts 32768 --batches 1,8 \
        --modes gpu --prefill_tokens 32768 --steps 20 --skip_probes 2>&1 | tail -5
    done
  fi
  if [[ " $parts " == *" 70b "* ]]; then
    echo "== llama3-70b quantization=fp8, gpu mode"
    tandem-bench --preset llama3-70b --set quantization=fp8 --contexts 32768 --batches 1 \
      --modes gpu --prefill_tokens 32768 --steps 10 --skip_probes 2>&1 | tail -5
    echo "== llama3-70b quantization=fp8, hybrid, int8 node KV"
    tandem-bench --preset llama3-70b --set quantization=fp8 --contexts ${CONTEXTS_70B:-131072} \
      --batches 1 --modes hybrid --shares= --select_tokens 2048 --window 4096 \
      --prefill_tokens 0 --steps 10 --node_kv_dtype int8 ${BENCH_70B:-} 2>&1 | tail -6
  fi
} 2>&1 | tee "$out/fp8.txt"
