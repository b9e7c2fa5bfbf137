// KvCacheManager: which sessions' KV stays for reuse after their requests end, and what leaves
// which tier when a request needs room (DESIGN "KV reuse across requests"; prefix_cache.h).
//
// Tiers of a cached session:
//   device   its window and page summaries where they ran (every mode); its offloaded KV where
//            its tier holds it (CPU nodes, host pages)
//   host     parked: window and summaries copied into a ParkingPool (pinned host memory) and
//            their device memory freed; a prompt that hits it brings them back over PCIe
//   closed   gone (its tier's storage freed)
//
// Eviction is explicit and least recently used: the engine asks for room by running its attempt
// through WithEviction, which parks (device short) or closes (room short elsewhere: a CPU node's
// pool, host pages, the session limit) one cached session at a time until the attempt fits or
// nothing is cached. The cache never holds what a request needs.
//
// The sessions themselves are the SessionTable's; the manager decides which of them are cached
// and moves them between tiers. Not thread-safe: the engine's executor thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/memory_shortage.h"
#include "tandem/gpu_worker/parking_pool.h"
#include "tandem/gpu_worker/prefix_cache.h"
#include "tandem/gpu_worker/session_table.h"

namespace tandem::gpu_worker {

struct KvCacheOptions {
  int64_t block_tokens = 16;    // the hash granularity (the engine's KV block)
  int64_t min_tokens = 16;      // shortest prefix worth reusing
  size_t host_bytes = 0;        // parking pool (0: cached sessions are closed, never parked)
};

class KvCacheManager {
 public:
  // `check_device_room(bytes)`: RESOURCE_EXHAUSTED when `bytes` more of device KV would pass
  // the worker's budget (Engine::CheckDeviceKv). `sessions` and `backend` outlive the manager.
  KvCacheManager(Backend& backend, SessionTable& sessions, const KvCacheOptions& options,
                 std::function<absl::Status(size_t bytes)> check_device_room);
  // Closes the sessions still parked in its pool (their host pages go with it).
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  // --- The cache.
  // Session `id` (of cache scope `scope`) is cached as the most recently used, holding `tokens`.
  void Insert(const std::string& id, const std::string& scope, std::span<const int32_t> tokens);
  // Takes `id` out of the cache (a request continues it, or it is closed); false if not cached.
  bool Take(const std::string& id) { return prefix_.Take(id); }
  bool contains(const std::string& id) const { return prefix_.contains(id); }
  // The cached session of `scope` sharing the longest prefix (at least min_tokens) with
  // `prompt`: PrefixCache::Match over sessions that are open and not in use (others are dropped
  // from the cache on the way).
  std::optional<PrefixCache::Hit> Match(const std::string& scope,
                                        std::span<const int32_t> prompt);

  // --- Eviction and tiers.
  // Runs `attempt`, and again after each eviction while it fails with RESOURCE_EXHAUSTED and a
  // cached session holds the memory it was short of (memory_shortage.h; MakeRoomIn): device
  // memory is made by parking the least recently used cached session holding some (closed
  // when it cannot be parked), CPU-node or host-page memory by closing the least recently used
  // one holding that.
  absl::Status WithEviction(const std::function<absl::Status()>& attempt);
  // A session slot: closes the least recently used cached sessions while `max_sessions` are
  // open; RESOURCE_EXHAUSTED when all of them are in use.
  absl::Status MakeSessionRoom(size_t max_sessions);
  // Brings parked cached session `id` (of `scope`) back to the device, making room by evicting
  // other cached sessions; it stays cached, as the most recently used. False when the device
  // cannot take it (it stays parked) or the copy failed (it is closed).
  bool Unpark(const std::string& scope, const std::string& id);
  // Closes cached session `id` and counts the eviction.
  void Close(const std::string& id);

  // --- What it holds (metrics, GetModelInfo).
  const PrefixCache& prefix() const { return prefix_; }
  size_t cached_sessions() const { return prefix_.size(); }
  size_t parked_sessions() const;
  size_t device_bytes() const;        // device bytes of the cached sessions not parked
  size_t host_bytes() const { return parking_.in_use_bytes(); }   // whole pool pages in use
  // What the cached sessions hold, by where: device (windows and page summaries of those not
  // parked), host (the parking pool's pages in use and their tiers' host pages), nodes.
  TierFootprint footprint() const;
  size_t host_budget_bytes() const { return parking_.max_bytes(); }
  uint64_t evictions() const { return evictions_; }   // cached sessions closed for room
  uint64_t parks() const { return parks_; }
  uint64_t unparks() const { return unparks_; }

 private:
  // Frees memory of `kind` (the kind a RESOURCE_EXHAUSTED attempt was short of,
  // memory_shortage.h): device: EvictFromDevice (parked sessions hold none and stay cached);
  // host pages or CPU nodes: the least recently used cached session whose tier holds that kind
  // is closed (parking would free device memory only). False when nothing cached holds it.
  bool MakeRoomIn(MemoryKind kind);
  // Parks (or, when it cannot be parked, closes) the least recently used cached session holding
  // device memory; false when none does.
  bool EvictFromDevice();
  // Closes the least recently used cached session, parked or not; false when none is cached.
  bool CloseLeastRecentlyUsed();
  // Parks cached session `id` within the pool, closing the least recently used parked sessions
  // to make room; false (nothing parked) when it cannot be.
  bool Park(const std::string& id);

  SessionTable& sessions_;
  KvCacheOptions options_;
  std::function<absl::Status(size_t)> check_device_room_;
  PrefixCache prefix_;
  ParkingPool parking_;   // the destructor closes the sessions parked in it first
  uint64_t evictions_ = 0;
  uint64_t parks_ = 0;
  uint64_t unparks_ = 0;
};

}  // namespace tandem::gpu_worker
