#include "tandem/cpu_attention/server.h"

#include <chrono>

#include <grpcpp/ext/channelz_service_plugin.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::cpu_attention {
namespace {

constexpr char kServiceName[] = "tandem.v1.CpuAttention";

void SetKeepalive(grpc::ChannelArguments& args) {
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

}  // namespace

grpc::ChannelArguments CpuAttentionChannelArguments(int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  SetKeepalive(args);
  return args;
}

absl::StatusOr<std::unique_ptr<CpuAttentionServer>> CpuAttentionServer::Start(
    const ServerOptions& options) {
  if (options.executor_threads == 0 || options.executor_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("executor_threads must be in 1..256, got ", options.executor_threads));
  }
  if (options.max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes must be >= 1 MiB, got ", options.max_message_bytes));
  }
  if (!options.allowed_peers.empty() && options.tls.ca.empty()) {
    return absl::InvalidArgumentError(
        "--allowed_peers needs mutual TLS (--tls_cert, --tls_key and --tls_ca): without client "
        "certificates there is no identity to check");
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          security::ServerCredentialsFromFiles(options.tls));
  std::unique_ptr<CpuAttentionServer> server(new CpuAttentionServer());
  NodeOptions node_options = options.node;
  if (!options.metrics_address.empty()) {
    server->registry_ = metrics::NewRegistry();
    TANDEM_ASSIGN_OR_RETURN(metrics::NodeMetrics m,
                            metrics::NodeMetrics::Create(*server->registry_));
    server->node_metrics_ = std::make_unique<metrics::NodeMetrics>(m);
    node_options.metrics = server->node_metrics_.get();
  }
  TANDEM_ASSIGN_OR_RETURN(server->node_, CpuAttentionNode::Create(node_options));
  if (server->node_metrics_ != nullptr) {
    const CpuAttentionNode* node = server->node_.get();
    const metrics::NodeMetrics* m = server->node_metrics_.get();
    auto before_scrape = [node, m] { SetNodeGauges(*node, *m); };
    TANDEM_ASSIGN_OR_RETURN(
        server->metrics_server_,
        metrics::MetricsServer::Start(options.metrics_address, server->registry_, before_scrape));
  }
  server->service_ = std::make_unique<CpuAttentionGrpcService>(
      server->node_.get(), options.executor_threads,
      static_cast<uint64_t>(options.max_message_bytes),
      security::Authenticator(std::nullopt, options.allowed_peers, !options.tls.ca.empty()));
  server->max_message_bytes_ = options.max_message_bytes;

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // channelz lists peers and sockets to any caller (it is not behind --allowed_peers), so a
  // node that restricts its callers does not serve it; nor does an in-process-only node.
  if (options.allowed_peers.empty() && !options.address.empty()) {
    grpc::channelz::experimental::InitChannelzService();
  }

  grpc::ServerBuilder builder;
  if (!options.address.empty()) {
    builder.AddListeningPort(options.address, credentials, &server->port_);
  }
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Two nodes must never share a port silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || (!options.address.empty() && server->port_ == 0)) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve on '", options.address, "' (address in use or invalid?)"));
  }
  if (grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
  }
  return server;
}

CpuAttentionServer::~CpuAttentionServer() {
  Shutdown();
  metrics_server_.reset();  // no scrape may read the node while it goes away
}

void SetNodeGauges(const CpuAttentionNode& node, const metrics::NodeMetrics& metrics) {
  const v1::StatsResponse stats = node.Stats();
  metrics.SetGauges({.pool_used_bytes = stats.used_bytes(),
                     .pool_total_bytes = stats.capacity_bytes(),
                     .sessions = stats.sessions(),
                     .attends_in_flight = stats.attend_in_flight(),
                     .scan_bytes_per_second = stats.scan_bytes_per_second()});
}

void CpuAttentionServer::Shutdown(int grace_ms) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(false);
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
}

void CpuAttentionServer::StartDraining() {
  node_->SetDraining(true);
  // The health service is thread-safe and ignores updates after Shutdown.
  if (server_ == nullptr) return;
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(kServiceName, false);  // readiness; "" (liveness) stays SERVING
  }
}

void CpuAttentionServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

std::shared_ptr<grpc::Channel> CpuAttentionServer::InProcessChannel() {
  return server_->InProcessChannel(CpuAttentionChannelArguments(max_message_bytes_));
}

}  // namespace tandem::cpu_attention
