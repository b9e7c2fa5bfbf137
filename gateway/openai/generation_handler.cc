#include "generation_handler.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"
#include "tandem/common/grpc_status.h"
#include "tandem/gateway/openai_response.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A generation admitted under --max_concurrent_requests: counted in flight (and in the running
// gauge) until destroyed.
class Slot {
 public:
  // A slot, or null when max_concurrent_requests generations are in flight.
  static std::unique_ptr<Slot> TryTake(GatewayServer::Shared& shared) {
    if (shared.in_flight.fetch_add(1) >= shared.options.max_concurrent_requests) {
      shared.in_flight.fetch_sub(1);
      return nullptr;
    }
    return std::unique_ptr<Slot>(new Slot(shared));
  }
  ~Slot() {
    shared_.in_flight.fetch_sub(1);
    shared_.metrics.requests_running->Decrement();
  }
  void CountDisconnect() { shared_.metrics.client_disconnects->Increment(); }
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

 private:
  explicit Slot(GatewayServer::Shared& shared) : shared_(shared) {
    shared_.metrics.requests_running->Increment();
  }
  GatewayServer::Shared& shared_;
};

// One Generate call on a worker. ClientGone() may be called from any thread (the disconnect
// watcher); everything else from the request's thread. Destroying an unfinished call cancels it
// and waits for gRPC to end it.
class GenerateCall {
 public:
  GenerateCall(std::unique_ptr<Slot> slot, WorkerPool* pool, WorkerPool::Lease lease,
               const v1::GenerateRequest& request, int timeout_s)
      : slot_(std::move(slot)), pool_(pool), lease_(std::move(lease)) {
    if (!request.session_id().empty() && !lease_.continued_session()) {
      new_session_id_ = request.session_id();
    }
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(timeout_s));
    reader_ = lease_.stub().Generate(&ctx_, request);
  }

  ~GenerateCall() {
    watch_.reset();  // no ClientGone() from the watcher past this point
    if (!finished_) {
      ctx_.TryCancel();
      v1::GenerateResponse ignored;
      while (reader_->Read(&ignored)) {
      }
      reader_->Finish();
    }
  }

  GenerateCall(const GenerateCall&) = delete;
  GenerateCall& operator=(const GenerateCall&) = delete;

  bool Read(v1::GenerateResponse* message) {
    if (!reader_->Read(message)) return false;
    saw_token_ = saw_token_ || message->has_token();
    return true;
  }

  // The call's status (once, after Read returned false). An UNAVAILABLE worker is routed
  // around until its health check passes again; a new session that failed before its first
  // token does not exist on the worker (a failed request changes nothing; one stopped in
  // prefill is closed), so the next request starts it anew.
  absl::Status Finish() {
    finished_ = true;
    const absl::Status status = FromGrpcStatus(reader_->Finish());
    if (status.code() == absl::StatusCode::kUnavailable && !cancelled_.load()) {
      lease_.MarkUnavailable();
    }
    if (!status.ok() && !saw_token_ && !new_session_id_.empty()) {
      pool_->ForgetSession(new_session_id_);
    }
    return status;
  }

  // The client went away: cancels the call; counted once (the watcher and a failed write may
  // both notice).
  void ClientGone() {
    if (!cancelled_.exchange(true)) slot_->CountDisconnect();
    ctx_.TryCancel();
  }
  bool cancelled() const { return cancelled_.load(); }
  v1::Generation::Stub& stub() const { return lease_.stub(); }
  void set_watch(std::unique_ptr<DisconnectWatcher::Watch> watch) { watch_ = std::move(watch); }

 private:
  std::unique_ptr<Slot> slot_;
  WorkerPool* pool_;
  WorkerPool::Lease lease_;
  std::string new_session_id_;  // the session this call starts ("" = none)
  bool saw_token_ = false;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  bool finished_ = false;
  std::atomic<bool> cancelled_{false};
  std::unique_ptr<DisconnectWatcher::Watch> watch_;
};

