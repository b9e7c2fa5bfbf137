// PageIndex: the page summaries of one sequence's offloaded KV, kept in device memory (Quest;
// DESIGN "Selection", selection = pages).
//
// Per layer: [num_kv_heads, capacity_pages, 3, head_dim] of the KV dtype, page p of kv head g
// holding the elementwise min (row 0), max (row 1) and mean (row 2) of the post-RoPE keys of
// offloaded entries [p·page_tokens, (p+1)·page_tokens) of that (layer, kv head) (backend.h's
// SummarizePages). That is 3/(2·page_tokens) of the offloaded K+V bytes (3/32 at the default
// 16-token pages). Pages are
// written when their entries leave the window (Append from the window's K before Release), so
// page p names exactly the entries the CPU nodes number p·page_tokens.. in the same shard.
//
// With LowRankOptions, the index also keeps every offloaded key's low-rank coordinates
// (LowRankIndex), for PageScore::kLowRank; sizes, forks and parking below include them.
//
// Memory: Reserve() grows every layer's buffer to a page capacity (geometrically; the old
// contents are copied on the device). It is the only place that allocates: RESOURCE_EXHAUSTED
// (with the bytes asked) when the device cannot hold the summaries, the index unchanged.
//
// Not thread-safe: the engine's executor thread owns it with its sequence.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/low_rank_index.h"
#include "tandem/gpu_worker/parking_pool.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

class PageIndex {
 public:
  // page_tokens in 1..4096; reserve_tokens: offloaded entries per (layer, kv head) to reserve
  // room for now (0 = none). INVALID_ARGUMENT for a bad geometry, page size or low-rank option.
  static absl::StatusOr<PageIndex> Create(Backend& backend, const WindowGeometry& geometry,
                                          int64_t page_tokens, int64_t reserve_tokens,
                                          const LowRankOptions& low_rank = {});

  PageIndex(PageIndex&&) = default;
  PageIndex& operator=(PageIndex&&) = default;

  // Device bytes of summaries for `tokens` offloaded entries per (layer, kv head) (whole pages).
  static size_t BytesFor(const WindowGeometry& geometry, int64_t page_tokens, int64_t tokens,
                         const LowRankOptions& low_rank = {});

  // Ensures room for `pages` pages per (layer, kv head).
  absl::Status Reserve(int64_t pages);

  // A copy on the device (a forked sequence's summaries), with room for `reserve_tokens`
  // offloaded entries per (layer, kv head) or the pages written, whichever is more.
  // RESOURCE_EXHAUSTED as Reserve.
  absl::StatusOr<PageIndex> Fork(int64_t reserve_tokens) const;

  // Summarises `count` entries (a multiple of page_tokens) of `layer`'s K, the slots
  // [first_slot, first_slot + count) of k_cache [num_kv_heads, capacity, head_dim] (the index's
  // dtype), as that layer's next count / page_tokens pages. Grows the capacity if needed.
  absl::Status Append(int64_t layer, const void* k_cache, int64_t capacity, int64_t first_slot,
                      int64_t count);
  // Append for evicted window blocks, every layer, in the blocks' order; then AdvanceLowRank.
  absl::Status AppendEvicted(const WindowCache& window, const std::vector<EvictedBlock>& blocks);
  // LowRankIndex::Advance (not waiting): installs the low-rank bases made since, starts those
  // due. Nothing without low-rank keys or while parked.
  absl::Status AdvanceLowRank() { return low_rank_ ? low_rank_->Advance() : absl::OkStatus(); }
  // LowRankIndex::tokens_until_due (0 without low-rank keys).
  int64_t tokens_until_low_rank_due() const { return low_rank_ ? low_rank_->tokens_until_due() : 0; }
  // Whether low-rank bases are being made in the background (LowRankIndex::solving).
  bool low_rank_solving() const { return low_rank_ && low_rank_->solving(); }

  // The parameters of a Backend::SelectPages of `layer`'s pages for query rows q (attention
  // scale softmax_scale, which the kLowRank score's logsumexp uses), scored by `score`
  // (kLowRank: FAILED_PRECONDITION unless low_rank_ready(layer)): pages
  // [num_tokens, num_kv_heads, select] on the device; scratch of
  // SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages(layer)) bytes (null: the
  // caller's batch sets it). Valid while the index does not grow. FAILED_PRECONDITION when the
  // layer has no page.
  absl::StatusOr<SelectPagesParams> SelectParams(int64_t layer, const float* q,
                                                 int64_t q_row_stride, int64_t num_tokens,
                                                 int64_t num_q_heads, int64_t select,
                                                 int32_t* pages, void* scratch,
                                                 PageScore score, float softmax_scale) const;

  // Parking, as WindowCache::Park: the pages written go to a space of `pool` (pinned host
  // memory) and the device buffers are freed (device_bytes() 0); Unpark() allocates the same
  // capacity and copies them back. RESOURCE_EXHAUSTED leaves the index as it was.
  absl::Status Park(ParkingPool& pool);
  absl::Status Unpark();
  bool parked() const { return parked_.held(); }
  size_t parked_bytes() const {
    return parked_.held_bytes() + (low_rank_ ? low_rank_->parked_bytes() : 0);
  }
  size_t ParkBytes() const;   // the bytes Park() copies to the host now
  size_t resident_bytes() const;   // device bytes on the device (parked: after Unpark())

  // Whether `layer`'s pages can be scored by PageScore::kLowRank (the index keeps low-rank keys
  // and that layer's basis is made: LowRankIndex::ready).
  bool low_rank_ready(int64_t layer) const {
    return low_rank_.has_value() && low_rank_->ready(layer);
  }
  const LowRankIndex* low_rank() const { return low_rank_ ? &*low_rank_ : nullptr; }

  int64_t page_tokens() const { return page_tokens_; }
  int64_t num_pages(int64_t layer) const { return pages_[layer]; }
  int64_t capacity_pages() const { return capacity_pages_; }
  size_t device_bytes() const;
  const WindowGeometry& geometry() const { return geometry_; }
  // [num_kv_heads, capacity_pages, 3, head_dim] of `layer` (tests).
  const void* summaries(int64_t layer) const { return layers_[layer].data(); }

 private:
  PageIndex() = default;
  size_t PageBytes() const;   // one page of one kv head: 3 · head_dim · dtype bytes
  size_t SummaryParkBytes() const;   // the summaries' share of ParkBytes()
  // Copies the pages written of every (layer, kv head) into `dst` (per layer, heads of
  // dst_capacity pages each).
  absl::Status CopyPagesInto(std::vector<DeviceBuffer>& dst, int64_t dst_capacity) const;

  Backend* backend_ = nullptr;
  WindowGeometry geometry_;
  int64_t page_tokens_ = 16;
  int64_t capacity_pages_ = 0;
  std::vector<DeviceBuffer> layers_;   // per layer, see the file comment
  std::vector<int64_t> pages_;         // per layer: pages written
  ParkingSpace parked_;                // while parked (Park() gives its layout)
  std::optional<LowRankIndex> low_rank_;   // with LowRankOptions::enabled()
};

}  // namespace tandem::gpu_worker
