// KvStore: the sessions of one CPU attention node and the pools their KV blocks live in.
//
// A session holds one Shard per owned (layer, kv-head). Pools are created on demand, one per
// BlockFormat, all charging one MemoryBudget of `capacity_bytes`. Closing a session drops all
// its block references; the store then holds no block of it.
//
// Thread-safety: KvStore's methods are thread-safe. A Session's shards are guarded by the
// session's mutex: hold it shared to read (Attend), exclusive to write (Append, Reselect).
// KvStore::Append takes the exclusive lock itself.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/memory_budget.h"
#include "tandem/kv_store/shard.h"

namespace tandem::kv_store {

struct Geometry {
  uint32_t num_layers = 0;
  uint32_t num_q_heads = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;

  uint32_t group() const { return num_q_heads / num_kv_heads; }  // GQA ratio G
  bool operator==(const Geometry&) const = default;
  // INVALID_ARGUMENT naming the field: layers 1..1024, kv heads 1..1024, q heads a multiple of
  // kv heads (<= 8192), head_dim 8..256 and a multiple of 8.
  absl::Status Validate() const;
};

struct ShardKey {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  auto operator<=>(const ShardKey&) const = default;
};

struct SessionOptions {
  Geometry geometry;
  uint32_t block_tokens = 0;  // 0 = the store's default
  KvDType dtype = KvDType::kBf16;
  float beta = 0.0f;             // >= 0, finite; 0 = dense
  std::vector<ShardKey> shards;  // owned shards; empty = every (layer, kv-head)
};

class Session {
 public:
  // Made by KvStore with validated options (shards sorted, unique, in range).
  Session(std::string id, SessionOptions options, BlockPool* pool, MemoryBudget* budget);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  const SessionOptions& options() const { return options_; }
  const Geometry& geometry() const { return options_.geometry; }
  const BlockFormat& format() const { return pool_->format(); }

  // beta is read under the session mutex (shared or exclusive) and written under exclusive.
  float beta() const { return beta_; }
  void set_beta(float beta) { beta_ = beta; }

  // Owned kv heads of `layer`, ascending (empty for a layer out of range).
  std::span<const uint32_t> owned_kv_heads(uint32_t layer) const;
  // The shard, or nullptr if (layer, kv_head) is not owned or the session was closed.
  Shard* shard(uint32_t layer, uint32_t kv_head);
  const Shard* shard(uint32_t layer, uint32_t kv_head) const;
  size_t num_shards() const { return shards_.size(); }

  std::shared_mutex& mutex() const { return mu_; }

 private:
  friend class KvStore;
  // Destroys every shard (dropping its block references) and marks the session closed, so a
  // caller still holding the shared_ptr finds no shards. Needs the exclusive lock. Returns the
  // number of block references dropped.
  uint64_t DropShardsLocked();

  const std::string id_;
  const SessionOptions options_;
  BlockPool* const pool_;
  float beta_;
  std::vector<std::vector<uint32_t>> owned_;           // [num_layers] -> kv heads ascending
  std::vector<int32_t> shard_index_;                   // [layer * H_kv + kv_head] -> index or -1
  std::vector<std::unique_ptr<Shard>> shards_;         // in options_.shards order
  bool closed_ = false;
  mutable std::shared_mutex mu_;
};

struct AppendStats {
  uint64_t entries_appended = 0;  // num_heads * n
  uint64_t entries_selected = 0;
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;          // charged to the budget: blocks + selected copies
  uint64_t blocks_in_use = 0;       // over all pools
  uint64_t block_bytes_in_use = 0;
  uint64_t stored_bytes = 0;        // sum over shards of held * entry_bytes (a prefix shared
                                    // by k shards is counted k times, see kv_store.cc)
  uint64_t selected_bytes = 0;      // capacity of the selected copies
  uint32_t sessions = 0;
};

class KvStore {
 public:
  struct Options {
    uint64_t capacity_bytes = 1ull << 30;
    uint32_t default_block_tokens = 64;
    uint32_t max_sessions = 4096;
  };
  explicit KvStore(Options options);
  ~KvStore();

  // INVALID_ARGUMENT for a bad id (1..128 chars of [A-Za-z0-9._:-]) or options,
  // ALREADY_EXISTS for a duplicate id, RESOURCE_EXHAUSTED past max_sessions. Options are
  // normalised: block_tokens 0 becomes the default, shards sorted (empty: every shard, at most
  // 65536 per session).
  absl::StatusOr<std::shared_ptr<Session>> OpenSession(const std::string& id,
                                                       SessionOptions options);
  // As OpenSession, then every shard shares the first prefix_tokens entries of the parent's
  // shard (NOT_FOUND parent; INVALID_ARGUMENT if options differ from the parent's or a parent
  // shard holds fewer entries).
  absl::StatusOr<std::shared_ptr<Session>> ForkSession(const std::string& id,
                                                       SessionOptions options,
                                                       const std::string& parent_id,
                                                       uint64_t prefix_tokens);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;
  // Removes the session and drops its block references; returns how many were dropped.
  absl::StatusOr<uint64_t> CloseSession(const std::string& id);

  // Appends n entries to each listed kv head of `layer`: k, v are [kv_heads.size(), n, D] of
  // the session dtype, maw [kv_heads.size(), n]. Selection threshold beta / window_entries.
  // Validates layer, heads (owned, no duplicates), n > 0, window_entries > 0 and every MAW
  // (finite, >= 0). All-or-nothing across heads. NOT_FOUND if the session was closed.
  absl::StatusOr<AppendStats> Append(Session& session, uint32_t layer,
                                     std::span<const uint32_t> kv_heads, const std::byte* k,
                                     const std::byte* v, const float* maw, uint32_t n,
                                     uint32_t window_entries);

  StoreStats Stats() const;
  const MemoryBudget& budget() const { return budget_; }
  uint32_t default_block_tokens() const { return options_.default_block_tokens; }

 private:
  absl::StatusOr<BlockPool*> PoolFor(const BlockFormat& format);
  absl::Status ValidateOptions(SessionOptions& options) const;

  const Options options_;
  MemoryBudget budget_;
  mutable std::mutex mu_;  // guards sessions_ and pools_
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::unique_ptr<BlockPool>> pools_;
};

}  // namespace tandem::kv_store
