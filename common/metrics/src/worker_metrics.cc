#include "tandem/metrics/worker_metrics.h"

#include <string>

#include "family_help.h"
#include "tandem/common/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::metrics {

absl::StatusOr<WorkerMetrics> WorkerMetrics::Create(prometheus::Registry& registry,
                                                    bool gpu_kv_budget) {
  WorkerMetrics m;
  TANDEM_ASSIGN_OR_RETURN(m.num_requests_running,
                          AddGauge(registry, "tandem:num_requests_running",
                                   "Requests admitted by the scheduler (in prefill or decode)."));
  TANDEM_ASSIGN_OR_RETURN(m.num_requests_waiting, AddGauge(registry, "tandem:num_requests_waiting",
                                                           "Requests queued for admission."));
  if (gpu_kv_budget) {
    TANDEM_ASSIGN_OR_RETURN(m.gpu_kv_cache_usage,
                            AddGauge(registry, "tandem:kv_cache_usage_perc",
                                     internal::kKvCacheUsageHelp, {{"tier", "gpu"}}));
  }
  TANDEM_ASSIGN_OR_RETURN(
      m.gpu_kv_cache_used_bytes,
      AddGauge(registry, "tandem:kv_cache_used_bytes",
               "Bytes of a KV tier in use (gpu: device KV of running requests' sequences).",
               {{"tier", "gpu"}}));
  TANDEM_ASSIGN_OR_RETURN(
      m.time_to_first_token,
      AddHistogram(registry, "tandem:time_to_first_token_seconds",
                   "Time from a request's arrival to its first generated token.",
                   TimeToFirstTokenBuckets()));
  TANDEM_ASSIGN_OR_RETURN(m.inter_token_latency,
                          AddHistogram(registry, "tandem:inter_token_latency_seconds",
                                       "Time between consecutive generated tokens of a request.",
                                       InterTokenLatencyBuckets()));
  TANDEM_ASSIGN_OR_RETURN(
      m.e2e_request_latency,
      AddHistogram(registry, "tandem:e2e_request_latency_seconds",
                   "Time from a request's arrival to its end, requests that succeeded.",
                   RequestLatencyBuckets()));
  TANDEM_ASSIGN_OR_RETURN(
      m.prompt_tokens,
      AddCounter(registry, "tandem:prompt_tokens_total",
                 "Prompt tokens processed (counted when a request's prefill completes)."));
  TANDEM_ASSIGN_OR_RETURN(
      m.generation_tokens,
      AddCounter(registry, "tandem:generation_tokens_total", "Tokens generated."));
  TANDEM_ASSIGN_OR_RETURN(
      m.degraded_steps,
      AddCounter(registry, "tandem:degraded_steps_total",
                 "Layer attends of a sequence in which some CPU node did not answer in time."));
  TANDEM_ASSIGN_OR_RETURN(
      m.prefix_cache_hit_tokens,
      AddCounter(registry, "tandem:prefix_cache_hit_tokens_total",
                 "Prompt tokens whose KV came from the prefix cache (not prefilled)."));
  TANDEM_ASSIGN_OR_RETURN(m.prefix_cache_sessions,
                          AddGauge(registry, "tandem:prefix_cache_sessions",
                                   "Finished requests' sessions kept in the prefix cache."));
  TANDEM_ASSIGN_OR_RETURN(m.prefix_cache_tokens,
                          AddGauge(registry, "tandem:prefix_cache_tokens",
                                   "Tokens held by the prefix cache's sessions."));
  TANDEM_ASSIGN_OR_RETURN(
      m.prefix_cache_evictions,
      AddCounter(registry, "tandem:prefix_cache_evictions_total",
                 "Cached sessions closed to make room (least recently used first)."));
  TANDEM_ASSIGN_OR_RETURN(
      prometheus::Family<prometheus::Gauge>* const cache_bytes,
      AddGaugeFamily(registry, "tandem:prefix_cache_bytes",
                     "Bytes held by the prefix cache's sessions, by tier: gpu (windows and page "
                     "summaries on the device), host (sessions parked in pinned host memory, host "
                     "pages), nodes (their KV on the CPU nodes)."));
  m.prefix_cache_gpu_bytes = &cache_bytes->Add({{"tier", "gpu"}});
  m.prefix_cache_host_bytes = &cache_bytes->Add({{"tier", "host"}});
  m.prefix_cache_node_bytes = &cache_bytes->Add({{"tier", "nodes"}});
  TANDEM_ASSIGN_OR_RETURN(
      m.prefix_cache_parks,
      AddCounter(registry, "tandem:prefix_cache_parks_total",
                 "Cached sessions moved off the device into host memory to make room."));
  TANDEM_ASSIGN_OR_RETURN(
      m.prefix_cache_unparks,
      AddCounter(registry, "tandem:prefix_cache_unparks_total",
                 "Parked cached sessions brought back to the device by a prompt that hit them."));
  TANDEM_ASSIGN_OR_RETURN(m.request_success,
                          AddCounterFamily(registry, "tandem:request_success_total",
                                           "Requests that ended with a result, by finish reason."));
  TANDEM_ASSIGN_OR_RETURN(
      m.request_failure,
      AddCounterFamily(registry, "tandem:request_failure_total",
                       "Requests that ended with an error, by gRPC status code."));
  return m;
}

prometheus::Counter& WorkerMetrics::RequestSuccess(std::string_view finished_reason) const {
  return request_success->Add({{"finished_reason", std::string(finished_reason)}});
}

prometheus::Counter& WorkerMetrics::RequestFailure(std::string_view code) const {
  return request_failure->Add({{"code", std::string(code)}});
}

}  // namespace tandem::metrics
