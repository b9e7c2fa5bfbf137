#include "tandem/gateway/gateway_metrics.h"

#include "tandem/common/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::gateway {

absl::StatusOr<GatewayMetrics> GatewayMetrics::Create(prometheus::Registry& registry) {
  using metrics::AddCounter;
  using metrics::AddGauge;
  using metrics::AddHistogram;
  GatewayMetrics m;
  TANDEM_ASSIGN_OR_RETURN(m.requests,
                          metrics::AddCounterFamily(registry, "tandem:gateway_requests_total",
                                                    "HTTP requests answered, by endpoint and "
                                                    "status code"));
  TANDEM_ASSIGN_OR_RETURN(m.requests_running,
                          AddGauge(registry, "tandem:gateway_requests_running",
                                   "Generations in flight through the gateway"));
  TANDEM_ASSIGN_OR_RETURN(m.client_disconnects,
                          AddCounter(registry, "tandem:gateway_client_disconnects_total",
                                     "Generations cancelled because the HTTP client went away"));
  TANDEM_ASSIGN_OR_RETURN(m.time_to_first_token,
                          AddHistogram(registry, "tandem:gateway_time_to_first_token_seconds",
                                       "HTTP request arrival to its first token written",
                                       metrics::TimeToFirstTokenBuckets()));
  TANDEM_ASSIGN_OR_RETURN(
      m.e2e_request_latency,
      AddHistogram(registry, "tandem:gateway_e2e_request_latency_seconds",
                   "HTTP request arrival to its last byte, generations that succeeded",
                   metrics::RequestLatencyBuckets()));
  TANDEM_ASSIGN_OR_RETURN(m.prompt_tokens,
                          AddCounter(registry, "tandem:gateway_prompt_tokens_total",
                                     "Prompt tokens of the generations that succeeded"));
  TANDEM_ASSIGN_OR_RETURN(m.generation_tokens,
                          AddCounter(registry, "tandem:gateway_generation_tokens_total",
                                     "Tokens generated for the gateway's clients"));
  TANDEM_ASSIGN_OR_RETURN(m.workers_serving,
                          AddGauge(registry, "tandem:gateway_workers_serving",
                                   "GPU workers whose health check answers SERVING"));
  return m;
}

void GatewayMetrics::CountRequest(const std::string& endpoint, int http_status) const {
  requests->Add({{"endpoint", endpoint}, {"code", std::to_string(http_status)}}).Increment();
}

}  // namespace tandem::gateway
