#include "tandem/gpu_worker/worker_server.h"

#include <grpcpp/ext/channelz_service_plugin.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::gpu_worker {
namespace {

constexpr char kServiceName[] = "tandem.v1.Generation";

}  // namespace

grpc::ChannelArguments GenerationChannelArguments(int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  return args;
}

absl::StatusOr<std::unique_ptr<GpuWorkerServer>> GpuWorkerServer::Start(
    const WorkerServerOptions& options) {
  if (options.max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes must be >= 1 MiB, got ", options.max_message_bytes));
  }
  if (options.tokens.has_value() && (options.tls.cert.empty() || options.tls.key.empty())) {
    return absl::InvalidArgumentError(
        "--auth_token_file needs TLS (--tls_cert and --tls_key): a bearer token sent in "
        "plaintext could be read and replayed");
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          security::ServerCredentialsFromFiles(options.tls));
  std::unique_ptr<GpuWorkerServer> server(new GpuWorkerServer());
  EngineOptions engine_options = options.engine;
  SchedulerOptions scheduler_options = options.scheduler;
  if (!options.metrics_address.empty()) {
    TANDEM_RETURN_IF_ERROR(
        server->StartMetrics(options.metrics_address, &engine_options, &scheduler_options));
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(engine_options));
  server->info_ = engine->info();
  if (server->node_metrics_ != nullptr && engine->nodes().embedded() != nullptr) {
    server->embedded_node_.store(&engine->nodes().embedded()->node(), std::memory_order_release);
  }
  NodePool& nodes = engine->nodes();   // (lives with the engine, in the scheduler)
  const Tokenizer& tokenizer = engine->tokenizer();   // (likewise)
  TANDEM_ASSIGN_OR_RETURN(server->scheduler_,
                          Scheduler::Create(std::move(engine), scheduler_options));
  ServiceSecurity security{
      security::Authenticator(options.tokens, /*allowed_peers=*/{}, !options.tls.ca.empty()),
      options.max_sessions_per_principal};
  server->service_ = std::make_unique<GenerationService>(server->scheduler_.get(), server->info_,
                                                         tokenizer, std::move(security));
  server->max_message_bytes_ = options.max_message_bytes;

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // channelz lists peers and sockets to any caller (no token needed), so a worker that
  // authenticates its clients does not serve it.
  if (!options.tokens.has_value()) grpc::channelz::experimental::InitChannelzService();

  grpc::ServerBuilder builder;
  if (!options.address.empty()) {
    builder.AddListeningPort(options.address, credentials, &server->port_);
  }
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // Long generations stream for minutes: keepalive finds dead clients (whose calls are then
  // cancelled, which stops their generation) and keeps idle connections through middleboxes.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Two workers must never share a port silently.
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
  server->readiness_ =
      PlacementReadiness::Watch(nodes, server->server_->GetHealthCheckService(), kServiceName);
  return server;
}

absl::Status GpuWorkerServer::StartMetrics(const std::string& address, EngineOptions* engine,
                                           SchedulerOptions* scheduler) {
  registry_ = metrics::NewRegistry();
  TANDEM_ASSIGN_OR_RETURN(metrics::WorkerMetrics w,
                          metrics::WorkerMetrics::Create(*registry_, engine->kv_cache_bytes > 0));
  worker_metrics_ = std::make_unique<metrics::WorkerMetrics>(w);
  scheduler->metrics = worker_metrics_.get();
  const bool embedded =
      engine->nodes.addresses.empty() && engine->nodes.dns_name.empty() && !engine->nodes.discovery;
  if (embedded) {
    TANDEM_ASSIGN_OR_RETURN(metrics::NodeMetrics n, metrics::NodeMetrics::Create(*registry_));
    node_metrics_ = std::make_unique<metrics::NodeMetrics>(n);
    engine->nodes.embedded.metrics = node_metrics_.get();
  }
  // The embedded node's gauges come from its Stats at each scrape (none until the engine, and
  // with it the node, exists).
  auto before_scrape = [this] {
    const cpu_attention::CpuAttentionNode* node = embedded_node_.load(std::memory_order_acquire);
    if (node != nullptr) cpu_attention::SetNodeGauges(*node, *node_metrics_);
  };
  TANDEM_ASSIGN_OR_RETURN(metrics_server_,
                          metrics::MetricsServer::Start(address, registry_, before_scrape));
  return absl::OkStatus();
}

GpuWorkerServer::~GpuWorkerServer() { Shutdown(); }

void GpuWorkerServer::Shutdown(int grace_ms) {
  {
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
    // Returns once every call has finished; calls finish from the scheduler thread, so the
    // scheduler must still run here.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  }
  if (scheduler_ != nullptr) scheduler_->Stop();
}

void GpuWorkerServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

std::shared_ptr<grpc::Channel> GpuWorkerServer::InProcessChannel() {
  return server_->InProcessChannel(GenerationChannelArguments(max_message_bytes_));
}

}  // namespace tandem::gpu_worker
