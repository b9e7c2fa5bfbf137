// The text and bytes of sampled tokens, for OpenAI logprobs (`token`, `bytes`). A TokenDelta's
// own text is what the token completes in the output (it may lag or be empty), not the token
// itself; the worker reports a token's exact bytes only for its top_logprobs candidates. So the
// gateway learns every candidate it sees, and asks a worker to Detokenize an id it has not seen
// (once per id: cached, at most `max_entries`, as the vocabulary is the same on every worker).
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "tandem/gateway/openai_response.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gateway {

class TokenPieces {
 public:
  explicit TokenPieces(size_t max_entries = 1 << 20) : max_entries_(max_entries) {}

  // The piece of delta.token_id(): from its top_logprobs when the id is there (exact bytes),
  // else the cache, else Detokenize([id]) through `stub` (bytes = the decoded UTF-8; on an RPC
  // failure, the delta's own text, not cached). Learns every candidate of `delta`.
  TokenPiece Sampled(const v1::TokenDelta& delta, v1::Generation::Stub& stub, int timeout_ms);

 private:
  void Put(int32_t id, TokenPiece piece);  // needs mu_

  const size_t max_entries_;
  std::mutex mu_;
  std::unordered_map<int32_t, TokenPiece> pieces_;  // guarded by mu_
};

}  // namespace tandem::gateway