// What a streamed answer needs after the handler has returned (the content provider runs on
// the connection's thread after it).
struct StreamState {
  std::unique_ptr<GenerateCall> call;
  std::unique_ptr<AnswerWriter> writer;
  v1::GenerateResponse first;  // read before answering: a request the worker refuses gets
                               // its HTTP status, not a 200 with an error event
  std::string endpoint;
  Clock::time_point arrival;
};

TokenPiece PieceOf(GatewayServer::Shared& shared, const GenerateCall& call,
                   const AnswerWriter& writer, const v1::TokenDelta& delta) {
  if (!writer.wants_pieces()) return {};
  return shared.pieces.Sampled(delta, call.stub(), shared.options.workers.rpc_timeout_ms);
}

void RecordSuccess(GatewayServer::Shared& shared, const v1::GenerateFinal& final,
                   Clock::time_point arrival) {
  shared.metrics.e2e_request_latency->Observe(SecondsSince(arrival));
  shared.metrics.prompt_tokens->Increment(static_cast<double>(final.usage().prompt_tokens()));
  shared.metrics.generation_tokens->Increment(
      static_cast<double>(final.usage().completion_tokens()));
}

// The SSE body of a streamed answer; false when the client is gone (the call is cancelled).
bool WriteStream(GatewayServer::Shared& shared, StreamState& st, httplib::DataSink& sink) {
  auto write = [&](const std::string& text) {
    if (text.empty() || sink.write(text.data(), text.size())) return true;
    st.call->ClientGone();
    return false;
  };
  AnswerWriter& writer = *st.writer;
  if (!write(writer.StreamStart())) return false;
  std::optional<v1::GenerateFinal> final;
  bool first_token = true;
  v1::GenerateResponse message = std::move(st.first);
  do {
    switch (message.event_case()) {
      case v1::GenerateResponse::kPrefill: {
        const v1::PrefillProgress& p = message.prefill();
        if (!write(SseComment(absl::StrCat("prefill ", p.processed(), "/", p.total())))) {
          return false;
        }
        if (!write(writer.StreamProgress(p))) return false;
        break;
      }
      case v1::GenerateResponse::kToken: {
        const v1::TokenDelta& delta = message.token();
        if (!write(writer.StreamToken(delta, PieceOf(shared, *st.call, writer, delta)))) {
          return false;
        }
        if (first_token) {
          shared.metrics.time_to_first_token->Observe(SecondsSince(st.arrival));
          first_token = false;
        }
        break;
      }
      case v1::GenerateResponse::kFinal:
        final = message.final();
        break;
      case v1::GenerateResponse::EVENT_NOT_SET:
        break;
    }
  } while (st.call->Read(&message));
  absl::Status status = st.call->Finish();
  if (st.call->cancelled()) return false;
  if (status.ok() && !final.has_value()) {
    status = absl::InternalError("the worker's stream ended without its final message");
  }
  if (!status.ok()) {
    // Headers are sent: the error goes as an event, then the stream ends.
    spdlog::warn("{}: stream failed after it started: {}", st.endpoint, status.ToString());
    write(writer.StreamError(FromStatus(status)));
    sink.done();
    return true;
  }
  if (!write(writer.StreamFinish(*final))) return false;
  sink.done();
  RecordSuccess(shared, *final, st.arrival);
  return true;
}

void AnswerWhole(GatewayServer::Shared& shared, const std::string& endpoint, GenerateCall& call,
                 AnswerWriter& writer, Clock::time_point arrival, httplib::Response& res) {
  std::optional<v1::GenerateFinal> final;
  v1::GenerateResponse message;
  while (call.Read(&message)) {
    if (message.has_token()) {
      writer.Append(message.token(), PieceOf(shared, call, writer, message.token()));
    } else if (message.has_final()) {
      final = message.final();
    }
  }
  absl::Status status = call.Finish();
  if (call.cancelled()) {
    res.status = 499;  // nobody reads it: the client is gone
    shared.metrics.CountRequest(endpoint, 499);
    return;
  }
  if (status.ok() && !final.has_value()) {
    status = absl::InternalError("the worker's stream ended without its final message");
  }
  if (!status.ok()) return SendError(shared, endpoint, status, res);
  res.status = 200;
  res.set_content(writer.Whole(*final), "application/json");
  shared.metrics.CountRequest(endpoint, 200);
  RecordSuccess(shared, *final, arrival);
}

}  // namespace

