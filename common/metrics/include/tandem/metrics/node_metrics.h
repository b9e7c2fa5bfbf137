// NodeMetrics: a CPU attention node's families, created once from a registry. The node counts
// attends and scanned bytes through these handles as it serves (lock-free increments); the
// gauges are set from the node's Stats before each scrape (SetFromStats, through
// MetricsServer's before_scrape). Pointers are owned by the registry and valid for its life.
//
//   tandem:node_attends_total{transport="shm|grpc"}  counter  (session, layer) queries attended:
//                                                             a gRPC Attend carries a batch of
//                                                             them, a shm request one
//   tandem:node_scanned_bytes_total        counter  K+V bytes read by attention (rate(): bytes/s)
//   tandem:node_scan_bytes_per_second      gauge    the node's moving average of its scan rate
//                                                   over calls large enough to time (what the
//                                                   worker's placement reads); 0 = none yet
//   tandem:node_pool_bytes{state="used|total"}  gauge  KV pool bytes (blocks + selected copies)
//   tandem:kv_cache_usage_perc{tier="cpu"} gauge    used / total (0..1)
//   tandem:node_sessions_open              gauge    sessions open on the node
//   tandem:node_attends_in_flight          gauge    attends being computed now
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace tandem::metrics {

// What the gauges show, from the node's Stats (cpu_attention.proto StatsResponse).
struct NodeGaugeValues {
  uint64_t pool_used_bytes = 0;
  uint64_t pool_total_bytes = 0;
  uint64_t sessions = 0;
  uint64_t attends_in_flight = 0;
  double scan_bytes_per_second = 0;
};

struct NodeMetrics {
  // INVALID_ARGUMENT when a family clashes with one already in `registry`.
  static absl::StatusOr<NodeMetrics> Create(prometheus::Registry& registry);

  void SetGauges(const NodeGaugeValues& values) const;

  prometheus::Counter* attends_grpc = nullptr;
  prometheus::Counter* attends_shm = nullptr;
  prometheus::Counter* scanned_bytes = nullptr;
  prometheus::Gauge* scan_bytes_per_second = nullptr;
  prometheus::Gauge* pool_used_bytes = nullptr;
  prometheus::Gauge* pool_total_bytes = nullptr;
  prometheus::Gauge* cpu_kv_cache_usage = nullptr;
  prometheus::Gauge* sessions_open = nullptr;
  prometheus::Gauge* attends_in_flight = nullptr;
};

}  // namespace tandem::metrics
