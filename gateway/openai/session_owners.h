// Which API key's principal owns each kept session the gateway routes (private to the
// gateway; used with --api_key_file). Behind the gateway every HTTP client reaches the workers
// as the gateway's one principal, so the worker cannot tell them apart: the gateway keeps the
// owner itself. A session named by a request belongs to the principal whose key first used it;
// another key's request on it (a generation or DELETE /v1/sessions/{id}) is PERMISSION_DENIED
// (403). That tells that the id is taken, which a client choosing its own ids learns anyway.
//
// Bounded: at most `max_sessions` ids (then new ids are RESOURCE_EXHAUSTED, 429, until some
// are deleted); entries never expire on their own, since a forgotten owner would let anyone
// take a live session over. Thread-safe.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"

namespace tandem::gateway {

class SessionOwners {
 public:
  explicit SessionOwners(size_t max_sessions) : max_sessions_(max_sessions) {}

  // OK when `principal` owns `id` or now does (a new id); PERMISSION_DENIED for another's,
  // RESOURCE_EXHAUSTED when the table is full.
  absl::Status Claim(const std::string& id, const std::string& principal);
  // PERMISSION_DENIED if another principal owns `id`; OK otherwise (unknown ids included).
  absl::Status Check(const std::string& id, const std::string& principal) const;
  void Forget(const std::string& id);

 private:
  const size_t max_sessions_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> owners_;  // session id -> principal
};

}  // namespace tandem::gateway