std::string ServedModelName(const GatewayServer::Shared& shared,
                            const v1::ModelInfoResponse& info) {
  if (!shared.options.served_model_name.empty()) return shared.options.served_model_name;
  std::string dir = info.model_dir();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

std::string BearerToken(const httplib::Request& req) {
  const std::string header = req.get_header_value("Authorization");
  if (header.size() <= 7 || !absl::EqualsIgnoreCase(header.substr(0, 7), "bearer ")) return "";
  return header.substr(7);
}

std::string ApiKeyPrincipal(const GatewayServer::Shared& shared, const httplib::Request& req) {
  if (!shared.options.api_keys.has_value()) return "";
  const std::string key = BearerToken(req);
  return key.empty() ? "" : shared.options.api_keys->Lookup(key).value_or("");
}

void SendJson(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(DumpJson(body), "application/json");
}

void SendError(const GatewayServer::Shared& shared, const std::string& endpoint,
               const absl::Status& status, httplib::Response& res) {
  const ApiError error = FromStatus(status);
  SendJson(res, error.http_status, ErrorJson(error));
  shared.metrics.CountRequest(endpoint, error.http_status);
}

void HandleGeneration(GatewayServer::Shared& shared, Endpoint endpoint, const httplib::Request& req,
                      std::string_view body, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  const std::string name =
      endpoint == Endpoint::kChatCompletions ? "/v1/chat/completions" : "/v1/completions";
  absl::StatusOr<OpenAiRequest> parsed = endpoint == Endpoint::kChatCompletions
                                             ? ParseChatRequest(body)
                                             : ParseCompletionRequest(body);
  if (!parsed.ok()) return SendError(shared, name, parsed.status(), res);
  RunGeneration(
      shared, name, arrival, *std::move(parsed),
      [endpoint, &shared](const std::string& model, const OpenAiRequest& r,
                          std::string_view prompt) {
        std::optional<ReasoningMode> reasoning;
        if (endpoint == Endpoint::kChatCompletions && shared.options.reasoning_parser.has_value()) {
          reasoning = ReasoningMode{*shared.options.reasoning_parser, PromptThinkingOf(prompt)};
        }
        return MakeCompletionsWriter(ResponseMeta{endpoint, NewResponseId(endpoint),
                                                  static_cast<int64_t>(std::time(nullptr)), model},
                                     r, reasoning);
      },
      req, res);
}

void RunGeneration(GatewayServer::Shared& shared, const std::string& name,
                   Clock::time_point arrival, OpenAiRequest r, const WriterFactory& make_writer,
                   const httplib::Request& req, httplib::Response& res) {
  if (!r.ignored_fields.empty()) {
    // As vLLM: unknown fields are accepted, and said so.
    spdlog::warn("{}: fields present in the request but ignored: {}", name,
                 absl::StrJoin(r.ignored_fields, ", "));
  }
  absl::StatusOr<v1::ModelInfoResponse> info = shared.pool->ModelInfo();
  if (!info.ok()) return SendError(shared, name, info.status(), res);
  const std::string model = ServedModelName(shared, *info);
  if (!r.model.empty() && r.model != model) {
    ApiError e{
        404,
        absl::StrCat("The model `", r.model, "` does not exist; this gateway serves `", model, "`"),
        "invalid_request_error", "model", "model_not_found"};
    SendJson(res, 404, ErrorJson(e));
    shared.metrics.CountRequest(name, 404);
    return;
  }
  ApplyModelDefaults(*info, &r);
  const int64_t context_cap = std::min<int64_t>(std::max<int64_t>(info->max_context(), 1), 1 << 20);
  r.generate.set_max_tokens(r.max_tokens.value_or(
      r.endpoint == Endpoint::kCompletions ? std::min<int64_t>(16, context_cap) : context_cap));

  std::optional<RenderedPrompt> prompt;
  if (r.endpoint != Endpoint::kCompletions) {   // chat and Responses: messages
    absl::StatusOr<std::shared_ptr<const chat_template::Template>> tmpl =
        shared.templates->Get(*info);
    if (!tmpl.ok()) return SendError(shared, name, tmpl.status(), res);
    absl::StatusOr<RenderedPrompt> rendered = RenderChatPrompt(**tmpl, r, *info);
    if (!rendered.ok()) return SendError(shared, name, rendered.status(), res);
    prompt = std::move(*rendered);
  }
  // The prefix cache's scope: every request reaches the worker as the gateway's one principal,
  // so the API key's principal goes in front of the client's cache_salt.
  if (const std::string principal = ApiKeyPrincipal(shared, req); !principal.empty()) {
    r.generate.set_cache_salt(
        absl::StrCat(principal.size(), ":", principal, "/", r.generate.cache_salt()));
  }
  if (shared.owners != nullptr && !r.generate.session_id().empty()) {
    const absl::Status claimed =
        shared.owners->Claim(r.generate.session_id(), ApiKeyPrincipal(shared, req));
    if (!claimed.ok()) return SendError(shared, name, claimed, res);
  }
  std::unique_ptr<Slot> slot = Slot::TryTake(shared);
  if (slot == nullptr) {
    return SendError(shared, name,
                     absl::ResourceExhaustedError(absl::StrCat(
                         "the gateway has ", shared.options.max_concurrent_requests,
                         " requests in flight (--max_concurrent_requests); retry later")),
                     res);
  }
  // One-shot requests that start alike go where the last such one went (its prefix cache).
  const std::string prefix_key =
      r.generate.session_id().empty()
          ? WorkerPool::PrefixKey(r.generate.cache_salt(),
                                  prompt.has_value() ? prompt->text : r.generate.prompt_text())
          : "";
  absl::StatusOr<WorkerPool::Lease> lease =
      shared.pool->Acquire(r.generate.session_id(), prefix_key);
  if (!lease.ok()) return SendError(shared, name, lease.status(), res);
  if (prompt.has_value()) {
    const absl::Status s = SetChatPrompt(*prompt, lease->continued_session(), lease->stub(),
                                         shared.options.workers.rpc_timeout_ms, &r.generate);
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kUnavailable) lease->MarkUnavailable();
      return SendError(shared, name, s, res);
    }
  }

  auto call = std::make_unique<GenerateCall>(std::move(slot), shared.pool.get(), std::move(*lease),
                                             r.generate, shared.options.request_timeout_s);
  const int fd = FindRequestSocket(req.local_port, req.remote_addr, req.remote_port);
  if (fd >= 0) {
    GenerateCall* c = call.get();
    call->set_watch(shared.watcher->Add(fd, [c] { c->ClientGone(); }));
  } else {
    spdlog::warn(
        "{}: the connection's socket was not found; a hang-up is noticed only when a "
        "write fails",
        name);
  }

  std::unique_ptr<AnswerWriter> writer =
      make_writer(model, r, prompt.has_value() ? std::string_view(prompt->text) : "");
  if (!r.stream) return AnswerWhole(shared, name, *call, *writer, arrival, res);

  auto st = std::make_shared<StreamState>();
  st->call = std::move(call);
  if (!st->call->Read(&st->first)) {
    const absl::Status status = st->call->Finish();
    if (st->call->cancelled()) {
      res.status = 499;
      return;
    }
    return SendError(shared, name,
                     status.ok() ? absl::InternalError("the worker's stream ended empty") : status,
                     res);
  }
  st->writer = std::move(writer);
  st->endpoint = name;
  st->arrival = arrival;
  shared.metrics.CountRequest(name, 200);
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  GatewayServer::Shared* sh = &shared;
  res.set_chunked_content_provider(
      "text/event-stream",
      [sh, st](size_t /*offset*/, httplib::DataSink& sink) { return WriteStream(*sh, *st, sink); });
}

}  // namespace tandem::gateway
