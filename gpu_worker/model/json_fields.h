// Typed, exception-free access to fields of untrusted JSON (config.json, safetensors headers,
// index files). nlohmann::json throws on a mistyped get<>() and has undefined behaviour for
// operator[] on a missing key of a const object; these helpers check first and turn every
// problem into INVALID_ARGUMENT naming `where` (e.g. "config.json: hidden_size").
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::gpu_worker::internal {

// Parses `text`; INVALID_ARGUMENT naming `where` if it is not JSON or not an object.
inline absl::StatusOr<nlohmann::json> ParseJsonObject(std::string_view text,
                                                      absl::string_view where) {
  nlohmann::json value = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                               /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON"));
  }
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected a JSON object, found ", value.type_name()));
  }
  return value;
}

// The member `key` of object `obj`, or nullptr when it is absent or JSON null (transformers
// writes null for "not set", e.g. "head_dim": null).
inline const nlohmann::json* FindField(const nlohmann::json& obj, absl::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(std::string(key));
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline absl::Status TypeError(absl::string_view where, absl::string_view expected,
                              const nlohmann::json& found) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": expected ", expected, ", found ", found.type_name()));
}

// A JSON integer that fits int64_t (floats such as 384.0 are rejected: sizes are integers).
inline absl::StatusOr<int64_t> JsonToInt64(const nlohmann::json& value, absl::string_view where) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": integer ", u, " is out of range"));
    }
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return TypeError(where, "an integer", value);
}

// Any finite JSON number.
inline absl::StatusOr<double> JsonToDouble(const nlohmann::json& value, absl::string_view where) {
  if (!value.is_number()) return TypeError(where, "a number", value);
  const double d = value.get<double>();
  if (!std::isfinite(d)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": number is not finite"));
  }
  return d;
}

inline absl::StatusOr<std::string> JsonToString(const nlohmann::json& value,
                                                absl::string_view where) {
  if (!value.is_string()) return TypeError(where, "a string", value);
  return value.get<std::string>();
}

inline absl::StatusOr<bool> JsonToBool(const nlohmann::json& value, absl::string_view where) {
  if (!value.is_boolean()) return TypeError(where, "a boolean", value);
  return value.get<bool>();
}

}  // namespace tandem::gpu_worker::internal
