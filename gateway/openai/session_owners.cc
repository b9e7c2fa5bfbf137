#include "session_owners.h"

#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

absl::Status NotYours(const std::string& id) {
  return absl::PermissionDeniedError(absl::StrCat("session '", id, "' belongs to another API key"));
}

}  // namespace

absl::Status SessionOwners::Claim(const std::string& id, const std::string& principal) {
  std::lock_guard lock(mu_);
  auto it = owners_.find(id);
  if (it != owners_.end()) return it->second == principal ? absl::OkStatus() : NotYours(id);
  if (owners_.size() >= max_sessions_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the gateway tracks ", max_sessions_, " sessions; delete some (DELETE /v1/sessions/{id})"));
  }
  owners_.emplace(id, principal);
  return absl::OkStatus();
}

absl::Status SessionOwners::Check(const std::string& id, const std::string& principal) const {
  std::lock_guard lock(mu_);
  auto it = owners_.find(id);
  return it == owners_.end() || it->second == principal ? absl::OkStatus() : NotYours(id);
}

void SessionOwners::Forget(const std::string& id) {
  std::lock_guard lock(mu_);
  owners_.erase(id);
}

}  // namespace tandem::gateway
