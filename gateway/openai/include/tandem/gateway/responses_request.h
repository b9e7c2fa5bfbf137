// OpenAI Responses API request bodies (POST /v1/responses) -> a chat request for the worker.
// Pure functions: no I/O, thread-safe.
//
// Accepted (OpenAI's names and meanings): model, input (a string, or a list of message items
// {role, content} with "type": "message" optional, roles user / assistant / system / developer
// (developer is sent as system), content a string or a list of input_text / output_text /
// text parts), instructions, previous_response_id, store (default true), metadata (at most 16
// string pairs, echoed), max_output_tokens, temperature, top_p, stream, text.format
// {"type": "text"}, truncation ("disabled" / "auto": tandem never truncates, a prompt past the
// context is refused), tools (empty only) and tool_choice ("none" / "auto"), and the fields of
// chat completions tandem adds (openai_request.h: mode, session_id, cache_salt, stop, seed, ...).
// Ignored: user, include, parallel_tool_calls, service_tier, prompt_cache_key,
// safety_identifier, reasoning (no reasoning model is served), stream_options. Refused with 400
// naming the field: function calls and other non-message input items, image / file / audio
// parts, background: true, conversation (use previous_response_id), top_logprobs > 0.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/gateway/openai_request.h"

namespace tandem::gateway {

inline constexpr size_t kMaxMetadataPairs = 16;       // OpenAI's bound
inline constexpr size_t kMaxMetadataKeyBytes = 64;
inline constexpr size_t kMaxMetadataValueBytes = 512;

struct ResponsesRequest {
  // The chat request: sampling, stream, max_tokens (from max_output_tokens) and tandem's
  // fields. Its `messages` are left null: the handler puts instructions, the stored
  // conversation of previous_response_id and `input` together.
  OpenAiRequest chat;
  nlohmann::ordered_json input;   // this turn's messages, chat-shaped: [{role, content: text}]
  std::string instructions;       // "" = none; a system message in front of everything
  std::string previous_response_id;
  bool store = true;
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
};

absl::StatusOr<ResponsesRequest> ParseResponsesRequest(std::string_view body);

}  // namespace tandem::gateway
