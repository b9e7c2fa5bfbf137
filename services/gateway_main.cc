// tandem-gateway: OpenAI-compatible HTTP (completions, chat completions, models, health,
// metrics) in front of one or more tandem-gpu-workers, until SIGINT or SIGTERM.
//
//   tandem-gateway --workers=localhost:50051,otherhost:50051 --address=127.0.0.1:8000
//
// Exit status: 0 after a signal, 1 when it cannot start (address in use, a chat template that
// does not parse), 2 for a bad command line.
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "log_flags.h"
#include "parse_flags.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "stop_signals.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/gateway_server.h"
#include "tandem/gateway/reasoning_parser.h"
#include "tandem/security/credentials.h"
#include "tandem/security/token_file.h"

ABSL_FLAG(std::vector<std::string>, workers, {},
          "tandem-gpu-workers to route to, comma-separated host:port (all serving one model)");
ABSL_FLAG(std::string, address, "127.0.0.1:8000",
          "host:port to serve HTTP on (port 0: any free; 0.0.0.0 to accept other hosts)");
ABSL_FLAG(std::string, served_model_name, "",
          "model id clients use and /v1/models lists; empty = the worker's model directory name");
ABSL_FLAG(std::string, chat_template, "",
          "Jinja chat template file used instead of the model's tokenizer_config.json one");
ABSL_FLAG(std::string, reasoning_parser, "",
          "split chat answers' <think>...</think> block into reasoning_content (as vLLM's "
          "--reasoning-parser): qwen3 or deepseek_r1; empty = off, thinking stays in content");
ABSL_FLAG(tandem::ByteSize, max_body_bytes, tandem::ByteSize{32ull << 20},
          "largest request body accepted (413 beyond)");
ABSL_FLAG(int64_t, responses_store_entries, 10000,
          "Responses API answers kept for previous_response_id and GET /v1/responses/{id} (least "
          "recently used dropped first); 0 = none stored");
ABSL_FLAG(tandem::ByteSize, responses_store_bytes, tandem::ByteSize{256ull << 20},
          "memory for those answers and their conversations");
ABSL_FLAG(int, max_concurrent_requests, 256, "generations in flight at most; more get 429");
ABSL_FLAG(int, http_threads, 0,
          "HTTP connection threads (one per open connection); 0 = max_concurrent_requests + 128");
ABSL_FLAG(int, request_timeout_s, 3600, "deadline of one generation on its worker, seconds");
ABSL_FLAG(int, read_timeout_s, 10,
          "a client that sends nothing for this long while sending a request is dropped, seconds");
ABSL_FLAG(int, header_timeout_s, 10,
          "a request's line and headers must arrive within this many seconds of the connection's "
          "opening or its previous response, else the connection is closed");
ABSL_FLAG(int, body_timeout_s, 30,
          "a request body must arrive whole within this many seconds of its headers (else 408)");
ABSL_FLAG(int, write_timeout_s, 60,
          "seconds a client may stop reading before it is dropped (its generation cancelled)");
ABSL_FLAG(int, keep_alive_s, 5, "idle keep-alive connections are closed after this, seconds");
ABSL_FLAG(int, disconnect_poll_ms, 50,
          "how often running requests' connections are checked for a client that hung up");
ABSL_FLAG(int, health_interval_ms, 2000, "between health checks of the workers");
ABSL_FLAG(int, rpc_timeout_ms, 10000,
          "deadline of the unary calls to workers (health, info, tokenize)");
ABSL_FLAG(tandem::ByteSize, max_message_bytes, tandem::ByteSize{64ull << 20},
          "largest gRPC message to or from a worker (as the workers' flag)");
ABSL_FLAG(int, shutdown_grace_ms, 5000,
          "on SIGTERM, time generations in flight get to finish before they are cancelled");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve HTTPS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::vector<std::string>, cors_origins, {},
          "browser origins whose pages may call the API (CORS), e.g. https://app.example.com, "
          "or * for any; none = same-origin pages only (non-browser clients are unaffected)");
