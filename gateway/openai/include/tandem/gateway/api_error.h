// Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the HTTP status
// OpenAI (and vLLM) use for each kind. The gateway's own checks and the workers' gRPC statuses
// both become an ApiError through FromStatus: INVALID_ARGUMENT (and OUT_OF_RANGE) -> 400
// invalid_request_error, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503,
// DEADLINE_EXCEEDED -> 504, CANCELLED -> 499 (nginx's "client closed request"; never seen by a
// client that is gone), UNIMPLEMENTED -> 501, anything else -> 500.
//
// The offending request field travels in the absl::Status as a payload (WithParam) so that
// `param` names it, as OpenAI's errors do.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

struct ApiError {
  int http_status = 500;
  std::string message;
  std::string type;   // "invalid_request_error", "not_found_error", ...
  std::string param;  // the request field at fault; "" = null
  std::string code;   // e.g. "model_not_found"; "" = null
};

// `status` with `param` (a request field name, e.g. "messages[2].content") attached.
absl::Status WithParam(absl::Status status, absl::string_view param);
// INVALID_ARGUMENT `message` naming `param`.
absl::Status InvalidField(absl::string_view param, absl::string_view message);
// The param attached by WithParam, or "".
std::string ParamOf(const absl::Status& status);

// `status` (not OK) -> the ApiError clients see.
ApiError FromStatus(const absl::Status& status);

// {"error": {...}}; param and code are null when empty.
nlohmann::json ErrorJson(const ApiError& error);

}  // namespace tandem::gateway
