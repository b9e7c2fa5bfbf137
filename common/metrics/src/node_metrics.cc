#include "tandem/metrics/node_metrics.h"

#include "family_help.h"
#include "tandem/common/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::metrics {

absl::StatusOr<NodeMetrics> NodeMetrics::Create(prometheus::Registry& registry) {
  NodeMetrics m;
  const char attends_help[] =
      "(session, layer) queries attended, by transport (a gRPC Attend carries a batch of them).";
  TANDEM_ASSIGN_OR_RETURN(m.attends_grpc, AddCounter(registry, "tandem:node_attends_total",
                                                     attends_help, {{"transport", "grpc"}}));
  TANDEM_ASSIGN_OR_RETURN(m.attends_shm, AddCounter(registry, "tandem:node_attends_total",
                                                    attends_help, {{"transport", "shm"}}));
  TANDEM_ASSIGN_OR_RETURN(
      m.scanned_bytes, AddCounter(registry, "tandem:node_scanned_bytes_total",
                                  "K and V bytes read by attention (rate() gives the scan rate)."));
  TANDEM_ASSIGN_OR_RETURN(
      m.scan_bytes_per_second,
      AddGauge(registry, "tandem:node_scan_bytes_per_second",
               "Moving average of the attention scan rate over calls large enough to time "
               "(0: none yet)."));
  const char pool_help[] = "KV pool bytes of the node (blocks and selected copies).";
  TANDEM_ASSIGN_OR_RETURN(m.pool_used_bytes, AddGauge(registry, "tandem:node_pool_bytes", pool_help,
                                                      {{"state", "used"}}));
  TANDEM_ASSIGN_OR_RETURN(m.pool_total_bytes, AddGauge(registry, "tandem:node_pool_bytes",
                                                       pool_help, {{"state", "total"}}));
  TANDEM_ASSIGN_OR_RETURN(m.cpu_kv_cache_usage,
                          AddGauge(registry, "tandem:kv_cache_usage_perc",
                                   internal::kKvCacheUsageHelp, {{"tier", "cpu"}}));
  TANDEM_ASSIGN_OR_RETURN(m.sessions_open, AddGauge(registry, "tandem:node_sessions_open",
                                                    "Sessions open on the node."));
  TANDEM_ASSIGN_OR_RETURN(m.attends_in_flight, AddGauge(registry, "tandem:node_attends_in_flight",
                                                        "Attend calls being computed now."));
  return m;
}

void NodeMetrics::SetGauges(const NodeGaugeValues& v) const {
  pool_used_bytes->Set(static_cast<double>(v.pool_used_bytes));
  pool_total_bytes->Set(static_cast<double>(v.pool_total_bytes));
  cpu_kv_cache_usage->Set(v.pool_total_bytes == 0 ? 0.0
                                                  : static_cast<double>(v.pool_used_bytes) /
                                                        static_cast<double>(v.pool_total_bytes));
  sessions_open->Set(static_cast<double>(v.sessions));
  attends_in_flight->Set(static_cast<double>(v.attends_in_flight));
  scan_bytes_per_second->Set(v.scan_bytes_per_second);
}

}  // namespace tandem::metrics
