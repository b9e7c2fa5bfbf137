#include "node_requests.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/tensor_codec.h"

namespace tandem::cpu_attention::internal {

using kv_store::KvDType;
using kv_store::Session;

absl::StatusOr<kv_store::KvDType> KvDTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return KvDType::kBf16;
    case v1::DTYPE_F32:
      return KvDType::kF32;
    case v1::DTYPE_F16:
      return absl::InvalidArgumentError(
          "kv_dtype DTYPE_F16 is not supported (oneDNN 2.6 has no fast f16 matmul); use BF16");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("kv_dtype ", v1::DType_Name(dtype), " is not a KV storage type"));
  }
}

v1::DType ProtoDType(KvDType dtype) {
  return dtype == KvDType::kBf16 ? v1::DTYPE_BF16 : v1::DTYPE_F32;
}

absl::Status CheckLayer(const Session& session, uint32_t layer) {
  if (layer >= session.geometry().num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range: session '",
                                                   session.id(), "' has ",
                                                   session.geometry().num_layers, " layers"));
  }
  return absl::OkStatus();
}

absl::Status CheckOpen(const Session& session) {
  if (session.closed()) {
    return absl::NotFoundError(absl::StrCat("session '", session.id(), "' was closed"));
  }
  return absl::OkStatus();
}

absl::Status Draining(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("node is draining: ", what, " refused"));
}


absl::StatusOr<std::vector<kv_store::ShardKey>> ShardKeys(
    const google::protobuf::RepeatedPtrField<v1::ShardId>& ids, absl::string_view what,
    const kv_store::Geometry& g) {
  const uint64_t max_shards = uint64_t{g.num_layers} * g.num_kv_heads;
  if (static_cast<uint64_t>(ids.size()) > max_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", ids.size(), " shards listed, the geometry has ", max_shards));
  }
  std::vector<kv_store::ShardKey> keys;
  keys.reserve(ids.size());
  for (const v1::ShardId& id : ids) keys.push_back({id.layer(), id.kv_head()});
  return keys;
}

absl::Status CheckBeta(float beta) {
  if (!std::isfinite(beta) || beta < 0) {
    return absl::InvalidArgumentError(absl::StrCat("beta must be finite and >= 0, got ", beta));
  }
  return absl::OkStatus();
}

absl::Status CheckQueryTokens(int64_t t, absl::string_view what, uint32_t max_tokens) {
  if (t < 1 || t > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": num_tokens ", t, " outside 1..", max_tokens));
  }
  return absl::OkStatus();
}

absl::Status DecodeQueries(const v1::Tensor& q, absl::string_view what, const Session& session,
                           uint32_t max_tokens, std::vector<float>* dst, uint32_t* num_tokens) {
  const auto& g = session.geometry();
  if (q.shape_size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected rank 3 [num_tokens, ", g.num_q_heads, ", ", g.head_dim,
                     "], got rank ", q.shape_size()));
  }
  const int64_t t = q.shape(0);
  TANDEM_RETURN_IF_ERROR(CheckQueryTokens(t, what, max_tokens));
  const int64_t shape[] = {t, g.num_q_heads, g.head_dim};
  TANDEM_RETURN_IF_ERROR(DecodeFloats(q, what, shape, /*require_finite=*/true, dst));
  *num_tokens = static_cast<uint32_t>(t);
  return absl::OkStatus();
}

absl::Status CopyQueries(std::span<const float> q, absl::string_view what, const Session& session,
                         uint32_t num_tokens, uint32_t max_tokens, std::vector<float>* dst) {
  const auto& g = session.geometry();
  TANDEM_RETURN_IF_ERROR(CheckQueryTokens(num_tokens, what, max_tokens));
  const size_t expected = size_t{num_tokens} * g.num_q_heads * g.head_dim;
  if (q.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", q.size(), " floats, expected [",
                                                   num_tokens, ", ", g.num_q_heads, ", ",
                                                   g.head_dim, "]"));
  }
  dst->assign(q.begin(), q.end());
  return CheckFinite(*dst, what);
}

absl::Status CheckAppendTokens(int64_t n) {
  if (n < 1 || n > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("k: expected shape [num_heads, num_tokens, head_dim] with num_tokens in "
                     "1..65536, got num_tokens ", n));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> PageTokensOf(const v1::OpenSessionRequest& request) {
  switch (request.selection()) {
    case v1::SELECTION_MAW:
      return 0u;
    case v1::SELECTION_PAGES:
      if (request.page_tokens() < 1 || request.page_tokens() > kMaxPageTokens) {
        return absl::InvalidArgumentError(absl::StrCat("page_tokens must be in 1..",
                                                       kMaxPageTokens, " for SELECTION_PAGES, got ",
                                                       request.page_tokens()));
      }
      return request.page_tokens();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("selection ", static_cast<int>(request.selection()), " is unknown"));
  }
}

}  // namespace tandem::cpu_attention::internal
