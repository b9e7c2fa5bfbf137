// LostSessions: the kept sessions the engine closed on its own after they had completed a turn
// (a failed pass or settle, a turn stopped mid-prompt), each with the reason. Without it the
// next request naming such a session would silently start a new one without the context the
// client believes is there; with it that request fails once with FAILED_PRECONDITION saying
// why (Engine::Begin), and the client starts over knowingly.
//
// Bounded: at most `capacity` ids (the engine's max_sessions); the oldest is dropped first, so
// a client that never comes back costs one entry for a while, never unbounded memory.
//
// Not thread-safe: the engine's thread only.
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <optional>
#include <string>

namespace tandem::gpu_worker {

class LostSessions {
 public:
  explicit LostSessions(size_t capacity) : capacity_(capacity) {}
  // Moves keep the entries' list iterators valid (std::list moves its nodes); copies would not.
  LostSessions(LostSessions&&) = default;
  LostSessions& operator=(LostSessions&&) = default;
  LostSessions(const LostSessions&) = delete;
  LostSessions& operator=(const LostSessions&) = delete;

  // Remembers that `id` was closed because of `reason` (replacing an earlier entry).
  void Remember(const std::string& id, std::string reason);
  // The reason `id` was lost, forgotten once returned (the next request with it starts a new
  // session); nullopt when it was not lost.
  std::optional<std::string> Take(const std::string& id);
  // Forgets `id` (the client closed it); true if it was remembered.
  bool Forget(const std::string& id);
  size_t size() const { return reasons_.size(); }

 private:
  struct Entry {
    std::string reason;
    std::list<std::string>::iterator age;   // its place in oldest_first_
  };
  size_t capacity_;
  std::list<std::string> oldest_first_;
  std::map<std::string, Entry> reasons_;
};

}  // namespace tandem::gpu_worker
