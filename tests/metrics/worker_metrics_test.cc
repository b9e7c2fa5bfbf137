// The worker's /metrics in process: a GpuWorkerServer (cpu backend, stories260k, embedded CPU
// node, a --kv_cache_bytes budget) with a metrics port. What a request in flight shows
// (running, device KV in use and its share of the budget), what a cancelled and a refused
// request count, and the embedded node's families in the worker's own registry. Skipped
// without ../shared/models.
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

#include "gtest/gtest.h"
#include "tandem/gpu_worker/worker_server.h"
#include "tandem/v1/generation.grpc.pb.h"
#include "text_format.h"

namespace tandem::gpu_worker {
namespace {

using metrics_test::Exposition;

std::filesystem::path Stories260kDir() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "stories260k";
}

Exposition Scrape(int port) {
  httplib::Client client("127.0.0.1", port);
  httplib::Result res = client.Get("/metrics");
  EXPECT_TRUE(res) << httplib::to_string(res.error());
  if (!res) return {};
  absl::StatusOr<Exposition> e = metrics_test::ParseExposition(res->body);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *e : Exposition{};
}

class WorkerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(Stories260kDir() / "golden.json")) {
      GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
    }
    std::ifstream in(Stories260kDir() / "golden.json");
    ids_ = nlohmann::json::parse(in).at("greedy_ids").get<std::vector<int32_t>>();
    ASSERT_GE(ids_.size(), 40u);
    WorkerServerOptions options;
    options.address = "";  // in-process channel only
    options.metrics_address = "127.0.0.1:0";
    options.engine.model_dir = Stories260kDir().string();
    options.engine.backend = "cpu";
    options.engine.cpu_threads = 2;
    options.engine.block_tokens = 16;
    options.engine.kv_cache_bytes = 64 << 20;
    options.engine.nodes.embedded.pool_bytes = 32 << 20;
    absl::StatusOr<std::unique_ptr<GpuWorkerServer>> server = GpuWorkerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->metrics_port(), 0);
    stub_ = v1::Generation::NewStub(server_->InProcessChannel());
  }

  v1::GenerateRequest Request(int64_t max_tokens) const {
    v1::GenerateRequest r;
    r.mutable_prompt_ids()->mutable_ids()->Assign(ids_.begin(), ids_.begin() + 40);
    r.set_max_tokens(max_tokens);
    r.set_ignore_eos(true);
    r.set_mode("hybrid");
    r.set_window(16);
    r.set_sink(4);
    return r;
  }

  std::vector<int32_t> ids_;
  std::unique_ptr<GpuWorkerServer> server_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(WorkerMetricsTest, InFlightCancelledAndRefusedRequests) {
  const int port = server_->metrics_port();
  // In flight: token 2 is sampled in the iteration after token 1's, so by then the scheduler
  // has counted token 1 and published an iteration with the request running.
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, Request(400));
    v1::GenerateResponse message;
    int tokens = 0;
    while (tokens < 2 && reader->Read(&message)) tokens += message.has_token() ? 1 : 0;
    ASSERT_EQ(tokens, 2);
    const Exposition e = Scrape(port);
    EXPECT_EQ(e.Value("tandem:num_requests_running"), 1.0);
    const double used = e.Value("tandem:kv_cache_used_bytes", {{"tier", "gpu"}}).value_or(0);
    EXPECT_GT(used, 0.0);
    EXPECT_DOUBLE_EQ(*e.Value("tandem:kv_cache_usage_perc", {{"tier", "gpu"}}),
                     used / double(64 << 20));
    // Tokens are counted after their step returns: the second may still be in flight.
    EXPECT_GE(e.Value("tandem:generation_tokens_total").value_or(0), 1.0);
    ctx.TryCancel();
    while (reader->Read(&message)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Refused: a window below the block size is INVALID_ARGUMENT at admission.
  {
    v1::GenerateRequest bad = Request(4);
    bad.set_window(8);
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, bad);
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  Exposition e;
  for (int i = 0; i < 100; ++i) {
    e = Scrape(port);
    if (e.Value("tandem:num_requests_running") == 0.0 &&
        e.Value("tandem:request_success_total", {{"finished_reason", "cancelled"}}) == 1.0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(e.Value("tandem:num_requests_running"), 0.0);
  EXPECT_EQ(e.Value("tandem:request_success_total", {{"finished_reason", "cancelled"}}), 1.0);
  EXPECT_EQ(e.Value("tandem:request_failure_total", {{"code", "INVALID_ARGUMENT"}}), 1.0);
  EXPECT_EQ(e.Value("tandem:prompt_tokens_total"), 40.0);  // the refused one never ran
  EXPECT_EQ(e.Value("tandem:time_to_first_token_seconds_count"), 1.0);
  EXPECT_EQ(e.Value("tandem:e2e_request_latency_seconds_count"), 1.0);
  EXPECT_EQ(e.Value("tandem:kv_cache_usage_perc", {{"tier", "gpu"}}), 0.0);
  const double generated = e.Value("tandem:generation_tokens_total").value_or(0);
  EXPECT_EQ(e.Value("tandem:inter_token_latency_seconds_count"), generated - 1);

  // The embedded node counts into the worker's registry.
  EXPECT_GT(e.Value("tandem:node_attends_total", {{"transport", "shm"}}).value_or(0) +
                e.Value("tandem:node_attends_total", {{"transport", "grpc"}}).value_or(0),
            0.0);
  EXPECT_GT(e.Value("tandem:node_scanned_bytes_total").value_or(0), 0.0);
  EXPECT_EQ(e.Value("tandem:node_pool_bytes", {{"state", "total"}}), double(32 << 20));
  EXPECT_EQ(e.Value("tandem:node_sessions_open"), 0.0);
}

TEST_F(WorkerMetricsTest, KeptSessionsBetweenTurnsCountInGpuKvUsage) {
  const int port = server_->metrics_port();
  v1::GenerateRequest turn = Request(4);
  turn.set_session_id("kept-1");
  {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, turn);
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  // Between turns nothing runs, but the kept session still holds its window on the device.
  Exposition e;
  for (int i = 0; i < 100; ++i) {
    e = Scrape(port);
    if (e.Value("tandem:num_requests_running") == 0.0 &&
        e.Value("tandem:request_success_total", {{"finished_reason", "length"}}) == 1.0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(e.Value("tandem:num_requests_running"), 0.0);
  const double kept = e.Value("tandem:kv_cache_used_bytes", {{"tier", "gpu"}}).value_or(0);
  EXPECT_GT(kept, 0.0);
  EXPECT_DOUBLE_EQ(*e.Value("tandem:kv_cache_usage_perc", {{"tier", "gpu"}}),
                   kept / double(64 << 20));

  grpc::ClientContext close_ctx;
  v1::CloseGenerationSessionRequest close;
  close.set_session_id("kept-1");
  v1::CloseGenerationSessionResponse closed;
  ASSERT_TRUE(stub_->CloseSession(&close_ctx, close, &closed).ok());
  for (int i = 0; i < 100; ++i) {
    e = Scrape(port);
    if (e.Value("tandem:kv_cache_used_bytes", {{"tier", "gpu"}}) == 0.0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(e.Value("tandem:kv_cache_used_bytes", {{"tier", "gpu"}}), 0.0);
}

}  // namespace
}  // namespace tandem::gpu_worker
