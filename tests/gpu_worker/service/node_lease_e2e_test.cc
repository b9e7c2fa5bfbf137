// Leases end to end (issue 26): the real tandem-gpu-worker holding hybrid sessions on a real
// tandem-cpu-attention. A worker killed with SIGKILL (no chance to close anything) has its
// sessions freed by the node within 2 lease periods; a worker restarted under the same
// --worker_name frees its predecessor's sessions as soon as it starts, long before the lease
// would lapse.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "service_test_util.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/worker_server.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;
using test_process::ChildProcess;

class NodeLeaseE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::LoadGolden(&golden_)) {
      GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
    }
    auto node = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                     "--pool_bytes=64MiB", "--threads=1", "--log_level=warn"});
    ASSERT_TRUE(node.ok()) << node.status();
    absl::StatusOr<int> port = (*node)->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    node_ = std::move(*node);
    node_address_ = absl::StrCat("127.0.0.1:", *port);
    node_stub_ = v1::CpuAttention::NewStub(
        grpc::CreateCustomChannel(node_address_, grpc::InsecureChannelCredentials(),
                                  cpu_attention::CpuAttentionChannelArguments()));
  }

  // A worker process on the node, named `name`, with a lease of `lease_s` seconds.
  std::unique_ptr<ChildProcess> StartWorker(const std::string& name, const std::string& lease_s) {
    auto worker = ChildProcess::Start(
        {TANDEM_GPU_WORKER_BIN, "--model=" + testing::Stories260kDir().string(),
         "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=1", "--mode=hybrid",
         "--window=16", "--sink=4", "--cpu_nodes=" + node_address_, "--worker_name=" + name,
         "--node_lease_s=" + lease_s, "--log_level=warn"});
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return nullptr;
    absl::StatusOr<int> port = (*worker)->WaitListening();
    EXPECT_TRUE(port.ok()) << port.status();
    if (!port.ok()) return nullptr;
    worker_port_ = *port;
    return *std::move(worker);
  }

  // A kept hybrid session on the worker: its KV is on the node until it is closed.
  void KeepSession(const std::string& session_id) {
    auto stub = v1::Generation::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", worker_port_), grpc::InsecureChannelCredentials(),
        GenerationChannelArguments()));
    v1::GenerateRequest request = testing::TextRequest(golden_.prompt_text, 60, "hybrid");
    request.set_ignore_eos(true);
    request.set_window(16);
    request.set_sink(4);
    request.set_session_id(session_id);
    testing::Stream s = testing::Generate(*stub, request);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    ASSERT_GT(s.final.cpu_kv_entries(), 0);
  }

  v1::StatsResponse NodeStats() {
    v1::StatsResponse stats;
    const grpc::Status s = node_stub_->Stats(testing::Deadline().get(), {}, &stats);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return stats;
  }

  // Seconds until the node holds no session (polled every 20 ms), or -1 after `limit_s`.
  double SecondsUntilNoSession(double limit_s) {
    const Clock::time_point start = Clock::now();
    for (;;) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (NodeStats().sessions() == 0) return waited;
      if (waited > limit_s) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  testing::Golden golden_;
  std::unique_ptr<ChildProcess> node_;
  std::string node_address_;
  std::unique_ptr<v1::CpuAttention::Stub> node_stub_;
  int worker_port_ = 0;
};

TEST_F(NodeLeaseE2eTest, AKilledWorkersSessionsAreFreedWithinTwoLeasePeriods) {
  constexpr double kLeaseS = 1.0;
  std::unique_ptr<ChildProcess> worker = StartWorker("lease-e2e-a", "1");
  ASSERT_NE(worker, nullptr);
  ASSERT_NO_FATAL_FAILURE(KeepSession("kept"));
  // The lease is renewed (every third of it) while the worker lives: the session outlasts it.
  std::this_thread::sleep_for(std::chrono::duration<double>(3 * kLeaseS));
  v1::StatsResponse stats = NodeStats();
  ASSERT_GE(stats.sessions(), 1u);
  EXPECT_EQ(stats.leases(), 1u);
  EXPECT_GT(stats.blocks_in_use(), 0u);

  worker.reset();   // SIGKILL: nothing is closed by the worker
  const double freed_after = SecondsUntilNoSession(10);
  ASSERT_GE(freed_after, 0) << "the node still holds the dead worker's sessions after 10 s";
  EXPECT_LE(freed_after, 2 * kLeaseS + 0.3);
  std::printf("[lease] sessions freed %.2f s after SIGKILL (lease %.1f s)\n", freed_after,
              kLeaseS);
  stats = NodeStats();
  EXPECT_EQ(stats.blocks_in_use(), 0u);
  EXPECT_EQ(stats.used_bytes(), 0u);
  EXPECT_GE(stats.sessions_expired(), 1u);
}

TEST_F(NodeLeaseE2eTest, ARestartedWorkerFreesItsPredecessorsSessionsAtStart) {
  std::unique_ptr<ChildProcess> worker = StartWorker("lease-e2e-b", "60");
  ASSERT_NE(worker, nullptr);
  ASSERT_NO_FATAL_FAILURE(KeepSession("kept"));
  worker.reset();   // SIGKILL; its lease would lapse only after 120 s
  ASSERT_GE(NodeStats().sessions(), 1u);

  // Another worker with another name leaves them alone ...
  std::unique_ptr<ChildProcess> other = StartWorker("lease-e2e-other", "60");
  ASSERT_NE(other, nullptr);
  EXPECT_GE(NodeStats().sessions(), 1u);
  // ... the same name frees them before it reports LISTENING.
  std::unique_ptr<ChildProcess> restarted = StartWorker("lease-e2e-b", "60");
  ASSERT_NE(restarted, nullptr);
  const v1::StatsResponse stats = NodeStats();
  EXPECT_EQ(stats.sessions(), 0u);
  EXPECT_EQ(stats.blocks_in_use(), 0u);
  EXPECT_GE(stats.sessions_expired(), 1u);
  // And it serves: a new kept session opens under the new incarnation.
  ASSERT_NO_FATAL_FAILURE(KeepSession("kept"));
  EXPECT_GE(NodeStats().sessions(), 1u);
}

}  // namespace
}  // namespace tandem::gpu_worker
