// tandem-load's pure logic: latency percentiles (exact and past the exact-sample cap), length
// distributions, Poisson arrivals, prompts, text splitting, and the report's totals.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "load_stats.h"
#include "load_workload.h"

namespace tandem::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LatencyStatsTest, EmptySeriesIsAllZeros) {
  const LatencyStats::Summary s = LatencyStats().Summarize();
  EXPECT_EQ(s.count, 0u);
  EXPECT_EQ(s.mean, 0);
  EXPECT_EQ(s.p99, 0);
  EXPECT_TRUE(s.exact);
}

// numpy.percentile([1..100], [50, 90, 99]) = 50.5, 90.1, 99.01 (linear interpolation).
TEST(LatencyStatsTest, ExactPercentilesInterpolateLikeNumpy) {
  LatencyStats stats;
  for (int i = 100; i >= 1; --i) stats.Add(i);
  const LatencyStats::Summary s = stats.Summarize();
  EXPECT_EQ(s.count, 100u);
  EXPECT_TRUE(s.exact);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);
  EXPECT_NEAR(s.p50, 50.5, 1e-12);
  EXPECT_NEAR(s.p90, 90.1, 1e-12);
  EXPECT_NEAR(s.p99, 99.01, 1e-12);

  LatencyStats one;
  one.Add(0.25);
  EXPECT_EQ(one.Summarize().p50, 0.25);
  EXPECT_EQ(one.Summarize().p99, 0.25);
}

// Past kExactSamples the histogram answers: within 1% of the true order statistics (its buckets
// are 1% wide), the mean still exact.
TEST(LatencyStatsTest, HistogramPercentilesStayWithinOnePercent) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> latency(std::log(0.02), 1.0);  // ~20 ms, heavy tail
  const size_t n = LatencyStats::kExactSamples + 50'000;
  std::vector<double> all(n);
  LatencyStats stats;
  for (double& x : all) {
    x = latency(rng);
    stats.Add(x);
  }
  const LatencyStats::Summary s = stats.Summarize();
  EXPECT_FALSE(s.exact);
  EXPECT_EQ(s.count, n);
  EXPECT_NEAR(s.mean, std::accumulate(all.begin(), all.end(), 0.0) / n, 1e-9);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(s.min, all.front());
  EXPECT_EQ(s.max, all.back());
  for (auto [p, got] : {std::pair{0.50, s.p50}, {0.90, s.p90}, {0.99, s.p99}}) {
    const double want = all[static_cast<size_t>(p * (n - 1))];
    EXPECT_NEAR(got, want, 0.01 * want) << "p" << p * 100;
  }
}

TEST(LengthSamplerTest, RejectsBadSpecs) {
  EXPECT_FALSE(LengthSampler::Create({LengthDist::kFixed, 0, 0}, "--prompt_tokens").ok());
  EXPECT_FALSE(LengthSampler::Create({LengthDist::kNormal, 10, -0.1}, "--prompt_tokens").ok());
  EXPECT_FALSE(LengthSampler::Create({LengthDist::kNormal, 10, NAN}, "--prompt_tokens").ok());
  const absl::Status uniform =
      LengthSampler::Create({LengthDist::kUniform, 10, 1.5}, "--output_tokens").status();
  EXPECT_EQ(uniform.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(uniform.message(), HasSubstr("--output_tokens"));
  EXPECT_FALSE(ParseLengthDist("zipf").ok());
  EXPECT_EQ(*ParseLengthDist("normal"), LengthDist::kNormal);
  EXPECT_STREQ(LengthDistName(LengthDist::kUniform), "uniform");
}

TEST(LengthSamplerTest, FixedIsTheMeanClampedToMax) {
  const LengthSampler fixed = *LengthSampler::Create({LengthDist::kFixed, 100, 0.5}, "x");
  std::mt19937_64 rng(1);
  EXPECT_EQ(fixed.Sample(rng, 1000), 100);
  EXPECT_EQ(fixed.Sample(rng, 40), 40);
  EXPECT_EQ(fixed.Sample(rng, 0), 1);
}

TEST(LengthSamplerTest, UniformCoversItsRange) {
  const LengthSampler uniform = *LengthSampler::Create({LengthDist::kUniform, 100, 0.5}, "x");
  std::mt19937_64 rng(2);
  int64_t lo = 1 << 30, hi = 0;
  double sum = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const int64_t x = uniform.Sample(rng, 1000);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  EXPECT_EQ(lo, 50);
  EXPECT_EQ(hi, 150);
  EXPECT_NEAR(sum / n, 100, 1.0);
}

TEST(LengthSamplerTest, NormalHasItsMeanAndSpreadAndStaysPositive) {
  const LengthSampler normal = *LengthSampler::Create({LengthDist::kNormal, 1000, 0.2}, "x");
  std::mt19937_64 rng(3);
  const int n = 20000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    const double x = static_cast<double>(normal.Sample(rng, 1 << 20));
    sum += x;
    sq += x * x;
  }
  const double mean = sum / n;
  EXPECT_NEAR(mean, 1000, 5);
  EXPECT_NEAR(std::sqrt(sq / n - mean * mean), 200, 5);

  const LengthSampler wide = *LengthSampler::Create({LengthDist::kNormal, 4, 3.0}, "x");
  for (int i = 0; i < 1000; ++i) {
    const int64_t x = wide.Sample(rng, 10);
    ASSERT_GE(x, 1);
    ASSERT_LE(x, 10);
  }
}

