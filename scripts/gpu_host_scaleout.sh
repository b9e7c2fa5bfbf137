#!/usr/bin/env bash
# Issue 5's benchmark on the GPU host (through the device tool): hybrid decode of Llama-3-8B
# geometry with 1, 2 and 4 tandem-cpu-attention processes, each pinned to its own cores
# (taskset) with its own memory limit (--pool_bytes), under per-head selection shares skewed as
# HGCA reports (log-uniform 0.5%..30%), for uniform and balanced shard placement.
# Prepared here by:
#   ninja -C build-gpu tandem-bench tandem-cpu-attention
#   ../shared/tools/gpu-bundle.sh build-gpu .carry/tandem.tar.xz build-gpu/lib
#   git rev-parse HEAD > .carry/commit
# Env: NODES ("1 2 4"), CONTEXTS ("131072 524288"), CORES_PER_NODE (3), POOL (28GiB per node),
# SKEW (0.005:0.3), BENCH_ARGS (extra tandem-bench flags). The bench process (the GPU worker
# side) runs on the cores after the nodes'. Logs and JSON go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/tandem
tar xJf .carry/tandem.tar.xz -C /tmp/tandem && source /tmp/tandem/env.sh
{
  echo "commit: $(cat .carry/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GB RAM"
} 2>&1 | tee "$out/host.txt"
cores_per_node=${CORES_PER_NODE:-3}
pool=${POOL:-28GiB}
skew=${SKEW:-0.005:0.3}
pids=()
stop_nodes() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
trap stop_nodes EXIT
for n in ${NODES:-1 2 4}; do
  addresses=()
  for ((i = 0; i < n; i++)); do
    first=$((i * cores_per_node))
    port=$((50700 + i))
    taskset -c "$first-$((first + cores_per_node - 1))" tandem-cpu-attention \
      --address=127.0.0.1:$port --threads=$cores_per_node --pool_bytes=$pool \
      --block_tokens=64 --log_level=warn > "$out/node${n}_$i.log" 2>&1 &
    pids+=($!)
    addresses+=(127.0.0.1:$port)
  done
  sleep 2
  worker_cores="$((n * cores_per_node))-$(($(nproc) - 1))"
  for ctx in ${CONTEXTS:-131072 524288}; do
    tag="n${n}_${ctx}"
    taskset -c "$worker_cores" tandem-bench --contexts "$ctx" --batches 1 --modes hybrid \
      --shares 0.1 --head_skew "$skew" --placements uniform,balanced \
      --cpu_nodes "$(IFS=,; echo "${addresses[*]}")" --prefill_tokens 0 --steps 10 \
      --warmup 2 --settle_steps 3 --node_threads "$cores_per_node" --skip_probes \
      --json "$out/scaleout_$tag.jsonl" ${BENCH_ARGS:-} > "$out/scaleout_$tag.txt" 2>&1
    echo "== $n node(s) x $cores_per_node cores, pool $pool each, context $ctx"
    grep '"probe"' "$out/scaleout_$tag.txt" | head -1
    grep -o '"placement":"[a-z]*"\|"migration_s":[0-9.e-]*\|"shards_migrated":[0-9]*\|"modelled_cpu_ms":[0-9.e-]*\|"nodes_in_use":[0-9]*\|"breakdown_ms":{[^}]*}' \
      "$out/scaleout_$tag.jsonl" | paste -sd' ' | sed 's/"placement"/\n"placement"/g'
    echo
    sed -n '/^mode /,$p' "$out/scaleout_$tag.txt"
  done
  stop_nodes
done
