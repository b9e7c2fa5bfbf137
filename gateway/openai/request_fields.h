// Reading OpenAI request bodies field by field: the typed reader (Fields), the bounded body
// parse, and the fields every generation endpoint shares (ReadCommon: sampling, streaming,
// tandem's extras, refused options). Used by openai_request.cc and responses_request.cc.
// Private to tandem::gateway.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "tandem/gateway/api_error.h"
#include "tandem/gateway/openai_request.h"

namespace tandem::gateway::internal {

using Json = nlohmann::ordered_json;

// Largest max_tokens accepted here (the worker caps it again at its context).
inline constexpr int64_t kMaxTokensLimit = 1 << 20;
// The worker takes 256 bytes of salt; the gateway prefixes the API key's principal.
inline constexpr size_t kMaxCacheSaltBytes = 128;
// top_p 0 as the worker reads it: a mass no token falls below, so only the most probable one
// is kept (the sampler always keeps it).
inline constexpr float kSmallestTopP = 1e-30f;

// Reads typed fields of one JSON object, remembering which keys were read so the rest can be
// reported as ignored. A null value reads as absent.
class Fields {
 public:
  explicit Fields(const Json& object) : object_(object) {}

  const Json* Find(const std::string& key) {
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::StatusOr<std::optional<bool>> Bool(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<bool>();
    if (!v->is_boolean()) return InvalidField(key, absl::StrCat("'", key, "' must be a boolean"));
    return std::optional<bool>(v->get<bool>());
  }

  absl::StatusOr<std::optional<double>> Number(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<double>();
    if (!v->is_number()) return InvalidField(key, absl::StrCat("'", key, "' must be a number"));
    return std::optional<double>(v->get<double>());
  }

  // An integer (a float with an integral value, e.g. 16.0, is accepted as pydantic does).
  absl::StatusOr<std::optional<int64_t>> Int(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<int64_t>();
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return InvalidField(key, absl::StrCat("'", key, "' is out of range"));
      }
      return std::optional<int64_t>(v->get<int64_t>());
    }
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15) {
        return std::optional<int64_t>(static_cast<int64_t>(d));
      }
    }
    return InvalidField(key, absl::StrCat("'", key, "' must be an integer"));
  }

  absl::StatusOr<std::optional<std::string>> String(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return InvalidField(key, absl::StrCat("'", key, "' must be a string"));
    return std::optional<std::string>(v->get<std::string>());
  }

  std::vector<std::string> Unread() const {
    std::vector<std::string> keys;
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (!seen_.contains(it.key())) keys.push_back(it.key());
    }
    return keys;
  }

 private:
  const Json& object_;
  std::set<std::string> seen_;
};

// The body as a JSON object, parsed within bounded_json.h's limits.
absl::StatusOr<Json> ParseBody(std::string_view body);
// A list field over its bound: 400 naming it.
absl::Status CheckListSize(const std::string& field, size_t size, size_t limit);
// 400 "'<field>' <what> is not supported by tandem".
absl::Status Unsupported(const std::string& field, absl::string_view what);
// Fields every endpoint shares: sampling, streaming, tandem's extras, refused options.
absl::Status ReadCommon(Fields& f, OpenAiRequest* r);

}  // namespace tandem::gateway::internal
