#include "tandem/gpu_worker/node_pool.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& name_and_port) {
  const size_t colon = name_and_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == name_and_port.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("node DNS name must be name:port, got '", name_and_port, "'"));
  }
  const std::string host = name_and_port.substr(0, colon);
  const std::string port = name_and_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.push_back(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip,
                sizeof(ip));
      out.push_back(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(result);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) return absl::UnavailableError(absl::StrCat("'", host, "' has no address"));
  return out;
}

absl::StatusOr<NodeTransport> ParseNodeTransport(const std::string& name) {
  if (name == "auto") return NodeTransport::kAuto;
  if (name == "shm") return NodeTransport::kShm;
  if (name == "grpc") return NodeTransport::kGrpc;
  return absl::InvalidArgumentError(
      absl::StrCat("transport must be auto, shm or grpc, got '", name, "'"));
}

const char* NodeTransportName(NodeTransport transport) {
  switch (transport) {
    case NodeTransport::kAuto:
      return "auto";
    case NodeTransport::kShm:
      return "shm";
    case NodeTransport::kGrpc:
      return "grpc";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<NodePool>> NodePool::Create(const NodePoolOptions& options) {
  auto pool = std::unique_ptr<NodePool>(new NodePool());
  pool->transport_ = options.transport;
  std::vector<std::string> addresses = options.addresses;
  if (!options.dns_name.empty()) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> resolved, ResolveAll(options.dns_name));
    addresses.insert(addresses.end(), resolved.begin(), resolved.end());
  }
  if (addresses.empty()) {
    cpu_attention::ServerOptions server_options;
    server_options.address = "";   // no port: in-process only
    server_options.node = options.embedded;
    server_options.max_message_bytes = options.max_message_bytes;
    TANDEM_ASSIGN_OR_RETURN(pool->embedded_,
                            cpu_attention::CpuAttentionServer::Start(server_options));
    Node node;
    node.address = "in-process";
    node.channel = pool->embedded_->InProcessChannel();
    node.stub = v1::CpuAttention::NewStub(node.channel);
    pool->nodes_.push_back(std::move(node));
    return pool;
  }
  for (const std::string& address : addresses) {
    if (address.empty() || address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU node address must be host:port, got '", address, "'"));
    }
    Node node;
    node.address = address;
    grpc::ChannelArguments args =
        cpu_attention::CpuAttentionChannelArguments(options.max_message_bytes);
    node.channel =
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    const auto deadline =
        std::chrono::system_clock::now() + std::chrono::milliseconds(options.connect_timeout_ms);
    if (!node.channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("CPU attention node ", address,
                                                 " is not reachable within ",
                                                 options.connect_timeout_ms, " ms"));
    }
    node.stub = v1::CpuAttention::NewStub(node.channel);
    pool->nodes_.push_back(std::move(node));
  }
  return pool;
}

}  // namespace tandem::gpu_worker
