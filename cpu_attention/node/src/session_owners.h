// Who opened each session of a CPU node, and what its bookkeeping costs (private to
// cpu_attention; used by cpu_attention_node.cc).
//
// Ownership: a session belongs to the principal that opened it (tandem/security/
// authenticator.h: the worker's certificate identity; kAnonymous without TLS). Every other
// call naming the session must come from that principal. A session of another principal is
// answered exactly as an unknown one (NOT_FOUND with the kv_store's own wording), so no call,
// fork_from included, tells whether an id exists: session ids are no oracle.
//
// Charge: the session's metadata (Session, its per-layer vectors, one Shard object per owned
// shard) is charged to the node's pool budget, so OpenSession with a huge geometry is bounded
// by --pool_bytes like KV blocks are (168 B per shard; measured: 10.9 MB of RSS for 65536
// shards).
//
// Thread-safe (one mutex; no call into the store under it).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::cpu_attention::internal {

// Bytes charged for a session of `num_layers` layers owning `num_shards` shards.
uint64_t SessionMetadataBytes(uint64_t num_layers, uint64_t num_shards);

class SessionOwners {
 public:
  // max_per_principal: sessions (open or being opened) one principal may hold; 0 = no bound.
  explicit SessionOwners(uint32_t max_per_principal) : max_per_principal_(max_per_principal) {}

  // Takes a slot for a session `caller` is about to open: RESOURCE_EXHAUSTED past the bound.
  // Every successful Reserve is followed by exactly one Add or Unreserve.
  absl::Status Reserve(const std::string& caller);
  void Unreserve(const std::string& caller);
  // Records the opened session (turns the reservation into it) with `charged` bytes.
  void Add(const std::string& id, const std::string& caller, uint64_t charged);

  // OK if `caller` owns `id` or nobody does (an id the owners never saw: the store answers for
  // it, NOT_FOUND when it does not exist either). NOT_FOUND "session '<id>' not found" for
  // another principal's session. `parent`: fork_from wording ("parent session ...").
  absl::Status Check(const std::string& id, const std::string& caller, bool parent = false) const;

  // Bytes charged for `id` (0 if unknown).
  uint64_t charged(const std::string& id) const;
  // Replaces the charge of `id` (after a reshard); no-op for an unknown id.
  void SetCharged(const std::string& id, uint64_t charged);
  // Forgets `id`; returns its charge (0 if unknown).
  uint64_t Remove(const std::string& id);

 private:
  struct Entry {
    std::string owner;
    uint64_t charged = 0;
  };
  const uint32_t max_per_principal_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> sessions_;          // by session id
  std::map<std::string, uint32_t> per_principal_;  // open + reserved, by principal
};

}  // namespace tandem::cpu_attention::internal
