#include "session_ownership.h"

#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker::internal {

absl::StatusOr<bool> SessionOwnership::Claim(const std::string& id, const std::string& principal) {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) {
    if (it->second.owner != principal) {
      return absl::PermissionDeniedError(
          absl::StrCat("session '", id, "' belongs to another caller"));
    }
    ++it->second.in_flight;
    return false;
  }
  uint32_t& held = per_principal_[principal];
  if (max_per_principal_ != 0 && held >= max_per_principal_) {
    if (held == 0) per_principal_.erase(principal);
    return absl::ResourceExhaustedError(
        absl::StrCat("this caller holds ", held,
                     " sessions, the most one caller may "
                     "(--max_sessions_per_principal); close one first"));
  }
  ++held;
  sessions_.emplace(id, Entry{principal, 1, false});
  return true;
}

bool SessionOwnership::Finished(const std::string& id, bool kept) {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return false;
  if (it->second.in_flight > 0) --it->second.in_flight;
  if (kept) {
    it->second.kept = true;
    return false;
  }
  if (it->second.kept || it->second.in_flight > 0) return false;
  EraseLocked(it);
  return true;
}

absl::Status SessionOwnership::CheckOwner(const std::string& id,
                                          const std::string& principal) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.owner != principal) {
    return absl::PermissionDeniedError(
        absl::StrCat("session '", id, "' belongs to another caller"));
  }
  return absl::OkStatus();
}

void SessionOwnership::Forget(const std::string& id) {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) EraseLocked(it);
}

void SessionOwnership::EraseLocked(std::map<std::string, Entry>::iterator it) {
  auto p = per_principal_.find(it->second.owner);
  if (p != per_principal_.end() && --p->second == 0) per_principal_.erase(p);
  sessions_.erase(it);
}

}  // namespace tandem::gpu_worker::internal
