// AnswerWriter: how one endpoint turns a worker's Generate stream into its HTTP answer, so the
// generation handler (generation_handler.h) runs every endpoint the same way: chat completions
// and completions (openai_response.h, MakeCompletionsWriter) and the Responses API
// (responses_answer.h, made by responses_handler.cc). Private to tandem::gateway.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "tandem/gateway/api_error.h"
#include "tandem/gateway/openai_request.h"
#include "tandem/gateway/openai_response.h"
#include "tandem/gateway/reasoning_parser.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::gateway {

class AnswerWriter {
 public:
  virtual ~AnswerWriter() = default;

  // Streamed answers: the SSE text to send first, for a prefill progress message, for one
  // token, after a successful generation (its end, e.g. the finish chunk, usage, [DONE]) and
  // after a failure once the stream has started (an error event and the end); "" = nothing.
  virtual std::string StreamStart() = 0;
  virtual std::string StreamProgress(const v1::PrefillProgress& progress) = 0;
  virtual std::string StreamToken(const v1::TokenDelta& delta, const TokenPiece& sampled) = 0;
  virtual std::string StreamFinish(const v1::GenerateFinal& final) = 0;
  virtual std::string StreamError(const ApiError& error) = 0;

  // Whole answers: each token, then the JSON body of a successful generation.
  virtual void Append(const v1::TokenDelta& delta, const TokenPiece& sampled) = 0;
  virtual std::string Whole(const v1::GenerateFinal& final) = 0;

  // Whether StreamToken and Append need each token's sampled piece (logprobs: one Detokenize
  // call per token); else they get an empty one.
  virtual bool wants_pieces() const = 0;
};

// Chat completions and completions: ResponseBuilder's chunks and aggregate, as `r` asked
// (include_usage, return_progress, logprobs); `reasoning` (chat only; nullopt = off): how the
// answer's thinking is split into reasoning_content.
std::unique_ptr<AnswerWriter> MakeCompletionsWriter(ResponseMeta meta, const OpenAiRequest& r,
                                                    std::optional<ReasoningMode> reasoning);

}  // namespace tandem::gateway
