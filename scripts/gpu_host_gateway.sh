#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the issue-13 checks that need a GPU:
#   rope     transformers' reference logits of the tiny yarn/dynamic fixtures
#            (tests/gpu_worker/model/rope_reference.py reference; written to $OUT/rope and put
#            in place of the fixtures' reference.json), then the cuda rope tests against them,
#            and the cuda engine's logprobs / EOS / chat-info tests
#   gateway  tandem-gateway's overhead: the same greedy requests to a cuda worker (gpu mode),
#            directly over gRPC and through the gateway (HTTP SSE), with tandem-gateway-bench,
#            for two models: a Llama-3-8B geometry with synthetic weights and gutenberg-14m's
#            4096-token vocabulary and tokenizer (so every generated id has text, as with a
#            real model: a chunk is streamed per token), and gutenberg-14m itself (real weights,
#            ~1 ms steps: where a per-token overhead would show most)
# Prepared here with the bundle in .carry/tandem.tar.xz and gutenberg-14m's tokenizer in
# .carry/shared/models/gutenberg-14m. PARTS selects (default: all). Logs go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
parts=${PARTS:-rope gateway}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

if has rope; then
  fixtures=tests/gpu_worker/model/rope_fixtures
  mkdir -p "$out/rope"
  python3 tests/gpu_worker/model/rope_reference.py reference "$fixtures" "$out/rope" \
    > "$out/rope_reference.txt" 2>&1
  echo "rope reference: exit $?"; tail -3 "$out/rope_reference.txt"
  for m in "$fixtures"/*/; do
    m=$(basename "$m")
    [[ -f "$out/rope/$m.json" ]] && cp "$out/rope/$m.json" "$fixtures/$m/reference.json"
  done
  # The tests were built with the fixtures' path of the build machine compiled in.
  compiled=$(strings "$(command -v gpu_worker_rope_reference_cuda_test)" |
             grep -m1 'rope_fixtures$' || true)
  if [[ -n "$compiled" && ! -e "$compiled" ]]; then
    mkdir -p "$(dirname "$compiled")" && ln -s "$PWD/$fixtures" "$compiled"
  fi
  timeout 120 gpu_worker_rope_reference_cuda_test --gtest_brief=1 > "$out/rope_cuda.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran|Skipped' "$out/rope_cuda.txt"
  timeout 120 backend_cuda_test --gtest_brief=1 --gtest_filter='*Rope*' \
    > "$out/backend_rope.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran' "$out/backend_rope.txt"
  timeout 200 gpu_worker_engine_cuda_test --gtest_brief=1 \
    --gtest_filter='*Logprob*:EosChat*:EngineGolden*' > "$out/engine_cuda.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran' "$out/engine_cuda.txt"
fi

if has gateway; then
  model=/tmp/llama3-8b
  tandem-geometry --preset=llama3-8b --set=vocab=4096 --config_only --out="$model" > /dev/null
  cp "$TANDEM_SHARED_DIR"/models/gutenberg-14m/tokenizer*.json "$model"/
  python3 - "$model/config.json" "$TANDEM_SHARED_DIR/models/gutenberg-14m/config.json" <<'PY'
import json, sys
config, donor = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for key in ("bos_token_id", "eos_token_id"):
    config[key] = donor.get(key, 0)
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY
  # start NAME CMD...: sets $port from the process's LISTENING line.
  pids=()
  start() {
    local name=$1
    shift
    "$@" > "$out/$name.log" 2>&1 &
    pids+=($!)
    port=
    for _ in $(seq 1 480); do
      port=$(awk '/^LISTENING/ {print $2}' "$out/$name.log")
      [[ -n "$port" ]] && return 0
      sleep 0.25
    done
    echo "$name did not start:"; tail -5 "$out/$name.log"
    return 1
  }
  bench() {   # bench NAME MODEL_DIR [worker flags]: one worker + gateway, both paths
    local name=$1 dir=$2
    shift 2
    if start "worker_$name" tandem-gpu-worker --model "$dir" --backend cuda --mode gpu \
         --address 127.0.0.1:0 --max_batch 64 --log_level warn "$@"; then
      local worker_port=$port
      if start "gateway_$name" tandem-gateway --workers "127.0.0.1:$worker_port" \
           --address 127.0.0.1:0 --log_level warn; then
        echo "== $name"
        timeout 240 tandem-gateway-bench --worker "127.0.0.1:$worker_port" \
          --gateway "127.0.0.1:$port" --concurrency "${CONCURRENCY:-1,8}" \
          --num_requests "${REQUESTS:-16}" --warmup 2 --prompt_tokens "${PROMPT:-1024}" \
          --output_tokens "${OUTPUT:-128}" 2>&1 | tee "$out/gateway_$name.txt"
      fi
    fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    pids=()
  }
  bench llama3-8b "$model" --random_weights
  bench gutenberg-14m "$TANDEM_SHARED_DIR/models/gutenberg-14m"
fi
