// A degraded answer is marked where OpenAI clients look (issue 26 item 4), end to end: the real
// tandem-cpu-attention, tandem-gpu-worker (hybrid, gutenberg-14m on the cpu backend) and
// tandem-gateway. The only CPU node is SIGKILLed while an answer streams; the stream still ends
// normally, and its finish chunk carries "tandem": {"degraded": true, ...} and the usage chunk
// degraded_steps > 0, which an answer served with the node carries as false and 0.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "http_test_client.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::gateway {
namespace {

using test_process::ChildProcess;
using Json = nlohmann::json;

std::filesystem::path GutenbergDir() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "gutenberg-14m";
}

class GatewayDegradedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(GutenbergDir() / "config.json")) {
      GTEST_SKIP() << "gutenberg-14m not found under " << GutenbergDir();
    }
    auto node = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                     "--pool_bytes=256MiB", "--threads=1", "--log_level=warn"});
    ASSERT_TRUE(node.ok()) << node.status();
    absl::StatusOr<int> node_port = (*node)->WaitListening();
    ASSERT_TRUE(node_port.ok()) << node_port.status();
    node_ = std::move(*node);
    const std::string node_address = absl::StrCat("127.0.0.1:", *node_port);
    node_stub_ = v1::CpuAttention::NewStub(
        grpc::CreateChannel(node_address, grpc::InsecureChannelCredentials()));
    auto worker = ChildProcess::Start(
        {TANDEM_GPU_WORKER_BIN, "--model=" + GutenbergDir().string(), "--address=127.0.0.1:0",
         "--backend=cpu", "--cpu_threads=1", "--mode=hybrid", "--window=64", "--sink=4",
         "--cpu_nodes=" + node_address, "--log_level=error"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> worker_port = worker_->WaitListening();
    ASSERT_TRUE(worker_port.ok()) << worker_port.status();
    auto gateway = ChildProcess::Start(
        {TANDEM_GATEWAY_BIN, absl::StrCat("--workers=127.0.0.1:", *worker_port),
         "--address=127.0.0.1:0", "--log_level=warn"});
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
    absl::StatusOr<int> port = gateway_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
  }

  std::string Body(int max_tokens) {
    return Json({{"prompt", "It was a dark and stormy night"},
                 {"max_tokens", max_tokens},
                 {"ignore_eos", true},
                 {"temperature", 0},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}})
        .dump();
  }

  // Waits up to `ms` for the node to hold KV blocks and to have answered some attends.
  bool WaitNodeAttending(int ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < deadline) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::StatsResponse stats;
      if (node_stub_->Stats(&ctx, {}, &stats).ok() && stats.blocks_in_use() > 0 &&
          stats.attend_calls() > 8) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  // The SSE events of `body` ("data: {...}" lines) parsed, [DONE] left out.
  static std::vector<Json> Events(const std::string& body) {
    std::vector<Json> events;
    size_t at = 0;
    while ((at = body.find("data: {", at)) != std::string::npos) {
      const size_t end = body.find('\n', at);
      events.push_back(Json::parse(body.substr(at + 6, end - at - 6)));
      at = end;
    }
    return events;
  }

  // The "tandem" object of the finish chunk and the usage of the usage chunk.
  static void FinishAndUsage(const std::vector<Json>& events, Json* tandem, Json* usage) {
    for (const Json& e : events) {
      if (e.contains("tandem")) *tandem = e["tandem"];
      if (e.contains("usage") && e["usage"].is_object()) *usage = e["usage"];
    }
  }

  std::unique_ptr<ChildProcess> node_, worker_, gateway_;
  std::unique_ptr<v1::CpuAttention::Stub> node_stub_;
  int port_ = 0;
};

TEST_F(GatewayDegradedTest, ANodeLostMidStreamMarksTheAnswerDegraded) {
  // With the node: not degraded.
  {
    testing::RawHttpConnection client(port_);
    ASSERT_TRUE(client.ok());
    ASSERT_TRUE(client.Post("/v1/completions", Body(200)));
    ASSERT_TRUE(client.ReadUntil("data: [DONE]", 60000)) << client.received();
    Json tandem, usage;
    FinishAndUsage(Events(client.received()), &tandem, &usage);
    EXPECT_EQ(tandem, Json({{"degraded", false}, {"degraded_steps", 0}, {"mode", "hybrid"}}));
    EXPECT_EQ(usage["degraded_steps"], 0) << usage;
  }
  // The node dies while the answer streams.
  testing::RawHttpConnection client(port_);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client.Post("/v1/completions", Body(1500)));
  ASSERT_TRUE(client.ReadUntil("\"text\":", 60000)) << client.received();
  ASSERT_TRUE(WaitNodeAttending(60000)) << "the node never attended";
  node_.reset();   // SIGKILL
  ASSERT_TRUE(client.ReadUntil("data: [DONE]", 120000)) << client.received();
  const std::vector<Json> events = Events(client.received());
  for (const Json& e : events) {
    EXPECT_FALSE(e.contains("error")) << e;
  }
  Json tandem, usage;
  FinishAndUsage(events, &tandem, &usage);
  ASSERT_TRUE(tandem.is_object()) << client.received().substr(0, 2000);
  EXPECT_EQ(tandem["degraded"], true) << tandem;
  EXPECT_GT(tandem["degraded_steps"].get<int64_t>(), 0) << tandem;
  EXPECT_EQ(tandem["mode"], "hybrid");
  EXPECT_EQ(usage["degraded_steps"], tandem["degraded_steps"]) << usage;
  EXPECT_EQ(usage["completion_tokens"], 1500) << usage;
}

}  // namespace
}  // namespace tandem::gateway
