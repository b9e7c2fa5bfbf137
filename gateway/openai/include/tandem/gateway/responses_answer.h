// One Responses API answer (POST /v1/responses), built from a worker's Generate stream: the
// response object (non-streamed, GET /v1/responses/{id}, and inside the stream's first and last
// events) and the streamed events, in OpenAI's shapes:
//   response {id: "resp_...", object: "response", created_at, status, model, output: [message
//   {id: "msg_...", type: "message", status, role: "assistant", content: [{type: "output_text",
//   text, annotations: []}]}], usage {input_tokens, input_tokens_details.cached_tokens,
//   output_tokens, output_tokens_details.reasoning_tokens, total_tokens, degraded_steps},
//   incomplete_details, instructions, max_output_tokens, temperature, top_p,
//   previous_response_id, store, metadata, tool_choice, tools, text, truncation, "tandem"}
//   events ("event: <type>" + "data: {type, sequence_number, ...}"): response.created,
//   response.in_progress, response.output_item.added, response.content_part.added,
//   response.output_text.delta (one per token with text), response.output_text.done,
//   response.content_part.done, response.output_item.done, then response.completed (EOS or a
//   stop string) or response.incomplete (max_output_tokens or a full context:
//   incomplete_details.reason "max_output_tokens"); a failure after the start is an "error"
//   event. There is no [DONE] line (OpenAI sends none for this API).
// "tandem": {degraded, degraded_steps, mode} as in openai_response.h.
//
// Not thread-safe: one answer per request.
#pragma once

#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"
#include "tandem/gateway/api_error.h"
#include "tandem/gateway/responses_request.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::gateway {

// What the response object echoes of its request.
struct ResponsesEcho {
  std::string instructions;
  int64_t max_output_tokens = 0;   // 0 = not given (null)
  double temperature = 1;
  double top_p = 1;
  std::string previous_response_id;
  bool store = true;
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
};
// `request`'s own fields, and the sampling and max_output_tokens of `running` (its chat request
// as it runs: the model's defaults applied).
ResponsesEcho EchoOf(const ResponsesRequest& request, const OpenAiRequest& running);

class ResponsesAnswer {
 public:
  ResponsesAnswer(std::string model, int64_t created_at, ResponsesEcho echo);

  const std::string& id() const { return id_; }   // "resp_" + 48 hex digits
  const std::string& text() const { return text_; }

  // Streaming: the events before the first token, one token's (empty when it adds no text),
  // the closing ones, and a failure's.
  std::string StreamStart();
  std::string StreamToken(const v1::TokenDelta& delta);
  std::string StreamFinish(const v1::GenerateFinal& final);
  std::string StreamError(const ApiError& error);

  // Non-streamed: accumulate each token, then the response object. Streaming accumulates too.
  void Append(const v1::TokenDelta& delta);
  nlohmann::ordered_json Response(const v1::GenerateFinal& final) const;

 private:
  // The response object while it runs (status "in_progress", no output yet).
  nlohmann::ordered_json InProgress() const;
  nlohmann::ordered_json Base(const std::string& status) const;
  nlohmann::ordered_json Message(const std::string& status) const;
  nlohmann::ordered_json TextPart() const;
  // "event: <type>\ndata: {type, sequence_number, ...fields}\n\n".
  std::string Event(const std::string& type, nlohmann::ordered_json fields);

  const std::string id_;
  const std::string message_id_;
  const std::string model_;
  const int64_t created_at_;
  const ResponsesEcho echo_;
  std::string text_;
  int64_t sequence_ = 0;
};

}  // namespace tandem::gateway
