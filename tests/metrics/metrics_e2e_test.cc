// /metrics end to end: the real tandem-cpu-attention and tandem-gpu-worker (cpu backend,
// stories260k, hybrid with a 16-token window so the node holds and attends KV) started with
// metrics ports; one Generate of N tokens; both /metrics scraped over HTTP and read back with
// the test's parser: token counters, request success, histogram counts, node attends and
// scanned bytes; promtool on each scrape where installed. Skipped without ../shared/models.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "free_port.h"
#include "gtest/gtest.h"
#include "promtool.h"
#include "tandem/v1/generation.grpc.pb.h"
#include "text_format.h"

namespace tandem::metrics {
namespace {

using metrics_test::Exposition;
using test_process::ChildProcess;
using test_process::FreePort;   // the servers get explicit ports, as a deployment gives them

std::filesystem::path Stories260kDir() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "stories260k";
}

// GET /metrics, parsed; the raw text in `text`.
Exposition Scrape(int port, std::string* text) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(10, 0);
  httplib::Result res = client.Get("/metrics");
  EXPECT_TRUE(res) << "GET /metrics on port " << port << ": " << httplib::to_string(res.error());
  if (!res) return {};
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  *text = res->body;
  absl::StatusOr<Exposition> e = metrics_test::ParseExposition(res->body);
  EXPECT_TRUE(e.ok()) << e.status() << "\n" << res->body;
  return e.ok() ? *e : Exposition{};
}

void CheckWithPromtool(const std::string& text, const std::string& who) {
  if (!metrics_test::PromtoolAvailable()) {
    std::printf("promtool is not installed: %s's scrape checked by the test's parser only\n",
                who.c_str());
    return;
  }
  absl::StatusOr<metrics_test::PromtoolResult> r = metrics_test::RunPromtool(text);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->exit_code == 0 || r->exit_code == 3) << who << ": promtool could not parse it";
  EXPECT_TRUE(r->problems.empty()) << who << ": " << r->problems.front();
}

class MetricsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(Stories260kDir() / "golden.json")) {
      GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
    }
    std::ifstream in(Stories260kDir() / "golden.json");
    greedy_ids_ = nlohmann::json::parse(in).at("greedy_ids").get<std::vector<int32_t>>();
    ASSERT_GE(greedy_ids_.size(), 40u);
  }

  std::vector<int32_t> greedy_ids_;
};

