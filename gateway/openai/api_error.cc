#include "tandem/gateway/api_error.h"

#include <utility>

#include "absl/strings/cord.h"

namespace tandem::gateway {
namespace {

constexpr absl::string_view kParamPayload = "type.tandem.dev/gateway.param";

}  // namespace

absl::Status WithParam(absl::Status status, absl::string_view param) {
  if (!status.ok() && !param.empty()) status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

absl::Status InvalidField(absl::string_view param, absl::string_view message) {
  return WithParam(absl::InvalidArgumentError(message), param);
}

std::string ParamOf(const absl::Status& status) {
  const auto param = status.GetPayload(kParamPayload);  // absl::optional<absl::Cord>
  return param.has_value() ? std::string(*param) : std::string();
}

ApiError FromStatus(const absl::Status& status) {
  ApiError e;
  e.message = std::string(status.message());
  e.param = ParamOf(status);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "not_found_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "resource_exhausted";
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable_error";
      e.code = "unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout_error";
      e.code = "deadline_exceeded";
      break;
    case absl::StatusCode::kCancelled:
      e.http_status = 499;
      e.type = "cancelled_error";
      break;
    case absl::StatusCode::kUnauthenticated:  // OpenAI's answer to a missing or bad API key
      e.http_status = 401;
      e.type = "invalid_request_error";
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:  // e.g. another principal's session
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kUnimplemented:
      e.http_status = 501;
      e.type = "not_implemented_error";
      break;
    default:
      e.http_status = 500;
      e.type = "internal_server_error";
      break;
  }
  if (e.message.empty()) e.message = absl::StatusCodeToString(status.code());
  return e;
}

nlohmann::json ErrorJson(const ApiError& error) {
  nlohmann::json body = {
      {"message", error.message}, {"type", error.type}, {"param", nullptr}, {"code", nullptr}};
  if (!error.param.empty()) body["param"] = error.param;
  if (!error.code.empty()) body["code"] = error.code;
  return {{"error", std::move(body)}};
}

}  // namespace tandem::gateway
