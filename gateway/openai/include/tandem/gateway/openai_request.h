// OpenAI request bodies -> what the gateway sends to a worker (tandem.v1.GenerateRequest) plus
// what shapes the answer (stream, usage, logprobs). Pure functions: no I/O, thread-safe.
//
// Accepted (OpenAI's names and meanings): model, stream, stream_options.include_usage,
// max_tokens (chat also max_completion_tokens, which wins), temperature (default 1 as OpenAI's),
// top_p, stop (string or list), seed (>= 0), n (1 only), user (ignored), presence_penalty and
// frequency_penalty (0 only), logit_bias (empty only); completions: prompt (a string, a list of
// token ids, or a one-element list of either), logprobs (0..5), echo (false only), suffix
// (empty only), best_of (1 only); chat: messages, logprobs (bool) + top_logprobs (0..20), tools,
// tool_choice ("none"/"auto"), response_format (type "text" only), chat_template_kwargs,
// add_generation_prompt (vLLM's extra, default true). tandem's extras: mode, beta, window, sink,
// selection, select_tokens, dense_layers, session_id, ignore_eos, top_k (-1 = no limit, as
// vLLM), and return_progress (llama.cpp's prompt_progress chunks while streaming). Unknown fields
// are ignored (listed in `ignored_fields` so the caller can log them); null is the same as
// absent. Errors: INVALID_ARGUMENT naming the field (ParamOf) for bad JSON, a wrong type, a
// value out of range or an unsupported option.
//
// Bounds (a request's cost is linear in its bytes and bounded in its lists): the body is parsed
// by ParseBoundedJson (nesting and keys per object, bounded_json.h); messages, tools, stop,
// stop_token_ids and logit_bias are bounded by the constants below (400 naming the field).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/generation.pb.h"

namespace tandem::gateway {

// kResponses: POST /v1/responses (responses_request.h), run as a chat request.
enum class Endpoint { kCompletions, kChatCompletions, kResponses };

inline constexpr size_t kMaxMessages = 16384;         // chat messages of one request
inline constexpr size_t kMaxTools = 1024;             // OpenAI takes 128
inline constexpr size_t kMaxStopStrings = 64;         // OpenAI takes 4 (also stop_token_ids)
inline constexpr size_t kMaxStopBytes = 4096;         // one stop string
inline constexpr size_t kMaxLogitBiasEntries = 1024;  // refused with entries anyway

struct OpenAiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // "" = not given (the served model)
  bool stream = false;
  bool include_usage = false;    // stream_options.include_usage
  bool return_progress = false;  // stream prompt_progress chunks (llama.cpp's shape)
  // Chat: logprobs (bool) and top_logprobs (0..20); completions: logprobs N (0..5) sets
  // logprobs = true, top_logprobs = N.
  bool logprobs = false;
  int top_logprobs = 0;
  // max_tokens / max_completion_tokens as given; unset = the endpoint's default (completions:
  // 16 as OpenAI's legacy API; chat: up to the context, as OpenAI and vLLM).
  std::optional<int64_t> max_tokens;

  // Chat and Responses: the messages (key order kept: templates print them with tojson), tools (null =
  // none), chat_template_kwargs (null = none) and add_generation_prompt.
  nlohmann::ordered_json messages;
  nlohmann::ordered_json tools;
  nlohmann::ordered_json template_kwargs;
  bool add_generation_prompt = true;

  // Sampling and tandem fields, logprobs, and for completions the prompt (prompt_text or
  // prompt_ids); max_tokens is left 0 for the caller to fill.
  v1::GenerateRequest generate;

  std::vector<std::string> ignored_fields;  // top-level keys not understood
  // Which sampling fields the request gave; the others take the model's (ApplyModelDefaults).
  bool temperature_given = false;
  bool top_p_given = false;
  bool top_k_given = false;
};

absl::StatusOr<OpenAiRequest> ParseCompletionRequest(std::string_view body);
absl::StatusOr<OpenAiRequest> ParseChatRequest(std::string_view body);

// The sampling fields `r` left out take what the model's generation_config.json recommends
// (ModelInfoResponse.default_*, as vLLM's --generation-config auto); without those, OpenAI's
// defaults stay (temperature 1, top_p 1, no top-k).
void ApplyModelDefaults(const v1::ModelInfoResponse& info, OpenAiRequest* r);

}  // namespace tandem::gateway
