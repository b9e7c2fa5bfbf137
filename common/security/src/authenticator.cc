#include "tandem/security/authenticator.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tandem::security {
namespace {

// The bearer token of the call's "authorization" metadata, or "" (absent or another scheme).
std::string BearerToken(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  absl::string_view value(it->second.data(), it->second.size());
  // RFC 6750: the scheme is case-insensitive.
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return "";
  return std::string(absl::StripLeadingAsciiWhitespace(value.substr(7)));
}

}  // namespace

absl::StatusOr<std::string> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  const bool has_cert = auth != nullptr && auth->IsPeerAuthenticated();
  std::vector<std::string> identities;
  if (has_cert) {
    for (const grpc::string_ref& id : auth->GetPeerIdentity()) {
      identities.emplace_back(id.data(), id.size());
    }
  }
  if (!allowed_peers_.empty()) {
    for (const std::string& id : identities) {
      if (allowed_peers_.count(id) > 0) return absl::StrCat("cert:", id);
    }
    return absl::PermissionDeniedError(
        has_cert ? absl::StrCat("client certificate '", identities.empty() ? "" : identities[0],
                                "' is not in this node's --allowed_peers")
                 : "this node serves only the identities in --allowed_peers (mutual TLS); the "
                   "call carried no client certificate");
  }
  if (tokens_.has_value()) {
    const std::string token = BearerToken(context);
    if (token.empty()) {
      return absl::UnauthenticatedError(
          "missing bearer token: send metadata 'authorization: Bearer <token>'");
    }
    std::optional<std::string> principal = tokens_->Lookup(token);
    if (!principal.has_value()) return absl::UnauthenticatedError("unknown bearer token");
    return absl::StrCat("token:", *principal);
  }
  if (!identities.empty()) return absl::StrCat("cert:", identities[0]);
  return std::string(kAnonymous);
}

std::set<std::string> ParsePeerList(const std::string& list) {
  std::set<std::string> peers;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    peers.insert(std::string(absl::StripAsciiWhitespace(item)));
  }
  return peers;
}

}  // namespace tandem::security
