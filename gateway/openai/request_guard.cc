#include "request_guard.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {

std::string FormBodyTooLargeMessage() {
  return absl::StrCat("the request body is over ",
                      CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH / 1024,
                      " KiB as application/x-www-form-urlencoded (curl's --data default); send "
                      "it with 'Content-Type: application/json'");
}

ApiError CheckBodyFraming(const httplib::Request& req, size_t max_body_bytes) {
  ApiError e;
  e.http_status = 0;
  e.type = "invalid_request_error";
  if (!req.has_header("Content-Length")) return e;
  if (req.get_header_value_count("Content-Length") != 1 || req.has_header("Transfer-Encoding")) {
    e.http_status = 400;
    e.message = "a request has one Content-Length and no Transfer-Encoding with it";
    return e;
  }
  const std::string value = req.get_header_value("Content-Length");
  uint64_t length = 0;
  const bool digits = !value.empty() && value.size() <= 20 &&
                      std::all_of(value.begin(), value.end(), absl::ascii_isdigit) &&
                      absl::SimpleAtoi(value, &length);
  if (!digits) {
    e.http_status = 400;
    e.message = absl::StrCat("Content-Length '", value.substr(0, 32),
                             "' is not a byte count (decimal digits)");
  } else if (length > CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH &&
             absl::StartsWith(req.get_header_value("Content-Type"),
                              "application/x-www-form-urlencoded")) {
    // curl's --data default: a JSON body sent as a form, which httplib caps.
    e.http_status = 413;
    e.message = FormBodyTooLargeMessage();
  } else if (length > max_body_bytes) {
    e.http_status = 413;
    e.message = absl::StrCat("the request body (Content-Length ", length, ") is over ",
                             max_body_bytes, " bytes (--max_body_bytes)");
  }
  return e;
}

bool ReadBodyWithin(const httplib::Request& req, const httplib::ContentReader& reader,
                    std::chrono::milliseconds timeout, std::string* body, ApiError* error) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (uint64_t length = 0; absl::SimpleAtoi(req.get_header_value("Content-Length"), &length)) {
    body->reserve(length);
  }
  bool late = false;
  const bool read = reader([&](const char* data, size_t size) {
    if (std::chrono::steady_clock::now() > deadline) {
      late = true;
      return false;
    }
    body->append(data, size);
    return true;
  });
  if (read && !late) return true;
  error->http_status = 408;
  error->type = "invalid_request_error";
  error->message =
      late ? absl::StrCat("the request body did not arrive within ", timeout.count() / 1000,
                          " s of its headers")
           : "the request body did not arrive whole (fewer bytes than Content-Length before the "
             "read timeout, or the connection closed)";
  return false;
}

void RefuseAndClose(const ApiError& error, httplib::Response& res) {
  res.status = error.http_status;
  res.set_header("Connection", "close");
  res.set_content(DumpJson(ErrorJson(error)), "application/json");
}

}  // namespace tandem::gateway
