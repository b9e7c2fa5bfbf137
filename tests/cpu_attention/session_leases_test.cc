// Leases of node sessions (cpu_attention.proto "Leases"; issue 26): the bookkeeping
// (cpu_attention/node/src/session_leases.h) on a clock the test drives, and a CpuAttentionNode that
// closes a lapsed or superseded lease's sessions on its own reaper thread.
#include "session_leases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "service_test_util.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/session_lease.h"

namespace tandem::cpu_attention {
namespace {

using internal::SessionLeases;
using testing::Geometry;
using testing::OpenRequest;
using Clock = SessionLeases::Clock;
using std::chrono::milliseconds;

v1::SessionLease Lease(const std::string& holder, uint64_t incarnation, uint32_t period_ms) {
  v1::SessionLease lease;
  lease.set_holder(holder);
  lease.set_incarnation(incarnation);
  lease.set_period_ms(period_ms);
  return lease;
}

std::vector<std::string> Sorted(std::vector<std::string> ids) {
  std::sort(ids.begin(), ids.end());
  return ids;
}

TEST(SessionLeasesTest, MalformedLeasesNameTheField) {
  EXPECT_TRUE(CheckSessionLease(Lease("w-1:50051", 1, 1000)).ok());
  const absl::Status holder = CheckSessionLease(Lease("w 1", 1, 1000));
  EXPECT_EQ(holder.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(holder.message().find("lease holder"), std::string::npos) << holder;
  EXPECT_EQ(CheckSessionLease(Lease("", 1, 1000)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckSessionLease(Lease(std::string(129, 'a'), 1, 1000)).code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status incarnation = CheckSessionLease(Lease("w", 0, 1000));
  EXPECT_NE(incarnation.message().find("incarnation"), std::string::npos) << incarnation;
  for (uint32_t period : {0u, 99u, 3600001u}) {
    const absl::Status s = CheckSessionLease(Lease("w", 1, period));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << period;
    EXPECT_NE(s.message().find("period_ms"), std::string::npos) << s;
  }
}

TEST(SessionLeasesTest, ALeaseLapsesTwoPeriodsAfterItsLastRenewal) {
  SessionLeases leases;
  const Clock::time_point t0 = Clock::now();
  const v1::SessionLease lease = Lease("w", 7, 1000);
  ASSERT_TRUE(leases.Renew("p", lease, t0).ok());
  ASSERT_TRUE(leases.Attach("a", "p", lease).ok());
  ASSERT_TRUE(leases.Attach("b", "p", lease).ok());
  EXPECT_TRUE(leases.TakeLapsed(t0 + milliseconds(1999)).empty());
  // A renewal at 1.5 s moves the deadline to 3.5 s.
  absl::StatusOr<SessionLeases::Renewal> renewed = leases.Renew("p", lease, t0 + milliseconds(1500));
  ASSERT_TRUE(renewed.ok());
  EXPECT_EQ(renewed->sessions, 2u);
  EXPECT_EQ(renewed->lapsed, 0u);
  EXPECT_TRUE(leases.TakeLapsed(t0 + milliseconds(3499)).empty());
  EXPECT_EQ(Sorted(leases.TakeLapsed(t0 + milliseconds(3500))),
            (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(leases.TakeLapsed(t0 + milliseconds(9000)).empty());   // taken once
  // The holder's next renewal learns what it lost, once.
  renewed = leases.Renew("p", lease, t0 + milliseconds(9000));
  ASSERT_TRUE(renewed.ok());
  EXPECT_EQ(renewed->sessions, 0u);
  EXPECT_EQ(renewed->lapsed, 2u);
  renewed = leases.Renew("p", lease, t0 + milliseconds(9001));
  EXPECT_EQ(renewed->lapsed, 0u);
}

TEST(SessionLeasesTest, ANewerIncarnationSupersedesTheOlderAtOnce) {
  SessionLeases leases;
  const Clock::time_point t0 = Clock::now();
  const v1::SessionLease old_process = Lease("w", 100, 60000);
  ASSERT_TRUE(leases.Renew("p", old_process, t0).ok());
  ASSERT_TRUE(leases.Attach("a", "p", old_process).ok());
  ASSERT_TRUE(leases.Attach("b", "p", old_process).ok());
  leases.Detach("b");   // closed by its owner
  // The restarted process (a larger incarnation) frees "a" at its first call, long before the
  // old lease would lapse.
  absl::StatusOr<SessionLeases::Renewal> renewal =
      leases.Renew("p", Lease("w", 200, 60000), t0 + milliseconds(10));
  ASSERT_TRUE(renewal.ok()) << renewal.status();
  EXPECT_EQ(renewal->superseded, (std::vector<std::string>{"a"}));
  EXPECT_EQ(renewal->sessions, 0u);
  // The old process is told, and cannot attach sessions to the lease any more.
  const absl::StatusOr<SessionLeases::Renewal> stale =
      leases.Renew("p", old_process, t0 + milliseconds(20));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.status().message().find("superseded by 200"), std::string::npos)
      << stale.status();
  EXPECT_EQ(leases.Attach("c", "p", old_process).code(), absl::StatusCode::kFailedPrecondition);
  // Once the newer lease lapsed, any incarnation takes it (a clock that went back heals).
  EXPECT_TRUE(leases.Renew("p", old_process, t0 + milliseconds(200000)).ok());
}

TEST(SessionLeasesTest, PrincipalsAndHoldersAreSeparateLeases) {
  SessionLeases leases;
  const Clock::time_point t0 = Clock::now();
  ASSERT_TRUE(leases.Renew("alice", Lease("w", 5, 1000), t0).ok());
  ASSERT_TRUE(leases.Attach("a", "alice", Lease("w", 5, 1000)).ok());
  ASSERT_TRUE(leases.Renew("alice", Lease("v", 5, 1000), t0).ok());
  ASSERT_TRUE(leases.Attach("v1", "alice", Lease("v", 5, 1000)).ok());
  // Another principal naming the same holder with a newer incarnation has its own lease.
  absl::StatusOr<SessionLeases::Renewal> mallory =
      leases.Renew("mallory", Lease("w", 9, 100), t0 + milliseconds(1));
  ASSERT_TRUE(mallory.ok());
  EXPECT_TRUE(mallory->superseded.empty());
  EXPECT_EQ(leases.leases(), 3u);
  // Only alice's "w" lapses when only "v" is renewed.
  ASSERT_TRUE(leases.Renew("alice", Lease("v", 5, 1000), t0 + milliseconds(1500)).ok());
  EXPECT_EQ(leases.TakeLapsed(t0 + milliseconds(2500)), (std::vector<std::string>{"a"}));
}

TEST(SessionLeasesTest, TheTableIsBoundedAndIdleLapsedLeasesMakeRoom) {
  SessionLeases leases;
  const Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < SessionLeases::kMaxLeases; ++i) {
    ASSERT_TRUE(leases.Renew("p", Lease("h" + std::to_string(i), 1, 100), t0).ok());
  }
  const absl::StatusOr<SessionLeases::Renewal> full =
      leases.Renew("p", Lease("one-more", 1, 100), t0 + milliseconds(10));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(leases.Renew("p", Lease("one-more", 1, 100), t0 + milliseconds(200)).ok());
  EXPECT_EQ(leases.leases(), 1u);
}

TEST(SessionLeasesTest, WaitLapsedWakesAtTheDeadlineAndOnStop) {
  SessionLeases leases;
  const v1::SessionLease lease = Lease("w", 1, 100);
  ASSERT_TRUE(leases.Renew("p", lease, Clock::now()).ok());
  ASSERT_TRUE(leases.Attach("a", "p", lease).ok());
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(leases.WaitLapsed(), (std::vector<std::string>{"a"}));
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, milliseconds(150));
  EXPECT_LT(waited, milliseconds(1000));
  std::thread stopper([&leases] {
    std::this_thread::sleep_for(milliseconds(50));
    leases.Stop();
  });
  EXPECT_TRUE(leases.WaitLapsed().empty());
  stopper.join();
}

// The node: a lapsed lease's sessions close on the reaper thread within 2 periods (plus the
// reaper's wake-up), others stay; a newer incarnation frees its predecessor's at once.
class NodeLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodeOptions options;
    options.pool_bytes = 64ull << 20;
    options.threads = 1;
    absl::StatusOr<std::unique_ptr<CpuAttentionNode>> node = CpuAttentionNode::Create(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = *std::move(node);
  }

  absl::Status Open(const std::string& id, const v1::SessionLease* lease,
                    const std::string& caller = "worker") {
    v1::OpenSessionRequest request = OpenRequest(id, Geometry{1, 4, 1, 64}, 16, true, 0);
    if (lease != nullptr) *request.mutable_lease() = *lease;
    v1::OpenSessionResponse response;
    return node_->OpenSession(request, &response, caller);
  }

  absl::StatusOr<v1::RenewLeaseResponse> Renew(const v1::SessionLease& lease,
                                               const std::string& caller = "worker") {
    v1::RenewLeaseRequest request;
    *request.mutable_lease() = lease;
    v1::RenewLeaseResponse response;
    if (absl::Status s = node_->RenewLease(request, &response, caller); !s.ok()) return s;
    return response;
  }

  // Polls Stats().sessions until it equals `want` or `limit` passes; returns the time taken.
  Clock::duration WaitForSessions(uint32_t want, Clock::duration limit) {
    const Clock::time_point start = Clock::now();
    while (node_->Stats().sessions() != want && Clock::now() - start < limit) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    return Clock::now() - start;
  }

  std::unique_ptr<CpuAttentionNode> node_;
};

TEST_F(NodeLeaseTest, ALapsedLeasesSessionsCloseWithinTwoPeriods) {
  constexpr uint32_t kPeriodMs = 200;
  const v1::SessionLease lease = Lease("worker-a:1", 1, kPeriodMs);
  const Clock::time_point opened = Clock::now();
  ASSERT_TRUE(Open("s1", &lease).ok());
  ASSERT_TRUE(Open("s2", &lease).ok());
  ASSERT_TRUE(Open("unleased", nullptr).ok());
  const uint64_t free_before_close = node_->Stats().free_bytes();
  ASSERT_EQ(node_->Stats().sessions(), 3u);
  ASSERT_EQ(node_->Stats().leases(), 1u);
  WaitForSessions(1, milliseconds(3000));
  const auto closed_after = Clock::now() - opened;
  ASSERT_EQ(node_->Stats().sessions(), 1u);
  // Not before 2 periods after the last renewal (the second OpenSession), and promptly after.
  EXPECT_GE(closed_after, milliseconds(2 * kPeriodMs));
  EXPECT_LT(closed_after, milliseconds(2 * kPeriodMs + 300));
  EXPECT_EQ(node_->Stats().sessions_expired(), 2u);
  EXPECT_GT(node_->Stats().free_bytes(), free_before_close);   // their charge came back
  // The closed ids are free for new sessions; the unleased one is still there.
  v1::CloseSessionRequest close;
  close.set_session_id("unleased");
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(node_->CloseSession(close, &closed, "worker").ok());
  absl::StatusOr<v1::RenewLeaseResponse> renewal = Renew(lease);
  ASSERT_TRUE(renewal.ok()) << renewal.status();
  EXPECT_EQ(renewal->lapsed_sessions(), 2u);
  EXPECT_EQ(renewal->sessions(), 0u);
  EXPECT_TRUE(Open("s1", &lease).ok());
}

TEST_F(NodeLeaseTest, RenewalsKeepSessionsPastManyPeriods) {
  const v1::SessionLease lease = Lease("worker-a:1", 1, 100);
  ASSERT_TRUE(Open("s1", &lease).ok());
  for (int i = 0; i < 10; ++i) {   // 10 x 60 ms = 3 periods x 2
    std::this_thread::sleep_for(milliseconds(60));
    absl::StatusOr<v1::RenewLeaseResponse> renewal = Renew(lease);
    ASSERT_TRUE(renewal.ok()) << renewal.status();
    EXPECT_EQ(renewal->sessions(), 1u);
  }
  EXPECT_EQ(node_->Stats().sessions(), 1u);
  EXPECT_EQ(node_->Stats().sessions_expired(), 0u);
}

TEST_F(NodeLeaseTest, ARestartedWorkerFreesItsPredecessorsSessionsAtOnce) {
  const v1::SessionLease before = Lease("worker-a:1", 1000, 60000);   // lapses in 2 minutes
  ASSERT_TRUE(Open("s1", &before).ok());
  ASSERT_TRUE(Open("s2", &before).ok());
  const v1::SessionLease other_worker = Lease("worker-b:1", 5, 60000);
  ASSERT_TRUE(Open("b1", &other_worker).ok());
  const v1::SessionLease after = Lease("worker-a:1", 2000, 60000);
  absl::StatusOr<v1::RenewLeaseResponse> renewal = Renew(after);
  ASSERT_TRUE(renewal.ok()) << renewal.status();
  EXPECT_EQ(renewal->superseded_sessions(), 2u);
  EXPECT_EQ(node_->Stats().sessions(), 1u);   // worker-b's stays
  EXPECT_EQ(node_->Stats().sessions_expired(), 2u);
  // The old process, if it still runs, is refused with a reason and cannot open more.
  const absl::Status stale = Open("s3", &before);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.message().find("--worker_name"), std::string::npos) << stale;
  EXPECT_EQ(node_->Stats().sessions(), 1u);
  // Its sessions were its own: opening under the new incarnation reuses their ids.
  EXPECT_TRUE(Open("s1", &after).ok());
}

TEST_F(NodeLeaseTest, AnotherPrincipalCannotSupersedeALease) {
  const v1::SessionLease lease = Lease("worker-a:1", 1, 60000);
  ASSERT_TRUE(Open("s1", &lease, "worker").ok());
  absl::StatusOr<v1::RenewLeaseResponse> renewal =
      Renew(Lease("worker-a:1", 99, 60000), "intruder");
  ASSERT_TRUE(renewal.ok());
  EXPECT_EQ(renewal->superseded_sessions(), 0u);
  EXPECT_EQ(node_->Stats().sessions(), 1u);
}

TEST_F(NodeLeaseTest, BadLeasesAreInvalidArgumentAndOpenNothing) {
  const v1::SessionLease bad = Lease("worker a", 1, 1000);
  const absl::Status s = Open("s1", &bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(node_->Stats().sessions(), 0u);
  v1::RenewLeaseRequest empty;
  v1::RenewLeaseResponse response;
  EXPECT_EQ(node_->RenewLease(empty, &response).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Renew(Lease("w", 1, 50)).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::cpu_attention
