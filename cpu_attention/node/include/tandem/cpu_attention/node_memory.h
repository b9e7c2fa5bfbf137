// What a CPU attention node charges to its pool (--pool_bytes) for a session besides its KV
// blocks, for those who size a node from outside (the GPU worker's memory estimator,
// gpu_worker/serving/memory_plan.h). KV blocks are kv_store::BlockFormat::block_bytes() each.
#pragma once

#include <cstdint>

namespace tandem::cpu_attention {

// Bytes charged at OpenSession for a session of `num_layers` layers owning `num_shards`
// (layer, kv head) shards on the node: its bookkeeping (session_owners.cc: measured).
uint64_t SessionMetadataBytes(uint64_t num_layers, uint64_t num_shards);

}  // namespace tandem::cpu_attention
