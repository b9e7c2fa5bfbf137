// The gateway's stored Responses API answers (POST /v1/responses with store: true, the default):
// what previous_response_id continues and GET / DELETE /v1/responses/{id} read. Private to
// tandem::gateway.
//
// Each entry keeps the conversation up to and including the answer, as chat messages
// [{role, content}] (the next turn's prompt starts with it, so the worker's prefix cache serves
// it), and the response object. Entries belong to the API key's principal that made them: any
// other principal is answered exactly as for an unknown id (no oracle). The store is in memory,
// least-recently-used first out past max_entries or max_bytes (a conversation's bytes are
// counted once per entry, so a long chat costs its length times its turns: bounded by the
// budget, not by the client).
//
// Thread-safe (one mutex).
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

class ResponseStore {
 public:
  struct Entry {
    std::string principal;
    nlohmann::ordered_json conversation;   // chat messages up to and including the answer
    nlohmann::ordered_json response;       // the response object
  };

  ResponseStore(size_t max_entries, size_t max_bytes)
      : max_entries_(max_entries), max_bytes_(max_bytes) {}

  // Stores `entry` under `id` (replacing one of that id), then evicts the least recently used
  // past the bounds. An entry larger than max_bytes alone is not stored (false).
  bool Put(const std::string& id, Entry entry);
  // The entry of `id` if `principal` made it; NOT_FOUND "Response with id '<id>' not found."
  // otherwise. Marks it recently used.
  absl::StatusOr<std::shared_ptr<const Entry>> Get(const std::string& id,
                                                   const std::string& principal);
  // Removes `id` if `principal` made it; NOT_FOUND as Get otherwise.
  absl::Status Delete(const std::string& id, const std::string& principal);

  size_t entries() const;
  size_t bytes() const;

 private:
  struct Slot {
    std::shared_ptr<const Entry> entry;
    size_t bytes = 0;
    std::list<std::string>::iterator lru;   // position in lru_
  };
  void EraseLocked(std::unordered_map<std::string, Slot>::iterator it);

  const size_t max_entries_;
  const size_t max_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Slot> slots_;
  std::list<std::string> lru_;   // most recently used first
  size_t bytes_ = 0;
};

}  // namespace tandem::gateway
