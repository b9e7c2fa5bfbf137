// Hostile clients against the real tandem-gateway (issue 26): deep nesting, lying lengths, slow
// clients, huge fields and many connections each get a 4xx or a closed connection within a
// bounded time; a well-behaved client meanwhile is not delayed by more than 2x; the gateway stays
// healthy and its RSS bounded. Timeouts are shortened by flags so that the suite runs in seconds.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "http_test_client.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using Clock = std::chrono::steady_clock;
using ::tandem::test_process::ChildProcess;
using testing::RawHttpConnection;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Resident set of `pid` in MiB (VmRSS of /proc/<pid>/status).
double RssMib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    int64_t kib = 0;
    std::string digits;
    for (char c : line) {
      if (c >= '0' && c <= '9') digits += c;
    }
    if (absl::SimpleAtoi(digits, &kib)) return static_cast<double>(kib) / 1024.0;
  }
  return -1;
}

class GatewayHostileE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(gpu_worker::testing::Stories260kDir() / "model.safetensors") &&
        !std::filesystem::exists(gpu_worker::testing::Stories260kDir() / "config.json")) {
      GTEST_SKIP() << "stories260k not found under " << gpu_worker::testing::Stories260kDir();
    }
    auto worker = ChildProcess::Start(
        {TANDEM_GPU_WORKER_BIN, "--model=" + gpu_worker::testing::Stories260kDir().string(),
         "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=1", "--mode=gpu",
         "--log_level=warn"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> worker_port = worker_->WaitListening();
    ASSERT_TRUE(worker_port.ok()) << worker_port.status();
    auto gateway = ChildProcess::Start(
        {TANDEM_GATEWAY_BIN, "--address=127.0.0.1:0", "--log_level=error",
         absl::StrCat("--workers=127.0.0.1:", *worker_port), "--read_timeout_s=2",
         "--header_timeout_s=2", "--body_timeout_s=3", "--keep_alive_s=2",
         "--max_body_bytes=8MiB", "--max_concurrent_requests=8", "--http_threads=128"});
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
    absl::StatusOr<int> port = gateway_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
  }

  // Sends `raw` on a new connection and waits up to `wait_s` for the answer's status line: the
  // status ("400", ...), "closed" when the gateway hung up first, "" when nothing came.
  std::string Answer(const std::string& raw, double wait_s, double* seconds = nullptr) {
    RawHttpConnection c(port_);
    EXPECT_TRUE(c.ok());
    const Clock::time_point start = Clock::now();
    EXPECT_TRUE(c.SendRaw(raw));
    const bool got = c.ReadUntil("\r\n", static_cast<int>(wait_s * 1000));
    if (seconds != nullptr) *seconds = SecondsSince(start);
    if (!got) return c.received().empty() && SecondsSince(start) < wait_s ? "closed" : "";
    return c.received().substr(9, 3);
  }

  static std::string Post(const std::string& path, const std::string& body,
                          const std::string& length) {
    return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
                        "Content-Length: ", length, "\r\n\r\n", body);
  }
  static std::string Post(const std::string& path, const std::string& body) {
    return Post(path, body, std::to_string(body.size()));
  }

  // Seconds of one small greedy completion, answered 200.
  double SmallCompletion() {
    RawHttpConnection c(port_);
    const Clock::time_point start = Clock::now();
    EXPECT_TRUE(c.Post("/v1/completions", R"({"prompt":"Once upon","max_tokens":4})"));
    EXPECT_TRUE(c.ReadUntil("\"usage\"", 30000)) << c.received();
    EXPECT_TRUE(absl::StartsWith(c.received(), "HTTP/1.1 200")) << c.received();
    return SecondsSince(start);
  }
  double MedianSmallCompletion(int n) {
    std::vector<double> t;
    for (int i = 0; i < n; ++i) t.push_back(SmallCompletion());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

  std::unique_ptr<ChildProcess> worker_, gateway_;
  int port_ = 0;
};

