// A running tandem-cpu-attention gRPC server: the node, its service, health (grpc.health.v1,
// SERVING for "" and "tandem.v1.CpuAttention"), reflection and channelz. The same object serves
// in-process callers through InProcessChannel() (what the GPU worker embeds by default) or
// node() directly.
//
// Health names follow the Kubernetes probes: "" is liveness (SERVING until Shutdown),
// "tandem.v1.CpuAttention" is readiness (NOT_SERVING once draining, so the pod leaves the
// headless Service's DNS and placement sends it nothing new).
//
// With a metrics address it also serves GET /metrics (Prometheus, tandem/metrics/
// node_metrics.h): attends by transport and scanned bytes counted as they are served, pool
// bytes, sessions and the scan rate read from the node's Stats at each scrape.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/grpc_service.h"
#include "tandem/metrics/metrics_server.h"
#include "tandem/metrics/node_metrics.h"
#include "tandem/security/credentials.h"

namespace tandem::cpu_attention {

struct ServerOptions {
  std::string address = "127.0.0.1:50061";  // host:port; port 0 picks a free one; "" = no port
  NodeOptions node;
  unsigned executor_threads = 4;
  // Largest message accepted or sent. Bulk KV must come as many AppendKv messages, never one
  // giant one; 64 MiB holds e.g. 1 layer x 8 kv heads x 4096 tokens x 128 dims of bf16 K+V.
  int max_message_bytes = 64 << 20;
  // host:port of GET /metrics (port 0 picks a free one); "" = none (node.metrics, if set, is
  // then counted into and served by its owner, e.g. the GPU worker for its embedded node).
  std::string metrics_address;
  // TLS of the port (tandem/security/credentials.h): cert + key = TLS, + ca = mutual TLS
  // (clients must present a certificate of that CA). None: plaintext.
  security::TlsFiles tls;
  // Certificate identities (SAN or CN) that may call anything but health; empty = every
  // client the CA verified (or everyone without TLS). Needs tls.ca.
  std::set<std::string> allowed_peers;
};

class CpuAttentionServer {
 public:
  // Builds the node and starts serving. INVALID_ARGUMENT for bad options (a metrics address
  // that is not host:port, allowed_peers without tls.ca, half-given TLS files included);
  // the TLS files' read errors; UNAVAILABLE if the address or the metrics address cannot
  // be bound.
  static absl::StatusOr<std::unique_ptr<CpuAttentionServer>> Start(const ServerOptions& options);
  ~CpuAttentionServer();  // Shutdown()

  // Stops accepting calls, lets calls in flight finish for up to `grace_ms`, then cancels them.
  void Shutdown(int grace_ms = 2000);
  void Wait();

  // Starts draining: the node refuses new sessions and shards (CpuAttentionNode::SetDraining)
  // and the readiness status "tandem.v1.CpuAttention" becomes NOT_SERVING; "" stays SERVING and
  // every other call keeps being served. Idempotent; thread-safe.
  void StartDraining();
  bool draining() const { return node_->draining(); }

  int port() const { return port_; }  // the bound port (0 without an address)
  // The bound metrics port (0 without a metrics address).
  int metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }
  CpuAttentionNode& node() { return *node_; }
  // A channel to this server that bypasses the network.
  std::shared_ptr<grpc::Channel> InProcessChannel();

 private:
  CpuAttentionServer() = default;

  // Destroyed in reverse order: the metrics server (whose scrapes read the node) first, the
  // counters the node updates after the node.
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<metrics::NodeMetrics> node_metrics_;
  std::unique_ptr<CpuAttentionNode> node_;
  std::unique_ptr<CpuAttentionGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  int port_ = 0;
  int max_message_bytes_ = 0;
  bool shut_down_ = false;
};

// Channel arguments every tandem client of a CPU node should use: message limits matching the
// server's, keepalive.
grpc::ChannelArguments CpuAttentionChannelArguments(int max_message_bytes = 64 << 20);

// Sets the node gauges of `metrics` (pool bytes, CPU KV usage, sessions, attends in flight, scan
// rate) from `node`'s Stats. Thread-safe; what a metrics server runs before each scrape.
void SetNodeGauges(const CpuAttentionNode& node, const metrics::NodeMetrics& metrics);

}  // namespace tandem::cpu_attention
