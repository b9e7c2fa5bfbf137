// WindowCache: the part of one sequence's KV cache that lives in device memory (HGCA §3.2.1).
//
// Per layer it holds K and V [num_kv_heads, capacity, head_dim] (cache dtype) and MAW
// [num_kv_heads, capacity] (f32). Slots are shared by all layers: a token occupies the same slot
// in every layer, so one slot -> position table serves them all.
//
//   slots [0, sink)                     sink tokens (positions 0..sink-1); they never leave
//   slots [sink, sink + ring_blocks·B)  recent tokens in a ring of blocks of B slots; block j of
//                                       the ring holds positions sink + (b·B .. b·B+B-1) for
//                                       the b-th recent block with b ≡ j (mod ring_blocks)
//
// After a forward pass adds tokens, TakeEvictions() names the oldest recent blocks to move to
// the CPU nodes so that at most `window` recent tokens stay; the caller reads them
// (ReadBlocks) for every layer, hands them over, then calls Release(). With `window` =
// kUnlimited nothing is ever evicted (the `gpu` mode: all KV on the device).
//
// Device prefill (Widen / Narrow): a bounded window can hold more recent tokens for a while,
// e.g. a whole prompt, so that every prefill chunk attends over the prompt's earlier KV on the
// device, exactly; afterwards Narrow() returns to the configured window: the oldest blocks then
// become PendingEvictions() and, once they are released, the ring shrinks back to its
// configured capacity (its device memory is returned). Between Narrow() and that last Release the
// sequence is settling(): its pending blocks leave a slice at a time (ModelRunner::SettleSlice)
// while it goes on decoding. They stay attended on the device until released, and new tokens
// may be appended as long as they land on free ring slots (never over a pending block:
// EvictionsBeforeAppend names the blocks that must leave first). Widen, Narrow, Grow and that shrink
// re-lay the ring into new buffers: each position keeps its KV and MAW, at the slot the new
// ring gives it (sink slots unchanged, ring blocks in position order modulo the new ring).
//
// Not thread-safe; used by the engine's executor thread only.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/parking_pool.h"

namespace tandem::gpu_worker {

struct WindowGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType dtype = DType::kF32;   // kF32 or kBF16
};

struct WindowOptions {
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
  int64_t sink = 4;            // tokens that never leave (>= 0)
  int64_t window = 512;        // most recent tokens kept on the device; kUnlimited = no eviction
  int64_t block = 16;          // tokens per evicted block (>= 1)
  int64_t max_chunk = 512;     // most tokens one forward pass adds
  int64_t max_context = 8192;  // most positions a sequence may reach (sizes the kUnlimited case)
};

// A run of consecutive recent slots to evict: positions [first_pos, first_pos + count).
struct EvictedBlock {
  int64_t first_slot = 0;
  int64_t first_pos = 0;
  int64_t count = 0;
};

// `blocks` with neighbours merged: a block that starts at the slot and position where the one
// before it ends joins it. A widened prefill evicts thousands of consecutive blocks at once;
// one copy, fill or kernel per run instead of per block keeps its settle at transfer speed
// rather than at the device's per-call cost (~5-10 us a call, x layers x heads).
std::vector<EvictedBlock> SlotRuns(const std::vector<EvictedBlock>& blocks);

class WindowCache {
 public:
  // Allocates the device buffers. INVALID_ARGUMENT for bad options, RESOURCE_EXHAUSTED when
  // the device memory does not suffice.
  static absl::StatusOr<WindowCache> Create(Backend& backend, const WindowGeometry& geometry,
                                            const WindowOptions& options);

  // Device bytes Create() allocates for these options (0 for options Create refuses).
  static size_t BytesFor(const WindowGeometry& geometry, const WindowOptions& options);

  WindowCache(WindowCache&&) = default;
  WindowCache& operator=(WindowCache&&) = default;

  // Assigns slots to the next `count` positions (next_position() onwards), uploads the slot and
  // position tables, and returns the slots (host copy, valid until the next call).
  // FAILED_PRECONDITION if a new position would land on the slot of a token still on the device
  // (pending evictions must leave first: EvictionsBeforeAppend) or the context limit would be
  // passed.
  absl::StatusOr<const std::vector<int32_t>*> Append(int64_t count);
  // The oldest recent blocks that must leave (ReadBlocks, the tier, Release) before Append(count)
  // fits the ring: none when the ring has room, which it always has after the pending evictions
  // left. A settling() ring holds its pending blocks while it decodes; this is what a pass must
  // take of them first.
  std::vector<EvictedBlock> EvictionsBeforeAppend(int64_t count) const;

  // Advances the positions by `count` tokens whose KV is held elsewhere (on CPU nodes or in host
  // memory: a restored context) and never enters the device. Allowed only while no recent token
  // is on the device and the sink is full; `count` must be a multiple of the block size (evicted
  // blocks start at block boundaries). FAILED_PRECONDITION / INVALID_ARGUMENT otherwise.
  absl::Status Skip(int64_t count);

