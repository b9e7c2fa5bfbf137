#include "tandem/gpu_worker/kv_cache_manager.h"

#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

KvCacheManager::KvCacheManager(Backend& backend, SessionTable& sessions,
                               const KvCacheOptions& options,
                               std::function<absl::Status(size_t bytes)> check_device_room)
    : sessions_(sessions),
      options_(options),
      check_device_room_(std::move(check_device_room)),
      prefix_(options.block_tokens),
      parking_(backend, options.host_bytes) {}

KvCacheManager::~KvCacheManager() {
  std::vector<std::string> parked;
  for (const auto& [id, seq] : sessions_.all()) {
    if (seq->parked()) parked.push_back(id);
  }
  for (const std::string& id : parked) (void)sessions_.Close(id);
}

void KvCacheManager::Insert(const std::string& id, const std::string& scope,
                            std::span<const int32_t> tokens) {
  prefix_.Insert(id, scope, tokens);
}

std::optional<PrefixCache::Hit> KvCacheManager::Match(const std::string& scope,
                                                      std::span<const int32_t> prompt) {
  std::optional<PrefixCache::Hit> hit = prefix_.Match(scope, prompt, options_.min_tokens);
  if (hit.has_value() && (!sessions_.contains(hit->session_id) || sessions_.busy(hit->session_id))) {
    prefix_.Take(hit->session_id);   // not a cached session any more
    hit.reset();
  }
  return hit;
}

absl::Status KvCacheManager::WithEviction(const std::function<absl::Status()>& attempt) {
  absl::Status status = attempt();
  while (absl::IsResourceExhausted(status) && MakeRoomIn(ShortOf(status))) status = attempt();
  return status;
}

bool KvCacheManager::MakeRoomIn(MemoryKind kind) {
  // Parked sessions hold no device memory: closing them would empty the cache and free nothing
  // the request lacks.
  if (kind == MemoryKind::kDevice) return EvictFromDevice();
  const std::optional<std::string> lru = prefix_.LeastRecentlyUsed([&](const std::string& id) {
    const Sequence* seq = sessions_.Find(id);
    if (seq == nullptr || seq->offload == nullptr) return false;
    const TierFootprint held = seq->offload->footprint();
    return (kind == MemoryKind::kNodes ? held.nodes : held.host) > 0;
  });
  if (!lru.has_value()) return false;
  Close(*lru);
  return true;
}

absl::Status KvCacheManager::MakeSessionRoom(size_t max_sessions) {
  while (sessions_.size() >= max_sessions) {
    if (!CloseLeastRecentlyUsed()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", max_sessions, " sessions are in use"));
    }
  }
  return absl::OkStatus();
}

bool KvCacheManager::EvictFromDevice() {
  const std::optional<std::string> lru = prefix_.LeastRecentlyUsed([&](const std::string& id) {
    const Sequence* seq = sessions_.Find(id);
    return seq == nullptr || seq->device_bytes() > 0;
  });
  if (!lru.has_value()) return false;
  const Sequence* seq = sessions_.Find(*lru);
  // (A parked session still holding device bytes cannot be parked again: closed.)
  if (seq == nullptr || seq->parked() || !Park(*lru)) Close(*lru);
  return true;
}

bool KvCacheManager::CloseLeastRecentlyUsed() {
  const std::optional<std::string> lru = prefix_.LeastRecentlyUsed();
  if (!lru.has_value()) return false;
  Close(*lru);
  return true;
}

bool KvCacheManager::Park(const std::string& id) {
  Sequence* seq = sessions_.Find(id);
  if (parking_.max_bytes() == 0 || seq == nullptr) return false;
  if (parking_.PagesFor(seq->ParkBytes()) * parking_.page_bytes() > parking_.max_bytes()) {
    return false;
  }
  auto is_parked = [&](const std::string& other) {
    const Sequence* o = sessions_.Find(other);
    return o != nullptr && o->parked();
  };
  for (;;) {
    const absl::Status parked = seq->Park(parking_);
    if (parked.ok()) break;
    // The pool is full: the least recently used parked session makes room.
    const std::optional<std::string> oldest =
        absl::IsResourceExhausted(parked) ? prefix_.LeastRecentlyUsed(is_parked) : std::nullopt;
    if (!oldest.has_value()) {
      spdlog::debug("prefix cache: {} not parked: {}", id, parked.ToString());
      return false;
    }
    Close(*oldest);
  }
  ++parks_;
  return true;
}

bool KvCacheManager::Unpark(const std::string& scope, const std::string& id) {
  Sequence& seq = *sessions_.Find(id);
  // Out of the cache while room is made, so that the room is not made by closing it (to park
  // another session in its host room); back in as the most recently used.
  const bool cached = prefix_.Take(id);
  auto recache = absl::MakeCleanup([&] {
    if (cached) prefix_.Insert(id, scope, seq.tokens);
  });
  const absl::Status unparked = WithEviction([&]() -> absl::Status {
    TANDEM_RETURN_IF_ERROR(check_device_room_(seq.resident_bytes()));
    return seq.Unpark();
  });
  if (unparked.ok()) {
    ++unparks_;
    return true;
  }
  spdlog::info("prefix cache: {} stays parked: {}", id, unparked.ToString());
  if (!absl::IsResourceExhausted(unparked)) {
    std::move(recache).Cancel();   // a failed copy: its state is not to be trusted
    Close(id);
  }
  return false;
}

void KvCacheManager::Close(const std::string& id) {
  prefix_.Take(id);
  if (sessions_.contains(id)) {
    if (absl::Status closed = sessions_.Close(id); !closed.ok()) {
      spdlog::warn("prefix cache: evicting {}: {}", id, closed.ToString());
    }
  }
  ++evictions_;
}

size_t KvCacheManager::parked_sessions() const {
  size_t count = 0;
  for (const auto& [id, seq] : sessions_.all()) count += seq->parked() ? 1 : 0;
  return count;
}

TierFootprint KvCacheManager::footprint() const {
  TierFootprint f{device_bytes(), host_bytes(), 0};
  for (const auto& [id, seq] : sessions_.all()) {
    if (!prefix_.contains(id) || seq->offload == nullptr) continue;
    const TierFootprint tier = seq->offload->footprint();
    f.host += tier.host;
    f.nodes += tier.nodes;
  }
  return f;
}

size_t KvCacheManager::device_bytes() const {
  return sessions_.DeviceBytes(
      [&](const std::string& id, const Sequence&) { return prefix_.contains(id); });
}

}  // namespace tandem::gpu_worker
