// A paged pool of fixed-size KV blocks of one BlockFormat (the FMS paper's page pool).
//
// Memory is one anonymous mapping reserved for `max_blocks` blocks with MAP_NORESERVE: address
// space only, physical pages arrive when a block is first written. Allocate and Unref are O(1)
// (free lists of block ids plus a bump index). Each allocated block is charged to the shared
// MemoryBudget and released when its reference count drops to zero. Reference counts implement
// prefix sharing: a block shared by k shards has count k, and a shard that wants to write into
// a block with count > 1 copies it first (copy-on-write, see Shard).
//
// Free blocks keep their physical pages (a block freed and reused soon costs no page faults)
// until ReleaseFreeBlocks hands the pages of those free for a while back to the kernel, so the
// process's resident memory falls after sessions end (what a memory autoscaler watches).
// Allocate takes the most recently freed block first, then a released one, then a new one.
//
// A warm reserve (SetWarmReserve) keeps that many free blocks with their pages in memory while
// the pool has blocks in use: WarmFreeBlocks, called off the hot path (kv_store::BlockWarmer),
// faults in released or never-used blocks until the free resident ones reach it, and
// ReleaseFreeBlocks leaves it. A settle's appends then copy at memory speed instead of taking a
// page fault per 4 KiB (~1.8 GB/s per thread against ~10 on the H200 host). An idle pool (no
// block in use) keeps no reserve, so a node still empties out.
//
// Thread-safe: allocation, reference counting and the counters take an internal mutex. Block
// *contents* are not synchronised here; the owner (a session) serialises writers.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/memory_budget.h"

namespace tandem::kv_store {

using BlockId = uint32_t;

class BlockPool {
 public:
  // INVALID_ARGUMENT for a bad format or max_blocks == 0; INTERNAL if the mapping fails.
  // `budget` must outlive the pool. huge_pages asks the kernel to back the mapping with
  // transparent huge pages (madvise MADV_HUGEPAGE; ignored where THP is off): fewer TLB misses
  // for scans of scattered blocks (page selection), at the cost of faulting in 2 MiB at a time.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const BlockFormat& format,
                                                            uint64_t max_blocks,
                                                            MemoryBudget* budget,
                                                            bool huge_pages = false);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block with reference count 1 and unspecified contents. RESOURCE_EXHAUSTED when the
  // budget or max_blocks is exhausted.
  absl::StatusOr<BlockId> Allocate();
  // `count` blocks as Allocate gives them, taken under one lock and charged to the budget at
  // once: all or none (RESOURCE_EXHAUSTED, nothing taken). The pages of those that hold none
  // (never written, or released) are faulted in before return, one MADV_POPULATE_WRITE per run
  // of adjacent ids outside the lock (a no-op on kernels before 5.14): the caller's copies into
  // them then run at memory speed instead of taking a fault per 4 KiB page.
  absl::StatusOr<std::vector<BlockId>> AllocateMany(uint64_t count);
  void Ref(BlockId id);
  // Drops one reference; the block returns to the free list (and its bytes to the budget) at 0.
  void Unref(BlockId id);
  uint32_t refcount(BlockId id) const;

  std::byte* data(BlockId id) { return base_ + size_t{id} * format_.block_bytes(); }
  const std::byte* data(BlockId id) const { return base_ + size_t{id} * format_.block_bytes(); }
  std::byte* k(BlockId id) { return data(id) + format_.k_offset(); }
  std::byte* v(BlockId id) { return data(id) + format_.v_offset(); }
  float* maw(BlockId id) { return reinterpret_cast<float*>(data(id) + format_.maw_offset()); }
  const std::byte* k(BlockId id) const { return data(id) + format_.k_offset(); }
  const std::byte* v(BlockId id) const { return data(id) + format_.v_offset(); }
  const float* maw(BlockId id) const {
    return reinterpret_cast<const float*>(data(id) + format_.maw_offset());
  }

  const BlockFormat& format() const { return format_; }
  uint64_t max_blocks() const { return max_blocks_; }
  uint64_t blocks_in_use() const;
  // Blocks ever touched (bump index): the pool's high-water mark of physical memory.
  uint64_t blocks_touched() const;
  // Touched blocks whose pages have not been released since: an upper bound on the pool's
  // resident memory in blocks (a page shared by a released block and a neighbour stays).
  uint64_t blocks_resident() const;

  // Releases the physical pages of the blocks that have been free since before `freed_before`
  // (madvise MADV_DONTNEED on the whole pages they cover; adjacent blocks are released as one
  // range, so pages that straddle two of them go too). They stay allocatable: their next write
  // faults in zero pages. The madvise runs outside the pool's lock; an Allocate that finds only
  // blocks being released waits for them. Returns the bytes of pages released.
  // Leaves the newest warm_reserve() of them while blocks are in use.
  uint64_t ReleaseFreeBlocks(std::chrono::steady_clock::time_point freed_before);

  // Free blocks to keep resident while blocks are in use (0: none, the default).
  void SetWarmReserve(uint64_t blocks);
  uint64_t warm_reserve() const;
  // Faults in up to `at_most` free blocks without pages (released ones first, then never-used
  // ones) while the free resident blocks are fewer than the reserve, the pool has blocks in use
  // and the budget could still hand them out. The pages are faulted in outside the lock (the
  // blocks are in transit meanwhile, as in ReleaseFreeBlocks). Returns the blocks warmed.
  uint64_t WarmFreeBlocks(uint64_t at_most);

 private:
  using Clock = std::chrono::steady_clock;
  BlockPool(const BlockFormat& format, uint64_t max_blocks, MemoryBudget* budget,
            std::byte* base, size_t mapped_bytes);
  // Appends to `out` up to n free ids without pages: released ones first, then never-used ones
  // (the bump index) while the pool has room. mu_ must be held.
  void TakeColdLocked(uint64_t n, std::vector<BlockId>& out);
  // Faults in the pages wholly or partly inside the blocks of `ids` (sorted), a call per run.
  void Populate(std::span<const BlockId> ids);

  const BlockFormat format_;
  const uint64_t max_blocks_;
  MemoryBudget* const budget_;
  std::byte* const base_;
  const size_t mapped_bytes_;

  mutable std::mutex mu_;
  std::condition_variable released_cv_;   // in_transit_ went down
  std::vector<uint32_t> refcounts_;  // [max_blocks], grown with the bump index
  // Free ids below next_unused_ (refcount 0), each in exactly one place: resident ones with the
  // time they were freed (oldest first), released ones, or in a ReleaseFreeBlocks call.
  std::deque<std::pair<BlockId, Clock::time_point>> free_resident_;
  std::vector<BlockId> free_released_;
  uint64_t in_transit_ = 0;          // free ids in a ReleaseFreeBlocks or WarmFreeBlocks call
  uint64_t warm_reserve_ = 0;
  BlockId next_unused_ = 0;          // bump index: ids >= this were never handed out
  uint64_t in_use_ = 0;
};

}  // namespace tandem::kv_store
