#include "session_leases.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/cpu_attention/session_lease.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::cpu_attention {

absl::Status CheckSessionLease(const v1::SessionLease& lease) {
  if (absl::Status s = kv_store::ValidateName("lease holder", lease.holder()); !s.ok()) return s;
  if (lease.incarnation() == 0) {
    return absl::InvalidArgumentError("lease incarnation must be > 0");
  }
  if (lease.period_ms() < kMinLeasePeriodMs || lease.period_ms() > kMaxLeasePeriodMs) {
    return absl::InvalidArgumentError(absl::StrCat("lease period_ms must be in ",
                                                   kMinLeasePeriodMs, "..", kMaxLeasePeriodMs,
                                                   ", got ", lease.period_ms()));
  }
  return absl::OkStatus();
}

namespace internal {

absl::StatusOr<SessionLeases::Renewal> SessionLeases::Renew(const std::string& principal,
                                                            const v1::SessionLease& lease,
                                                            Clock::time_point now) {
  Renewal renewal;
  {
    std::lock_guard lock(mu_);
    const Key key{principal, lease.holder()};
    auto it = leases_.find(key);
    if (it == leases_.end()) {
      if (leases_.size() >= kMaxLeases && !PruneLocked(now)) {
        return absl::ResourceExhaustedError(
            absl::StrCat("the node keeps ", kMaxLeases, " live leases, its most"));
      }
      it = leases_.emplace(key, Lease{}).first;
      it->second.incarnation = lease.incarnation();
    }
    Lease& held = it->second;
    const bool lapsed = held.deadline <= now;
    if (lease.incarnation() < held.incarnation && !lapsed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "lease of holder '", lease.holder(), "': incarnation ", lease.incarnation(),
          " is superseded by ", held.incarnation,
          " (a newer process of this holder; give each worker its own --worker_name)"));
    }
    if (lease.incarnation() != held.incarnation) {
      for (const std::string& id : held.sessions) lease_of_.erase(id);
      renewal.superseded.assign(held.sessions.begin(), held.sessions.end());
      held.sessions.clear();
      held.lapsed = 0;
      held.incarnation = lease.incarnation();
    }
    held.period = std::chrono::milliseconds(lease.period_ms());
    held.deadline = now + 2 * held.period;
    renewal.sessions = static_cast<uint32_t>(held.sessions.size());
    renewal.lapsed = std::exchange(held.lapsed, 0);
  }
  changed_.notify_all();   // the earliest deadline may have moved
  return renewal;
}

absl::Status SessionLeases::Attach(const std::string& session_id, const std::string& principal,
                                   const v1::SessionLease& lease) {
  {
    std::lock_guard lock(mu_);
    auto it = leases_.find(Key{principal, lease.holder()});
    if (it == leases_.end() || it->second.incarnation != lease.incarnation()) {
      return absl::FailedPreconditionError(
          absl::StrCat("lease of holder '", lease.holder(), "': incarnation ",
                       lease.incarnation(), " was superseded while the session opened"));
    }
    it->second.sessions.insert(session_id);
    lease_of_[session_id] = it->first;
  }
  changed_.notify_all();   // a lease with sessions now has a deadline to wait for
  return absl::OkStatus();
}

void SessionLeases::Detach(const std::string& session_id) {
  std::lock_guard lock(mu_);
  auto it = lease_of_.find(session_id);
  if (it == lease_of_.end()) return;
  auto lease = leases_.find(it->second);
  if (lease != leases_.end()) lease->second.sessions.erase(session_id);
  lease_of_.erase(it);
}

std::vector<std::string> SessionLeases::TakeLapsed(Clock::time_point now) {
  std::lock_guard lock(mu_);
  return TakeLapsedLocked(now);
}

std::vector<std::string> SessionLeases::TakeLapsedLocked(Clock::time_point now) {
  std::vector<std::string> lapsed;
  for (auto& [key, lease] : leases_) {
    if (lease.sessions.empty() || lease.deadline > now) continue;
    for (const std::string& id : lease.sessions) {
      lapsed.push_back(id);
      lease_of_.erase(id);
    }
    lease.lapsed += static_cast<uint32_t>(lease.sessions.size());
    lease.sessions.clear();
  }
  return lapsed;
}

std::vector<std::string> SessionLeases::WaitLapsed() {
  std::unique_lock lock(mu_);
  while (!stopped_) {
    std::vector<std::string> lapsed = TakeLapsedLocked(Clock::now());
    if (!lapsed.empty()) return lapsed;
    const Clock::time_point next = NextDeadlineLocked();
    if (next == Clock::time_point::max()) {
      changed_.wait(lock);
    } else {
      changed_.wait_until(lock, next);
    }
  }
  return {};
}

void SessionLeases::Stop() {
  {
    std::lock_guard lock(mu_);
    stopped_ = true;
  }
  changed_.notify_all();
}

size_t SessionLeases::leases() const {
  std::lock_guard lock(mu_);
  return leases_.size();
}

SessionLeases::Clock::time_point SessionLeases::NextDeadlineLocked() const {
  Clock::time_point next = Clock::time_point::max();
  for (const auto& [key, lease] : leases_) {
    if (!lease.sessions.empty()) next = std::min(next, lease.deadline);
  }
  return next;
}

bool SessionLeases::PruneLocked(Clock::time_point now) {
  const size_t before = leases_.size();
  std::erase_if(leases_, [now](const auto& entry) {
    return entry.second.sessions.empty() && entry.second.deadline <= now;
  });
  return leases_.size() < before;
}

}  // namespace internal
}  // namespace tandem::cpu_attention
