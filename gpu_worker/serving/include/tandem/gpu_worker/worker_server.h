// A running tandem-gpu-worker gRPC server: the Engine on its Scheduler thread (continuous
// batching), the Generation service, health (grpc.health.v1, SERVING for "" and
// "tandem.v1.Generation"), reflection and channelz. The same object serves in-process callers
// through InProcessChannel().
//
// With a metrics address it also serves GET /metrics (Prometheus): the scheduler's
// WorkerMetrics (tandem/metrics/worker_metrics.h) and, when the CPU node is the embedded one,
// that node's NodeMetrics (attends by transport, scanned bytes, pool) in the same registry.
//
// Thread-safe: Shutdown() and the accessors may be called from any thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/generation_service.h"
#include "tandem/gpu_worker/placement_readiness.h"
#include "tandem/gpu_worker/scheduler.h"
#include "tandem/metrics/metrics_server.h"
#include "tandem/metrics/node_metrics.h"
#include "tandem/metrics/worker_metrics.h"
#include "tandem/security/credentials.h"
#include "tandem/security/token_file.h"

namespace tandem::gpu_worker {

struct WorkerServerOptions {
  std::string address = "127.0.0.1:50051";  // host:port; port 0 picks a free one; "" = no port
  EngineOptions engine;
  SchedulerOptions scheduler;
  // Largest message accepted or sent (>= 1 MiB). Generate streams one small message per
  // token; the limit matters for long prompt_ids / Tokenize / Detokenize payloads.
  int max_message_bytes = 64 << 20;
  // host:port of GET /metrics (port 0 picks a free one); "" = none. Bound before the model
  // loads, so a taken port fails at once.
  std::string metrics_address;
  // TLS of the port: cert + key = TLS, + ca = mutual TLS (clients must present a certificate
  // of that CA; its identity is their principal unless a token names one). None: plaintext.
  security::TlsFiles tls;
  // Bearer tokens clients must send (--auth_token_file); none = no token needed. Needs TLS.
  std::optional<security::TokenTable> tokens;
  // Kept sessions one principal may hold; 0 = only engine.max_sessions bounds them.
  uint32_t max_sessions_per_principal = 0;
};

class GpuWorkerServer {
 public:
  // Loads the model (Engine::Create), starts the scheduler and serves. The Engine's errors
  // pass through (INVALID_ARGUMENT for a bad model or option, UNAVAILABLE for unreachable CPU
  // nodes); UNAVAILABLE if the address or the metrics address cannot be bound,
  // INVALID_ARGUMENT for a metrics address that is not host:port, tokens without TLS or
  // half-given TLS files; the files' read errors.
  static absl::StatusOr<std::unique_ptr<GpuWorkerServer>> Start(const WorkerServerOptions& options);
  ~GpuWorkerServer();  // Shutdown(), then stops the scheduler and frees the engine

  // Reports NOT_SERVING, stops accepting calls, lets calls in flight finish for up to
  // `grace_ms`, then cancels the rest (a cancelled Generate stops after its current token)
  // and waits for them; then stops the scheduler. Idempotent.
  void Shutdown(int grace_ms = 5000);
  // Blocks until Shutdown() has finished.
  void Wait();

  int port() const { return port_; }  // the bound port (0 without an address)
  // The bound metrics port (0 without a metrics address).
  int metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }
  const ModelInfo& model_info() const { return info_; }
  Scheduler& scheduler() { return *scheduler_; }
  // A channel to this server that bypasses the network (valid until Shutdown).
  std::shared_ptr<grpc::Channel> InProcessChannel();

 private:
  GpuWorkerServer() = default;
  // Creates the registry and the worker's (and an embedded node's) metrics, points the options
  // at them and serves GET /metrics on `address`.
  absl::Status StartMetrics(const std::string& address, EngineOptions* engine,
                            SchedulerOptions* scheduler);

  // Destroyed in reverse order: the gRPC server before the service, the service before the
  // scheduler that its calls post to; the scheduler (which counts into worker_metrics_) and the
  // engine's embedded node (node_metrics_) before the metrics; the metrics server, whose scrapes
  // read the embedded node, first of all.
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<metrics::WorkerMetrics> worker_metrics_;
  std::unique_ptr<metrics::NodeMetrics> node_metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  // Health follows whether hybrid sessions can be placed; gone before server_ and the pool.
  std::unique_ptr<PlacementReadiness> readiness_;
  // The engine's embedded CPU node (null: none, or no metrics); read by scrapes.
  std::atomic<const cpu_attention::CpuAttentionNode*> embedded_node_{nullptr};
  ModelInfo info_;
  int port_ = 0;
  int max_message_bytes_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

// Channel arguments every client of a GPU worker should use: message limits matching the
// server's, keepalive.
grpc::ChannelArguments GenerationChannelArguments(int max_message_bytes = 64 << 20);

}  // namespace tandem::gpu_worker
