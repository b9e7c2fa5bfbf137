#include "tandem/gateway/token_pieces.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <utility>

namespace tandem::gateway {

void TokenPieces::Put(int32_t id, TokenPiece piece) {
  if (pieces_.size() < max_entries_ || pieces_.contains(id)) pieces_[id] = std::move(piece);
}

TokenPiece TokenPieces::Sampled(const v1::TokenDelta& delta, v1::Generation::Stub& stub,
                                int timeout_ms) {
  {
    std::lock_guard lock(mu_);
    for (const v1::TokenLogprob& t : delta.top_logprobs()) {
      Put(t.token_id(), TokenPiece{t.text(), t.raw()});
    }
    auto it = pieces_.find(delta.token_id());
    if (it != pieces_.end()) return it->second;
  }
  v1::DetokenizeRequest request;
  request.add_token_ids(delta.token_id());
  v1::DetokenizeResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  if (!stub.Detokenize(&ctx, request, &response).ok())
    return TokenPiece{delta.text(), delta.text()};
  TokenPiece piece{response.text(), response.text()};
  std::lock_guard lock(mu_);
  Put(delta.token_id(), piece);
  return piece;
}

}  // namespace tandem::gateway
