// Draining of the real tandem-cpu-attention binary (Kubernetes scale-down): the first SIGTERM
// turns readiness ("tandem.v1.CpuAttention") NOT_SERVING while liveness ("") stays SERVING,
// refuses new sessions and keeps serving the open ones; the process exits 0 once the last
// session is closed, when --drain_timeout_s runs out, or at a second signal.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "child_process.h"
#include "health_check.h"
#include "service_test_util.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;
using Clock = std::chrono::steady_clock;

using test_process::ChildProcess;

// How long the node may take to exit once it should stop, and how long the test waits for it.
// An idle node exits in milliseconds, but its gRPC shutdown grants calls in flight a 2 s grace
// (tandem-cpu-attention's main) on top of the drain; on a loaded 2-core CI machine the exit also
// waits for CPU. 10 s is the grace plus generous slack: it still tells an exit driven by the
// drain (or the second signal) from one that never comes, or comes only at the 60 s drain
// timeout of SecondSignalStopsAtOnce.
constexpr auto kExitBound = std::chrono::seconds(10);
constexpr int kExitWaitMs = 15000;

// The node binary with stdout and stderr captured, on a free loopback port.
absl::StatusOr<std::unique_ptr<ChildProcess>> StartNode(const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                   "--pool_bytes=64MiB", "--threads=1", "--executor_threads=2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return ChildProcess::Start(argv, /*capture_stderr=*/true);
}

std::unique_ptr<grpc::ClientContext> Deadline(int ms = 10000) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  return ctx;
}

using test_health::HealthStatus;
using test_health::kNotServing;
using test_health::kServing;
const std::string kReadiness = "tandem.v1.CpuAttention";

class DrainTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    auto p = StartNode(flags);
    ASSERT_TRUE(p.ok()) << p.status();
    process_ = std::move(*p);
    auto port = process_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(*port),
                                         grpc::InsecureChannelCredentials(),
                                         CpuAttentionChannelArguments());
    stub_ = v1::CpuAttention::NewStub(channel_);
  }

  grpc::Status Open(const std::string& id) {
    v1::OpenSessionResponse resp;
    auto ctx = Deadline();
    return stub_->OpenSession(ctx.get(), OpenRequest(id, g_, 16, true, 0), &resp);
  }

  // Opens `id` and appends 40 entries.
  void OpenWithEntries(const std::string& id) {
    const grpc::Status opened = Open(id);
    ASSERT_TRUE(opened.ok()) << opened.error_message();
    std::mt19937 rng(1);
    entries_.assign(1, HeadEntries{});
    AddRandomEntries(entries_, 40, g_.head_dim, true, 1e-2f, rng);
    v1::AppendKvResponse totals;
    auto ctx = Deadline();
    auto writer = stub_->AppendKv(ctx.get(), &totals);
    ASSERT_TRUE(writer->Write(AppendRequest(id, 0, entries_, 0, 40, g_.head_dim, true, 64)));
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }

  // Waits until the readiness status is NOT_SERVING (the signal was handled).
  void WaitNotReady() {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    absl::StatusOr<int> s;
    while (Clock::now() < deadline) {
      s = HealthStatus(channel_, kReadiness);
      if (s.ok() && *s == kNotServing) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    FAIL() << "readiness did not turn NOT_SERVING: "
           << (s.ok() ? std::to_string(*s) : s.status().ToString()) << "\n"
           << process_->log();
  }

  v1::StatsResponse Stats() {
    v1::StatsResponse s;
    auto ctx = Deadline();
    EXPECT_TRUE(stub_->Stats(ctx.get(), {}, &s).ok());
    return s;
  }

  Geometry g_{1, 4, 1, 64};
  std::unique_ptr<ChildProcess> process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CpuAttention::Stub> stub_;
  std::vector<HeadEntries> entries_;
};

