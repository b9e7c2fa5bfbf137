#include "load_stats.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::bench {
namespace {

// Histogram buckets: [kMinS * kRatio^i, kMinS * kRatio^(i+1)); the first also holds everything
// below, the last everything above. 1 us .. 1e5 s covers any latency a run can see.
constexpr double kMinS = 1e-6;
constexpr double kRatio = 1.01;
const double kLogRatio = std::log(kRatio);
const size_t kBuckets = static_cast<size_t>(std::ceil(std::log(1e5 / kMinS) / kLogRatio));

size_t BucketOf(double seconds) {
  if (!(seconds > kMinS)) return 0;
  const auto i = static_cast<size_t>(std::log(seconds / kMinS) / kLogRatio);
  return std::min(i, kBuckets - 1);
}

}  // namespace

LatencyStats::LatencyStats() : buckets_(kBuckets, 0) {}

void LatencyStats::Add(double seconds) {
  if (count_ == 0) {
    min_ = max_ = seconds;
  } else {
    min_ = std::min(min_, seconds);
    max_ = std::max(max_, seconds);
  }
  ++count_;
  sum_ += seconds;
  if (samples_.size() < kExactSamples) samples_.push_back(seconds);
  ++buckets_[BucketOf(seconds)];
}

double LatencyStats::Percentile(const std::vector<double>& sorted, double p) const {
  const double pos = p * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[lo + 1] - sorted[lo]);
}

double LatencyStats::HistogramPercentile(double p) const {
  const auto rank = static_cast<uint64_t>(p * static_cast<double>(count_ - 1));
  uint64_t seen = 0;
  size_t i = 0;
  for (; i < buckets_.size(); ++i) {
    seen += buckets_[i];
    if (seen > rank) break;
  }
  const double mid = kMinS * std::pow(kRatio, static_cast<double>(i) + 0.5);
  return std::clamp(mid, min_, max_);
}

LatencyStats::Summary LatencyStats::Summarize() const {
  Summary s;
  if (count_ == 0) return s;
  s.count = count_;
  s.mean = sum_ / static_cast<double>(count_);
  s.min = min_;
  s.max = max_;
  s.exact = samples_.size() == count_;
  if (s.exact) {
    std::vector<double> sorted = samples_;
    std::sort(sorted.begin(), sorted.end());
    s.p50 = Percentile(sorted, 0.50);
    s.p90 = Percentile(sorted, 0.90);
    s.p99 = Percentile(sorted, 0.99);
  } else {
    s.p50 = HistogramPercentile(0.50);
    s.p90 = HistogramPercentile(0.90);
    s.p99 = HistogramPercentile(0.99);
  }
  return s;
}

void LoadCollector::Add(const RequestRecord& r) {
  std::lock_guard lock(mu_);
  if (!any_) {
    first_send_s_ = r.send_s;
    last_end_s_ = r.end_s;
    any_ = true;
  }
  first_send_s_ = std::min(first_send_s_, r.send_s);
  last_end_s_ = std::max(last_end_s_, r.end_s);
  queue_.Add(std::max(0.0, r.send_s - r.scheduled_s));
  if (r.code != 0) {
    ++failed_;
    const std::string name = StatusCodeName(r.code);
    if (errors_[name]++ == 0) error_sample_[name] = r.message;
    return;
  }
  ++ok_;
  input_tokens_ += r.prompt_tokens;
  cached_tokens_ += r.cached_tokens;
  output_tokens_ += r.output_tokens;
  e2e_.Add(r.end_s - r.send_s);
  if (r.first_token_s >= 0) ttft_.Add(r.first_token_s - r.send_s);
  if (r.output_tokens >= 2 && r.first_token_s >= 0) {
    tpot_.Add((r.end_s - r.first_token_s) / static_cast<double>(r.output_tokens - 1));
  }
  for (double gap : r.itl_s) itl_.Add(gap);
  if (r.first_token_s >= 0) {
    last_first_token_s_ = std::max(last_first_token_s_, r.first_token_s);
    first_ok_end_s_ = first_ok_end_s_ < 0 ? r.end_s : std::min(first_ok_end_s_, r.end_s);
    double t = r.first_token_s;
    auto count = [this](double at) {
      const size_t bin = static_cast<size_t>(std::max(0.0, at) / kTokenBinS);
      if (bin >= token_bins_.size()) token_bins_.resize(bin + 1, 0);
      ++token_bins_[bin];
    };
    count(t);
    for (double gap : r.itl_s) count(t += gap);
  }
}

LoadCollector::Report LoadCollector::Finish() const {
  std::lock_guard lock(mu_);
  Report r;
  r.ok = ok_;
  r.failed = failed_;
  r.errors = errors_;
  r.error_sample = error_sample_;
  r.duration_s = any_ ? last_end_s_ - first_send_s_ : 0;
  r.input_tokens = input_tokens_;
  r.cached_tokens = cached_tokens_;
  r.output_tokens = output_tokens_;
  if (r.duration_s > 0) {
    r.request_throughput = static_cast<double>(ok_) / r.duration_s;
    r.input_tok_s = static_cast<double>(input_tokens_) / r.duration_s;
    r.output_tok_s = static_cast<double>(output_tokens_) / r.duration_s;
    r.total_tok_s = r.input_tok_s + r.output_tok_s;
  }
  r.ttft = ttft_.Summarize();
  r.itl = itl_.Summarize();
  r.tpot = tpot_.Summarize();
  r.e2e = e2e_.Summarize();
  r.queue = queue_.Summarize();
  if (last_first_token_s_ >= 0 && first_ok_end_s_ > last_first_token_s_) {
    const size_t lo = static_cast<size_t>(last_first_token_s_ / kTokenBinS);
    const size_t hi = static_cast<size_t>(first_ok_end_s_ / kTokenBinS);
    uint64_t tokens = 0;
    for (size_t b = lo; b < hi && b < token_bins_.size(); ++b) tokens += token_bins_[b];
    r.all_decoding_span_s = static_cast<double>(hi - lo) * kTokenBinS;
    if (r.all_decoding_span_s > 0) r.all_decoding_tok_s = tokens / r.all_decoding_span_s;
  }
  return r;
}

