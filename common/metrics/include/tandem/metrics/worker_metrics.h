// WorkerMetrics: the GPU worker's families (vLLM's names under `tandem:`), created once from a
// registry; the scheduler updates them through these handles. Pointers are owned by the
// registry and valid for its life. Thread-safety: as registry.h says.
//
//   tandem:num_requests_running              gauge      requests admitted (prefill or decode)
//   tandem:num_requests_waiting              gauge      requests queued for admission
//   tandem:kv_cache_usage_perc{tier="gpu"}   gauge      device KV bytes of running requests'
//                                                        sequences / --kv_cache_bytes (0..1);
//                                                        absent when the worker has no budget
//   tandem:kv_cache_used_bytes{tier="gpu"}   gauge      those bytes
//   tandem:time_to_first_token_seconds       histogram  arrival -> first token sampled
//   tandem:inter_token_latency_seconds       histogram  between consecutive tokens of a request
//   tandem:e2e_request_latency_seconds       histogram  arrival -> end, requests that succeeded
//   tandem:prompt_tokens_total               counter    prompt tokens, counted when a request's
//                                                        prefill completes
//   tandem:generation_tokens_total           counter    tokens sampled
//   tandem:request_success_total{finished_reason}  counter  length|stop|eos|context|cancelled
//   tandem:request_failure_total{code}       counter    requests ended with an error (its
//                                                        gRPC code name, e.g. "RESOURCE_EXHAUSTED")
//   tandem:degraded_steps_total              counter    (sequence, layer) attends of a step in
//                                                        which some CPU node did not answer
//   tandem:prefix_cache_hit_tokens_total     counter    prompt tokens served by the prefix
//                                                        cache (not prefilled)
//   tandem:prefix_cache_sessions             gauge      finished requests' sessions cached
//   tandem:prefix_cache_tokens               gauge      tokens those sessions hold
//   tandem:prefix_cache_evictions_total      counter    cached sessions closed for room
//   tandem:prefix_cache_bytes{tier}          gauge      bytes the cached sessions hold:
//                                                        tier="gpu" (windows and page summaries
//                                                        on the device), "host" (parked ones,
//                                                        and host pages of offload/exact
//                                                        sessions), "nodes" (their KV on the
//                                                        CPU nodes, as the nodes charge it)
//   tandem:prefix_cache_parks_total          counter    cached sessions parked in host memory
//   tandem:prefix_cache_unparks_total        counter    parked sessions a prompt brought back
//
// The CPU tier's usage (tier="cpu") is exported by each CPU node (node_metrics.h), which knows
// its pool exactly; the worker's view of it is only as fresh as its last Stats call.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace tandem::metrics {

struct WorkerMetrics {
  // INVALID_ARGUMENT when a family clashes with one already in `registry`. gpu_kv_budget: the
  // worker has a --kv_cache_bytes budget (else gpu_kv_cache_usage stays null and unexported:
  // a share of "the device's memory" would mislead).
  static absl::StatusOr<WorkerMetrics> Create(prometheus::Registry& registry, bool gpu_kv_budget);

  prometheus::Gauge* num_requests_running = nullptr;
  prometheus::Gauge* num_requests_waiting = nullptr;
  prometheus::Gauge* gpu_kv_cache_usage = nullptr;  // null without a budget
  prometheus::Gauge* gpu_kv_cache_used_bytes = nullptr;
  prometheus::Histogram* time_to_first_token = nullptr;
  prometheus::Histogram* inter_token_latency = nullptr;
  prometheus::Histogram* e2e_request_latency = nullptr;
  prometheus::Counter* prompt_tokens = nullptr;
  prometheus::Counter* generation_tokens = nullptr;
  prometheus::Counter* degraded_steps = nullptr;
  prometheus::Counter* prefix_cache_hit_tokens = nullptr;
  prometheus::Gauge* prefix_cache_sessions = nullptr;
  prometheus::Gauge* prefix_cache_tokens = nullptr;
  prometheus::Counter* prefix_cache_evictions = nullptr;
  prometheus::Gauge* prefix_cache_gpu_bytes = nullptr;    // prefix_cache_bytes{tier="gpu"}
  prometheus::Gauge* prefix_cache_host_bytes = nullptr;   // prefix_cache_bytes{tier="host"}
  prometheus::Gauge* prefix_cache_node_bytes = nullptr;   // prefix_cache_bytes{tier="nodes"}
  prometheus::Counter* prefix_cache_parks = nullptr;
  prometheus::Counter* prefix_cache_unparks = nullptr;
  prometheus::Family<prometheus::Counter>* request_success = nullptr;
  prometheus::Family<prometheus::Counter>* request_failure = nullptr;

  // The series of one finished reason / error code (created at first use; one lock and hash per
  // call: per request, not per token).
  prometheus::Counter& RequestSuccess(std::string_view finished_reason) const;
  prometheus::Counter& RequestFailure(std::string_view code) const;
};

}  // namespace tandem::metrics
