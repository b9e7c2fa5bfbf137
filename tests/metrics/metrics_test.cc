// tandem::metrics: what the registry helpers, the serializer and MetricsServer expose, read
// back with the test's own text-format parser (text_format.h) and checked by value; promtool
// where it is installed.
#include <httplib.h>

#include <atomic>
#include <cmath>
#include <string>

#include "gtest/gtest.h"
#include "promtool.h"
#include "tandem/metrics/metrics_server.h"
#include "tandem/metrics/node_metrics.h"
#include "tandem/metrics/registry.h"
#include "tandem/metrics/worker_metrics.h"
#include "text_format.h"

namespace tandem::metrics {
namespace {

using metrics_test::Exposition;
using metrics_test::ParseExposition;

Exposition Parse(const prometheus::Registry& registry) {
  const std::string text = SerializeText(registry);
  absl::StatusOr<Exposition> e = ParseExposition(text);
  EXPECT_TRUE(e.ok()) << e.status() << "\n" << text;
  return e.ok() ? *e : Exposition{};
}

TEST(Registry, CountersAndGaugesReadBackWithNamesLabelsAndValues) {
  auto registry = NewRegistry();
  absl::StatusOr<prometheus::Counter*> shm =
      AddCounter(*registry, "tandem:node_attends_total", "Attends.", {{"transport", "shm"}});
  absl::StatusOr<prometheus::Counter*> grpc =
      AddCounter(*registry, "tandem:node_attends_total", "Attends.", {{"transport", "grpc"}});
  absl::StatusOr<prometheus::Gauge*> gauge =
      AddGauge(*registry, "tandem:num_requests_running", "Running.");
  ASSERT_TRUE(shm.ok() && grpc.ok() && gauge.ok());
  (*shm)->Increment(3);
  (*grpc)->Increment();
  (*gauge)->Set(7);
  (*gauge)->Decrement(2);

  const Exposition e = Parse(*registry);
  EXPECT_EQ(e.type.at("tandem:node_attends_total"), "counter");
  EXPECT_EQ(e.help.at("tandem:node_attends_total"), "Attends.");
  EXPECT_EQ(e.type.at("tandem:num_requests_running"), "gauge");
  EXPECT_EQ(e.Value("tandem:node_attends_total", {{"transport", "shm"}}), 3.0);
  EXPECT_EQ(e.Value("tandem:node_attends_total", {{"transport", "grpc"}}), 1.0);
  EXPECT_EQ(e.Find("tandem:node_attends_total").size(), 2u);
  EXPECT_EQ(e.Value("tandem:num_requests_running"), 5.0);
}

TEST(Registry, LabelValuesAreEscapedAndReadBack) {
  auto registry = NewRegistry();
  absl::StatusOr<prometheus::Family<prometheus::Counter>*> family =
      AddCounterFamily(*registry, "tandem:http_requests_total", "Requests.");
  ASSERT_TRUE(family.ok());
  const std::string odd = "a \"quoted\" back\\slash\nnewline";
  (*family)->Add({{"route", odd}, {"code", "200"}}).Increment(2);
  (*family)->Add({{"route", "/v1/models"}, {"code", "404"}}).Increment();
  const Exposition e = Parse(*registry);
  EXPECT_EQ(e.Value("tandem:http_requests_total", {{"route", odd}}), 2.0);
  EXPECT_EQ(e.Value("tandem:http_requests_total", {{"route", "/v1/models"}, {"code", "404"}}), 1.0);
}

TEST(Registry, HistogramBucketsCountKnownObservations) {
  auto registry = NewRegistry();
  absl::StatusOr<prometheus::Histogram*> h = AddHistogram(
      *registry, "tandem:time_to_first_token_seconds", "TTFT.", TimeToFirstTokenBuckets());
  ASSERT_TRUE(h.ok());
  // 0.0005 <= 0.001; 0.003 in (0.001, 0.005]; 0.005 exactly on a bound (le is inclusive);
  // 3.0 in (2.5, 5]; 5000 above every bound (+Inf only).
  for (double v : {0.0005, 0.003, 0.005, 3.0, 5000.0}) (*h)->Observe(v);
  const Exposition e = Parse(*registry);
  const std::string b = "tandem:time_to_first_token_seconds_bucket";
  EXPECT_EQ(e.type.at("tandem:time_to_first_token_seconds"), "histogram");
  EXPECT_EQ(e.Value(b, {{"le", "0.001"}}), 1.0);
  EXPECT_EQ(e.Value(b, {{"le", "0.005"}}), 3.0);
  EXPECT_EQ(e.Value(b, {{"le", "2.5"}}), 3.0);
  EXPECT_EQ(e.Value(b, {{"le", "5"}}), 4.0);
  EXPECT_EQ(e.Value(b, {{"le", "2560"}}), 4.0);
  EXPECT_EQ(e.Value(b, {{"le", "+Inf"}}), 5.0);
  EXPECT_EQ(e.Find(b).size(), TimeToFirstTokenBuckets().size() + 1);
  EXPECT_EQ(e.Value("tandem:time_to_first_token_seconds_count"), 5.0);
  EXPECT_NEAR(*e.Value("tandem:time_to_first_token_seconds_sum"), 5003.0085, 1e-9);
}

TEST(Registry, BucketSetsIncreaseAndMatchVllm) {
  for (const std::vector<double>* buckets :
       {&TimeToFirstTokenBuckets(), &InterTokenLatencyBuckets(), &RequestLatencyBuckets()}) {
    ASSERT_FALSE(buckets->empty());
    for (size_t i = 1; i < buckets->size(); ++i) EXPECT_LT((*buckets)[i - 1], (*buckets)[i]);
  }
  EXPECT_EQ(TimeToFirstTokenBuckets().back(), 2560.0);
  EXPECT_EQ(InterTokenLatencyBuckets().back(), 80.0);
  EXPECT_EQ(RequestLatencyBuckets().back(), 7680.0);
}

TEST(Registry, BadNamesLabelsBucketsAndClashesAreInvalidArgument) {
  auto registry = NewRegistry();
  EXPECT_EQ(AddCounter(*registry, "bad name", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddGauge(*registry, "tandem:g", "x", {{"bad-label", "v"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddHistogram(*registry, "tandem:h", "x", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddHistogram(*registry, "tandem:h", "x", {1.0, 1.0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(AddCounter(*registry, "tandem:taken", "x").ok());
  EXPECT_EQ(AddGauge(*registry, "tandem:taken", "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  // The same counter asked for twice is the same series.
  absl::StatusOr<prometheus::Counter*> again = AddCounter(*registry, "tandem:taken", "x");
  ASSERT_TRUE(again.ok());
  (*again)->Increment(4);
  EXPECT_EQ(Parse(*registry).Value("tandem:taken"), 4.0);
}

TEST(WorkerMetrics, FamiliesNamesAndLabels) {
  auto registry = NewRegistry();
  absl::StatusOr<WorkerMetrics> m = WorkerMetrics::Create(*registry, /*gpu_kv_budget=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  m->prompt_tokens->Increment(12);
  m->generation_tokens->Increment(5);
  m->RequestSuccess("length").Increment();
  m->RequestSuccess("length").Increment();
  m->RequestSuccess("stop").Increment();
  m->RequestFailure("RESOURCE_EXHAUSTED").Increment();
  m->gpu_kv_cache_usage->Set(0.25);
  m->inter_token_latency->Observe(0.002);
  const Exposition e = Parse(*registry);
  EXPECT_EQ(e.type.at("tandem:num_requests_running"), "gauge");
  EXPECT_EQ(e.type.at("tandem:num_requests_waiting"), "gauge");
  EXPECT_EQ(e.type.at("tandem:time_to_first_token_seconds"), "histogram");
  EXPECT_EQ(e.type.at("tandem:inter_token_latency_seconds"), "histogram");
  EXPECT_EQ(e.type.at("tandem:e2e_request_latency_seconds"), "histogram");
  EXPECT_EQ(e.type.at("tandem:degraded_steps_total"), "counter");
  EXPECT_EQ(e.Value("tandem:prompt_tokens_total"), 12.0);
  EXPECT_EQ(e.Value("tandem:generation_tokens_total"), 5.0);
  EXPECT_EQ(e.Value("tandem:request_success_total", {{"finished_reason", "length"}}), 2.0);
  EXPECT_EQ(e.Value("tandem:request_success_total", {{"finished_reason", "stop"}}), 1.0);
  EXPECT_EQ(e.Value("tandem:request_failure_total", {{"code", "RESOURCE_EXHAUSTED"}}), 1.0);
  EXPECT_EQ(e.Value("tandem:kv_cache_usage_perc", {{"tier", "gpu"}}), 0.25);
  EXPECT_EQ(e.Value("tandem:inter_token_latency_seconds_bucket", {{"le", "0.0025"}}), 1.0);
  EXPECT_EQ(e.Value("tandem:inter_token_latency_seconds_bucket", {{"le", "0.001"}}), 0.0);

  auto unbudgeted = NewRegistry();
  absl::StatusOr<WorkerMetrics> u = WorkerMetrics::Create(*unbudgeted, /*gpu_kv_budget=*/false);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->gpu_kv_cache_usage, nullptr);
  EXPECT_TRUE(Parse(*unbudgeted).Find("tandem:kv_cache_usage_perc").empty());
}

TEST(NodeMetrics, GaugesFromStatsAndCounters) {
  auto registry = NewRegistry();
  absl::StatusOr<NodeMetrics> m = NodeMetrics::Create(*registry);
  ASSERT_TRUE(m.ok()) << m.status();
  m->attends_shm->Increment(40);
  m->attends_grpc->Increment(2);
  m->scanned_bytes->Increment(1 << 20);
  m->SetGauges({.pool_used_bytes = 256,
                .pool_total_bytes = 1024,
                .sessions = 3,
                .attends_in_flight = 1,
                .scan_bytes_per_second = 5e9});
  const Exposition e = Parse(*registry);
  EXPECT_EQ(e.Value("tandem:node_attends_total", {{"transport", "shm"}}), 40.0);
  EXPECT_EQ(e.Value("tandem:node_attends_total", {{"transport", "grpc"}}), 2.0);
  EXPECT_EQ(e.Value("tandem:node_scanned_bytes_total"), double(1 << 20));
  EXPECT_EQ(e.Value("tandem:node_pool_bytes", {{"state", "used"}}), 256.0);
  EXPECT_EQ(e.Value("tandem:node_pool_bytes", {{"state", "total"}}), 1024.0);
  EXPECT_EQ(e.Value("tandem:kv_cache_usage_perc", {{"tier", "cpu"}}), 0.25);
  EXPECT_EQ(e.Value("tandem:node_sessions_open"), 3.0);
  EXPECT_EQ(e.Value("tandem:node_attends_in_flight"), 1.0);
  EXPECT_EQ(e.Value("tandem:node_scan_bytes_per_second"), 5e9);
}

TEST(WorkerAndNodeMetrics, ShareOneRegistry) {
  // An in-process node and the worker may export into one registry: the kv_cache_usage_perc
  // family is shared (tier gpu and cpu).
  auto registry = NewRegistry();
  absl::StatusOr<WorkerMetrics> w = WorkerMetrics::Create(*registry, true);
  absl::StatusOr<NodeMetrics> n = NodeMetrics::Create(*registry);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(Parse(*registry).Find("tandem:kv_cache_usage_perc").size(), 2u);
}

TEST(Promtool, AcceptsTheExpositionApartFromColons) {
  if (!metrics_test::PromtoolAvailable()) GTEST_SKIP() << "promtool is not installed";
  auto registry = NewRegistry();
  absl::StatusOr<WorkerMetrics> w = WorkerMetrics::Create(*registry, true);
  absl::StatusOr<NodeMetrics> n = NodeMetrics::Create(*registry);
  ASSERT_TRUE(w.ok() && n.ok());
  w->time_to_first_token->Observe(0.1);
  w->RequestSuccess("eos").Increment();
  absl::StatusOr<metrics_test::PromtoolResult> r =
      metrics_test::RunPromtool(SerializeText(*registry));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->exit_code == 0 || r->exit_code == 3) << "promtool could not parse it";
  EXPECT_TRUE(r->problems.empty()) << r->problems.front();
  EXPECT_FALSE(r->colon_findings.empty());
}

TEST(MetricsServer, ServesTheRegistryOverHttpAndRefreshesBeforeEachScrape) {
  auto registry = NewRegistry();
  absl::StatusOr<prometheus::Gauge*> gauge = AddGauge(*registry, "tandem:scrapes_seen", "x");
  ASSERT_TRUE(gauge.ok());
  std::atomic<int> refreshes{0};
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", registry, [&] { (*gauge)->Set(++refreshes); });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  httplib::Client client("127.0.0.1", (*server)->port());
  for (int i = 1; i <= 2; ++i) {
    httplib::Result res = client.Get("/metrics");
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    EXPECT_EQ(res->status, 200);
    absl::StatusOr<Exposition> e = ParseExposition(res->body);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->Value("tandem:scrapes_seen"), double(i));
    EXPECT_EQ(res->get_header_value("Content-Type"), std::string(kTextContentType));
  }

  // The port is taken: a second server says so instead of failing later.
  absl::StatusOr<std::unique_ptr<MetricsServer>> clash =
      MetricsServer::Start(absl::StrCat("127.0.0.1:", (*server)->port()), registry);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable) << clash.status();
}

TEST(MetricsServer, RejectsMalformedAddresses) {
  auto registry = NewRegistry();
  for (const char* bad :
       {"", "9090", "host:", ":9090", "127.0.0.1:port", "127.0.0.1:70000", "127.0.0.1:-1"}) {
    EXPECT_EQ(MetricsServer::Start(bad, registry).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::metrics