TEST(ArrivalScheduleTest, PoissonGapsHaveMeanOneOverRate) {
  ArrivalSchedule schedule(20.0, 5);
  double last = 0;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    const double t = schedule.Next();
    ASSERT_GE(t, last);
    last = t;
  }
  EXPECT_NEAR(last / n, 1.0 / 20.0, 0.05 / 20.0);

  ArrivalSchedule a(3.0, 9), b(3.0, 9);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.Next(), b.Next());
  ArrivalSchedule closed(0, 9);
  EXPECT_EQ(closed.Next(), 0);
  EXPECT_EQ(closed.Next(), 0);
}

TEST(PromptSourceTest, RandomIdsAreInOneToVocab) {
  EXPECT_FALSE(PromptSource::Random(1).ok());
  const PromptSource source = *PromptSource::Random(512);
  EXPECT_TRUE(source.is_random());
  std::mt19937_64 rng(4);
  const std::vector<int32_t> ids = source.Make(0, 5000, rng);
  ASSERT_EQ(ids.size(), 5000u);
  EXPECT_EQ(*std::min_element(ids.begin(), ids.end()), 1);
  EXPECT_EQ(*std::max_element(ids.begin(), ids.end()), 511);
}

TEST(PromptSourceTest, CorpusPromptsAreConsecutiveSlicesThatWrap) {
  EXPECT_FALSE(PromptSource::Corpus({}).ok());
  const PromptSource source = *PromptSource::Corpus({0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_FALSE(source.is_random());
  EXPECT_EQ(source.corpus_tokens(), 10u);
  std::mt19937_64 rng(0);
  EXPECT_THAT(source.Make(0, 4, rng), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(source.Make(1, 4, rng), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(source.Make(2, 4, rng), ElementsAre(8, 9, 0, 1));
  EXPECT_THAT(source.Make(0, 13, rng), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2));
}

TEST(SplitTextTest, PiecesConcatenateEndAtSpacesAndKeepUtf8Whole) {
  const std::string text = "the quick brown fox jumps over the lazy dog\nand runs away";
  const std::vector<absl::string_view> pieces = SplitText(text, 12);
  EXPECT_EQ(absl::StrJoin(pieces, ""), text);
  for (absl::string_view p : pieces) {
    EXPECT_LE(p.size(), 12u);
    if (p.data() + p.size() != text.data() + text.size()) {
      EXPECT_TRUE(p.back() == ' ' || p.back() == '\n') << "'" << p << "'";
    }
  }
  // No spaces: cuts fall between characters of two bytes (é = C3 A9), never inside one.
  std::string accents;
  for (int i = 0; i < 15; ++i) accents += "\xC3\xA9";
  for (absl::string_view p : SplitText(accents, 5)) {
    EXPECT_EQ(p.size() % 2, 0u);
    EXPECT_EQ(static_cast<unsigned char>(p[0]), 0xC3);
  }
  EXPECT_EQ(absl::StrJoin(SplitText(accents, 5), ""), accents);
  EXPECT_TRUE(SplitText("", 8).empty());
}

TEST(RequestSeedTest, DiffersByIndexAndRun) {
  EXPECT_NE(RequestSeed(0, 0), RequestSeed(0, 1));
  EXPECT_NE(RequestSeed(0, 0), RequestSeed(1, 0));
  EXPECT_EQ(RequestSeed(3, 4), RequestSeed(3, 4));
}

TEST(LoadCollectorTest, TotalsThroughputAndLatencies) {
  LoadCollector collector;
  RequestRecord a;  // sent at 1 s, first token at 1.5 s, then 3 more tokens 0.1 s apart
  a.scheduled_s = a.send_s = 1.0;
  a.first_token_s = 1.5;
  a.end_s = 1.8;
  a.prompt_tokens = 10;
  a.output_tokens = 4;
  a.itl_s = {0.1, 0.1, 0.1};
  RequestRecord b;  // open loop: due at 1.5 s, sent at 2 s; one token
  b.scheduled_s = 1.5;
  b.send_s = 2.0;
  b.first_token_s = 2.25;
  b.end_s = 3.0;
  b.prompt_tokens = 20;
  b.output_tokens = 1;
  RequestRecord failed;
  failed.scheduled_s = failed.send_s = 0.5;
  failed.end_s = 0.6;
  failed.prompt_tokens = 99;
  failed.code = 14;  // UNAVAILABLE
  failed.message = "connection refused";
  RequestRecord failed_again = failed;
  failed_again.message = "second";
  for (const RequestRecord* r : {&a, &b, &failed, &failed_again}) collector.Add(*r);

  const LoadCollector::Report report = collector.Finish();
  EXPECT_EQ(report.ok, 2u);
  EXPECT_EQ(report.failed, 2u);
  EXPECT_EQ(report.errors.at("UNAVAILABLE"), 2u);
  EXPECT_EQ(report.error_sample.at("UNAVAILABLE"), "connection refused");
  EXPECT_DOUBLE_EQ(report.duration_s, 2.5);  // 0.5 (first send) .. 3.0 (last end)
  EXPECT_EQ(report.input_tokens, 30);
  EXPECT_EQ(report.output_tokens, 5);
  EXPECT_DOUBLE_EQ(report.request_throughput, 2 / 2.5);
  EXPECT_DOUBLE_EQ(report.output_tok_s, 5 / 2.5);
  EXPECT_DOUBLE_EQ(report.input_tok_s, 30 / 2.5);
  EXPECT_EQ(report.ttft.count, 2u);
  EXPECT_DOUBLE_EQ(report.ttft.mean, (0.5 + 0.25) / 2);
  EXPECT_EQ(report.itl.count, 3u);
  EXPECT_NEAR(report.itl.p50, 0.1, 1e-12);
  EXPECT_EQ(report.tpot.count, 1u);  // b has one token: no TPOT
  EXPECT_NEAR(report.tpot.mean, 0.3 / 3, 1e-12);
  EXPECT_NEAR(report.e2e.max, 1.0, 1e-12);
  EXPECT_NEAR(report.queue.max, 0.5, 1e-12);

  nlohmann::ordered_json config;
  config["loop"] = "open";
  const nlohmann::ordered_json json = ReportJson(report, config);
  EXPECT_EQ(json["completed"], 2);
  EXPECT_EQ(json["failed"], 2);
  EXPECT_EQ(json["errors"]["UNAVAILABLE"], 2);
  EXPECT_DOUBLE_EQ(json["output_throughput"].get<double>(), 2.0);
  EXPECT_NEAR(json["mean_ttft_ms"].get<double>(), 375.0, 1e-9);
  EXPECT_NEAR(json["p99_itl_ms"].get<double>(), 100.0, 1e-9);
  EXPECT_TRUE(json["percentiles_exact"].get<bool>());
  EXPECT_EQ(json["config"]["loop"], "open");

  const std::string table = ReportTable(report);
  EXPECT_THAT(table, HasSubstr("Successful requests:                     2\n"));
  EXPECT_THAT(table, HasSubstr("  UNAVAILABLE:"));
  EXPECT_THAT(table, HasSubstr(" 2  (first: connection refused)\n"));
  EXPECT_THAT(table, HasSubstr("Mean TTFT (ms):                          375.00\n"));
  EXPECT_THAT(table, HasSubstr("Mean queue delay (ms):"));
}

TEST(StatusCodeNameTest, NamesGrpcCodes) {
  EXPECT_EQ(StatusCodeName(0), "OK");
  EXPECT_EQ(StatusCodeName(4), "DEADLINE_EXCEEDED");
  EXPECT_EQ(StatusCodeName(14), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(16), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(42), "CODE_42");
}

}  // namespace
}  // namespace tandem::bench

namespace tandem::bench {
namespace {

// Two requests decoding together from 2.0 s (the later first token) to 3.0 s (the earlier end):
// a emits 41 tokens 0.05 s apart from 1.0 s (20 of them in [2.0, 3.0)), b 101 tokens 0.01 s
// apart from 2.0 s (100 in [2.0, 3.0)): 120 tokens in 1 s (10 ms bins: +-2 at the edges).
TEST(LoadCollectorTest, AllDecodingThroughputCountsTheSpanWhereEveryRequestDecodes) {
  LoadCollector collector;
  RequestRecord a;
  a.send_s = 0.5;
  a.first_token_s = 1.0;
  a.output_tokens = 41;
  a.itl_s.assign(40, 0.05);
  a.end_s = 3.0 + 1e-9;
  RequestRecord b;
  b.send_s = 0.5;
  b.first_token_s = 2.0 + 1e-9;
  b.output_tokens = 101;
  b.itl_s.assign(100, 0.01);
  b.end_s = 3.5;
  collector.Add(a);
  collector.Add(b);
  const LoadCollector::Report r = collector.Finish();
  EXPECT_NEAR(r.all_decoding_span_s, 1.0, 1e-9);
  EXPECT_NEAR(r.all_decoding_tok_s, 120.0, 2.0);
  // No overlap: nothing to report.
  LoadCollector apart;
  b.first_token_s = 3.2;
  b.itl_s.clear();
  b.output_tokens = 1;
  apart.Add(a);
  apart.Add(b);
  EXPECT_EQ(apart.Finish().all_decoding_tok_s, 0.0);
}

}  // namespace
}  // namespace tandem::bench
