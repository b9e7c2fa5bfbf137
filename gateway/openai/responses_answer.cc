#include "tandem/gateway/responses_answer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/gateway/openai_response.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;

bool Incomplete(const v1::GenerateFinal& final) {
  return final.finish_reason() == v1::FINISH_REASON_LENGTH ||
         final.finish_reason() == v1::FINISH_REASON_CONTEXT;
}

Json Usage(const v1::GenerateFinal& final) {
  const v1::Usage& usage = final.usage();
  return {{"input_tokens", usage.prompt_tokens()},
          {"input_tokens_details", {{"cached_tokens", usage.cached_tokens()}}},
          {"output_tokens", usage.completion_tokens()},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", usage.total_tokens()},
          {"degraded_steps", final.degraded_steps()}};
}

}  // namespace

ResponsesEcho EchoOf(const ResponsesRequest& request, const OpenAiRequest& running) {
  ResponsesEcho echo;
  echo.instructions = request.instructions;
  echo.max_output_tokens = running.max_tokens.value_or(0);
  echo.temperature = running.generate.temperature();
  echo.top_p = running.generate.top_p() > 0 ? running.generate.top_p() : 1.0;
  echo.previous_response_id = request.previous_response_id;
  echo.store = request.store;
  echo.metadata = request.metadata;
  return echo;
}

ResponsesAnswer::ResponsesAnswer(std::string model, int64_t created_at, ResponsesEcho echo)
    : id_("resp_" + RandomHex(48)),
      message_id_("msg_" + RandomHex(48)),
      model_(std::move(model)),
      created_at_(created_at),
      echo_(std::move(echo)) {}

Json ResponsesAnswer::Base(const std::string& status) const {
  auto text_or_null = [](const std::string& s) { return s.empty() ? Json() : Json(s); };
  return {{"id", id_},
          {"object", "response"},
          {"created_at", created_at_},
          {"status", status},
          {"error", nullptr},
          {"incomplete_details", nullptr},
          {"instructions", text_or_null(echo_.instructions)},
          {"max_output_tokens",
           echo_.max_output_tokens > 0 ? Json(echo_.max_output_tokens) : Json()},
          {"model", model_},
          {"output", Json::array()},
          {"parallel_tool_calls", false},
          {"previous_response_id", text_or_null(echo_.previous_response_id)},
          {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
          {"store", echo_.store},
          {"temperature", echo_.temperature},
          {"text", {{"format", {{"type", "text"}}}}},
          {"tool_choice", "auto"},
          {"tools", Json::array()},
          {"top_p", echo_.top_p},
          {"truncation", "disabled"},
          {"usage", nullptr},
          {"metadata", echo_.metadata}};
}

Json ResponsesAnswer::TextPart() const {
  return {{"type", "output_text"}, {"text", text_}, {"annotations", Json::array()},
          {"logprobs", Json::array()}};
}

Json ResponsesAnswer::Message(const std::string& status) const {
  return {{"id", message_id_},
          {"type", "message"},
          {"status", status},
          {"role", "assistant"},
          {"content", status == "in_progress" ? Json::array() : Json::array({TextPart()})}};
}

Json ResponsesAnswer::InProgress() const { return Base("in_progress"); }

Json ResponsesAnswer::Response(const v1::GenerateFinal& final) const {
  const bool incomplete = Incomplete(final);
  Json r = Base(incomplete ? "incomplete" : "completed");
  if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  r["output"] = Json::array({Message(incomplete ? "incomplete" : "completed")});
  r["usage"] = Usage(final);
  r["tandem"] = Json(TandemJson(final));
  return r;
}

std::string ResponsesAnswer::Event(const std::string& type, Json fields) {
  Json event = {{"type", type}, {"sequence_number", sequence_++}};
  for (auto it = fields.begin(); it != fields.end(); ++it) event[it.key()] = std::move(it.value());
  return absl::StrCat("event: ", type, "\ndata: ", DumpJson(nlohmann::json(event)), "\n\n");
}

std::string ResponsesAnswer::StreamStart() {
  // One statement per event: their sequence numbers follow the order they are made in.
  std::string sse = Event("response.created", {{"response", InProgress()}});
  sse += Event("response.in_progress", {{"response", InProgress()}});
  sse += Event("response.output_item.added", {{"output_index", 0}, {"item", Message("in_progress")}});
  sse += Event("response.content_part.added", {{"item_id", message_id_},
                                               {"output_index", 0},
                                               {"content_index", 0},
                                               {"part", TextPart()}});
  return sse;
}

void ResponsesAnswer::Append(const v1::TokenDelta& delta) {
  text_ += delta.text();
}

std::string ResponsesAnswer::StreamToken(const v1::TokenDelta& delta) {
  Append(delta);
  if (delta.text().empty()) return "";
  return Event("response.output_text.delta", {{"item_id", message_id_},
                                              {"output_index", 0},
                                              {"content_index", 0},
                                              {"delta", delta.text()},
                                              {"logprobs", Json::array()}});
}

std::string ResponsesAnswer::StreamFinish(const v1::GenerateFinal& final) {
  Json response = Response(final);
  std::string sse = Event("response.output_text.done", {{"item_id", message_id_},
                                                        {"output_index", 0},
                                                        {"content_index", 0},
                                                        {"text", text_},
                                                        {"logprobs", Json::array()}});
  sse += Event("response.content_part.done", {{"item_id", message_id_},
                                              {"output_index", 0},
                                              {"content_index", 0},
                                              {"part", TextPart()}});
  sse += Event("response.output_item.done", {{"output_index", 0}, {"item", response["output"][0]}});
  const std::string type = Incomplete(final) ? "response.incomplete" : "response.completed";
  sse += Event(type, {{"response", std::move(response)}});
  return sse;
}

std::string ResponsesAnswer::StreamError(const ApiError& error) {
  return Event("error", {{"code", error.code.empty() ? error.type : error.code},
                         {"message", error.message},
                         {"param", error.param.empty() ? Json() : Json(error.param)}});
}

}  // namespace tandem::gateway
