// tandem::metrics: the Prometheus layer every tandem process shares, over prometheus-cpp
// (Debian 1.0.1). One registry per process; families are created once at startup and their
// series kept as handles (prometheus::Counter / Gauge / Histogram), so hot paths update
// atomics without name or label lookups.
//
// Names follow vLLM's under the `tandem:` prefix (`tandem:num_requests_running`, ...): the
// Prometheus data model and prometheus-cpp accept the colon. NOTE: `promtool check metrics`
// (its lint) reports "metric names should not contain ':'" for every such family, as it does
// for vLLM's; it parses the exposition and finds nothing else (tests/metrics checks exactly that).
//
// Thread safety: creating families and series locks the registry (startup, or per request for
// a family whose label values appear at run time); Counter::Increment and Gauge::Set are
// lock-free; Histogram::Observe takes the histogram's own mutex (prometheus-cpp), uncontended
// except while a scrape copies it.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/registry.h"

namespace tandem::metrics {

// Content-Type of the text exposition format that SerializeText writes (HTTP responses of
// GET /metrics).
inline constexpr std::string_view kTextContentType = "text/plain; version=0.0.4; charset=utf-8";

// A registry that merges re-registrations of the same name, type, help and labels (so two
// components asking for one family share it).
std::shared_ptr<prometheus::Registry> NewRegistry();

// Everything `collectable` holds now, in the text exposition format 0.0.4 (what a server other
// than MetricsServer returns for GET /metrics, e.g. the gateway on its own HTTP port).
// Thread-safe; takes the registry's lock while it copies the values.
std::string SerializeText(const prometheus::Collectable& collectable);

// Families whose series are added as label values appear (`family->Add({{"code", "200"}})`,
// thread-safe: one lock and one hash of the labels per call). INVALID_ARGUMENT for a bad metric
// name or a name taken by another type or help text. The registry owns the family.
absl::StatusOr<prometheus::Family<prometheus::Counter>*> AddCounterFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help);
absl::StatusOr<prometheus::Family<prometheus::Gauge>*> AddGaugeFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help);
absl::StatusOr<prometheus::Family<prometheus::Histogram>*> AddHistogramFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help);

// One series (the family created or joined as above): INVALID_ARGUMENT also for a bad label
// name, and for histogram buckets that are empty or not strictly increasing. The registry owns
// the series; the pointer stays valid for the registry's life.
absl::StatusOr<prometheus::Counter*> AddCounter(prometheus::Registry& registry,
                                                const std::string& name, const std::string& help,
                                                const prometheus::Labels& labels = {});
absl::StatusOr<prometheus::Gauge*> AddGauge(prometheus::Registry& registry, const std::string& name,
                                            const std::string& help,
                                            const prometheus::Labels& labels = {});
absl::StatusOr<prometheus::Histogram*> AddHistogram(prometheus::Registry& registry,
                                                    const std::string& name,
                                                    const std::string& help,
                                                    const std::vector<double>& buckets,
                                                    const prometheus::Labels& labels = {});

// Bucket upper bounds (seconds) of the latency histograms, vLLM's (v1 loggers) so dashboards
// carry over. The inter-token buckets add 1, 2.5 and 5 ms below vLLM's 10 ms: small models on
// tandem's cpu backend step faster than that.
const std::vector<double>& TimeToFirstTokenBuckets();
const std::vector<double>& InterTokenLatencyBuckets();
const std::vector<double>& RequestLatencyBuckets();

}  // namespace tandem::metrics
