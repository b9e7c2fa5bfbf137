// tandem-gateway's HTTP server (cpp-httplib): OpenAI-compatible endpoints in front of GPU
// workers.
//   POST /v1/completions, POST /v1/chat/completions   streamed (SSE) or not
//   GET  /v1/models, /v1/models/{id}                   the served model (OpenAI list shape)
//   DELETE /v1/sessions/{id}                           frees a kept session (tandem's extra)
//   GET  /health                                       200 when a worker is SERVING, else 503
//   GET  /metrics                                      Prometheus text (gateway_metrics.h)
// Every error is OpenAI's JSON error object (api_error.h), unknown routes included.
//
// Bounds: request bodies over max_body_bytes -> 413 (a Content-Length over it or not a byte count
// is refused before the body is read); headers slower than header_timeout_s -> the connection
// is closed; a body slower than body_timeout_s -> 408; a JSON body is
// parsed within nesting and size bounds (bounded_json.h); more than max_concurrent_requests
// generations in flight -> 429; each generation has a deadline of request_timeout_s on the
// worker; a client that stops reading for write_timeout_s is dropped (and its generation
// cancelled); a client that hangs up is noticed within disconnect_poll_ms and its generation
// cancelled (disconnect_watcher.h).
//
// Thread-safe: Stop() may be called from any thread (e.g. a signal-waiting main thread).
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gateway/reasoning_parser.h"
#include "tandem/gateway/worker_pool.h"
#include "tandem/security/token_file.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace tandem::gateway {

struct GatewayOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0 = any free port (port() tells which)
  std::string served_model_name;  // "" = the worker's model directory's basename
  std::string chat_template;      // template source that overrides the worker's
  // Chat answers' thinking split into reasoning_content (reasoning_parser.h); nullopt = off,
  // the think block stays in content.
  std::optional<ReasoningSyntax> reasoning_parser;
  size_t max_body_bytes = 32 << 20;
  int max_concurrent_requests = 256;  // generations in flight; more -> 429
  int http_threads = 0;               // 0 = max_concurrent_requests + 128
  int request_timeout_s = 3600;       // deadline of one generation on the worker
  // A client that sends nothing for read_timeout_s while sending a request is dropped; a
  // request's line and headers must arrive within header_timeout_s of the connection's arrival
  // or previous response (else it is closed: connection_reaper.h); a body must arrive whole
  // within body_timeout_s of its headers (408; request_guard.h).
  int read_timeout_s = 10;
  int header_timeout_s = 10;
  int body_timeout_s = 30;
  int write_timeout_s = 60;           // a client that reads nothing for this long is dropped
  int keep_alive_s = 5;               // idle keep-alive connections are closed after this
  int disconnect_poll_ms = 50;
  WorkerPoolOptions workers;
  // HTTPS: PEM certificate chain and key; both empty = plain HTTP.
  std::string tls_cert;
  std::string tls_key;
  // API keys clients must send ("Authorization: Bearer <key>", security::TokenTable); none =
  // no key needed. /health and /metrics stay open.
  std::optional<security::TokenTable> api_keys;
  // Browser origins allowed to call the API (CORS): exact origins, or "*" for any; empty = none
  // (cors_policy.h).
  std::vector<std::string> cors_origins;
  // Stored Responses API answers (store: true; previous_response_id, GET /v1/responses/{id}):
  // at most this many, and this many bytes of their conversations and response objects, the
  // least recently used dropped first. 0 entries = nothing is stored.
  size_t responses_store_entries = 10000;
  size_t responses_store_bytes = 256 << 20;
};

class GatewayServer {
 public:
  // Connects to the workers (WorkerPool::Create; workers that are down join later), binds and
  // starts serving on a background thread. INVALID_ARGUMENT for bad options or a
  // chat_template that does not parse; UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GatewayServer>> Start(const GatewayOptions& options);
  ~GatewayServer();  // Stop(0)

  // Stops accepting connections, lets generations in flight finish for up to `grace_ms`,
  // cancels the rest (their clients see the stream end early), and waits for the connections'
  // threads. Idempotent.
  void Stop(int grace_ms = 5000);

  int port() const { return port_; }
  WorkerPool& workers();

  struct Shared;  // what the handlers use (generation_handler.h)

 private:
  GatewayServer() = default;
  void AddRoutes();

  std::unique_ptr<Shared> shared_;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
};

}  // namespace tandem::gateway