  // Forgets positions [positions, next_position()): their slots become empty (as Release leaves
  // them) and the next Append continues at `positions`. A cached session reused for a prompt
  // that shares only its first `positions` tokens (prefix_cache.h) drops the rest this way.
  // Only tokens still on the device can go: FAILED_PRECONDITION when a position at or after
  // `positions` has left it (evicted to the tier); INVALID_ARGUMENT when `positions` is
  // negative or past next_position(). No-op when it equals next_position().
  absl::Status Truncate(int64_t positions);

  // A cache for another sequence that holds this one's positions [0, positions) as
  // Truncate(positions) would leave them (a fork of a cached prefix: two requests continue one
  // document), in buffers of its own: the same sink, block and window, the context limit raised
  // to `max_context` if that is larger. The device copy covers the positions on the device (the
  // sink and the recent ones before `positions`); the fork's tier holds the evicted ones. A
  // settling ring's pending blocks below `positions` come along, still pending (the fork settles
  // them into its own tier). FAILED_PRECONDITION when a position at or after `positions` has left
  // the device (as Truncate) or the ring is widened (a prefill under way); INVALID_ARGUMENT for
  // `positions` outside [0, next_position()]; RESOURCE_EXHAUSTED when the device memory does not
  // suffice.
  absl::StatusOr<WindowCache> Fork(int64_t positions, int64_t max_context) const;
  // Device bytes Fork(positions, max_context) allocates; its errors for a fork it refuses.
  absl::StatusOr<size_t> ForkBytes(int64_t positions, int64_t max_context) const;

  // Raises the context limit of an unlimited-window (gpu mode) cache to `max_context`
  // positions, moving its KV into larger device buffers: a session sized for one request that a
  // later turn extends. No-op when the limit is already that high. FAILED_PRECONDITION for a
  // bounded window (its capacity does not depend on the context), RESOURCE_EXHAUSTED when the
  // device memory does not suffice (the cache is then unchanged).
  absl::Status Grow(int64_t max_context);

  // Makes room for `recent_tokens` recent tokens (rounded up to the block; at most the context
  // limit) before the next eviction: the ring is re-laid into larger buffers holding that many
  // plus one pass (the rule of Create with window = recent_tokens). No-op when the window is
  // already that large. A settling() ring widens with its pending blocks (they stay, oldest
  // first, and leave after the next Narrow), if `recent_tokens` covers every recent token on the
  // device. FAILED_PRECONDITION for an unlimited window, with evictions pending on a ring that is
  // not settling, or a settling ring that `recent_tokens` does not cover; RESOURCE_EXHAUSTED when
  // the device memory does not suffice (the cache is then unchanged).
  absl::Status Widen(int64_t recent_tokens);
  // Widen() as far as possible towards `recent_tokens` (whole blocks) with at most
  // `max_extra_bytes` more device bytes than now, taking 1/8 off the widening while the device
  // refuses the allocation (RESOURCE_EXHAUSTED); the window then keeps its size. Returns the
  // window it holds afterwards. Errors other than RESOURCE_EXHAUSTED are returned.
  absl::StatusOr<int64_t> WidenWithin(int64_t recent_tokens, size_t max_extra_bytes);
  // Goes back to the configured window after Widen(): the recent tokens beyond it become
  // PendingEvictions(); the Release() that leaves none shrinks the ring to its configured
  // capacity (at once when none are pending). No-op when not widened. Errors as Widen's (a
  // failed shrink keeps the larger ring, which stays correct).
  absl::Status Narrow();
  // Whether Widen() holds a larger window than the configured one, and whether a ring larger
  // than the configured one is held (widened, or narrowed with evictions still pending).
  bool widened() const { return configured_window_ > 0 && options_.window > configured_window_; }
  bool relaid() const { return configured_window_ > 0; }
  // Narrowed with blocks beyond the configured window still on the device: the prompt's settle
  // is under way (ModelRunner::SettleSlice moves them to the tier).
  // (PendingEvictions() non-empty, without building the list: called per session per step.)
  bool settling() const {
    return relaid() && !widened() && options_.window != WindowOptions::kUnlimited &&
           RecentTokens() > options_.window;
  }
  // The window the cache was created with (options().window is the widened one while widened).
  int64_t configured_window() const {
    return configured_window_ > 0 ? configured_window_ : options_.window;
  }

  // The oldest recent blocks that must leave so that at most `window` recent tokens remain.
  // They stay readable until Release().
  std::vector<EvictedBlock> PendingEvictions() const;
  // n_gpu of the MAW selection threshold (β / n_gpu) for blocks that leave now: the entries on
  // the device, but at most the configured sink + window when the ring is re-laid (a widened
  // prefill's blocks are judged as if the window had its configured size).
  int64_t eviction_entries() const;

