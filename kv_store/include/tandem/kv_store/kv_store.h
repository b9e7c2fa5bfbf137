// KvStore: the sessions of one CPU attention node and the pools their KV blocks live in.
//
// A session holds one Shard per owned (layer, kv-head). The owned set is chosen at OpenSession
// and changes with KvStore::Reshard (placement moves shards between nodes: the new node adds an
// empty shard and imports the entries, the old one drops it). Pools are created on demand, one
// per BlockFormat, all charging one MemoryBudget of `capacity_bytes`. Closing a session (or
// dropping a shard) drops its block references; the store then holds no block of it.
//
// Thread-safety: KvStore's methods are thread-safe. A Session's shard set and shards are
// guarded by the session's mutex: hold it shared to read (Attend, export), exclusive to write
// (Append, Reselect, Reshard). KvStore::Append and KvStore::Reshard take the exclusive lock
// themselves.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/block_warmer.h"
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
  // The dtype Append takes and ReadEntries gives through the node (the wire dtype): kF32 or
  // kBf16.
  KvDType dtype = KvDType::kBf16;
  // Store the blocks as kInt8 rows (int8_rows.h): Append quantises, exports dequantise to
  // `dtype`. A fork must match its parent.
  bool int8_storage = false;
  KvDType storage_dtype() const { return int8_storage ? KvDType::kInt8 : dtype; }
  // Bytes of one K or V row as Append takes it: head_dim elements of `dtype`.
  size_t input_row_bytes() const { return size_t{geometry.head_dim} * DTypeBytes(dtype); }
  float beta = 0.0f;             // >= 0, finite; 0 = dense
  // 0: MAW selection (the salience index: flags and the selected copy). 1..4096: query-aware
  // `pages` selection with pages of page_tokens entries: no salience index is kept, every
  // appended entry is unselected, so the shards have no selected copy and spend no memory on
  // one; beta and window_entries are not used and Append's flags must all be 0. The pages
  // themselves are the attention kernel's business (paged_attention.h). A fork must match
  // its parent.
  uint32_t page_tokens = 0;
  bool has_selection_index() const { return page_tokens == 0; }
  // Shards owned at open; empty = every (layer, kv-head). The session moves them into its
  // shard table (Session::options().shards is empty); Session::shard_keys() gives the set now.
  std::vector<ShardKey> shards;
};

class Session {
 public:
  // Made by KvStore with validated options (shards sorted, unique, in range).
  Session(std::string id, SessionOptions options, BlockPool* pool, MemoryBudget* budget);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  // Geometry, block size, dtype and the beta it was opened with; immutable, so it may be read
  // without the lock. `shards` is empty (see SessionOptions::shards).
  const SessionOptions& options() const { return options_; }
  const Geometry& geometry() const { return options_.geometry; }
  // The block format: its dtype is options().storage_dtype(), which the kernels read.
  const BlockFormat& format() const { return pool_->format(); }

  // beta is read under the session mutex (shared or exclusive) and written under exclusive.
  float beta() const { return beta_; }
  void set_beta(float beta) { beta_ = beta; }

  // The accessors below read the shard set: hold the session mutex (shared or exclusive).
  //
  // Owned kv heads of `layer`, ascending (empty for a layer out of range or owning none).
  std::span<const uint32_t> owned_kv_heads(uint32_t layer) const;
  // The shard, or nullptr if (layer, kv_head) is not owned or the session was closed.
  Shard* shard(uint32_t layer, uint32_t kv_head);
  const Shard* shard(uint32_t layer, uint32_t kv_head) const;
  size_t num_shards() const { return num_shards_; }
  // Owned shards, ascending.
  std::vector<ShardKey> shard_keys() const;
  // True once KvStore::CloseSession (or the store's destruction) dropped every shard.
  bool closed() const { return closed_; }

