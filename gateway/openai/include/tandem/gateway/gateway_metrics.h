// The gateway's Prometheus families (tandem::metrics, vLLM-like names under `tandem:gateway_`),
// served on the gateway's own HTTP port at GET /metrics. Times are seen from the HTTP side:
// arrival of the request -> first token written (TTFT) / last byte (e2e), so they include the
// gateway's and the network's overhead over the worker's own histograms.
//
//   tandem:gateway_requests_total{endpoint, code}     counter    HTTP requests answered
//   tandem:gateway_requests_running                    gauge      generations in flight
//   tandem:gateway_client_disconnects_total            counter    generations cancelled because
//                                                                  the client went away
//   tandem:gateway_time_to_first_token_seconds         histogram
//   tandem:gateway_e2e_request_latency_seconds         histogram  generations that succeeded
//   tandem:gateway_prompt_tokens_total                 counter
//   tandem:gateway_generation_tokens_total             counter
//   tandem:gateway_workers_serving                     gauge      set before each scrape
//
// Pointers are owned by the registry. Thread-safety: as tandem/metrics/registry.h says.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace tandem::gateway {

struct GatewayMetrics {
  static absl::StatusOr<GatewayMetrics> Create(prometheus::Registry& registry);

  // The counter of one answered request (one lock and hash per request).
  void CountRequest(const std::string& endpoint, int http_status) const;

  prometheus::Family<prometheus::Counter>* requests = nullptr;
  prometheus::Gauge* requests_running = nullptr;
  prometheus::Counter* client_disconnects = nullptr;
  prometheus::Histogram* time_to_first_token = nullptr;
  prometheus::Histogram* e2e_request_latency = nullptr;
  prometheus::Counter* prompt_tokens = nullptr;
  prometheus::Counter* generation_tokens = nullptr;
  prometheus::Gauge* workers_serving = nullptr;
};

}  // namespace tandem::gateway
