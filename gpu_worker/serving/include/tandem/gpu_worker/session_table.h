// SessionTable: the engine's open sessions by id (running requests', kept conversations' opened
// with a session_id, and the prefix cache's), which generation uses each one now, the prefix
// cache scope of the kept ones, and the kept ones the engine closed on its own (LostSessions).
// It owns the sequences; what is cached and what is evicted is the KvCacheManager's to say
// (kv_cache_manager.h), what a request feeds the engine's.
//
// Not thread-safe: the engine's executor thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "tandem/gpu_worker/lost_sessions.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

struct Generation;

class SessionTable {
 public:
  // max_lost: how many lost session ids are remembered (the engine's max_sessions).
  explicit SessionTable(size_t max_lost) : lost_(max_lost) {}

  size_t size() const { return sessions_.size(); }
  bool contains(const std::string& id) const { return sessions_.count(id) != 0; }
  Sequence* Find(const std::string& id);
  const Sequence* Find(const std::string& id) const;
  // Adds `seq` under its id (replacing none: the id must be new); returns it.
  Sequence& Add(std::unique_ptr<Sequence> seq);
  // Closes session `id`: its tier's storage is freed (CPU node shards, host pages), its device
  // memory with the sequence, its kept scope forgotten. Returns the tier's close status;
  // NOT_FOUND when there is no such session.
  absl::Status Close(const std::string& id);
  // Closes kept session `id` after a failure of its own, remembering `reason` for the next
  // request that names it (LostSessions). A no-op for an unknown id.
  void CloseLost(const std::string& id, const std::string& reason);
  // A fresh id for a session no client names ("anon-N").
  std::string NewAnonymousId() { return "anon-" + std::to_string(next_anonymous_++); }

  // The generation using session `id` from Begin to End (null when none).
  void SetRunning(const std::string& id, Generation* generation) { running_[id] = generation; }
  void ClearRunning(const std::string& id) { running_.erase(id); }
  bool busy(const std::string& id) const { return running_.count(id) != 0; }
  Generation* running(const std::string& id) const;
  const std::map<std::string, Generation*>& running() const { return running_; }

  // Kept sessions and the prefix cache scope (Engine::CacheScope::own) they were opened in:
  // pinned prefixes that one-shot requests of that scope fork.
  void Keep(const std::string& id, std::string own_scope) { kept_[id] = std::move(own_scope); }
  const std::map<std::string, std::string>& kept() const { return kept_; }

  LostSessions& lost() { return lost_; }

  // Device bytes of every open session's window and page summaries (Sequence::device_bytes).
  size_t DeviceBytes() const;
  // Of the sessions `counted` accepts.
  template <typename Pred>
  size_t DeviceBytes(Pred counted) const {
    size_t bytes = 0;
    for (const auto& [id, seq] : sessions_) bytes += counted(id, *seq) ? seq->device_bytes() : 0;
    return bytes;
  }
  const std::map<std::string, std::unique_ptr<Sequence>>& all() const { return sessions_; }
  // Drops every session without closing tiers one by one (the engine's destruction, while the
  // node pool still exists).
  void Clear() { sessions_.clear(); running_.clear(); kept_.clear(); }

 private:
  std::map<std::string, std::unique_ptr<Sequence>> sessions_;
  std::map<std::string, Generation*> running_;
  std::map<std::string, std::string> kept_;
  LostSessions lost_;
  uint64_t next_anonymous_ = 0;
};

}  // namespace tandem::gpu_worker
