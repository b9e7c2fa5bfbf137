// Builders shared by the shard-migration tests: ShardId lists, ReshardSession and ExportShard
// requests, and the AppendKv message that imports one ExportShard chunk with its flags.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::testing {

using ShardList = std::vector<std::pair<uint32_t, uint32_t>>;  // (layer, kv_head)

inline void AddShards(const ShardList& shards,
                      google::protobuf::RepeatedPtrField<v1::ShardId>* dst) {
  for (const auto& [layer, head] : shards) {
    v1::ShardId* id = dst->Add();
    id->set_layer(layer);
    id->set_kv_head(head);
  }
}

inline v1::ReshardSessionRequest ReshardRequest(const std::string& session, const ShardList& add,
                                                const ShardList& drop) {
  v1::ReshardSessionRequest r;
  r.set_session_id(session);
  AddShards(add, r.mutable_add());
  AddShards(drop, r.mutable_drop());
  return r;
}

inline v1::ExportShardRequest ExportRequest(const std::string& session, uint32_t layer,
                                            uint32_t head, uint64_t from = 0, uint64_t to = 0,
                                            uint32_t max_chunk_entries = 0) {
  v1::ExportShardRequest r;
  r.set_session_id(session);
  r.mutable_shard()->set_layer(layer);
  r.mutable_shard()->set_kv_head(head);
  r.set_from_entry(from);
  r.set_to_entry(to);
  r.set_max_chunk_entries(max_chunk_entries);
  return r;
}

// The AppendKv message that imports `chunk` (entries of one kv head) into `head` of `layer`:
// the chunk's [n, D] tensors become [1, n, D], its flags decide the selection.
inline v1::AppendKvRequest ImportRequest(const std::string& session, uint32_t layer, uint32_t head,
                                         const v1::ExportShardChunk& chunk) {
  v1::AppendKvRequest r;
  r.set_session_id(session);
  r.set_layer(layer);
  r.add_kv_heads(head);
  *r.mutable_k() = chunk.k();
  *r.mutable_v() = chunk.v();
  *r.mutable_maw() = chunk.maw();
  r.mutable_k()->mutable_shape()->Add(0);  // [n, D] -> [1, n, D]
  r.mutable_v()->mutable_shape()->Add(0);
  for (v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    auto* shape = t->mutable_shape();
    shape->Set(2, shape->Get(1));
    shape->Set(1, shape->Get(0));
    shape->Set(0, 1);
  }
  r.mutable_maw()->mutable_shape()->Add(0);  // [n] -> [1, n]
  r.mutable_maw()->mutable_shape()->Set(1, r.maw().shape(0));
  r.mutable_maw()->mutable_shape()->Set(0, 1);
  r.set_selected(chunk.selected());
  r.set_window_entries(0);  // ignored with flags
  return r;
}

}  // namespace tandem::cpu_attention::testing
