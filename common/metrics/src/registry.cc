#include "tandem/metrics/registry.h"

#include <sstream>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace tandem::metrics {
namespace {

// prometheus-cpp reports bad names, label names and clashes by throwing (std::invalid_argument);
// no exception leaves this library.
template <typename T, typename Build>
absl::StatusOr<T> Guard(const std::string& name, Build build) {
  try {
    return build();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "': ", e.what()));
  }
}

absl::Status CheckBuckets(const std::string& name, const std::vector<double>& buckets) {
  if (buckets.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "' without buckets"));
  }
  for (size_t i = 1; i < buckets.size(); ++i) {
    if (!(buckets[i - 1] < buckets[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram '", name, "': buckets must increase strictly"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<prometheus::Registry> NewRegistry() {
  return std::make_shared<prometheus::Registry>(prometheus::Registry::InsertBehavior::Merge);
}

std::string SerializeText(const prometheus::Collectable& collectable) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, collectable.Collect());
  return out.str();
}

absl::StatusOr<prometheus::Family<prometheus::Counter>*> AddCounterFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return Guard<prometheus::Family<prometheus::Counter>*>(
      name, [&] { return &prometheus::BuildCounter().Name(name).Help(help).Register(registry); });
}

absl::StatusOr<prometheus::Family<prometheus::Gauge>*> AddGaugeFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return Guard<prometheus::Family<prometheus::Gauge>*>(
      name, [&] { return &prometheus::BuildGauge().Name(name).Help(help).Register(registry); });
}

absl::StatusOr<prometheus::Family<prometheus::Histogram>*> AddHistogramFamily(
    prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return Guard<prometheus::Family<prometheus::Histogram>*>(
      name, [&] { return &prometheus::BuildHistogram().Name(name).Help(help).Register(registry); });
}

absl::StatusOr<prometheus::Counter*> AddCounter(prometheus::Registry& registry,
                                                const std::string& name, const std::string& help,
                                                const prometheus::Labels& labels) {
  return Guard<prometheus::Counter*>(name, [&] {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add(labels);
  });
}

absl::StatusOr<prometheus::Gauge*> AddGauge(prometheus::Registry& registry, const std::string& name,
                                            const std::string& help,
                                            const prometheus::Labels& labels) {
  return Guard<prometheus::Gauge*>(name, [&] {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add(labels);
  });
}

absl::StatusOr<prometheus::Histogram*> AddHistogram(prometheus::Registry& registry,
                                                    const std::string& name,
                                                    const std::string& help,
                                                    const std::vector<double>& buckets,
                                                    const prometheus::Labels& labels) {
  if (absl::Status s = CheckBuckets(name, buckets); !s.ok()) return s;
  return Guard<prometheus::Histogram*>(name, [&] {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(labels,
                                                                                      buckets);
  });
}

const std::vector<double>& TimeToFirstTokenBuckets() {
  static const std::vector<double> buckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                              0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                              20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
  return buckets;
}

const std::vector<double>& InterTokenLatencyBuckets() {
  static const std::vector<double> buckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                              0.15,  0.2,    0.3,   0.4,  0.5,   0.75, 1.0,   2.5,
                                              5.0,   7.5,    10.0,  20.0, 40.0,  80.0};
  return buckets;
}

const std::vector<double>& RequestLatencyBuckets() {
  static const std::vector<double> buckets = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                              5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                              60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  return buckets;
}

}  // namespace tandem::metrics