std::string StatusCodeName(int code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return kNames[code];
  return absl::StrCat("CODE_", code);
}

nlohmann::ordered_json ReportJson(const LoadCollector::Report& r,
                                  const nlohmann::ordered_json& config) {
  nlohmann::ordered_json j;
  j["completed"] = r.ok;
  j["failed"] = r.failed;
  j["errors"] = r.errors;
  j["error_samples"] = r.error_sample;
  j["duration"] = r.duration_s;
  j["total_input_tokens"] = r.input_tokens;
  j["total_cached_tokens"] = r.cached_tokens;
  j["total_output_tokens"] = r.output_tokens;
  j["request_throughput"] = r.request_throughput;
  j["input_throughput"] = r.input_tok_s;
  j["output_throughput"] = r.output_tok_s;
  j["all_decoding_throughput"] = r.all_decoding_tok_s;
  j["all_decoding_span_s"] = r.all_decoding_span_s;
  j["total_token_throughput"] = r.total_tok_s;
  const auto put = [&](const char* name, const LatencyStats::Summary& s) {
    j[absl::StrCat("mean_", name, "_ms")] = s.mean * 1e3;
    j[absl::StrCat("median_", name, "_ms")] = s.p50 * 1e3;
    j[absl::StrCat("p90_", name, "_ms")] = s.p90 * 1e3;
    j[absl::StrCat("p99_", name, "_ms")] = s.p99 * 1e3;
    j[absl::StrCat("max_", name, "_ms")] = s.max * 1e3;
  };
  put("ttft", r.ttft);
  put("tpot", r.tpot);
  put("itl", r.itl);
  put("e2el", r.e2e);
  put("queue", r.queue);
  j["percentiles_exact"] = r.ttft.exact && r.tpot.exact && r.itl.exact && r.e2e.exact;
  j["config"] = config;
  return j;
}

std::string ReportTable(const LoadCollector::Report& r) {
  std::string out;
  const auto line = [&](absl::string_view label, const std::string& value) {
    absl::StrAppendFormat(&out, "%-40s %s\n", label, value);
  };
  const auto title = [&](absl::string_view text) {
    const size_t width = 50, pad = (width - std::min(width, text.size() + 2)) / 2;
    absl::StrAppend(&out, std::string(pad, '-'), " ", text, " ",
                    std::string(width - pad - text.size() - 2, '-'), "\n");
  };
  const auto num = [](double v, int decimals) { return absl::StrFormat("%.*f", decimals, v); };
  const auto latency = [&](absl::string_view what, const LatencyStats::Summary& s) {
    line(absl::StrCat("Mean ", what, " (ms):"), num(s.mean * 1e3, 2));
    line(absl::StrCat("Median ", what, " (ms):"), num(s.p50 * 1e3, 2));
    line(absl::StrCat("P90 ", what, " (ms):"), num(s.p90 * 1e3, 2));
    line(absl::StrCat("P99 ", what, " (ms):"), num(s.p99 * 1e3, 2));
  };
  absl::StrAppend(&out, std::string(18, '='), " tandem-load result ", std::string(12, '='), "\n");
  line("Successful requests:", absl::StrCat(r.ok));
  line("Failed requests:", absl::StrCat(r.failed));
  for (const auto& [code, count] : r.errors) {
    const std::string& sample = r.error_sample.at(code);
    line(absl::StrCat("  ", code, ":"),
         absl::StrCat(count, sample.empty() ? "" : absl::StrCat("  (first: ", sample, ")")));
  }
  line("Benchmark duration (s):", num(r.duration_s, 2));
  line("Total input tokens:", absl::StrCat(r.input_tokens));
  line("Cached input tokens:", absl::StrCat(r.cached_tokens));
  line("Total generated tokens:", absl::StrCat(r.output_tokens));
  line("Request throughput (req/s):", num(r.request_throughput, 2));
  line("Input token throughput (tok/s):", num(r.input_tok_s, 2));
  line("Output token throughput (tok/s):", num(r.output_tok_s, 2));
  line("All-decoding throughput (tok/s):",
       num(r.all_decoding_tok_s, 2) + " over " + num(r.all_decoding_span_s, 2) + " s");
  line("Total token throughput (tok/s):", num(r.total_tok_s, 2));
  title("Time to First Token");
  latency("TTFT", r.ttft);
  title("Time per Output Token (excl. 1st token)");
  latency("TPOT", r.tpot);
  title("Inter-token Latency");
  latency("ITL", r.itl);
  title("End-to-end Latency");
  line("Mean E2EL (ms):", num(r.e2e.mean * 1e3, 2));
  line("Median E2EL (ms):", num(r.e2e.p50 * 1e3, 2));
  line("P99 E2EL (ms):", num(r.e2e.p99 * 1e3, 2));
  if (r.queue.max > 0) {
    title("Queueing (due -> sent, open loop)");
    line("Mean queue delay (ms):", num(r.queue.mean * 1e3, 2));
    line("P99 queue delay (ms):", num(r.queue.p99 * 1e3, 2));
  }
  absl::StrAppend(&out, std::string(50, '='), "\n");
  return out;
}

}  // namespace tandem::bench
