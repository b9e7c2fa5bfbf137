// The leases of a CPU node's sessions (private to cpu_attention; used by cpu_attention_node.cc):
// which sessions belong to which worker process, and when they lapse (cpu_attention.proto,
// "Leases").
//
// A lease is keyed by (principal, holder): one principal cannot renew, supersede or expire
// another's. It records the holder's newest incarnation, its period and its deadline (last
// renewal + 2 x period). Sessions attach to the lease they were opened with and leave it when
// they close. The table is bounded (kMaxLeases): an idle lapsed lease is dropped to make room.
//
// Time is the node's steady clock, passed in by every call (tests drive it); WaitExpired is the
// one blocking call, for the node's reaper thread.
//
// Thread-safe (one mutex; no call out of this class under it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::internal {

class SessionLeases {
 public:
  using Clock = std::chrono::steady_clock;

  static constexpr size_t kMaxLeases = 4096;

  struct Renewal {
    uint32_t sessions = 0;         // attached to the lease now
    uint32_t lapsed = 0;           // closed for lapsing since the previous renewal
    // Sessions of older incarnations, detached by this call: the caller closes them.
    std::vector<std::string> superseded;
  };
  // Renews (principal, lease.holder) until now + 2 x period, creating it if absent. A newer
  // incarnation (or any, once the lease lapsed) takes the lease over and detaches the older
  // incarnations' sessions; an older one is FAILED_PRECONDITION. RESOURCE_EXHAUSTED when the
  // table is full of live leases. The lease passed CheckSessionLease (session_lease.h).
  absl::StatusOr<Renewal> Renew(const std::string& principal, const v1::SessionLease& lease,
                                Clock::time_point now);

  // Attaches an opened session to its lease. FAILED_PRECONDITION when the lease is gone or a
  // newer incarnation took it over since Renew (the caller closes the session).
  absl::Status Attach(const std::string& session_id, const std::string& principal,
                      const v1::SessionLease& lease);
  // Detaches a closed session (no-op for one without a lease).
  void Detach(const std::string& session_id);

  // Detaches and returns the sessions of every lease whose deadline is <= now (their leases
  // count them as lapsed for the next renewal).
  std::vector<std::string> TakeLapsed(Clock::time_point now);
  // Blocks until some lease with sessions lapses or Stop(); returns its sessions (detached, as
  // TakeLapsed), or nothing once stopped.
  std::vector<std::string> WaitLapsed();
  // Makes WaitLapsed return at once, now and later.
  void Stop();

  size_t leases() const;

 private:
  using Key = std::pair<std::string, std::string>;   // (principal, holder)
  struct Lease {
    uint64_t incarnation = 0;
    std::chrono::milliseconds period{0};
    Clock::time_point deadline;
    std::set<std::string> sessions;
    uint32_t lapsed = 0;   // since the last renewal
  };
  std::vector<std::string> TakeLapsedLocked(Clock::time_point now);
  // Earliest deadline of a lease with sessions; Clock::time_point::max() if none.
  Clock::time_point NextDeadlineLocked() const;
  // Drops idle lapsed leases; returns whether one was dropped.
  bool PruneLocked(Clock::time_point now);

  mutable std::mutex mu_;
  std::condition_variable changed_;
  bool stopped_ = false;
  std::map<Key, Lease> leases_;
  std::map<std::string, Key> lease_of_;   // session id -> its lease
};

}  // namespace tandem::cpu_attention::internal
