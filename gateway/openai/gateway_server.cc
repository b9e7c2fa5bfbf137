#include "tandem/gateway/gateway_server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cors_policy.h"
#include "connection_reaper.h"
#include "generation_handler.h"
#include "responses_handler.h"
#include "request_guard.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/sse.h"
#include "tandem/metrics/registry.h"

namespace tandem::gateway {
namespace {

// The generation endpoints (POST only): registered from here, and a GET on one is a 405.
using BodyHandler = void (*)(GatewayServer::Shared&, const httplib::Request&, std::string_view,
                             httplib::Response&);
struct GenerationRoute {
  const char* path;
  BodyHandler handle;
};
const GenerationRoute kGenerationRoutes[] = {
    {"/v1/completions",
     [](GatewayServer::Shared& s, const httplib::Request& req, std::string_view body,
        httplib::Response& res) { HandleGeneration(s, Endpoint::kCompletions, req, body, res); }},
    {"/v1/chat/completions",
     [](GatewayServer::Shared& s, const httplib::Request& req, std::string_view body,
        httplib::Response& res) {
       HandleGeneration(s, Endpoint::kChatCompletions, req, body, res);
     }},
    {"/v1/responses", HandleResponses}};

nlohmann::json ModelJson(const std::string& id, const v1::ModelInfoResponse& info,
                         int64_t created) {
  return {{"id", id},
          {"object", "model"},
          {"created", created},
          {"owned_by", "tandem"},
          {"root", info.model_dir()},
          {"parent", nullptr},
          {"max_model_len", info.max_context()}};
}

}  // namespace

absl::StatusOr<std::unique_ptr<GatewayServer>> GatewayServer::Start(const GatewayOptions& options) {
  if (options.max_concurrent_requests < 1 || options.request_timeout_s < 1 ||
      options.read_timeout_s < 1 || options.header_timeout_s < 1 || options.body_timeout_s < 1 ||
      options.write_timeout_s < 1 || options.keep_alive_s < 1 || options.max_body_bytes < 1024 ||
      options.http_threads < 0) {
    return absl::InvalidArgumentError(
        "max_concurrent_requests, request/read/header/body/write timeouts and keep_alive must be "
        ">= 1, max_body_bytes >= 1 KiB, http_threads >= 0");
  }
  std::unique_ptr<GatewayServer> server(new GatewayServer());
  auto shared = std::make_unique<Shared>();
  shared->options = options;
  shared->templates = std::make_unique<ChatTemplateSource>(options.chat_template);
  TANDEM_RETURN_IF_ERROR(shared->templates->CheckOverride());
  shared->registry = metrics::NewRegistry();
  TANDEM_ASSIGN_OR_RETURN(shared->metrics, GatewayMetrics::Create(*shared->registry));
  TANDEM_ASSIGN_OR_RETURN(shared->pool, WorkerPool::Create(options.workers));
  shared->watcher = std::make_unique<DisconnectWatcher>(options.disconnect_poll_ms);
  shared->responses = std::make_unique<ResponseStore>(options.responses_store_entries,
                                                      options.responses_store_bytes);
  if (options.api_keys.has_value()) {
    shared->owners = std::make_unique<SessionOwners>(options.workers.max_sticky_sessions);
  }
  server->shared_ = std::move(shared);

  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together (HTTPS)");
  }
  if (options.tls_cert.empty()) {
    server->http_ = std::make_unique<httplib::Server>();
  } else {
    auto https = std::make_unique<httplib::SSLServer>(options.tls_cert.c_str(),
                                                      options.tls_key.c_str());
    if (!https->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot serve HTTPS with --tls_cert '",
                                                     options.tls_cert, "' and --tls_key '",
                                                     options.tls_key, "' (unreadable or no PEM?)"));
    }
    server->http_ = std::move(https);
  }
  httplib::Server& http = *server->http_;
  // Each open connection holds a thread (httplib): generations while they run, and clients
  // still sending a request until the header/body deadlines cut them off. Enough threads for the
  // cap plus the cheap endpoints, idle keep-alive connections and slow clients; an idle thread
  // costs its stack's address space, not memory.
  const size_t threads = options.http_threads > 0
                             ? static_cast<size_t>(options.http_threads)
                             : static_cast<size_t>(options.max_concurrent_requests) + 128;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(options.max_body_bytes);
  http.set_read_timeout(options.read_timeout_s, 0);
  http.set_write_timeout(options.write_timeout_s, 0);
  http.set_keep_alive_timeout(options.keep_alive_s);
  http.set_tcp_nodelay(true);
  // Before any body is read: its framing (a lying or absurd length is answered at once), then
  // CORS (a browser's preflight carries no API key), then the API key: every route but health
  // and metrics needs a listed one (OpenAI's 401 otherwise).
  TANDEM_ASSIGN_OR_RETURN(CorsPolicy cors, CorsPolicy::Parse(options.cors_origins));
  http.set_pre_routing_handler([s = server->shared_.get(), cors](const httplib::Request& req,
                                                                 httplib::Response& res) {
    if (s->reaper != nullptr) s->reaper->HeadersArrived(req.remote_addr, req.remote_port);
    if (const ApiError framing = CheckBodyFraming(req, s->options.max_body_bytes);
        framing.http_status != 0) {
      RefuseAndClose(framing, res);
      s->metrics.CountRequest(req.path, framing.http_status);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (cors.AnswerPreflight(req, res)) return httplib::Server::HandlerResponse::Handled;
    cors.Decorate(req, res);
    if (!s->options.api_keys.has_value() || req.path == "/health" || req.path == "/metrics") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    const std::string key = BearerToken(req);
    if (!key.empty() && s->options.api_keys->Lookup(key).has_value()) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    const ApiError e = FromStatus(absl::UnauthenticatedError(
        key.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                    : "incorrect API key provided"));
    // The body is not read: the connection cannot serve another request.
    RefuseAndClose(e, res);
    return httplib::Server::HandlerResponse::Handled;
  });
  server->AddRoutes();

  const int port = options.port == 0
                       ? http.bind_to_any_port(options.host)
                       : (http.bind_to_port(options.host, options.port) ? options.port : -1);
  if (port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind ", options.host, ":", options.port, " (in use?)"));
  }
  server->port_ = port;
  server->shared_->reaper = std::make_unique<ConnectionReaper>(
      port, std::chrono::seconds(options.header_timeout_s));
  server->listener_ = std::thread([s = server.get()] {
    if (!s->http_->listen_after_bind()) spdlog::error("the HTTP listener stopped with an error");
  });
  return server;
}

