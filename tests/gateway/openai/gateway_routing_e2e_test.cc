// Several workers behind one gateway: new sessions and one-shot requests spread over the
// workers, every turn of a session reaches the worker that holds it, and a worker that dies is
// routed around (its sessions answer 503 naming it; /health counts the rest); DELETE
// /v1/sessions/{id} frees a kept session.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using test_process::ChildProcess;
using Json = nlohmann::json;

class GatewayRoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(gpu_worker::testing::Stories260kDir() / "config.json")) {
      GTEST_SKIP() << "stories260k not found under " << gpu_worker::testing::Stories260kDir();
    }
    std::string addresses;
    for (int i = 0; i < 2; ++i) {
      auto worker = ChildProcess::Start(
          {TANDEM_GPU_WORKER_BIN, "--model=" + gpu_worker::testing::Stories260kDir().string(),
           "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=1", "--mode=gpu",
           "--log_level=warn"});
      ASSERT_TRUE(worker.ok()) << worker.status();
      absl::StatusOr<int> port = (*worker)->WaitListening();
      ASSERT_TRUE(port.ok()) << port.status();
      workers_.push_back(std::move(*worker));
      const std::string address = absl::StrCat("127.0.0.1:", *port);
      stubs_.push_back(v1::Generation::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials())));
      addresses += (i == 0 ? "" : ",") + address;
    }
    auto gateway =
        ChildProcess::Start({TANDEM_GATEWAY_BIN, "--workers=" + addresses, "--address=127.0.0.1:0",
                             "--health_interval_ms=100", "--log_level=error"});
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
    absl::StatusOr<int> port = gateway_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    http_ = std::make_unique<httplib::Client>("127.0.0.1", *port);
  }

  uint64_t OpenSessions(size_t worker) {
    v1::ModelInfoResponse info;
    const grpc::Status s =
        stubs_[worker]->GetModelInfo(gpu_worker::testing::Deadline().get(), {}, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return info.open_sessions();
  }

  httplib::Result Complete(const std::string& session_id, const std::string& prompt) {
    Json body = {{"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0}};
    if (!session_id.empty()) body["session_id"] = session_id;
    return http_->Post("/v1/completions", body.dump(), "application/json");
  }

  std::vector<std::unique_ptr<ChildProcess>> workers_;
  std::vector<std::unique_ptr<v1::Generation::Stub>> stubs_;
  std::unique_ptr<ChildProcess> gateway_;
  std::unique_ptr<httplib::Client> http_;
};

TEST_F(GatewayRoutingTest, SessionsStickToTheirWorkerAndADeadWorkerIsRoutedAround) {
  for (int turn = 0; turn < 2; ++turn) {
    for (int i = 0; i < 6; ++i) {
      auto res = Complete(absl::StrCat("s", i), turn == 0 ? "Once upon a time" : " The");
      ASSERT_TRUE(res);
      ASSERT_EQ(res->status, 200) << res->body;
    }
  }
  // Six sessions, each kept once (a turn routed elsewhere would have opened a second copy),
  // spread evenly: new sessions take turns when the workers are equally loaded.
  EXPECT_EQ(OpenSessions(0), 3u);
  EXPECT_EQ(OpenSessions(1), 3u);

  workers_[1].reset();  // SIGKILL
  auto health = http_->Get("/health");
  for (int i = 0; i < 100 && health && Json::parse(health->body)["workers_serving"] != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    health = http_->Get("/health");
  }
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(Json::parse(health->body)["workers_serving"], 1);

  for (int i = 0; i < 4; ++i) {
    auto res = Complete("", "Once upon a time");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  }
  int served = 0, unavailable = 0;
  for (int i = 0; i < 6; ++i) {
    auto res = Complete(absl::StrCat("s", i), " A");
    ASSERT_TRUE(res);
    if (res->status == 200) {
      ++served;
    } else {
      EXPECT_EQ(res->status, 503) << res->body;
      EXPECT_THAT(Json::parse(res->body)["error"]["message"].get<std::string>(),
                  ::testing::HasSubstr("is not serving"));
      ++unavailable;
    }
  }
  EXPECT_EQ(served, 3);
  EXPECT_EQ(unavailable, 3);
  EXPECT_EQ(OpenSessions(0), 3u);

  // DELETE /v1/sessions/{id} frees the sessions the live worker holds; those of the dead one
  // are 503 naming it; a session nobody holds is 404.
  int deleted = 0, unreachable = 0;
  for (int i = 0; i < 6; ++i) {
    auto res = http_->Delete(absl::StrCat("/v1/sessions/s", i));
    ASSERT_TRUE(res);
    if (res->status == 200) {
      EXPECT_EQ(Json::parse(res->body),
                Json({{"id", absl::StrCat("s", i)}, {"object", "session"}, {"deleted", true}}));
      ++deleted;
    } else {
      EXPECT_EQ(res->status, 503) << res->body;
      ++unreachable;
    }
  }
  EXPECT_EQ(deleted, 3);
  EXPECT_EQ(unreachable, 3);
  auto unknown = http_->Delete("/v1/sessions/never-opened");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404) << unknown->body;
  EXPECT_EQ(Json::parse(unknown->body)["error"]["type"], "not_found_error");
  EXPECT_EQ(OpenSessions(0), 0u);
}

}  // namespace
}  // namespace tandem::gateway
