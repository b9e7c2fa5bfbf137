#!/usr/bin/env bash
# Issue 25 on the GPU host (through the device tool): a 3-turn OpenAI chat over a ~32K-token
# document through tandem-gateway (bench/chat_turns.py: chat completions with the history
# resent, and the Responses API with previous_response_id), per worker mode. Llama-3-8B geometry
# with random weights and gutenberg-14m's 4096-token vocabulary (tandem-gpu-worker
# --random_weights; its tokenizer, so the document is real text and every token has text); the gateway renders tests/gateway/openai/chatml.jinja. Prepared here by:
#   cmake --build build --target tandem-gpu-worker tandem-gateway tandem-geometry
#   mkdir -p /tmp/cbundle/bin && cp build/services/{tandem-gpu-worker,tandem-gateway,tandem-geometry} \
#     /tmp/cbundle/bin/
#   ../shared/tools/gpu-bundle.sh /tmp/cbundle .carry/tandem.tar.xz build/lib
#   git rev-parse HEAD > .carry/commit
#   mkdir -p .carry/shared/models .carry/shared/data
#   cp -r ../shared/models/gutenberg-14m .carry/shared/models/
#   cp ../shared/data/gutenberg-eval/{10101,10146}.txt .carry/shared/data/
# and run with carry [".carry"]. MODES (default "gpu hybrid"), DOC_CHARS (default 110000, about
# 32K tokens with this tokenizer). Logs go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
shared=$PWD/.carry/shared
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GB"
} 2>&1 | tee "$out/host.txt"

model=/tmp/llama3-8b
tandem-geometry --preset=llama3-8b --config_only --out="$model" > /dev/null
cp "$shared"/models/gutenberg-14m/tokenizer*.json "$model"/
python3 - "$model/config.json" "$shared/models/gutenberg-14m/config.json" <<'PY'
import json, sys
config, donor = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
# The tokenizer's vocabulary, so every sampled id has text (a streamed delta to time).
for key in ("bos_token_id", "eos_token_id", "vocab_size"):
    config[key] = donor.get(key, 0)
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY

wait_listening() {   # wait_listening LOG PID: prints the port
  for _ in $(seq 1 240); do
    local p
    p=$(awk '/^LISTENING/ {print $2}' "$1")
    [[ -n "$p" ]] && { echo "$p"; return 0; }
    kill -0 "$2" 2>/dev/null || break
    sleep 0.5
  done
  tail -5 "$1" >&2
  return 1
}

for mode in ${MODES:-gpu hybrid}; do
  wargs=(--mode "$mode")
  [[ $mode == hybrid ]] && wargs+=(--window 4096 --selection pages --embedded_pool_bytes 16GiB)
  tandem-gpu-worker --model "$model" --random_weights --backend cuda --address 127.0.0.1:0 \
    --prefill_chunk 4096 --log_level warn "${wargs[@]}" > "$out/worker_$mode.log" 2>&1 &
  wpid=$!
  wport=$(wait_listening "$out/worker_$mode.log" "$wpid") || { echo "worker $mode: no start"; continue; }
  tandem-gateway --workers "127.0.0.1:$wport" --address 127.0.0.1:0 --log_level warn \
    --chat_template tests/gateway/openai/chatml.jinja > "$out/gateway_$mode.log" 2>&1 &
  gpid=$!
  gport=$(wait_listening "$out/gateway_$mode.log" "$gpid") || { echo "gateway: no start"; kill "$wpid"; continue; }
  echo "[$mode]"
  python3 bench/chat_turns.py --port "$gport" --doc "$shared/data/10101.txt" \
    --doc "$shared/data/10146.txt" --doc_chars "${DOC_CHARS:-110000}" 2>&1 | tee "$out/chat_$mode.txt"
  kill "$gpid" "$wpid"; wait "$gpid" "$wpid" 2>/dev/null
done
