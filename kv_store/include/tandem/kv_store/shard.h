// The offloaded KV of one (session, layer, kv-head): a block table over a BlockPool plus the
// salience index (HGCA §3.2.2): a selected flag per entry and a contiguous copy of the selected
// entries' K and V, so attention over them is one dense matmul over a compact slice.
//
// Entry i lives in block blocks()[i / block_tokens] at row i % block_tokens. The selected copy
// holds the selected entries in entry order:
//   selected_k(): [selected_count(), head_dim] of the pool dtype, row-major, contiguous
//   selected_v(): [selected_count(), head_dim]
// Its storage is charged to the MemoryBudget and grows geometrically (amortised O(1) append).
//
// Copy-on-write: a block shared with another shard (refcount > 1) is copied into a fresh block
// before this shard writes into it; the other shard never sees the write.
//
// Not thread-safe: the owning Session's mutex serialises writers against readers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/memory_budget.h"

namespace tandem::kv_store {

// Which appended entries are selected: all of them (beta == 0, dense mode), or those whose MAW
// is strictly greater than `threshold` (= beta / window_entries).
struct SelectRule {
  bool select_all = true;
  float threshold = 0.0f;
  bool Selects(float maw) const { return select_all || maw > threshold; }
};

// A growable, 64-byte aligned byte buffer whose capacity is charged to a MemoryBudget.
class BudgetedBuffer {
 public:
  explicit BudgetedBuffer(MemoryBudget* budget) : budget_(budget) {}
  ~BudgetedBuffer();
  BudgetedBuffer(const BudgetedBuffer&) = delete;
  BudgetedBuffer& operator=(const BudgetedBuffer&) = delete;

  // Ensures capacity >= bytes, keeping the first size() bytes. Grows to max(bytes, 2*capacity)
  // when the budget allows, else to exactly `bytes`; RESOURCE_EXHAUSTED leaves it unchanged.
  absl::Status Reserve(size_t bytes);
  // Frees the storage and returns its bytes to the budget.
  void Clear();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  friend class Shard;  // grows its K and V copies together, see Shard::ReserveSelected
  // Grows to exactly `new_capacity` (a multiple of 64, > capacity()), charging the difference.
  absl::Status GrowTo(size_t new_capacity);

  MemoryBudget* budget_;
  std::byte* data_ = nullptr;
  size_t capacity_ = 0;
};

class Shard {
 public:
  // `pool` and `budget` must outlive the shard.
  Shard(BlockPool* pool, MemoryBudget* budget);
  ~Shard();  // drops every block reference and the selected copy
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  // Appends n entries after the current ones: k and v are [n, head_dim] of the pool dtype,
  // maw is [n] floats. Selected entries (per `rule`) are also appended to the selected copy.
  // Returns how many of the n were selected. RESOURCE_EXHAUSTED leaves the shard unchanged.
  absl::StatusOr<uint64_t> Append(const std::byte* k, const std::byte* v, const float* maw,
                                  uint64_t n, SelectRule rule);
  // As Append, but entry i is selected iff selected[i] != 0 (selected is [n]): the import side
  // of a shard migration, where entries keep the selection they had on the old node.
  absl::StatusOr<uint64_t> AppendWithSelection(const std::byte* k, const std::byte* v,
                                               const float* maw, const uint8_t* selected,
                                               uint64_t n);

  // Copies entries [first, first + n) out of the block table (the export side of a migration):
  // k and v get [n, head_dim] of the pool dtype, maw [n] floats, selected [n] flags (0 or 1).
  // Bit-identical to what was appended (MAW included). OUT_OF_RANGE if first + n > held().
  absl::Status ReadEntries(uint64_t first, uint64_t n, std::byte* k, std::byte* v, float* maw,
                           uint8_t* selected) const;

  // Makes this (empty) shard share the first `prefix` entries of `parent` by reference, with
  // the parent's selection flags for them. FAILED_PRECONDITION if this shard is not empty,
  // INVALID_ARGUMENT if prefix > parent.held() or the pools differ.
  absl::Status ShareFrom(const Shard& parent, uint64_t prefix);

  // Drops entries [held, this->held()) so that `held` remain (used to roll back a multi-head
  // append). No-op if held >= this->held().
  void Truncate(uint64_t held);

  // Replaces the selection: selected[i] != 0 selects entry i; selected.size() == held().
  // Rebuilds the contiguous copy. RESOURCE_EXHAUSTED / INVALID_ARGUMENT leave it unchanged.
  absl::Status SetSelection(std::span<const uint8_t> selected);

  uint64_t held() const { return held_; }
  uint64_t selected_count() const { return selected_count_; }
  std::span<const uint8_t> selected_flags() const { return selected_flags_; }
  const std::byte* selected_k() const { return sel_k_.data(); }
  const std::byte* selected_v() const { return sel_v_.data(); }
  // Bytes charged for the selected copy (capacity of its K and V buffers).
  size_t selected_capacity_bytes() const { return sel_k_.capacity() + sel_v_.capacity(); }

  // Block views for scans over every held entry (Reselect).
  const std::vector<BlockId>& blocks() const { return blocks_; }
  uint32_t block_entries(size_t i) const;  // entries of block i that are held
  const std::byte* block_k(size_t i) const { return pool_->k(blocks_[i]); }
  const std::byte* block_v(size_t i) const { return pool_->v(blocks_[i]); }
  const float* block_maw(size_t i) const { return pool_->maw(blocks_[i]); }

  const BlockFormat& format() const { return pool_->format(); }
  const BlockPool* pool() const { return pool_; }
  // Unique among the shards of this process: a shard dropped and added again at the same
  // (layer, kv-head) is a new shard with a new serial (an export in progress tells them apart).
  uint64_t serial() const { return serial_; }

 private:
  // Append with the selection of entry i (of the n) given by `selects(i)`.
  absl::StatusOr<uint64_t> AppendImpl(const std::byte* k, const std::byte* v, const float* maw,
                                      uint64_t n, absl::FunctionRef<bool(uint64_t)> selects);
  // Copies the held rows of the shared partial last block into `fresh` (already allocated)
  // and swaps it into the table, dropping this shard's reference to the shared block.
  void CopyOnWriteLastBlock(BlockId fresh);
  // Ensures the selected copy has room for `rows` rows in both K and V; on
  // RESOURCE_EXHAUSTED neither buffer has grown (single-threaded budget use; a concurrent
  // charger can make K grow and V fail, which changes capacity only, never contents).
  absl::Status ReserveSelected(uint64_t rows);

  BlockPool* pool_;
  MemoryBudget* budget_;
  const uint64_t serial_;
  std::vector<BlockId> blocks_;
  uint64_t held_ = 0;
  std::vector<uint8_t> selected_flags_;  // [held_]
  uint64_t selected_count_ = 0;
  BudgetedBuffer sel_k_;  // [capacity, head_dim], first selected_count_ rows valid
  BudgetedBuffer sel_v_;
};

}  // namespace tandem::kv_store