GatewayServer::~GatewayServer() { Stop(0); }

WorkerPool& GatewayServer::workers() { return *shared_->pool; }

void GatewayServer::Stop(int grace_ms) {
  if (stopped_.exchange(true)) return;
  if (http_ != nullptr) http_->stop();
  // The listener thread now waits for the connections' threads; generations keep theirs.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  while (shared_->in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (shared_->in_flight.load() > 0) {
    spdlog::warn("cancelling {} generation(s) still running after the shutdown grace",
                 shared_->in_flight.load());
    shared_->watcher->FireAll();
  }
  if (listener_.joinable()) listener_.join();
}

void GatewayServer::AddRoutes() {
  httplib::Server& http = *http_;
  Shared* s = shared_.get();

  // The body is read here, against the deadline (request_guard.h), not by httplib before.
  for (const GenerationRoute& route : kGenerationRoutes) {
    http.Post(route.path, [s, handle = route.handle](const httplib::Request& req,
                                                     httplib::Response& res,
                                                     const httplib::ContentReader& reader) {
      std::string body;
      ApiError late;
      if (!ReadBodyWithin(req, reader, std::chrono::seconds(s->options.body_timeout_s), &body,
                          &late)) {
        RefuseAndClose(late, res);
        s->metrics.CountRequest(req.path, late.http_status);
        return;
      }
      handle(*s, req, body, res);
    });
  }
  http.Get(R"(/v1/responses/([A-Za-z0-9_]+))",
           [s](const httplib::Request& req, httplib::Response& res) {
             HandleGetResponse(*s, req, res);
           });
  http.Delete(R"(/v1/responses/([A-Za-z0-9_]+))",
              [s](const httplib::Request& req, httplib::Response& res) {
                HandleDeleteResponse(*s, req, res);
              });

  http.Get("/v1/models", [s](const httplib::Request&, httplib::Response& res) {
    absl::StatusOr<v1::ModelInfoResponse> info = s->pool->ModelInfo();
    if (!info.ok()) return SendError(*s, "/v1/models", info.status(), res);
    SendJson(
        res, 200,
        {{"object", "list"},
         {"data", nlohmann::json::array({ModelJson(ServedModelName(*s, *info), *info,
                                                   static_cast<int64_t>(std::time(nullptr)))})}});
    s->metrics.CountRequest("/v1/models", 200);
  });
  http.Get(R"(/v1/models/(.+))", [s](const httplib::Request& req, httplib::Response& res) {
    absl::StatusOr<v1::ModelInfoResponse> info = s->pool->ModelInfo();
    if (!info.ok()) return SendError(*s, "/v1/models", info.status(), res);
    const std::string id = ServedModelName(*s, *info);
    if (req.matches[1] != id) {
      ApiError e{404, absl::StrCat("The model `", req.matches[1].str(), "` does not exist"),
                 "not_found_error", "model", "model_not_found"};
      SendJson(res, 404, ErrorJson(e));
      s->metrics.CountRequest("/v1/models", 404);
      return;
    }
    SendJson(res, 200, ModelJson(id, *info, static_cast<int64_t>(std::time(nullptr))));
    s->metrics.CountRequest("/v1/models", 200);
  });

  // tandem's extra: DELETE /v1/sessions/{id} frees a kept session (its KV on the worker and the
  // CPU nodes), as Generation.CloseSession does. OpenAI's delete shape {id, object, deleted}.
  http.Delete(R"(/v1/sessions/(.+))", [s](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (s->owners != nullptr) {
      const absl::Status mine = s->owners->Check(id, ApiKeyPrincipal(*s, req));
      if (!mine.ok()) return SendError(*s, "/v1/sessions", mine, res);
    }
    const absl::Status closed = s->pool->CloseSession(id);
    if (s->owners != nullptr && (closed.ok() || absl::IsNotFound(closed))) s->owners->Forget(id);
    if (!closed.ok()) return SendError(*s, "/v1/sessions", closed, res);
    SendJson(res, 200, {{"id", id}, {"object", "session"}, {"deleted", true}});
    s->metrics.CountRequest("/v1/sessions", 200);
  });

  http.Get("/health", [s](const httplib::Request&, httplib::Response& res) {
    const size_t serving = s->pool->ServingCount();
    nlohmann::json workers = nlohmann::json::array();
    for (const WorkerState& w : s->pool->States()) {
      workers.push_back(
          {{"address", w.address}, {"serving", w.serving}, {"outstanding", w.outstanding}});
    }
    const int code = serving > 0 ? 200 : 503;
    SendJson(res, code,
             {{"status", serving > 0 ? "ok" : "unavailable"},
              {"workers_serving", serving},
              {"workers", std::move(workers)}});
    s->metrics.CountRequest("/health", code);
  });

  http.Get("/metrics", [s](const httplib::Request&, httplib::Response& res) {
    s->metrics.workers_serving->Set(static_cast<double>(s->pool->ServingCount()));
    res.status = 200;
    res.set_content(metrics::SerializeText(*s->registry), std::string(metrics::kTextContentType));
  });

  // Unknown routes, bodies over the limit, methods not allowed: OpenAI's error shape. Handlers'
  // own errors already have a body and pass through.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [s](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.is_chunked_content_provider_ || res.content_length_ > 0 ||
            res.status == 499) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        ApiError e;
        e.http_status = res.status;
        const bool post_route =
            std::any_of(std::begin(kGenerationRoutes), std::end(kGenerationRoutes),
                        [&](const GenerationRoute& route) { return req.path == route.path; });
        if (res.status == 404 && post_route && req.method != "POST") {
          e.http_status = res.status = 405;
          e.message = absl::StrCat(req.path, " takes POST, not ", req.method);
          e.type = "invalid_request_error";
          res.set_header("Allow", "POST");
        } else if (res.status == 404) {
          e.message = absl::StrCat("no route ", req.method, " ", req.path);
          e.type = "not_found_error";
        } else if (res.status == 413 && absl::StartsWith(req.get_header_value("Content-Type"),
                                                          "application/x-www-form-urlencoded")) {
          // The HTTP library caps form bodies before any handler runs.
          e.message = FormBodyTooLargeMessage();
          e.type = "invalid_request_error";
        } else if (res.status == 413) {
          e.message = absl::StrCat("the request body is over ", s->options.max_body_bytes,
                                   " bytes (--max_body_bytes)");
          e.type = "invalid_request_error";
        } else {
          e.message = absl::StrCat("HTTP ", res.status);
          e.type = res.status < 500 ? "invalid_request_error" : "internal_server_error";
        }
        res.set_content(DumpJson(ErrorJson(e)), "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_logger([s](const httplib::Request& req, const httplib::Response& res) {
    if (s->reaper != nullptr) s->reaper->ResponseSent(req.remote_addr, req.remote_port);
    spdlog::debug("{} {} {} from {}:{}", req.method, req.path, res.status, req.remote_addr,
                  req.remote_port);
  });
  http.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("{} {}: {}", req.method, req.path, what);
        ApiError e{500, absl::StrCat("internal error: ", what), "internal_server_error", "", ""};
        SendJson(res, 500, ErrorJson(e));
      });
}

}  // namespace tandem::gateway
