#!/usr/bin/env bash
# Runs on the GPU host (through the device tool) the served-path benchmarks of continuous
# batching (issue 12) on a Llama-3-8B geometry with synthetic weights made on the device
# (tandem-gpu-worker --random_weights; the tokenizer is gutenberg-14m's, whose ids fit the
# vocabulary), driven by tandem-load over gRPC:
#   tests   the cuda backend's window-attention and KV-write tests (batched too), the cuda
#           engine tests of the scheduler and the micro-batched runner
#   gpu     gpu mode, 4K prompts: one stream, then a wave of 64 concurrent streams
#   ttft    a short prompt's TTFT idle and while a 32K prompt is prefilled, and the 32K
#           prompt's alone and with them, for each worker configuration in TTFT_CONFIGS:
#           "name:flag,flag ..." entries (default "off:--max_step_ms=0"; e.g.
#           "breaks:--prefill_breaks cap25:--max_step_ms=25"), each on --prefill_chunk
#           TTFT_CHUNK (2048) unless its flags say otherwise; TTFT_SHORT_REQUESTS (6) short
#           requests (closed loop) start TTFT_DELAY_S (1) seconds into the 32K prompt, or with
#           TTFT_RATE, Poisson arrivals at that rate for TTFT_BUSY_S (1) seconds
#   served  8 clients x 16K-token prompts, 256 generated, hybrid, per SERVED_CONFIGS (issue 27's
#           served row: ITL p50 / p99)
#   settle  tandem-bench's TTFT rows of one hybrid (pages) prompt of each SETTLE_CONTEXTS
#           length, then its settle a slice per decode step as a worker does, per
#           SETTLE_CONFIGS ("name:flag,flag ..."): every step's time and where the settle's
#           host time went (page index, download, append to the node)
#   append  tandem-transport-bench's append rows (no attend rows): APPEND_TOKENS (2048) tokens
#           of the 32 layers per call, 1 GiB a row, into never-written blocks and reused ones,
#           per APPEND_CONFIGS ("name:flag,flag ...", default "base:")
#   hybrid  tandem-bench hybrid decode at 64K (8 x 128K of bf16 KV is more than the host
#           holds; page selection, 2048-token budget), batch 1
#           and 8, one pass and two micro-batches (ping-pong) on the same sequences
# Prepared here with the bundle in .carry/tandem.tar.xz and gutenberg-14m's tokenizer in
# .carry/shared/models/gutenberg-14m. PARTS selects (default: all). Logs go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
# BUNDLE: another bundle to run (an A/B of two builds in one call, each with its own OUT).
tar xJf "${BUNDLE:-.carry/tandem.tar.xz}" -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
parts=${PARTS:-tests gpu ttft hybrid}
has() { [[ " $parts " == *" $1 "* ]]; }
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

model=/tmp/llama3-8b
# PRESET: another tandem-geometry preset (qwen3-8b, ...) for every part.
tandem-geometry --preset="${PRESET:-llama3-8b}" --config_only --out="$model" > /dev/null
cp "$TANDEM_SHARED_DIR"/models/gutenberg-14m/tokenizer*.json "$model"/
# The tokenizer's special ids replace Llama-3's (128000/128001 are not in its vocabulary).
python3 - "$model/config.json" "$TANDEM_SHARED_DIR/models/gutenberg-14m/config.json" <<'PY'
import json, sys
config, donor = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for key in ("bos_token_id", "eos_token_id"):
    config[key] = donor.get(key, 0)
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY

# start_worker NAME ARGS...: a worker on a free port; sets $port and $wpid.
start_worker() {
  local name=$1
  shift
  tandem-gpu-worker --model "$model" --random_weights --backend cuda --address 127.0.0.1:0 \
    "$@" > "$out/worker_$name.log" 2>&1 &
  wpid=$!
  port=
  for _ in $(seq 1 240); do
    port=$(awk '/^LISTENING/ {print $2}' "$out/worker_$name.log")
    [[ -n "$port" ]] && return 0
    kill -0 "$wpid" 2>/dev/null || break
    sleep 0.5
  done
  echo "worker $name did not start:"; tail -5 "$out/worker_$name.log"
  return 1
}
stop_worker() { kill "$wpid" 2>/dev/null; wait "$wpid" 2>/dev/null; }
load() {   # load NAME ARGS...
  local name=$1
  shift
  tandem-load --target "127.0.0.1:$port" --json_out "$out/load_$name.json" "$@" \
    > "$out/load_$name.txt" 2>&1
  grep -E '^(Successful|Failed req|Benchmark duration|Output token|All-decoding|Median TTFT|P99 TTFT|Mean ITL|P99 ITL|Median ITL|Mean TPOT)' \
    "$out/load_$name.txt" | sed "s/^/[$name] /"
}

if has tests; then
  timeout 200 backend_cuda_test --gtest_brief=1 --gtest_filter='*Batch*:*WindowAttention*:*WriteKv*' \
    > "$out/backend_tests.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran' "$out/backend_tests.txt"
  timeout 300 gpu_worker_engine_cuda_test --gtest_brief=1 \
    --gtest_filter='Scheduler*:MicroBatch*:HybridEquivalence*:EngineGolden*:PageSelection*' \
    > "$out/tests.txt" 2>&1
  grep -E 'FAILED|PASSED|tests ran' "$out/tests.txt"
fi

if has gpu; then
  if start_worker gpu --mode gpu --prefill_chunk "${GPU_CHUNK:-2048}" --max_batch 64 \
       --max_sessions 128; then
    common=(--prompt_tokens 4096 --output_tokens "${GPU_OUT:-256}" --mode gpu)
    load gpu_c1 --concurrency 1 --num_requests 1 --warmup 1 "${common[@]}"
    load gpu_c64 --concurrency 64 --num_requests 64 --warmup 1 "${common[@]}"
    stop_worker
  fi
