#!/usr/bin/env bash
# Issue 25 on the GPU host (through the device tool): the prefix cache's TTFT. A long prompt
# (a "document" of --shared_prefix_tokens random ids + a 64-token question), then the same
# document with other questions, per mode, Llama-3-8B geometry with random weights
# (tandem-gpu-worker --random_weights; the tokenizer is gutenberg-14m's), driven by tandem-load
# over gRPC. Prepared here by:
#   cmake --build build --target tandem-gpu-worker tandem-load tandem-geometry
#   mkdir -p /tmp/pbundle/bin && cp build/services/tandem-gpu-worker build/bench/tandem-load \
#     build/services/tandem-geometry /tmp/pbundle/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/pbundle .carry/tandem.tar.xz build/lib
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models && cp -r ../shared/models/gutenberg-14m .carry/shared/models/
# and run with carry [".carry"]. CONTEXTS (default 131000: with the 64-token question and 8
# generated tokens, the model's 131072) are the document lengths; MODES
# (default "gpu hybrid") the worker modes; QA=1 adds the document-QA load (32 clients, 4
# documents of QA_TOKENS, 4 questions each) per mode of QA_MODES (default gpu) with the cache
# on and off (QA_CACHE, default "true false"); CONTEXTS="" skips the TTFT rows. PARK=1 adds
# the parking rows: per mode of PARK_MODES (default gpu) and document length of PARK_TOKENS
# (default 32768), a device KV budget for about two documents (PARK_KV_BYTES, default 2.5
# documents' KV), four documents read one after another and the first read again (parked in
# host memory by then, or closed with --prefix_cache_host_bytes=0), then the round-robin load
# of PARK_DOCS (default 6) documents under that budget with parking on and off (PARK_HOSTS,
# default "auto 0", the --prefix_cache_host_bytes values). Logs go under
# $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
export TANDEM_SHARED_DIR=$PWD/.carry/shared
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

model=/tmp/llama3-8b
tandem-geometry --preset=llama3-8b --config_only --out="$model" > /dev/null
cp "$TANDEM_SHARED_DIR"/models/gutenberg-14m/tokenizer*.json "$model"/
max_tokens=0
for t in ${CONTEXTS:-131000}; do (( t + 72 > max_tokens )) && max_tokens=$(( t + 72 )); done
python3 - "$model/config.json" "$TANDEM_SHARED_DIR/models/gutenberg-14m/config.json" \
  "$max_tokens" <<'PY'
import json, sys
config, donor = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for key in ("bos_token_id", "eos_token_id"):
    config[key] = donor.get(key, 0)
# Documents longer than Llama-3-8B's 128K: a longer position range (timing only; the weights
# are random anyway).
config["max_position_embeddings"] = max(config["max_position_embeddings"], int(sys.argv[3]))
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY

start_worker() {   # start_worker NAME ARGS...: sets $port and $wpid
  local name=$1
  shift
  tandem-gpu-worker --model "$model" --random_weights --backend cuda --address 127.0.0.1:0 \
    --prefill_chunk 4096 --log_level warn "$@" > "$out/worker_$name.log" 2>&1 &
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
ask() {   # ask NAME SEED TOKENS ARGS...: one request: the document + question SEED
  local name=$1 seed=$2 tokens=$3
  shift 3
  tandem-load --target "127.0.0.1:$port" --concurrency 1 --num_requests 1 --progress_s 0 \
    --shared_prefix_tokens "$tokens" --prompt_tokens 64 --output_tokens 8 --load_seed "$seed" \
    "$@" > "$out/load_$name.txt" 2>&1
  echo "[$name] $(grep -E 'Median TTFT' "$out/load_$name.txt" | tr -s ' ') |" \
       "$(grep -E 'Cached input' "$out/load_$name.txt" | tr -s ' ')"
}

for mode in ${MODES:-gpu hybrid}; do
  for tokens in ${CONTEXTS-131000}; do
    args=(--mode "$mode")
    wargs=(--mode "$mode")
    if [[ $mode == hybrid ]]; then
      # 128 KiB of bf16 KV per token (32 layers x 8 kv heads x 128 x K,V), plus room.
      wargs+=(--window 4096 --selection pages --embedded_pool_bytes "$(( tokens / 8192 + 8 ))GiB")
    fi
    start_worker "${mode}_$tokens" "${wargs[@]}" || continue
    ask "${mode}_${tokens}_cold" 1 "$tokens" "${args[@]}"
    ask "${mode}_${tokens}_hit1" 2 "$tokens" "${args[@]}"
    ask "${mode}_${tokens}_hit2" 3 "$tokens" "${args[@]}"
    grep -E 'Failed|error' "$out/load_${mode}_${tokens}_cold.txt" | head -3
    stop_worker
  done
done

if [[ ${QA:-0} == 1 ]]; then
  for mode in ${QA_MODES:-gpu}; do
    for cache in ${QA_CACHE:-true false}; do
      # A device KV budget makes requests beyond it wait instead of failing the allocation.
      wargs=(--mode "$mode" --prefix_cache="$cache" --max_batch 64
             --kv_cache_bytes "${QA_KV_BYTES:-80GiB}")
      # Node memory for the 4 documents (forks share their blocks) and the misses' copies.
      [[ $mode == hybrid ]] && wargs+=(--window 4096 --selection pages --embedded_pool_bytes 48GiB)
      start_worker "qa_${mode}_$cache" "${wargs[@]}" || continue
      tandem-load --target "127.0.0.1:$port" --concurrency 32 --num_requests 128 --progress_s 0 \
        --shared_prefix_tokens "${QA_TOKENS:-32768}" --shared_prefixes 4 --prompt_tokens 64 \
        --output_tokens 32 --mode "$mode" --json_out "$out/qa_${mode}_$cache.json" \
        > "$out/qa_${mode}_$cache.txt" 2>&1
      echo "[qa mode=$mode cache=$cache]"
      grep -E 'Successful|Failed req|duration|Request throughput|Median TTFT|P99 TTFT|Cached input' \
        "$out/qa_${mode}_$cache.txt"
      stop_worker
    done
  done
fi

if [[ ${PARK:-0} == 1 ]]; then
  for mode in ${PARK_MODES:-gpu}; do
    for tokens in ${PARK_TOKENS:-32768}; do
      # One document's device KV: gpu mode all of it (128 KiB of bf16 K+V per token for this
      # geometry, + MAW and the 72-token tail); hybrid its 4096-token window and summaries.
      per_doc=$(( (tokens + 1024) * 132 * 1024 ))
      wargs=(--mode "$mode" --max_batch 8)
      if [[ $mode == hybrid ]]; then
        per_doc=$(( (4096 + 4096 + 1024) * 132 * 1024 + tokens * 8 * 1024 ))
        wargs+=(--window 4096 --selection pages --embedded_pool_bytes "$(( tokens / 2048 + 8 ))GiB")
      fi
      budget=${PARK_KV_BYTES:-$(( per_doc * 5 / 2 ))}
      for host in ${PARK_HOSTS:-auto 0}; do
        name="park_${mode}_${tokens}_host$host"
        start_worker "$name" "${wargs[@]}" --kv_cache_bytes "$budget" \
          --prefix_cache_host_bytes "$host" || continue
        for doc in 1 2 3 4; do
          ask "${name}_doc$doc" 1 "$tokens" --mode "$mode" --shared_prefix_seed "$doc"
        done
        ask "${name}_doc1_again" 2 "$tokens" --mode "$mode" --shared_prefix_seed 1
        ask "${name}_doc1_third" 3 "$tokens" --mode "$mode" --shared_prefix_seed 1
        # Parked too, now with the pool pinned: the steady state's unpark (and park of another).
        ask "${name}_doc2_again" 2 "$tokens" --mode "$mode" --shared_prefix_seed 2
        tandem-load --target "127.0.0.1:$port" --concurrency 4 --num_requests 48 --progress_s 0 \
          --shared_prefix_tokens "$tokens" --shared_prefixes "${PARK_DOCS:-6}" \
          --shared_prefix_seed 7 --prompt_tokens 64 --output_tokens 8 --mode "$mode" \
          > "$out/${name}_load.txt" 2>&1
        echo "[$name load, ${PARK_DOCS:-6} documents round robin, budget $budget]"
        grep -E 'Successful|Failed req|Request throughput|Median TTFT|P99 TTFT|Cached input' \
          "$out/${name}_load.txt"
        grep -iE 'parked|prefix cache' "$out/worker_$name.log" | head -3
        stop_worker
      done
    done
  done
fi
