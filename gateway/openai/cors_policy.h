// CorsPolicy: which browser origins may call the gateway's API (CORS; private to the gateway's
// server). Off by default: browsers then allow only pages of the gateway's own origin, and any
// non-browser client is unaffected either way. With --cors_origins (exact origins such as
// https://app.example.com, or * for any), the gateway
//   - answers a browser's preflight (OPTIONS with Origin and Access-Control-Request-Method) with
//     204 and the methods and headers it may use, before the API-key check (browsers send no
//     Authorization header on a preflight);
//   - marks every response to an allowed origin with Access-Control-Allow-Origin (errors
//     included, so that the page can read them).
// Credentials (cookies) are never allowed: the API is keyed by the Authorization header.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include <httplib.h>

namespace tandem::gateway {

class CorsPolicy {
 public:
  CorsPolicy() = default;   // off
  // INVALID_ARGUMENT for an entry that is neither "*" nor a scheme://host[:port] origin.
  static absl::StatusOr<CorsPolicy> Parse(const std::vector<std::string>& origins);

  bool enabled() const { return any_ || !origins_.empty(); }
  // Answers `req` when it is a preflight (true: nothing else runs). An origin not allowed gets
  // 403 without CORS headers, so the browser refuses the call.
  bool AnswerPreflight(const httplib::Request& req, httplib::Response& res) const;
  // Adds the CORS headers to `res` when `req` comes from an allowed origin.
  void Decorate(const httplib::Request& req, httplib::Response& res) const;

 private:
  bool Allows(const std::string& origin) const;
  bool any_ = false;
  std::vector<std::string> origins_;
};

}  // namespace tandem::gateway