  // Adds empty shards. Needs the exclusive lock. INVALID_ARGUMENT (naming the shard) for an id
  // out of range, listed twice or already owned, or past 65536 shards per session; NOT_FOUND
  // if the session was closed. All or nothing.
  absl::Status AddShards(std::span<const ShardKey> keys);
  // Destroys the shards: their block references are dropped (a block's bytes return to the
  // budget when no other shard shares it) and so is their selected copy. Needs the exclusive
  // lock. Returns the block references dropped. INVALID_ARGUMENT for a shard not owned or
  // listed twice; NOT_FOUND if the session was closed. All or nothing.
  absl::StatusOr<uint64_t> DropShards(std::span<const ShardKey> keys);

  std::shared_mutex& mutex() const { return mu_; }

 private:
  friend class KvStore;
  // One layer's owned shards: heads ascending, shards[i] holds kv head heads[i].
  struct LayerShards {
    std::vector<uint32_t> heads;
    std::vector<std::unique_ptr<Shard>> shards;
  };

  // Validation of AddShards / DropShards without changing anything; `dropping` is the number
  // of shards dropped in the same reshard (for the per-session limit).
  absl::Status CheckAdd(std::span<const ShardKey> keys, size_t dropping) const;
  absl::Status CheckDrop(std::span<const ShardKey> keys) const;
  absl::Status CheckNotClosed() const;
  // Destroys every shard (dropping its block references) and marks the session closed, so a
  // caller still holding the shared_ptr finds no shards. Needs the exclusive lock. Returns the
  // number of block references dropped.
  uint64_t CloseLocked();

  const std::string id_;
  const SessionOptions options_;
  BlockPool* const pool_;
  MemoryBudget* const budget_;
  float beta_;
  std::vector<LayerShards> layers_;  // [num_layers]
  size_t num_shards_ = 0;
  bool closed_ = false;
  mutable std::shared_mutex mu_;
};

struct AppendStats {
  uint64_t entries_appended = 0;  // num_heads * n
  uint64_t entries_selected = 0;
};

struct ReshardStats {
  uint64_t blocks_released = 0;  // block references dropped with the dropped shards
  uint64_t shards = 0;           // shards owned after the reshard
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;          // charged to the budget: blocks + selected copies
  uint64_t blocks_in_use = 0;       // over all pools
  uint64_t block_bytes_in_use = 0;
  uint64_t stored_bytes = 0;        // sum over shards of held * entry_bytes (a prefix shared
                                    // by k shards is counted k times, see kv_store.cc)
  uint64_t selected_bytes = 0;      // capacity of the selected copies
  // Bytes of touched blocks whose pages have not been released (BlockPool::blocks_resident):
  // the pools' share of the process's resident memory, in use or free.
  uint64_t resident_block_bytes = 0;
  uint32_t sessions = 0;
};

// Names clients choose (session ids, lease holders): 1..kMaxNameChars characters of
// [A-Za-z0-9._:-], so they print, log and travel in URLs and metric labels unescaped.
inline constexpr size_t kMaxNameChars = 128;
// INVALID_ARGUMENT "<what> ..." naming the rule `name` breaks.
absl::Status ValidateName(absl::string_view what, const std::string& name);

class KvStore {
 public:
  struct Options {
    uint64_t capacity_bytes = 1ull << 30;
    uint32_t default_block_tokens = 64;
    uint32_t max_sessions = 4096;
    bool huge_pages = false;   // BlockPool::Create's huge_pages for every pool
    // Runs fn(i) for every i in [0, n) and returns when all have run, on several threads when
    // it can (the CPU node passes its attention ThreadPool::ParallelFor); must be callable from
    // any thread at once. A large Append (a prompt's settle, a synthetic fill, a migration's
    // copy) quantises int8 rows in slices and fills its heads' shards through it; null: all in
    // the calling thread.
    std::function<void(size_t n, const std::function<void(size_t)>& fn)> parallel_for = nullptr;
    // Free block bytes each pool keeps faulted in while it has blocks in use (BlockPool's warm
    // reserve), made by a BlockWarmer thread woken by Append; 0: none, and no thread.
    uint64_t warm_reserve_bytes = 0;
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
  // shard (NOT_FOUND parent; INVALID_ARGUMENT if geometry, block size or dtype differ from the
  // parent's, the shards differ from the parent's owned shards now, or a parent shard holds
  // fewer entries).
  absl::StatusOr<std::shared_ptr<Session>> ForkSession(const std::string& id,
                                                       SessionOptions options,
                                                       const std::string& parent_id,
                                                       uint64_t prefix_tokens);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;
  // Removes the session and drops its block references; returns how many were dropped.
  absl::StatusOr<uint64_t> CloseSession(const std::string& id);