fi

if has ttft; then
  # Per worker configuration in TTFT_CONFIGS: the short prompt idle, the 32K prompt alone,
  # then the short prompts while the 32K one is prefilled. Each run of a worker has its own
  # prompts (--load_seed), so none is served from the prefix cache; each worker the same ones.
  for config in ${TTFT_CONFIGS:-off:--max_step_ms=0}; do
    cap=${config%%:*}   # the configuration's name in the logs
    flags=${config#*:}
    seed=${TTFT_SEED:-100}   # every configuration gets the same prompts and arrivals
    # shellcheck disable=SC2086  # the flags split at commas into words
    if start_worker "ttft_$cap" --mode gpu --prefill_chunk "${TTFT_CHUNK:-2048}" --max_batch 64 \
         ${flags//,/ }; then
      short=(--concurrency 1 --prompt_tokens 256 --output_tokens 8 --mode gpu)
      long=(--concurrency 1 --num_requests 1 --prompt_tokens 32768 --output_tokens 4 --mode gpu)
      load "ttft_idle_$cap" --num_requests 6 --warmup 2 --load_seed $((seed += 1)) "${short[@]}"
      load "ttft_long_alone_$cap" --load_seed $((seed += 1)) "${long[@]}"
      seed=$((seed + 1))  # (not inside the backgrounded command: its expansion stays there)
      tandem-load --target "127.0.0.1:$port" --load_seed "$seed" "${long[@]}" \
        --json_out "$out/load_ttft_long_$cap.json" > "$out/load_ttft_long_$cap.txt" 2>&1 &
      lpid=$!
      sleep "${TTFT_DELAY_S:-1}"
      if [[ -n "${TTFT_RATE:-}" ]]; then   # open loop: arrivals only while the 32K prompt runs
        busy=(--request_rate "$TTFT_RATE" --duration_s "${TTFT_BUSY_S:-1}" --concurrency 64)
      else
        busy=(--num_requests "${TTFT_SHORT_REQUESTS:-6}")
      fi
      load "ttft_busy_$cap" --load_seed $((seed += 1)) "${short[@]}" "${busy[@]}"
      wait "$lpid"
      grep -E '^(Median TTFT|Benchmark duration)' "$out/load_ttft_long_$cap.txt" |
        sed "s/^/[ttft_long_$cap] /"
      stop_worker
    fi
  done
fi

if has served; then
  # Issue 27's served row: SERVED_CLIENTS (8) closed-loop clients, two requests each, of
  # SERVED_PROMPT (16384) prompt tokens and SERVED_OUTPUT (256) generated, hybrid mode (pages,
  # a 2048-token budget, a 4096-token window, the embedded CPU node), per worker configuration in
  # SERVED_CONFIGS ("name:flag,flag ...", default "base:--prefill_breaks=false"). The ITL
  # percentiles show what prefill chunks and settle slices do to the decoding requests.
  clients=${SERVED_CLIENTS:-8}
  for config in ${SERVED_CONFIGS:-base:--prefill_breaks=false}; do
    name=${config%%:*}
    flags=${config#*:}
    # shellcheck disable=SC2086  # the flags split at commas into words
    if start_worker "served_$name" --mode hybrid --selection pages --select_tokens 2048 \
         --window 4096 --prefill_chunk "${SERVED_CHUNK:-2048}" --max_batch 64 \
         --embedded_pool_bytes 40GiB ${flags//,/ }; then
      load "served_$name" --concurrency "$clients" --num_requests $((2 * clients)) \
        --prompt_tokens "${SERVED_PROMPT:-16384}" --output_tokens "${SERVED_OUTPUT:-256}" \
        --mode hybrid --load_seed 300
      stop_worker
    fi
  done
fi

if has settle; then
  for config in ${SETTLE_CONFIGS:-base:--page_key_rank=-1}; do
    name=${config%%:*}
    flags=${config#*:}
    # shellcheck disable=SC2086  # the flags split at commas into words
    timeout "${SETTLE_TIMEOUT:-300}" tandem-bench --contexts= --skip_probes --modes hybrid \
      --prefill_contexts "${SETTLE_CONTEXTS:-16384,32768}" --prefill_selections pages \
      --block 16 --window 4096 --prefill_chunk 2048 --prefill_select_tokens 2048 \
      --json "$out/settle_$name.json" ${flags//,/ } > "$out/settle_$name.txt" 2>&1
    grep -A1 '^prefill' "$out/settle_$name.txt" | sed "s/^/[settle_$name] /"
  done
fi

if has append; then
  # APPEND_CONFIGS: "name:flag,flag ..." entries, each a run of the append rows (default one,
  # "base:" with the bench's defaults).
  for config in ${APPEND_CONFIGS:-base:}; do
    name=${config%%:*}
    flags=${config#*:}
    # shellcheck disable=SC2086  # the flags split at commas into words
    tandem-transport-bench --contexts= --append_tokens "${APPEND_TOKENS:-2048}" --append_mib 1024 \
      ${flags//,/ } > "$out/append_$name.txt" 2>&1
    grep '^append' "$out/append_$name.txt" | sed "s/^/[append_$name] /"
  done
fi

if has hybrid; then
  timeout "${HYBRID_TIMEOUT:-240}" tandem-bench --modes hybrid --contexts "${HYBRID_CONTEXT:-65536}" --batches 1,8 \
    --select_tokens "${SELECT_TOKENS:-2048}" --shares= --window 4096 --prefill_tokens 0 \
    --steps 20 --micro_batches 1,2 --json "$out/hybrid.json" > "$out/hybrid.txt" 2>&1
  tail -14 "$out/hybrid.txt"
fi
