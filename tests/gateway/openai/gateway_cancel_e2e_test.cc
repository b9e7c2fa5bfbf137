// A client that hangs up cancels its generation on the worker, streamed or not: gutenberg-14m on
// the cpu backend (about 2 ms a token on one thread) is asked for 8000 tokens in a kept session;
// the client goes away early, and the session then holds far fewer positions than a finished
// request would have left (8000+), the gateway counts the disconnect and runs nothing. A worker
// lost while an answer streams ends the stream with an SSE error event and [DONE].
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "free_port.h"
#include "http_test_client.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using test_process::ChildProcess;
using Json = nlohmann::json;

constexpr int64_t kMaxTokens = 8000;

std::filesystem::path GutenbergDir() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "gutenberg-14m";
}

class GatewayCancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(GutenbergDir() / "config.json")) {
      GTEST_SKIP() << "gutenberg-14m not found under " << GutenbergDir();
    }
    worker_metrics_port_ = test_process::FreePort();
    ASSERT_GT(worker_metrics_port_, 0);
    auto worker = ChildProcess::Start(
        {TANDEM_GPU_WORKER_BIN, "--model=" + GutenbergDir().string(), "--address=127.0.0.1:0",
         "--backend=cpu", "--cpu_threads=1", "--mode=gpu", "--log_level=warn",
         absl::StrCat("--metrics_address=127.0.0.1:", worker_metrics_port_)});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> worker_port = worker_->WaitListening();
    ASSERT_TRUE(worker_port.ok()) << worker_port.status();
    worker_address_ = absl::StrCat("127.0.0.1:", *worker_port);
    const std::string& address = worker_address_;
    stub_ =
        v1::Generation::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    auto gateway = ChildProcess::Start({TANDEM_GATEWAY_BIN, "--workers=" + address,
                                        "--address=127.0.0.1:0", "--disconnect_poll_ms=20",
                                        "--shutdown_grace_ms=1000", "--log_level=warn"});
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
    absl::StatusOr<int> port = gateway_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
  }

  // Positions the kept session holds now: a one-token turn through the worker itself, whose
  // final message counts the session's KV entries (gpu mode: all on the device).
  int64_t SessionPositions(const std::string& session_id) {
    v1::GenerateRequest r;
    r.set_session_id(session_id);
    r.mutable_prompt_ids()->add_ids(100);
    r.set_max_tokens(1);
    const gpu_worker::testing::Stream s = gpu_worker::testing::Generate(*stub_, r);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    return s.final.device_kv_entries() + s.final.cpu_kv_entries();
  }

  // The metric `name` (a series without labels) of the gateway or, at `port`, of another
  // server; -1 when absent.
  double Metric(const std::string& name, int port = 0) {
    httplib::Client http("127.0.0.1", port == 0 ? port_ : port);
    auto res = http.Get("/metrics");
    if (!res) return -1;
    const std::string prefix = name + " ";
    const size_t at = res->body.find("\n" + prefix);
    if (at == std::string::npos) return -1;
    return std::stod(res->body.substr(at + 1 + prefix.size()));
  }

  // Waits up to `ms` for the gateway to run no generation.
  bool WaitIdle(int ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
      if (Metric("tandem:gateway_requests_running") == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Waits up to `ms` for the worker to have generated at least `tokens` tokens (its counter
  // tandem:generation_tokens_total, over every request it served).
  bool WaitGenerated(double tokens, int ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
      if (Metric("tandem:generation_tokens_total", worker_metrics_port_) >= tokens) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  Json Body(const std::string& session_id, bool stream) {
    return {{"prompt", "It was a dark and stormy night"},
            {"max_tokens", kMaxTokens},
            {"ignore_eos", true},
            {"temperature", 0},
            {"session_id", session_id},
            {"stream", stream}};
  }

  std::unique_ptr<ChildProcess> worker_, gateway_;
  std::string worker_address_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  int port_ = 0;
  int worker_metrics_port_ = 0;
};

TEST_F(GatewayCancelTest, HangingUpAStreamCancelsTheGeneration) {
  testing::RawHttpConnection client(port_);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body("cancel-stream", true).dump()));
  // Some tokens arrive, then the client goes away.
  ASSERT_TRUE(client.ReadUntil("\"text\":", 30000)) << client.received();
  EXPECT_EQ(Metric("tandem:gateway_requests_running"), 1);
  const auto hang_up = std::chrono::steady_clock::now();
  client.Close();
  ASSERT_TRUE(WaitIdle(5000)) << "the generation still runs 5 s after the client left";
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - hang_up).count();
  EXPECT_LT(seconds, 3.0);
  EXPECT_EQ(Metric("tandem:gateway_client_disconnects_total"), 1);
  const int64_t positions = SessionPositions("cancel-stream");
  EXPECT_GT(positions, 8);               // the prompt and some tokens ran
  EXPECT_LT(positions, kMaxTokens / 4);  // far from the 8000 a finished request leaves
}

