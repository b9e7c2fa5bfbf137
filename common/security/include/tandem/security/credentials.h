// TLS and mutual TLS credentials read from PEM files, for tandem's gRPC servers (worker, CPU
// node) and clients (the worker's node channels, the gateway, the CLI).
//
// Server: a certificate chain and its key make the port TLS; a CA file on top makes it mutual
// TLS: every client must present a certificate signed by that CA (the handshake fails
// otherwise, before any RPC). No files: insecure credentials (plaintext; the default, meant for
// localhost and tests).
//
// Client: a CA file verifies the server against that CA (no CA: the system roots); a
// certificate and key are the client's own identity for a mutual-TLS server. A bearer token
// rides on TLS channels only (composite credentials: "authorization: Bearer <token>" on every
// call): a token sent in plaintext could be read and replayed.
//
// Errors: INVALID_ARGUMENT naming the flag for a half-given pair (cert without key, CA without
// cert on a server, a token without TLS), NOT_FOUND / PERMISSION_DENIED naming the file when it
// cannot be read, INVALID_ARGUMENT when a file holds no PEM block. Thread-safe (no state).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::security {

// Paths of PEM files; "" = not given.
struct TlsFiles {
  std::string cert;  // certificate chain, leaf first
  std::string key;   // private key of `cert`
  std::string ca;    // server: CA of client certificates (mTLS); client: CA of the server
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The whole file (bounded at 1 MiB: a PEM bundle is far smaller). `what` names the flag in
// messages.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what);

// Insecure credentials when no file is given; TLS with cert + key; mutual TLS with cert + key +
// ca (client certificates required and verified). `flag_prefix` ("--tls_" or "--node_tls_")
// names the flags in messages.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const TlsFiles& files, const std::string& flag_prefix = "--tls_");

// Client credentials: insecure when no file and no token; TLS otherwise (`files.ca` or the
// system roots verify the server; cert + key present the client's certificate). A non-empty
// `bearer_token` is sent on every call and needs TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFiles(
    const TlsFiles& files, const std::string& bearer_token = "",
    const std::string& flag_prefix = "--tls_");

// Sets the name the server's certificate is checked against (instead of the host of the
// target address), e.g. when nodes are dialled by IP but their certificate names a DNS name.
// "" leaves `args` as they are.
void SetTlsServerName(const std::string& name, grpc::ChannelArguments* args);

}  // namespace tandem::security
