// Checks and decodes of the node's requests (private to cpu_attention; used by
// cpu_attention_node.cc): every size in a request is bounded here before memory is allocated,
// and every failure is INVALID_ARGUMENT (NOT_FOUND / UNAVAILABLE where said) with a message
// naming the field.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tandem/kv_store/kv_store.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::internal {

constexpr uint32_t kMaxPageTokens = 4096;   // OpenSessionRequest.page_tokens

absl::StatusOr<kv_store::KvDType> KvDTypeFromProto(v1::DType dtype);
v1::DType ProtoDType(kv_store::KvDType dtype);
absl::Status CheckLayer(const kv_store::Session& session, uint32_t layer);
// Call with the session's lock held: NOT_FOUND if it was closed after the caller found it.
absl::Status CheckOpen(const kv_store::Session& session);
// UNAVAILABLE: "node is draining: <what> refused".
absl::Status Draining(absl::string_view what);
// Reads a repeated ShardId field after bounding its size by the geometry.
absl::StatusOr<std::vector<kv_store::ShardKey>> ShardKeys(
    const google::protobuf::RepeatedPtrField<v1::ShardId>& ids, absl::string_view what,
    const kv_store::Geometry& g);
absl::Status CheckBeta(float beta);
absl::Status CheckQueryTokens(int64_t t, absl::string_view what, uint32_t max_tokens);
// Decodes q of shape [T, H_q, D] after checking T against the node's limit.
absl::Status DecodeQueries(const v1::Tensor& q, absl::string_view what,
                           const kv_store::Session& session, uint32_t max_tokens,
                           std::vector<float>* dst, uint32_t* num_tokens);
// The raw form of DecodeQueries: q is f32 [T, H_q, D], copied before it is checked for finite
// values (it may sit in memory another process writes).
absl::Status CopyQueries(std::span<const float> q, absl::string_view what,
                         const kv_store::Session& session, uint32_t num_tokens,
                         uint32_t max_tokens, std::vector<float>* dst);
absl::Status CheckAppendTokens(int64_t n);
// kv_store::SessionOptions::page_tokens of an OpenSession: 0 for SELECTION_MAW (page_tokens is
// ignored), page_tokens in 1..kMaxPageTokens for SELECTION_PAGES.
absl::StatusOr<uint32_t> PageTokensOf(const v1::OpenSessionRequest& request);

}  // namespace tandem::cpu_attention::internal
