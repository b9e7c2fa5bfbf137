#include "tandem/security/credentials.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::security {
namespace {

constexpr size_t kMaxPemBytes = 1 << 20;

}  // namespace

absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string reason =
        absl::StrCat(what, ": cannot read '", path, "': ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(reason) : absl::NotFoundError(reason);
  }
  std::string text(kMaxPemBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxPemBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", path, "' is larger than 1 MiB; not a PEM file"));
  }
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", path, "' holds no PEM block (-----BEGIN ...)"));
  }
  return text;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const TlsFiles& files, const std::string& flag_prefix) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "cert and ", flag_prefix,
                                                   "key go together (", flag_prefix,
                                                   "ca on top makes it mutual TLS)"));
  }
  grpc::SslServerCredentialsOptions options(
      files.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                       : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  TANDEM_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(files.cert, flag_prefix + "cert"));
  TANDEM_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(files.key, flag_prefix + "key"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.ca.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPemFile(files.ca, flag_prefix + "ca"));
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFiles(
    const TlsFiles& files, const std::string& bearer_token, const std::string& flag_prefix) {
  if (!files.enabled()) {
    if (!bearer_token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a bearer token needs TLS (give ", flag_prefix,
          "ca, the CA of the server's certificate): in plaintext it could be read and replayed"));
    }
    return grpc::InsecureChannelCredentials();
  }
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag_prefix, "cert and ", flag_prefix, "key go together"));
  }
  grpc::SslCredentialsOptions options;
  if (!files.ca.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPemFile(files.ca, flag_prefix + "ca"));
  }
  if (!files.cert.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.pem_cert_chain, ReadPemFile(files.cert, flag_prefix + "cert"));
    TANDEM_ASSIGN_OR_RETURN(options.pem_private_key, ReadPemFile(files.key, flag_prefix + "key"));
  }
  std::shared_ptr<grpc::ChannelCredentials> tls = grpc::SslCredentials(options);
  if (bearer_token.empty()) return tls;
  return grpc::CompositeChannelCredentials(tls, grpc::AccessTokenCredentials(bearer_token));
}

void SetTlsServerName(const std::string& name, grpc::ChannelArguments* args) {
  if (!name.empty()) args->SetSslTargetNameOverride(name);
}

}  // namespace tandem::security
