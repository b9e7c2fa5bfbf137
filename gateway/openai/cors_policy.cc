#include "cors_policy.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

// scheme://host[:port] with nothing after (browsers send the Origin header exactly so).
bool IsOrigin(const std::string& s) {
  const size_t scheme_end = s.find("://");
  if (scheme_end == std::string::npos || scheme_end == 0) return false;
  const std::string scheme = s.substr(0, scheme_end);
  if (scheme != "http" && scheme != "https") return false;
  const std::string rest = s.substr(scheme_end + 3);
  return !rest.empty() && rest.find_first_of("/?#* ") == std::string::npos;
}

}  // namespace

absl::StatusOr<CorsPolicy> CorsPolicy::Parse(const std::vector<std::string>& origins) {
  CorsPolicy policy;
  for (const std::string& o : origins) {
    if (o.empty()) continue;
    if (o == "*") {
      policy.any_ = true;
    } else if (IsOrigin(o)) {
      policy.origins_.push_back(o);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cors_origins: '", o, "' is neither * nor an origin like https://app.example.com"));
    }
  }
  return policy;
}

bool CorsPolicy::Allows(const std::string& origin) const {
  if (origin.empty()) return false;
  return any_ || std::find(origins_.begin(), origins_.end(), origin) != origins_.end();
}

bool CorsPolicy::AnswerPreflight(const httplib::Request& req, httplib::Response& res) const {
  if (!enabled() || req.method != "OPTIONS" || !req.has_header("Origin") ||
      !req.has_header("Access-Control-Request-Method")) {
    return false;
  }
  if (!Allows(req.get_header_value("Origin"))) {
    res.status = 403;
    return true;
  }
  Decorate(req, res);
  res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
  const std::string asked = req.get_header_value("Access-Control-Request-Headers");
  res.set_header("Access-Control-Allow-Headers",
                 asked.empty() ? "Authorization, Content-Type" : asked);
  res.set_header("Access-Control-Max-Age", "600");
  res.status = 204;
  return true;
}

void CorsPolicy::Decorate(const httplib::Request& req, httplib::Response& res) const {
  const std::string origin = req.get_header_value("Origin");
  if (!enabled() || !Allows(origin)) return;
  if (any_) {
    res.set_header("Access-Control-Allow-Origin", "*");
  } else {
    res.set_header("Access-Control-Allow-Origin", origin);
    res.set_header("Vary", "Origin");
  }
}

}  // namespace tandem::gateway
