// The generation endpoints (POST /v1/completions, /v1/chat/completions; /v1/responses in
// responses_handler.h runs through RunGeneration too) and the state every handler of
// GatewayServer shares. Private to tandem::gateway.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "prometheus/registry.h"
#include "answer_writer.h"
#include "connection_reaper.h"
#include "response_store.h"
#include "session_owners.h"
#include "tandem/gateway/api_error.h"
#include "tandem/gateway/chat_prompt.h"
#include "tandem/gateway/disconnect_watcher.h"
#include "tandem/gateway/gateway_metrics.h"
#include "tandem/gateway/gateway_server.h"
#include "tandem/gateway/openai_request.h"
#include "tandem/gateway/token_pieces.h"
#include "tandem/gateway/worker_pool.h"

namespace tandem::gateway {

struct GatewayServer::Shared {
  GatewayOptions options;
  std::unique_ptr<WorkerPool> pool;
  std::unique_ptr<DisconnectWatcher> watcher;
  std::unique_ptr<ChatTemplateSource> templates;
  TokenPieces pieces;
  std::shared_ptr<prometheus::Registry> registry;
  GatewayMetrics metrics;
  std::atomic<int> in_flight{0};  // generations admitted and not finished
  // Session owners by API key (null without --api_key_file).
  std::unique_ptr<SessionOwners> owners;
  // Closes connections slow to send their headers (made once the port is bound; null before).
  std::unique_ptr<ConnectionReaper> reaper;
  // Stored Responses API answers (previous_response_id, GET /v1/responses/{id}).
  std::unique_ptr<ResponseStore> responses;
};

// The principal of the request's API key ("" without --api_key_file; the pre-routing check
// has already refused requests without a listed key).
std::string ApiKeyPrincipal(const GatewayServer::Shared& shared, const httplib::Request& req);
// The key of an `Authorization: Bearer <key>` header (the scheme is case-insensitive, RFC 7235);
// "" when there is none.
std::string BearerToken(const httplib::Request& req);

// The model id clients see: --served_model_name, else the basename of the worker's model_dir.
std::string ServedModelName(const GatewayServer::Shared& shared, const v1::ModelInfoResponse& info);

// Answers `res` with `body` as JSON and HTTP `status`.
void SendJson(httplib::Response& res, int status, const nlohmann::json& body);
// Answers `res` with the OpenAI error of `status` and counts it under `endpoint`.
void SendError(const GatewayServer::Shared& shared, const std::string& endpoint,
               const absl::Status& status, httplib::Response& res);

// One completions / chat completions request (its JSON `body`), streamed or not.
void HandleGeneration(GatewayServer::Shared& shared, Endpoint endpoint, const httplib::Request& req,
                      std::string_view body, httplib::Response& res);

// Makes the writer of one answer once the served model's name is known (`r`: the request as it
// runs, the model's defaults applied; `prompt`: the rendered chat prompt, "" for completions).
using WriterFactory = std::function<std::unique_ptr<AnswerWriter>(
    const std::string& model, const OpenAiRequest& r, std::string_view prompt)>;
// Runs the parsed request `r` on a worker (model check, the model's sampling defaults, the chat
// template for chat and Responses requests, the prefix-cache scope, admission, routing) and
// answers `res` with `make_writer`'s answer, streamed or not. `name`: the route, for metrics and
// logs; `arrival`: when the request arrived (latency metrics count from it).
void RunGeneration(GatewayServer::Shared& shared, const std::string& name,
                   std::chrono::steady_clock::time_point arrival, OpenAiRequest r,
                   const WriterFactory& make_writer, const httplib::Request& req,
                   httplib::Response& res);

}  // namespace tandem::gateway