  // Appends n entries to each listed kv head of `layer`: k, v are [kv_heads.size(), n, D] of
  // the session dtype (options().dtype; quantised here when the session stores int8), maw
  // [kv_heads.size(), n]. A session without a selection index selects
  // nothing (window_entries may be 0; any flag != 0 is INVALID_ARGUMENT). Else the selection
  // threshold is beta / window_entries, unless `selected` is given: then it is [kv_heads.size(), n] flags (each 0 or 1) that decide
  // the selection of the entries (a migration keeps the flags an entry had on the old node) and
  // window_entries is ignored. Validates layer, heads (owned, no duplicates), n > 0,
  // window_entries > 0 (without flags), every MAW (finite, >= 0) and every flag. All-or-nothing
  // across heads. NOT_FOUND if the session was closed.
  absl::StatusOr<AppendStats> Append(Session& session, uint32_t layer,
                                     std::span<const uint32_t> kv_heads, const std::byte* k,
                                     const std::byte* v, const float* maw, uint32_t n,
                                     uint32_t window_entries,
                                     std::span<const uint8_t> selected = {});

  // Changes the session's owned shards under its exclusive lock: drops `drop` (see
  // Session::DropShards), then adds the empty shards `add` (Session::AddShards). Everything is
  // validated first, so it is all or nothing; a shard in both lists is INVALID_ARGUMENT.
  // NOT_FOUND if the session was closed.
  absl::StatusOr<ReshardStats> Reshard(Session& session, std::span<const ShardKey> add,
                                       std::span<const ShardKey> drop);

  // Returns the physical memory of the KV blocks free since before `freed_before` to the
  // kernel (BlockPool::ReleaseFreeBlocks on every pool) and, when some was, the C heap's free
  // memory too (malloc_trim: freed selected copies). Returns the block bytes released.
  uint64_t ReleaseFreeMemory(std::chrono::steady_clock::time_point freed_before);
  // One BlockPool::WarmFreeBlocks of up to `batch_bytes` on every pool below its warm reserve;
  // returns the blocks faulted in (0: every pool is at its reserve).
  uint64_t WarmFreeBlocks(uint64_t batch_bytes);
  // Blocks faulted in by the warm reserves' thread so far (0 without a reserve).
  uint64_t warmed_blocks() const;

  StoreStats Stats() const;
  const MemoryBudget& budget() const { return budget_; }
  uint32_t default_block_tokens() const { return options_.default_block_tokens; }

 private:
  absl::StatusOr<BlockPool*> PoolFor(const BlockFormat& format);
  absl::Status ValidateOptions(SessionOptions& options) const;
  // Takes a new session's id: ALREADY_EXISTS or RESOURCE_EXHAUSTED (max_sessions). Needs mu_.
  absl::Status CheckNewSessionLocked(const std::string& id) const;

  const Options options_;
  MemoryBudget budget_;
  mutable std::mutex mu_;  // guards sessions_ and pools_
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::unique_ptr<BlockPool>> pools_;
  std::unique_ptr<BlockWarmer> warmer_;   // null: no warm reserve; stopped first in ~KvStore
};

}  // namespace tandem::kv_store