TEST_F(DrainTest, SigtermDrainsUntilTheLastSessionCloses) {
  ASSERT_NO_FATAL_FAILURE(Start({"--drain_timeout_s=60"}));
  EXPECT_EQ(HealthStatus(channel_, "").value_or(-1), kServing);
  EXPECT_EQ(HealthStatus(channel_, kReadiness).value_or(-1), kServing);
  const v1::StatsResponse before = Stats();
  EXPECT_FALSE(before.draining());
  EXPECT_EQ(before.node_id().size(), 16u);
  ASSERT_NO_FATAL_FAILURE(OpenWithEntries("s"));

  process_->Signal(SIGTERM);
  ASSERT_NO_FATAL_FAILURE(WaitNotReady());
  EXPECT_EQ(HealthStatus(channel_, "").value_or(-1), kServing) << "liveness must stay SERVING";
  const v1::StatsResponse draining = Stats();
  EXPECT_TRUE(draining.draining());
  EXPECT_EQ(draining.sessions(), 1u);
  EXPECT_EQ(draining.node_id(), before.node_id());
  EXPECT_EQ(Open("t").error_code(), grpc::StatusCode::UNAVAILABLE);

  // The open session is still served.
  std::mt19937 rng(2);
  v1::AttendRequest attend;
  attend.set_layer(0);
  v1::AttendQuery* query = attend.add_queries();
  query->set_session_id("s");
  const std::vector<float> q = RandomQueries(1, g_, rng);
  EncodeF32(q, std::vector<int64_t>{1, 4, 64}, query->mutable_q());
  v1::AttendResponse resp;
  auto ctx = Deadline();
  const grpc::Status attended = stub_->Attend(ctx.get(), attend, &resp);
  ASSERT_TRUE(attended.ok()) << attended.error_message();
  EXPECT_EQ(resp.results(0).held(0), 40u);
  EXPECT_EQ(resp.results(0).selected(0), 40u);
  testing::ExpectHeadMatches(resp.results(0), 0, 1, 0, q, 1, g_, entries_[0], {}, 1e-3);
  // It keeps waiting for the session.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(process_->Running());

  v1::CloseSessionRequest close;
  close.set_session_id("s");
  v1::CloseSessionResponse closed;
  auto close_ctx = Deadline();
  ASSERT_TRUE(stub_->CloseSession(close_ctx.get(), close, &closed).ok());
  const auto closed_at = Clock::now();
  const absl::StatusOr<int> code = process_->Wait(kExitWaitMs);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << process_->log();
  EXPECT_EQ(*code, 0) << process_->log();
  EXPECT_LT(Clock::now() - closed_at, kExitBound);
  EXPECT_TRUE(absl::StrContains(process_->log(), "draining")) << process_->log();
  EXPECT_TRUE(absl::StrContains(process_->log(), "drained")) << process_->log();
}

TEST_F(DrainTest, SecondSignalStopsAtOnce) {
  ASSERT_NO_FATAL_FAILURE(Start({"--drain_timeout_s=60"}));
  ASSERT_NO_FATAL_FAILURE(OpenWithEntries("s"));
  process_->Signal(SIGTERM);
  ASSERT_NO_FATAL_FAILURE(WaitNotReady());
  EXPECT_TRUE(process_->Running());
  const auto signalled = Clock::now();
  process_->Signal(SIGINT);
  const absl::StatusOr<int> code = process_->Wait(kExitWaitMs);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << process_->log();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(Clock::now() - signalled, kExitBound);
  EXPECT_TRUE(absl::StrContains(process_->log(), "stopping at once")) << process_->log();
}

TEST_F(DrainTest, DrainTimeoutStopsWithSessionsOpen) {
  ASSERT_NO_FATAL_FAILURE(Start({"--drain_timeout_s=1"}));
  ASSERT_NO_FATAL_FAILURE(OpenWithEntries("s"));
  const auto signalled = Clock::now();
  process_->Signal(SIGTERM);
  const absl::StatusOr<int> code = process_->Wait(kExitWaitMs);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << process_->log();
  EXPECT_EQ(*code, 0);
  const auto took = Clock::now() - signalled;
  EXPECT_GE(took, std::chrono::milliseconds(900));
  EXPECT_LT(took, std::chrono::seconds(1) + kExitBound);  // the 1 s drain timeout, then the exit
  EXPECT_TRUE(absl::StrContains(process_->log(), "drain timeout")) << process_->log();
}

TEST_F(DrainTest, ZeroTimeoutStopsAtTheFirstSignal) {
  ASSERT_NO_FATAL_FAILURE(Start({"--drain_timeout_s=0"}));
  ASSERT_NO_FATAL_FAILURE(OpenWithEntries("s"));
  const auto signalled = Clock::now();
  process_->Signal(SIGTERM);
  const absl::StatusOr<int> code = process_->Wait(kExitWaitMs);
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << process_->log();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(Clock::now() - signalled, kExitBound);
}

}  // namespace
}  // namespace tandem::cpu_attention
