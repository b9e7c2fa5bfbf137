#include "responses_handler.h"

#include <chrono>
#include <ctime>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/gateway/responses_answer.h"
#include "tandem/gateway/responses_request.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;
constexpr char kRoute[] = "/v1/responses";

// A Responses answer; stores the conversation with it when it ends well and `store` is set.
class ResponsesWriter final : public AnswerWriter {
 public:
  ResponsesWriter(ResponsesAnswer answer, ResponseStore* store, std::string principal,
                  Json conversation)
      : answer_(std::move(answer)),
        store_(store),
        principal_(std::move(principal)),
        conversation_(std::move(conversation)) {}

  std::string StreamStart() override { return answer_.StreamStart(); }
  std::string StreamProgress(const v1::PrefillProgress&) override { return ""; }
  std::string StreamToken(const v1::TokenDelta& delta, const TokenPiece&) override {
    return answer_.StreamToken(delta);
  }
  std::string StreamFinish(const v1::GenerateFinal& final) override {
    Store(final);
    return answer_.StreamFinish(final);
  }
  std::string StreamError(const ApiError& error) override { return answer_.StreamError(error); }
  void Append(const v1::TokenDelta& delta, const TokenPiece&) override { answer_.Append(delta); }
  std::string Whole(const v1::GenerateFinal& final) override {
    Store(final);
    return DumpJson(nlohmann::json(answer_.Response(final)));
  }
  bool wants_pieces() const override { return false; }

 private:
  void Store(const v1::GenerateFinal& final) {
    if (store_ == nullptr) return;
    conversation_.push_back(Json{{"role", "assistant"}, {"content", answer_.text()}});
    if (!store_->Put(answer_.id(), ResponseStore::Entry{principal_, std::move(conversation_),
                                                        answer_.Response(final)})) {
      spdlog::warn("{}: response {} is larger than the store (--responses_store_bytes); not "
                   "stored", kRoute, answer_.id());
    }
  }

  ResponsesAnswer answer_;
  ResponseStore* store_;   // null: store false
  const std::string principal_;
  Json conversation_;      // the turns before this answer
};

}  // namespace

void HandleResponses(GatewayServer::Shared& shared, const httplib::Request& req,
                     std::string_view body, httplib::Response& res) {
  const auto arrival = std::chrono::steady_clock::now();
  absl::StatusOr<ResponsesRequest> parsed = ParseResponsesRequest(body);
  if (!parsed.ok()) return SendError(shared, kRoute, parsed.status(), res);
  ResponsesRequest& request = *parsed;
  std::string principal = ApiKeyPrincipal(shared, req);
  // The conversation: the stored one of previous_response_id, then this input. Instructions
  // are not carried from one response to the next (OpenAI's rule): they go in front of this
  // turn's prompt only.
  Json conversation = Json::array();
  if (!request.previous_response_id.empty()) {
    absl::StatusOr<std::shared_ptr<const ResponseStore::Entry>> previous =
        shared.responses->Get(request.previous_response_id, principal);
    if (!previous.ok()) {
      return SendError(shared, kRoute, WithParam(previous.status(), "previous_response_id"), res);
    }
    conversation = (*previous)->conversation;
  }
  for (Json& message : request.input) conversation.push_back(std::move(message));
  Json& messages = request.chat.messages;
  messages = Json::array();
  if (!request.instructions.empty()) {
    messages.push_back(Json{{"role", "system"}, {"content", request.instructions}});
  }
  for (const Json& message : conversation) messages.push_back(message);
  if (messages.size() > kMaxMessages) {
    return SendError(shared, kRoute,
                     InvalidField("previous_response_id",
                                  absl::StrCat("the conversation has ", messages.size(),
                                               " messages; at most ", kMaxMessages)),
                     res);
  }
  ResponseStore* store = request.store ? shared.responses.get() : nullptr;
  OpenAiRequest chat = std::move(request.chat);
  RunGeneration(
      shared, kRoute, arrival, std::move(chat),
      [&request, &principal, &conversation, store](const std::string& model, const OpenAiRequest& r,
                                                   std::string_view /*prompt*/) {
        return std::make_unique<ResponsesWriter>(
            ResponsesAnswer(model, static_cast<int64_t>(std::time(nullptr)), EchoOf(request, r)),
            store, std::move(principal), std::move(conversation));
      },
      req, res);
}

void HandleGetResponse(GatewayServer::Shared& shared, const httplib::Request& req,
                       httplib::Response& res) {
  absl::StatusOr<std::shared_ptr<const ResponseStore::Entry>> entry =
      shared.responses->Get(req.matches[1], ApiKeyPrincipal(shared, req));
  if (!entry.ok()) return SendError(shared, kRoute, entry.status(), res);
  SendJson(res, 200, nlohmann::json((*entry)->response));
  shared.metrics.CountRequest(kRoute, 200);
}

void HandleDeleteResponse(GatewayServer::Shared& shared, const httplib::Request& req,
                          httplib::Response& res) {
  const std::string id = req.matches[1];
  const absl::Status deleted = shared.responses->Delete(id, ApiKeyPrincipal(shared, req));
  if (!deleted.ok()) return SendError(shared, kRoute, deleted, res);
  SendJson(res, 200, {{"id", id}, {"object", "response"}, {"deleted", true}});
  shared.metrics.CountRequest(kRoute, 200);
}

}  // namespace tandem::gateway
