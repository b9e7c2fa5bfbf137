// tandem-load's measurements: latency distributions in bounded memory, the per-request records
// folded into run totals, and the report (a human table and one JSON object).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace tandem::bench {

// Mean, extremes and percentiles of a latency series (seconds). Exact while it holds at most
// kExactSamples values (percentiles interpolate linearly between order statistics, as numpy's
// default, which vLLM's benchmark_serving reports); past that, percentiles come from a
// log-bucketed histogram with buckets 1% wide (relative error <= 0.5%, clamped to [min, max]),
// so memory stays bounded whatever the run's length. Mean, min and max are always exact.
// Not thread-safe.
class LatencyStats {
 public:
  static constexpr size_t kExactSamples = size_t{1} << 20;

  LatencyStats();

  void Add(double seconds);

  struct Summary {
    uint64_t count = 0;
    double mean = 0, min = 0, max = 0, p50 = 0, p90 = 0, p99 = 0;
    bool exact = true;  // false once the histogram answers the percentiles
  };
  // All zeros for an empty series.
  Summary Summarize() const;

  uint64_t count() const { return count_; }

 private:
  double Percentile(const std::vector<double>& sorted, double p) const;
  double HistogramPercentile(double p) const;

  uint64_t count_ = 0;
  double sum_ = 0, min_ = 0, max_ = 0;
  std::vector<double> samples_;    // the first kExactSamples values
  std::vector<uint64_t> buckets_;  // every value, by log bucket
};

// One finished request, as the client saw it. Times are seconds from the start of the measured
// phase (steady clock).
struct RequestRecord {
  double scheduled_s = 0;     // when it was due (open loop), = send_s in a closed loop
  double send_s = 0;          // Generate called
  double first_token_s = -1;  // first `token` message received; -1 when none came
  double end_s = 0;           // the stream's status received
  int64_t prompt_tokens = 0;  // ids sent
  int64_t cached_tokens = 0;  // of those, served by the worker's prefix cache (usage)
  int64_t output_tokens = 0;  // `token` messages received
  int code = 0;               // grpc::StatusCode; 0 = OK with a `final` message
  std::string message;        // the error's message
  std::vector<double> itl_s;  // gaps between consecutive `token` messages
};

// The run's totals and distributions. Thread-safe (one lock per Add: requests take
// milliseconds, so the lock is never contended in practice).
class LoadCollector {
 public:
  void Add(const RequestRecord& record);

  struct Report {
    uint64_t ok = 0, failed = 0;
    std::map<std::string, uint64_t> errors;           // status code name -> count
    std::map<std::string, std::string> error_sample;  // status code name -> first message
    double duration_s = 0;          // first send -> last end over all recorded requests
    int64_t input_tokens = 0;       // prompt tokens of successful requests
    int64_t cached_tokens = 0;      // of those, served by the prefix cache
    int64_t output_tokens = 0;      // tokens received by successful requests
    double request_throughput = 0;  // successful requests / duration
    double input_tok_s = 0, output_tok_s = 0, total_tok_s = 0;
    LatencyStats::Summary ttft, itl, tpot, e2e, queue;
    // Tokens per second while every successful request was decoding at once: tokens received
    // from the last first token to the first end over those two times (0 when that span is
    // empty). With a wave of N = concurrency requests this is the decode rate of a batch of N,
    // free of the prefills around it.
    double all_decoding_tok_s = 0;
    double all_decoding_span_s = 0;
  };
  Report Finish() const;

 private:
  mutable std::mutex mu_;
  uint64_t ok_ = 0, failed_ = 0;
  std::map<std::string, uint64_t> errors_;
  std::map<std::string, std::string> error_sample_;
  double first_send_s_ = 0, last_end_s_ = 0;
  bool any_ = false;
  int64_t input_tokens_ = 0, output_tokens_ = 0, cached_tokens_ = 0;
  // TTFT: send -> first token; ITL: token gaps; TPOT: (end - first token) / (tokens - 1) per
  // request with >= 2 tokens; E2E: send -> end; queue: due -> sent (open loop).
  LatencyStats ttft_, itl_, tpot_, e2e_, queue_;
  // Tokens received per kTokenBinS of the run (bounded: one counter per 10 ms of run time) and
  // the span in which every successful request was decoding.
  static constexpr double kTokenBinS = 0.01;
  std::vector<uint32_t> token_bins_;
  double last_first_token_s_ = -1, first_ok_end_s_ = -1;
};

// "OK", "UNAVAILABLE", ...: grpc::StatusCode's name; "CODE_<n>" for an unknown number.
std::string StatusCodeName(int code);

// The report as one flat JSON object with vLLM benchmark_serving's key names (completed, failed,
// duration [s], total_input_tokens, request_throughput [req/s], output_throughput [tok/s],
// mean_ttft_ms, median_ttft_ms, p90_ttft_ms, p99_ttft_ms, ... for ttft, tpot, itl, e2el), plus
// "errors" (code name -> count), "error_samples" and the run's settings under "config".
nlohmann::ordered_json ReportJson(const LoadCollector::Report& report,
                                  const nlohmann::ordered_json& config);

// The human table printed on stdout.
std::string ReportTable(const LoadCollector::Report& report);

}  // namespace tandem::bench
