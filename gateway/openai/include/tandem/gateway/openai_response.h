// The JSON bodies of one OpenAI answer, built from a worker's Generate stream: streamed chunks
// ("chat.completion.chunk" / "text_completion" objects) and the non-streamed aggregate
// ("chat.completion" / "text_completion"), in OpenAI's shapes:
//   chat:        choices[0].delta {role, content} | message {role, content};
//                with a reasoning parser (reasoning_parser.h) the thinking is cut out of
//                content into delta.reasoning_content / message.reasoning_content (vLLM's
//                field); in the message an empty part is null (content stays "" when there
//                is no reasoning either), and a delta carries only its non-empty parts;
//                logprobs {content: [{token, logprob, bytes, top_logprobs: [...]}]}
//   completions: choices[0].text; logprobs {tokens, token_logprobs, top_logprobs, text_offset}
//   usage {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens,
//   degraded_steps}; with include_usage every chunk has "usage": null and the last chunk has
//   empty choices and the usage.
// tandem's extra, on the aggregate and on the stream's finish chunk:
//   "tandem": {degraded, degraded_steps, mode}: degraded is true when some decode step ran
//   without a CPU node's answer (node lost mid-request: that part of the KV was skipped, so the
//   text may differ from what exact attention gives); OpenAI's clients ignore the field, and a
//   client that must not accept a degraded answer checks it (or usage.degraded_steps).
// finish_reason: max_tokens -> "length", EOS and stop strings -> "stop", a full context ->
// "length" (the model could not go on). Log-probabilities of -inf become -9999.0 (JSON has no
// infinity; OpenAI and vLLM use the same floor).
//
// Not thread-safe: one builder per request.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "nlohmann/json.hpp"
#include "tandem/gateway/openai_request.h"
#include "tandem/gateway/reasoning_parser.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::gateway {

// A sampled token decoded alone: its text (U+FFFD for a partial UTF-8 character) and exact bytes.
struct TokenPiece {
  std::string text;
  std::string bytes;
};

struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;       // NewResponseId
  int64_t created = 0;  // Unix seconds
  std::string model;    // the served model name
};

// "cmpl-" / "chatcmpl-" + 24 random hex digits.
std::string NewResponseId(Endpoint endpoint);
// `digits` random lowercase hex digits (ids; not a secret).
std::string RandomHex(int digits);
// "length" / "stop"; "" for FINISH_REASON_CANCELLED / UNSPECIFIED (no OpenAI equivalent).
std::string FinishReasonName(v1::FinishReason reason);

class ResponseBuilder {
 public:
  // `logprobs` / `top_logprobs`: as the request asked (OpenAiRequest). `reasoning` (chat only;
  // nullopt = off): how the answer's thinking is split from its content.
  ResponseBuilder(ResponseMeta meta, bool logprobs, int top_logprobs, bool include_usage,
                  std::optional<ReasoningMode> reasoning = std::nullopt);

  // Streaming. Chat's first chunk: delta {role: "assistant", content: ""}.
  nlohmann::json RoleChunk() const;
  // One token's chunk; nullopt when it carries nothing (no text to tell and no logprobs). A
  // delta whose index was seen already (the worker's held-back text) adds text only. With a
  // reasoning parser the delta's text goes to reasoning_content and/or content, and text that
  // may be part of a tag waits for the next token.
  std::optional<nlohmann::json> TokenChunk(const v1::TokenDelta& delta, const TokenPiece& sampled);
  // After the last token, before FinishChunk: the text the reasoning parser still held back
  // (a partial tag that never completed); nullopt when there is none.
  std::optional<nlohmann::json> HeldBackChunk();
  // Empty delta / text with the finish_reason, and the "tandem" object.
  nlohmann::json FinishChunk(const v1::GenerateFinal& final) const;
  // include_usage: empty choices and the usage.
  nlohmann::json UsageChunk(const v1::GenerateFinal& final) const;
  // return_progress: llama.cpp's prompt_progress {total, cache, processed, time_ms}, no choices.
  nlohmann::json ProgressChunk(const v1::PrefillProgress& progress) const;

  // Non-streamed: accumulate each token, then the whole answer.
  void Append(const v1::TokenDelta& delta, const TokenPiece& sampled);
  nlohmann::json Aggregate(const v1::GenerateFinal& final) const;

  const ResponseMeta& meta() const { return meta_; }

 private:
  nlohmann::json Envelope(bool chunk) const;
  // Adds one token's log-probabilities to `logprobs` (the endpoint's shape; created when null).
  void AddLogprobs(const v1::TokenDelta& delta, const TokenPiece& sampled,
                   nlohmann::json* logprobs) const;

  // A chunk of the chat delta `delta` (logprobs and finish_reason null).
  nlohmann::json ChatChunk(nlohmann::json delta) const;

  ResponseMeta meta_;
  bool logprobs_;
  int top_logprobs_;
  bool include_usage_;
  int64_t last_index_ = -1;  // highest TokenDelta.index seen (a repeat only adds text)
  int64_t text_offset_ = 0;  // bytes of generated text before the next token (text_offset)
  std::string text_;         // Append: the text so far
  nlohmann::json aggregate_logprobs_;  // Append: the logprobs so far (null without)
  std::optional<ReasoningParser> reasoning_;  // streamed chat answers' splitter (null = off)
};

// The usage object of a finished generation.
nlohmann::json UsageJson(const v1::GenerateFinal& final);
// The "tandem" object of a finished generation: {degraded, degraded_steps, mode}.
nlohmann::json TandemJson(const v1::GenerateFinal& final);

}  // namespace tandem::gateway