TEST_F(GatewayHostileE2eTest, DeepNestingHugeFieldsAndLongListsAre400sAtOnce) {
  const double rss_before = RssMib(gateway_->pid());
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  std::string bias = R"({"prompt":"hi","logit_bias":{)";
  for (int i = 0; i < 100000; ++i) absl::StrAppend(&bias, i > 0 ? "," : "", "\"", i, "\":1");
  bias += "}}";
  std::string stops = R"({"prompt":"hi","stop":[)";
  for (int i = 0; i < 1000; ++i) absl::StrAppend(&stops, i > 0 ? "," : "", "\"s\"");
  stops += "]}";
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"/v1/completions", R"({"prompt":)" + deep + "}"},
      {"/v1/chat/completions", R"({"messages":)" + deep + "}"},
      {"/v1/chat/completions", R"({"messages":[{"role":"user","content":)" + deep + "}]}"},
      {"/v1/chat/completions",
       R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"none","tools":)" + deep +
           "}"},
      {"/v1/completions", bias},
      {"/v1/completions", stops},
      // 3 MB of prompt for a 512-token model: refused by the worker before tokenizing.
      {"/v1/completions", R"({"prompt":")" + std::string(3 << 20, 'a') + R"(","max_tokens":1})"},
  };
  for (const auto& [path, body] : bodies) {
    double seconds = 0;
    EXPECT_EQ(Answer(Post(path, body), 10, &seconds), "400") << body.substr(0, 60);
    EXPECT_LT(seconds, 3.0) << body.substr(0, 60);
  }
  EXPECT_GT(SmallCompletion(), 0.0);   // still serving
  // Nothing of those requests stays resident (the bodies were up to 3 MB each).
  EXPECT_LT(RssMib(gateway_->pid()), rss_before + 64) << "RSS before " << rss_before << " MiB";
}

TEST_F(GatewayHostileE2eTest, LyingLengthsAreAnsweredWithinBounds) {
  double seconds = 0;
  for (const char* length : {"-1", "100000000000000000000", "1e3", "12abc"}) {
    EXPECT_EQ(Answer(Post("/v1/completions", "{}", length), 5, &seconds), "400") << length;
    EXPECT_LT(seconds, 1.0) << length;
  }
  EXPECT_EQ(Answer(Post("/v1/completions", "{}", std::to_string(64 << 20)), 5, &seconds), "413");
  EXPECT_LT(seconds, 1.0);
  // A length larger than what comes: 408 once the reads go idle (--read_timeout_s=2).
  EXPECT_EQ(Answer(Post("/v1/completions", R"({"a":1})", "100"), 10, &seconds), "408");
  EXPECT_LT(seconds, 5.0);
  EXPECT_GT(SmallCompletion(), 0.0);
}

TEST_F(GatewayHostileE2eTest, SlowClientsAreCutOff) {
  // Headers at one byte per 300 ms never finish within --header_timeout_s=2: closed.
  {
    RawHttpConnection c(port_);
    const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 0123456789\r\n";
    const Clock::time_point start = Clock::now();
    bool cut = false;
    for (char ch : head + head + head) {
      if (!c.SendRaw(std::string(1, ch)) || c.PeerClosed()) {
        cut = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    EXPECT_TRUE(cut);
    EXPECT_LT(SecondsSince(start), 2 + 2.5);
  }
  // A body at one byte per 300 ms: 408 once --body_timeout_s=3 has passed (checked as bytes
  // arrive, so within the body timeout plus one idle read, --read_timeout_s=2).
  {
    RawHttpConnection c(port_);
    const std::string body = R"({"prompt":"Once upon","max_tokens":4}                    )";
    ASSERT_TRUE(c.SendRaw(Post("/v1/completions", "", std::to_string(body.size()))));
    const Clock::time_point start = Clock::now();
    for (char ch : body) {
      if (!c.SendRaw(std::string(1, ch)) || c.ReadUntil("\r\n", 1)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    EXPECT_TRUE(c.ReadUntil("\r\n", 3000));
    EXPECT_TRUE(absl::StartsWith(c.received(), "HTTP/1.1 408")) << c.received();
    EXPECT_LT(SecondsSince(start), 3 + 2 + 1.5) << c.received();
  }
  EXPECT_GT(SmallCompletion(), 0.0);
}

TEST_F(GatewayHostileE2eTest, ManyHostileConnectionsDoNotDelayOthers) {
  const double rss_before = RssMib(gateway_->pid());
  const double baseline = MedianSmallCompletion(7);
  // 40 connections that send half a request line and stall, 10 that trickle headers.
  std::vector<std::unique_ptr<RawHttpConnection>> hostile;
  for (int i = 0; i < 50; ++i) {
    hostile.push_back(std::make_unique<RawHttpConnection>(port_));
    ASSERT_TRUE(hostile.back()->SendRaw("POST /v1/compl"));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double loaded = MedianSmallCompletion(7);
  // 2x, plus 250 ms for the scheduling noise of a 2-core CI machine running other tests at once
  // (alone here: 2x + 0.1 s holds).
  EXPECT_LT(loaded, 2 * baseline + 0.25) << "baseline " << baseline << " s";
  // Every one of them is closed within the header timeout (2 s) and a scan.
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  int closed = 0;
  for (auto& c : hostile) closed += c->PeerClosed() ? 1 : 0;
  EXPECT_EQ(closed, 50);
  EXPECT_LT(RssMib(gateway_->pid()), rss_before + 64);
  EXPECT_TRUE(gateway_->Running());
}

}  // namespace
}  // namespace tandem::gateway