TEST_F(GatewayCancelTest, HangingUpANonStreamedRequestCancelsTheGeneration) {
  testing::RawHttpConnection client(port_);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body("cancel-whole", false).dump()));
  // Nothing arrives before the end; wait until the gateway runs it and the worker has generated
  // some tokens (the worker's counter, not a sleep: on a loaded machine the prompt alone can
  // take longer than any fixed wait), then leave.
  const auto start = std::chrono::steady_clock::now();
  while (Metric("tandem:gateway_requests_running") != 1 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(Metric("tandem:gateway_requests_running"), 1) << "the gateway never ran it";
  ASSERT_TRUE(WaitGenerated(8, 30000)) << "the worker generated no 8 tokens in 30 s";
  client.Close();
  ASSERT_TRUE(WaitIdle(5000)) << "the generation still runs 5 s after the client left";
  EXPECT_EQ(Metric("tandem:gateway_client_disconnects_total"), 1);
  const int64_t positions = SessionPositions("cancel-whole");
  EXPECT_GT(positions, 8);               // the prompt and at least 8 tokens ran
  EXPECT_LT(positions, kMaxTokens / 4);  // far from the 8000 a finished request leaves
}

TEST_F(GatewayCancelTest, AWorkerLostMidStreamEndsTheStreamWithAnErrorEvent) {
  testing::RawHttpConnection client(port_);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body("", true).dump()));
  ASSERT_TRUE(client.ReadUntil("\"text\":", 30000)) << client.received();
  worker_.reset();  // SIGKILL: the worker is gone while the answer streams
  ASSERT_TRUE(client.ReadUntil("data: [DONE]", 10000)) << client.received();
  const std::string& body = client.received();
  EXPECT_NE(body.find("HTTP/1.1 200"), std::string::npos);
  const size_t error = body.find("data: {\"error\":");
  ASSERT_NE(error, std::string::npos) << body;
  const size_t end = body.find("\n", error);
  const Json event = Json::parse(body.substr(error + 6, end - error - 6));
  EXPECT_EQ(event["error"]["type"], "service_unavailable_error");
  EXPECT_LT(error, body.find("data: [DONE]"));
  EXPECT_EQ(body.find("finish_reason\":\"length"), std::string::npos);
}

TEST_F(GatewayCancelTest, RequestsOverTheConcurrencyCapGet429) {
  // A second gateway on the same worker, with room for one generation.
  auto capped = ChildProcess::Start({TANDEM_GATEWAY_BIN, "--workers=" + worker_address_,
                                     "--address=127.0.0.1:0", "--max_concurrent_requests=1",
                                     "--log_level=warn"});
  ASSERT_TRUE(capped.ok()) << capped.status();
  absl::StatusOr<int> port = (*capped)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  testing::RawHttpConnection client(*port);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body("", true).dump()));
  ASSERT_TRUE(client.ReadUntil("\"text\":", 30000)) << client.received();
  httplib::Client http("127.0.0.1", *port);
  const std::string small = R"({"prompt": "It was", "max_tokens": 2})";
  auto refused = http.Post("/v1/completions", small, "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 429);
  EXPECT_EQ(Json::parse(refused->body)["error"]["type"], "rate_limit_error");
  client.Close();
  // Once the first is cancelled, there is room again.
  int status = 0;
  for (int i = 0; i < 100 && status != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto res = http.Post("/v1/completions", small, "application/json");
    status = res ? res->status : -1;
  }
  EXPECT_EQ(status, 200);
}

TEST_F(GatewayCancelTest, SigtermCancelsWhatOutlivesTheGrace) {
  testing::RawHttpConnection client(port_);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body("", true).dump()));
  ASSERT_TRUE(client.ReadUntil("\"text\":", 30000)) << client.received();
  // The grace is 1 s; the 8000-token answer needs ~16 s more.
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<int> code = gateway_->Terminate(20000);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(seconds, 0.9);
  EXPECT_LT(seconds, 5.0);
  client.ReadUntil("never", 2000);  // the stream ends without [DONE]
  EXPECT_EQ(client.received().find("data: [DONE]"), std::string::npos);
}

}  // namespace
}  // namespace tandem::gateway
