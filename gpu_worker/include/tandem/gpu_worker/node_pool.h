// NodePool: the CPU attention nodes a GPU worker talks to. They come from a list of host:port
// addresses, from a DNS name that resolves to several addresses (a Kubernetes headless Service),
// or, when neither is given, from one node running in this process (the embedded default, served
// over an in-process gRPC channel so the code path is the same as for remote nodes).
//
// Thread-safe after Create(): stubs may be used from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::gpu_worker {

// How RemoteKv carries a session's Attend and AppendKv to a node (control calls always use
// gRPC). kAuto: shared memory when the node maps the worker's segment (same host), else gRPC.
// kShm: shared memory or fail at OpenSession. kGrpc: gRPC only.
enum class NodeTransport { kAuto, kShm, kGrpc };
// "auto", "shm" or "grpc"; INVALID_ARGUMENT otherwise.
absl::StatusOr<NodeTransport> ParseNodeTransport(const std::string& name);
const char* NodeTransportName(NodeTransport transport);

struct NodePoolOptions {
  std::vector<std::string> addresses;   // "host:port" each
  std::string dns_name;                 // "name:port": every address the name resolves to
  cpu_attention::NodeOptions embedded;  // the in-process node, used when both are empty
  int max_message_bytes = 64 << 20;
  int connect_timeout_ms = 5000;        // Create waits this long for every remote node
  NodeTransport transport = NodeTransport::kAuto;   // RemoteKv's default for these nodes
};

class NodePool {
 public:
  // UNAVAILABLE when a remote node cannot be reached within connect_timeout_ms or the DNS name
  // does not resolve; INVALID_ARGUMENT for malformed addresses.
  static absl::StatusOr<std::unique_ptr<NodePool>> Create(const NodePoolOptions& options);

  size_t size() const { return nodes_.size(); }
  v1::CpuAttention::Stub& stub(size_t i) const { return *nodes_[i].stub; }
  const std::string& address(size_t i) const { return nodes_[i].address; }
  // The in-process node, or nullptr when the nodes are remote.
  cpu_attention::CpuAttentionServer* embedded() const { return embedded_.get(); }
  NodeTransport transport() const { return transport_; }

 private:
  struct Node {
    std::string address;   // "in-process" for the embedded node
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::CpuAttention::Stub> stub;
  };
  NodePool() = default;

  std::unique_ptr<cpu_attention::CpuAttentionServer> embedded_;
  std::vector<Node> nodes_;
  NodeTransport transport_ = NodeTransport::kAuto;
};

// Resolves "name:port" to "ip:port" strings (IPv6 as "[ip]:port"), sorted and deduplicated.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& name_and_port);

}  // namespace tandem::gpu_worker