ABSL_FLAG(std::string, api_key_file, "",
          "API keys clients must send ('Authorization: Bearer <key>'), one per line, optionally "
          "'key name'; others get 401. /health and /metrics stay open");
ABSL_FLAG(std::string, worker_tls_ca, "",
          "PEM CA the workers' certificates are verified against (TLS to the workers)");
ABSL_FLAG(std::string, worker_tls_cert, "",
          "PEM client certificate for workers that require mutual TLS (with --worker_tls_key)");
ABSL_FLAG(std::string, worker_tls_key, "", "PEM private key of --worker_tls_cert");
ABSL_FLAG(std::string, worker_tls_server_name, "",
          "name the workers' certificate carries when it differs from --workers' hosts");
ABSL_FLAG(std::string, worker_token_file, "",
          "file whose first line is the bearer token sent to the workers (their "
          "--auth_token_file); needs --worker_tls_ca");

namespace {

absl::Status UsageError(absl::string_view message) { return absl::InvalidArgumentError(message); }

// HTTPS and API keys of the HTTP side; TLS and the token of the channels to the workers.
absl::Status SecurityFromFlags(tandem::gateway::GatewayOptions* o) {
  o->tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o->tls_key = absl::GetFlag(FLAGS_tls_key);
  if (o->tls_cert.empty() != o->tls_key.empty()) {
    return UsageError("--tls_cert and --tls_key go together (HTTPS)");
  }
  if (const std::string path = absl::GetFlag(FLAGS_api_key_file); !path.empty()) {
    absl::StatusOr<tandem::security::TokenTable> keys = tandem::security::TokenTable::Load(path);
    if (!keys.ok()) return UsageError(absl::StrCat("--api_key_file: ", keys.status().message()));
    o->api_keys = *std::move(keys);
  }
  o->cors_origins = absl::GetFlag(FLAGS_cors_origins);
  std::string token;
  if (const std::string path = absl::GetFlag(FLAGS_worker_token_file); !path.empty()) {
    absl::StatusOr<std::string> read = tandem::security::ReadClientToken(path);
    if (!read.ok()) return UsageError(read.status().message());
    token = *std::move(read);
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      tandem::security::ChannelCredentialsFromFiles(
          {absl::GetFlag(FLAGS_worker_tls_cert), absl::GetFlag(FLAGS_worker_tls_key),
           absl::GetFlag(FLAGS_worker_tls_ca)},
          token, "--worker_tls_");
  if (!credentials.ok()) return UsageError(credentials.status().message());
  o->workers.credentials = *std::move(credentials);
  o->workers.tls_server_name = absl::GetFlag(FLAGS_worker_tls_server_name);
  return absl::OkStatus();
}

absl::StatusOr<tandem::gateway::GatewayOptions> OptionsFromFlags() {
  tandem::gateway::GatewayOptions o;
  for (const std::string& w : absl::GetFlag(FLAGS_workers)) {
    if (!w.empty()) o.workers.addresses.push_back(w);
  }
  if (o.workers.addresses.empty()) return UsageError("--workers is required (host:port,...)");
  const std::string address = absl::GetFlag(FLAGS_address);
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &o.port) || o.port < 0 || o.port > 65535) {
    return UsageError(absl::StrCat("--address must be host:port, got '", address, "'"));
  }
  o.host = address.substr(0, colon);
  if (o.host.size() > 2 && o.host.front() == '[' && o.host.back() == ']') {
    o.host = o.host.substr(1, o.host.size() - 2);
  }
  o.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  const std::string template_file = absl::GetFlag(FLAGS_chat_template);
  if (!template_file.empty()) {
    std::ifstream in(template_file, std::ios::binary);
    if (!in) return UsageError(absl::StrCat("--chat_template: cannot read '", template_file, "'"));
    std::stringstream text;
    text << in.rdbuf();
    o.chat_template = text.str();
    if (o.chat_template.empty()) {
      return UsageError(absl::StrCat("--chat_template: '", template_file, "' is empty"));
    }
  }
  absl::StatusOr<std::optional<tandem::gateway::ReasoningSyntax>> reasoning =
      tandem::gateway::ParseReasoningSyntax(absl::GetFlag(FLAGS_reasoning_parser));
  if (!reasoning.ok()) return UsageError(reasoning.status().message());
  o.reasoning_parser = *reasoning;
  o.max_body_bytes = absl::GetFlag(FLAGS_max_body_bytes).bytes;
  const int64_t store_entries = absl::GetFlag(FLAGS_responses_store_entries);
  if (store_entries < 0 || store_entries > 100000000) {
    return absl::InvalidArgumentError("--responses_store_entries must be in 0..100000000");
  }
  o.responses_store_entries = static_cast<size_t>(store_entries);
  o.responses_store_bytes = absl::GetFlag(FLAGS_responses_store_bytes).bytes;
  o.max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  o.http_threads = absl::GetFlag(FLAGS_http_threads);
  o.request_timeout_s = absl::GetFlag(FLAGS_request_timeout_s);
  o.read_timeout_s = absl::GetFlag(FLAGS_read_timeout_s);
  o.header_timeout_s = absl::GetFlag(FLAGS_header_timeout_s);
  o.body_timeout_s = absl::GetFlag(FLAGS_body_timeout_s);
  o.write_timeout_s = absl::GetFlag(FLAGS_write_timeout_s);
  o.keep_alive_s = absl::GetFlag(FLAGS_keep_alive_s);
  o.disconnect_poll_ms = absl::GetFlag(FLAGS_disconnect_poll_ms);
  o.workers.health_interval_ms = absl::GetFlag(FLAGS_health_interval_ms);
  o.workers.rpc_timeout_ms = absl::GetFlag(FLAGS_rpc_timeout_ms);
  const uint64_t max_message = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  if (max_message < (1u << 20) || max_message > (1u << 30)) {
    return UsageError("--max_message_bytes must be in 1MiB..1GiB");
  }
  o.workers.max_message_bytes = static_cast<int>(max_message);
  TANDEM_RETURN_IF_ERROR(SecurityFromFlags(&o));
  if (o.disconnect_poll_ms < 1 || o.workers.health_interval_ms < 1 ||
      o.workers.rpc_timeout_ms < 1) {
    return UsageError(
        "--disconnect_poll_ms, --health_interval_ms and --rpc_timeout_ms must be >= 1");
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything starts a thread (stop_signals.h); the main thread waits for them below.
  const sigset_t stop_signals = tandem::services::BlockStopSignals();
  absl::SetProgramUsageMessage(
      "OpenAI-compatible HTTP API in front of tandem GPU workers.\n"
      "  tandem-gateway --workers=localhost:50051 --address=127.0.0.1:8000");
  const std::vector<char*> positional = tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  if (!tandem::services::ConfigureStderrLogging("tandem-gateway", absl::GetFlag(FLAGS_log_level))) {
    return 2;
  }
  if (positional.size() > 1) {
    std::fprintf(stderr, "tandem-gateway: unexpected argument '%s'\n", positional[1]);
    return 2;
  }
  absl::StatusOr<tandem::gateway::GatewayOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "tandem-gateway: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }

  // A client that hangs up mid-write must not kill the process.
  std::signal(SIGPIPE, SIG_IGN);

  auto server = tandem::gateway::GatewayServer::Start(*options);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  spdlog::info("tandem-gateway on {}://{}:{} -> {} worker(s), {} serving",
               options->tls_cert.empty() ? "http" : "https", options->host, (*server)->port(),
               (*server)->workers().size(), (*server)->workers().ServingCount());
  std::printf("LISTENING %d\n", (*server)->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  spdlog::info("signal {}: stopping", sig);
  (*server)->Stop(absl::GetFlag(FLAGS_shutdown_grace_ms));
  server->reset();
  spdlog::info("stopped");
  return 0;
}