TEST_F(MetricsE2eTest, WorkerAndNodeCountOneGeneration) {
  const int node_metrics_port = FreePort(), worker_metrics_port = FreePort();
  ASSERT_GT(node_metrics_port, 0);
  ASSERT_GT(worker_metrics_port, 0);
  auto node =
      ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0", "--pool_bytes=64MiB",
                           "--threads=1", "--executor_threads=2", "--log_level=warn",
                           absl::StrCat("--metrics_address=127.0.0.1:", node_metrics_port)});
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<int> node_port = (*node)->WaitListening();
  ASSERT_TRUE(node_port.ok()) << node_port.status();
  auto worker = ChildProcess::Start(
      {TANDEM_GPU_WORKER_BIN, "--model=" + Stories260kDir().string(), "--backend=cpu",
       "--cpu_threads=2", "--address=127.0.0.1:0", "--block_tokens=16", "--log_level=warn",
       absl::StrCat("--cpu_nodes=127.0.0.1:", *node_port),
       absl::StrCat("--metrics_address=127.0.0.1:", worker_metrics_port)});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> worker_port = (*worker)->WaitListening();
  ASSERT_TRUE(worker_port.ok()) << worker_port.status();

  // 40 prompt ids; a 16-token window + 4 sinks leave the rest of the prompt and of the
  // generation on the node, which attends over it every step and layer.
  constexpr int kPrompt = 40, kTokens = 24;
  v1::GenerateRequest request;
  request.mutable_prompt_ids()->mutable_ids()->Assign(greedy_ids_.begin(),
                                                      greedy_ids_.begin() + kPrompt);
  request.set_max_tokens(kTokens);
  request.set_ignore_eos(true);
  request.set_mode("hybrid");
  request.set_window(16);
  request.set_sink(4);
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", *worker_port),
                                                          grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->Generate(&ctx, request);
  v1::GenerateResponse message;
  v1::GenerateFinal final;
  int tokens = 0;
  while (reader->Read(&message)) {
    if (message.has_token()) ++tokens;
    if (message.has_final()) final = message.final();
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(final.usage().completion_tokens(), kTokens);
  ASSERT_EQ(final.usage().prompt_tokens(), kPrompt);
  ASSERT_GT(final.cpu_kv_entries(), 0) << "the node held none of the KV";

  // The scheduler publishes its gauges after it ended the request: wait for that iteration.
  std::string worker_text;
  Exposition w;
  for (int i = 0; i < 100; ++i) {
    w = Scrape(worker_metrics_port, &worker_text);
    if (w.Value("tandem:num_requests_running") == 0.0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(w.Value("tandem:num_requests_running"), 0.0);
  EXPECT_EQ(w.Value("tandem:num_requests_waiting"), 0.0);
  EXPECT_EQ(w.Value("tandem:generation_tokens_total"), double(kTokens));
  EXPECT_EQ(w.Value("tandem:prompt_tokens_total"), double(kPrompt));
  EXPECT_EQ(w.Value("tandem:request_success_total", {{"finished_reason", "length"}}), 1.0);
  EXPECT_EQ(w.Find("tandem:request_success_total").size(), 1u);
  EXPECT_TRUE(w.Find("tandem:request_failure_total").empty());
  EXPECT_EQ(w.Value("tandem:time_to_first_token_seconds_count"), 1.0);
  EXPECT_EQ(w.Value("tandem:e2e_request_latency_seconds_count"), 1.0);
  EXPECT_EQ(w.Value("tandem:inter_token_latency_seconds_count"), double(kTokens - 1));
  EXPECT_NEAR(*w.Value("tandem:time_to_first_token_seconds_sum"),
              final.time_to_first_token_seconds(), 1e-6);
  EXPECT_NEAR(*w.Value("tandem:e2e_request_latency_seconds_sum"), final.total_seconds(), 1e-6);
  EXPECT_EQ(w.Value("tandem:degraded_steps_total"), double(final.degraded_steps()));
  // The finished request's session stays in the prefix cache (prompt and generated tokens but
  // the last, sampled and not fed), its window on the device and the rest on the node.
  EXPECT_EQ(w.Value("tandem:prefix_cache_sessions"), 1.0);
  EXPECT_EQ(w.Value("tandem:prefix_cache_tokens"), double(kPrompt + kTokens - 1));
  EXPECT_EQ(w.Value("tandem:prefix_cache_hit_tokens_total"), 0.0);
  EXPECT_EQ(w.Value("tandem:prefix_cache_evictions_total"), 0.0);
  // No --kv_cache_bytes: no share of a budget, only the bytes (the cached session's window).
  EXPECT_TRUE(w.Find("tandem:kv_cache_usage_perc").empty());
  EXPECT_GT(w.Value("tandem:kv_cache_used_bytes", {{"tier", "gpu"}}).value_or(0), 0.0);
  CheckWithPromtool(worker_text, "tandem-gpu-worker");

  std::string node_text;
  const Exposition n = Scrape(node_metrics_port, &node_text);
  const double attends = n.Value("tandem:node_attends_total", {{"transport", "shm"}}).value_or(-1) +
                         n.Value("tandem:node_attends_total", {{"transport", "grpc"}}).value_or(-1);
  EXPECT_GT(attends, 0.0);
  EXPECT_GT(n.Value("tandem:node_scanned_bytes_total").value_or(0), 0.0);
  EXPECT_EQ(n.Value("tandem:node_pool_bytes", {{"state", "total"}}), double(64 << 20));
  EXPECT_EQ(n.Value("tandem:node_sessions_open"), 1.0);  // the one-shot session, cached
  EXPECT_EQ(n.Value("tandem:node_attends_in_flight"), 0.0);
  const std::optional<double> usage = n.Value("tandem:kv_cache_usage_perc", {{"tier", "cpu"}});
  ASSERT_TRUE(usage.has_value());
  EXPECT_GE(*usage, 0.0);
  EXPECT_LE(*usage, 1.0);
  CheckWithPromtool(node_text, "tandem-cpu-attention");

  absl::StatusOr<int> code = (*worker)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  code = (*node)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(MetricsE2eTest, ATakenMetricsPortIsAClearStartupError) {
  // The node's metrics port is taken by the first node: the second exits 1 naming it, and so
  // does a worker (before it loads the model).
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string flag = absl::StrCat("--metrics_address=127.0.0.1:", port);
  auto node = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                   "--pool_bytes=16MiB", "--threads=1", "--log_level=warn", flag});
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_TRUE((*node)->WaitListening().ok());

  for (const std::vector<std::string>& argv :
       {std::vector<std::string>{TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                 "--pool_bytes=16MiB", "--threads=1", flag},
        std::vector<std::string>{TANDEM_GPU_WORKER_BIN, "--model=" + Stories260kDir().string(),
                                 "--backend=cpu", "--address=127.0.0.1:0", flag}}) {
    auto second = ChildProcess::Start(argv, /*capture_stderr=*/true);
    ASSERT_TRUE(second.ok()) << second.status();
    absl::StatusOr<int> code = (*second)->Wait(60000);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 1) << argv[0] << "\n" << (*second)->log();
    // The node logs to stdout, the worker to stderr.
    EXPECT_NE((*second)->log().find(absl::StrCat("cannot serve metrics on '127.0.0.1:", port, "'")),
              std::string::npos)
        << (*second)->log();
  }
  absl::StatusOr<int> code = (*node)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
}

}  // namespace
}  // namespace tandem::metrics
