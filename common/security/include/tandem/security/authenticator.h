// Who is calling: the principal a server's handlers key session ownership by, from the call's
// bearer token or its client certificate, and whether it may call at all.
//
// Rules, in order:
//  1. With a token table: the call must carry "authorization: Bearer <token>" with a listed
//     token, else UNAUTHENTICATED; the principal is the token's ("token:<name>").
//  2. Else, with a verified client certificate (mutual TLS): the principal is the certificate's
//     identity ("cert:<SAN or CN>", gRPC's peer identity: the subject alternative names when
//     present, else the common name; the first one).
//  3. Else: the one anonymous principal kAnonymous. This is the insecure mode: every caller is
//     the same principal, so session ownership separates nobody.
// With allowed peers (the CPU node's --allowed_peers): the client certificate must carry one of
// the listed identities (any of its SANs or its CN, compared exactly), else PERMISSION_DENIED
// (a call without a certificate too); the principal is then "cert:<that identity>".
//
// Health checks are not routed through this (grpc.health.v1 stays open: probes carry neither
// tokens nor certificates). Immutable after construction: thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "tandem/security/token_file.h"

namespace tandem::security {

inline constexpr char kAnonymous[] = "anonymous";

class Authenticator {
 public:
  // No tokens, no allowed peers: every call is kAnonymous (or its certificate's principal).
  Authenticator() = default;
  // `mutual_tls`: the server verifies client certificates (its --tls_ca is set).
  Authenticator(std::optional<TokenTable> tokens, std::set<std::string> allowed_peers,
                bool mutual_tls)
      : tokens_(std::move(tokens)),
        allowed_peers_(std::move(allowed_peers)),
        mutual_tls_(mutual_tls) {}

  // The caller's principal, UNAUTHENTICATED (missing or unknown token) or PERMISSION_DENIED (a
  // certificate identity not allowed).
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context) const;

  // True when callers can be told apart (tokens or client certificates); false: every caller
  // is kAnonymous.
  bool identifies_callers() const { return tokens_.has_value() || mutual_tls_; }

 private:
  std::optional<TokenTable> tokens_;
  std::set<std::string> allowed_peers_;
  bool mutual_tls_ = false;
};

// Splits "a,b,c" (the --allowed_peers flag) into identities; empty items are dropped.
std::set<std::string> ParsePeerList(const std::string& list);

}  // namespace tandem::security
