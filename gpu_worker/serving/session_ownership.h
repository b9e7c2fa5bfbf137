// Which principal owns each kept session of the worker (private to gpu_serving; used by
// generation_service.cc).
//
// A kept session (GenerateRequest.session_id) belongs to the principal whose Generate created
// it (tandem/security/authenticator.h: token or client certificate; kAnonymous in the insecure
// mode, where everyone is that one principal). Another principal's Generate or CloseSession on
// it gets PERMISSION_DENIED and nothing runs. That answer tells that the id is taken, which a
// client choosing its own ids must learn anyway (it could never use it); no call reads or
// changes another principal's session. Clients should choose random ids.
//
// Sessions per principal are bounded (created + being created). A session whose first request
// fails is forgotten (the service also closes it in the engine), so a failed attempt neither
// keeps a slot nor blocks the id.
//
// Thread-safe (one mutex).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::gpu_worker::internal {

class SessionOwnership {
 public:
  // max_per_principal: kept sessions one principal may hold; 0 = no bound.
  explicit SessionOwnership(uint32_t max_per_principal) : max_per_principal_(max_per_principal) {}

  // Before a Generate on session `id`: PERMISSION_DENIED if another principal owns it,
  // RESOURCE_EXHAUSTED if it is new and `principal` holds the most sessions allowed. Returns
  // true when this call creates the entry. Every OK Claim is followed by one Finished.
  absl::StatusOr<bool> Claim(const std::string& id, const std::string& principal);
  // After that Generate: `kept` = it succeeded and the session stays open. Returns true when
  // the session was never kept and is now forgotten (the caller closes it in the engine).
  bool Finished(const std::string& id, bool kept);
  // Before CloseSession: PERMISSION_DENIED if another principal owns `id`.
  absl::Status CheckOwner(const std::string& id, const std::string& principal) const;
  // After CloseSession: forgets `id`.
  void Forget(const std::string& id);

 private:
  struct Entry {
    std::string owner;
    uint32_t in_flight = 0;  // Generates on it now
    bool kept = false;       // a Generate on it succeeded with the session kept
  };
  void EraseLocked(std::map<std::string, Entry>::iterator it);

  const uint32_t max_per_principal_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> sessions_;          // by session id
  std::map<std::string, uint32_t> per_principal_;  // entries, by principal
};

}  // namespace tandem::gpu_worker::internal