  // Copies K, V and MAW of `blocks` for `layer` to host memory, head-major:
  //   k_host, v_host: [num_kv_heads, total, head_dim] of the cache dtype
  //   maw_host: [num_kv_heads, total] f32 (negative values, i.e. never attended, become 0)
  // where total = Σ count, blocks in the given order.
  absl::Status ReadBlocks(int64_t layer, const std::vector<EvictedBlock>& blocks, void* k_host,
                          void* v_host, float* maw_host);

  // Frees the slots of the blocks returned by PendingEvictions() (empties them on the device).
  // After Narrow(), the Release that leaves no eviction pending shrinks the ring (see Narrow).
  absl::Status Release(const std::vector<EvictedBlock>& blocks);

  // Device pointers for the attention of `layer`.
  // Parking (a cached session under device-memory pressure, DESIGN "KV reuse across
  // requests"): Park() copies K, V and MAW of the slots ever used, [0, scan_slots), into a
  // space of `pool` (pinned host memory) and frees the device buffers; Unpark() allocates them
  // again and copies the slots back over PCIe. Every position keeps its slot, so the cache
  // continues as if it had never left. While parked only the size and position accessors may
  // be used (device_bytes() is 0). RESOURCE_EXHAUSTED (the pool or the device) leaves the cache
  // as it was; a parked cache does not park again, nor a widened or settling one
  // (FAILED_PRECONDITION: its slots are about to move).
  absl::Status Park(ParkingPool& pool);
  absl::Status Unpark();
  bool parked() const { return parked_.held(); }
  size_t parked_bytes() const { return parked_.held_bytes(); }   // pool bytes while parked
  size_t ParkBytes() const;    // the bytes Park() copies to the host now
  size_t resident_bytes() const;   // device bytes on the device (parked: after Unpark())

  void* k(int64_t layer) const;
  void* v(int64_t layer) const;
  float* maw(int64_t layer) const;
  const int32_t* slot_pos() const { return slot_pos_dev_.as<int32_t>(); }

  int64_t capacity() const { return capacity_; }
  int64_t scan_slots() const { return scan_slots_; }   // slots [0, scan_slots) ever used
  int64_t next_position() const { return next_pos_; }
  int64_t entries() const { return next_pos_ - evicted_tokens_; }   // tokens on the device
  int64_t evicted_tokens() const { return evicted_tokens_; }
  int64_t recent_tokens() const { return RecentTokens(); }   // entries past the sink
  const WindowGeometry& geometry() const { return geometry_; }
  const WindowOptions& options() const { return options_; }
  size_t device_bytes() const;

 private:
  WindowCache() = default;
  // Moves the cache into a new one made with `target` options (same sink and block): each
  // position's K, V and MAW are copied to its slot in the new ring, a run of slots contiguous
  // in both rings per copy. RESOURCE_EXHAUSTED leaves the cache unchanged.
  absl::Status Relayout(const WindowOptions& target);
  // Copies K, V, MAW and the slot table of positions [0, end) that are on the device into `dst`
  // (same geometry, sink and block; empty), each to the slot dst's ring gives it, and leaves dst
  // at next_position() = end with this cache's evicted positions. end >= the device's first
  // recent position, so that dst holds every position it has not evicted.
  absl::Status CopyPositionsInto(WindowCache& dst, int64_t end) const;
  // The options of Fork(positions, max_context): this cache's, with the ring widened to hold the
  // prefix's recent tokens when they exceed the window (a settling ring), or its errors.
  absl::StatusOr<WindowOptions> ForkOptions(int64_t positions, int64_t max_context) const;
  // Relayout to the configured window (its ring), ending the re-laid state.
  absl::Status Shrink();
  // Marks slots [first_slot, first_slot + count) empty (position -1, MAW fresh), on the host
  // mirror and the device (Release and Truncate).
  absl::Status EmptySlots(int64_t first_slot, int64_t count);
  int64_t SlotOf(int64_t pos) const;
  int64_t RecentTokens() const;

  Backend* backend_ = nullptr;
  WindowGeometry geometry_;
  WindowOptions options_;
  int64_t capacity_ = 0;
  int64_t ring_blocks_ = 0;
  int64_t scan_slots_ = 0;
  int64_t next_pos_ = 0;          // positions [0, next_pos_) have been appended
  int64_t evicted_tokens_ = 0;    // recent positions [sink, sink + evicted_tokens_) have left
  int64_t configured_window_ = 0; // while re-laid by Widen (until the shrink): the created one
  DeviceBuffer kv_;               // per layer: K then V, [layers][2][num_kv_heads][capacity][D]
  DeviceBuffer maw_;              // [layers][num_kv_heads][capacity] f32
  DeviceBuffer slot_pos_dev_;     // [capacity] i32
  ParkingSpace parked_;           // while parked (Park() gives its layout)
  std::vector<int32_t> slot_pos_; // host mirror of slot_pos_dev_
  std::vector<int32_t> new_slots_;
};

}  // namespace tandem::gpu_worker
