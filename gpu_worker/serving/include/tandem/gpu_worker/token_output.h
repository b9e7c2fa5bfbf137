// TokenOutput: what becomes of a generation's logits row once its feed is in: the next token
// sampled (the request's temperature, top-k, top-p, its seeded generator), its log-probability
// and top candidates when asked (logprobs.h), its text (the stream decoder and the stop
// strings), the finish reason (EOS, stop, length, context, cancelled by the callback) and the
// token reported to the request's callback. The engine's sessions and KV never enter here.
//
// Not thread-safe: the engine's executor thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/generation.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {

class TokenOutput {
 public:
  // max_context: a sequence that reaches it finishes (FinishReason::kContext). `backend` and
  // `tokenizer` outlive this.
  TokenOutput(Backend& backend, const Tokenizer& tokenizer, int64_t vocab, int64_t max_context)
      : backend_(backend), tokenizer_(tokenizer), vocab_(vocab), max_context_(max_context) {}

  // Samples `g`'s next token from `logits` (device, [vocab]) and reports it: g.summary,
  // g.reason, the session's pending token; when it goes on, g.feed becomes that token.
  absl::Status Emit(Generation& g, const float* logits);

 private:
  // The sampled token's log-probability and the request's top candidates into `event`. NOTE:
  // copies the row to the host (vocab · 4 bytes, 512 KiB for a 128K vocabulary); only for
  // requests that ask for logprobs.
  absl::Status AddLogprobs(const Generation& g, const float* logits, TokenEvent* event);

  Backend& backend_;
  const Tokenizer& tokenizer_;
  int64_t vocab_;
  int64_t max_context_;
  std::vector<float> logits_host_;   // [vocab]: one row for AddLogprobs, reused
};

}  // namespace tandem::gpu_worker
