// NetnsCluster: CPU attention nodes (real tandem-cpu-attention processes) on this machine, each in
// its own network namespace behind its own veth pair, optionally with added latency on its path,
// so a GPU worker in the root namespace reaches them the way it reaches nodes on other hosts:
// over distinct IP addresses and links, through the kernel's network stack.
//
//   root namespace                          namespace tdm<pid>n<i>
//   tdm<pid>h<i>  B+4i+1/30  <── veth ──>  tdm<pid>v<i>  B+4i+2/30
//                                             tandem-cpu-attention on B+4i+2:port
//                                             (or, with the delay proxy, the node on
//                                              127.0.0.1 and tandem-delay-proxy on B+4i+2:port)
//
// B, the cluster's block, is a /25 of 198.18.0.0/15 (RFC 2544, reserved for network test benches),
// which holds 1024 such blocks of 32 nodes (one /30 each). A cluster claims one block for its life:
// it starts at block pid % 1024 and takes the first one that no other live cluster holds (an
// abstract unix socket bound per block is the claim, released by the kernel when the process dies)
// and that no address or route on this machine overlaps. Names carry the pid, so concurrent ctest
// processes never clash; Create() first removes tdm* namespaces, links and /tmp/tdm<pid>-* log
// folders left by processes that are gone (a crashed or SIGKILLed test), killing what still runs
// inside those namespaces.
//
// Latency: NodeSpec::latency_ms is the round-trip time added to the node's path, half in each
// direction. Mechanism kNetem: `tc qdisc ... netem delay` on both veth ends (egress each way).
// kProxy, where the kernel has no sch_netem: tandem-delay-proxy inside the namespace holds every
// chunk of every TCP connection for latency_ms / 2 in each direction (timestamped queue, see
// delay_proxy.cc). Either way it is real in-flight delay on every call, not a delay at connect.
//
// Lifetime: the destructor stops every process it started (SIGTERM, then SIGKILL after
// ClusterOptions::stop_timeout) and deletes its namespaces and links, also when a test assertion
// fails midway. Processes die with the thread that started them (PR_SET_PDEATHSIG): create the
// cluster and add nodes from the test's main thread.
//
// Not thread-safe: one thread uses a cluster.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::multihost {

class Subprocess;

enum class LatencyMechanism {
  kNone,   // no latency requested
  kNetem,  // tc netem on both veth ends
  kProxy,  // tandem-delay-proxy in the node's namespace
};
const char* LatencyMechanismName(LatencyMechanism mechanism);  // "none", "netem", "proxy"

// How latency is added. kAuto: netem where the kernel has it (probed once per cluster), else the
// proxy. kNetem: netem or AddNode fails. kProxy: always the proxy (tests the proxy on kernels
// that do have netem).
enum class LatencyPreference { kAuto, kNetem, kProxy };

struct ClusterOptions {
  LatencyPreference latency = LatencyPreference::kAuto;
  std::string node_binary;   // empty: the tandem-cpu-attention this test was built with
  std::string proxy_binary;  // empty: the tandem-delay-proxy this test was built with
  std::chrono::milliseconds start_timeout{30000};  // per process, until its LISTENING line
  std::chrono::milliseconds stop_timeout{5000};    // SIGTERM to SIGKILL in the destructor
};

struct NodeSpec {
  int latency_ms = 0;                    // added round trip on the node's path, 0..10000
  uint64_t pool_bytes = 64ull << 20;     // --pool_bytes
  unsigned threads = 1;                  // --threads
  unsigned executor_threads = 2;         // --executor_threads
  std::vector<std::string> extra_flags;  // appended to the node's command line, e.g.
                                         // "--drain_timeout_s=5"
};

class NetnsCluster {
 public:
  // FAILED_PRECONDITION when this machine cannot host a cluster (not root, `ip` missing, `ip
  // netns add` or veth creation refused): the message says why, and tests GTEST_SKIP on that code.
  // Any other error is a real failure (e.g. no free address block). ALREADY_EXISTS while another
  // cluster of this process lives (names carry only the pid: one cluster per process at a time).
  static absl::StatusOr<std::unique_ptr<NetnsCluster>> Create(ClusterOptions options = {});
  ~NetnsCluster();

  NetnsCluster(const NetnsCluster&) = delete;
  NetnsCluster& operator=(const NetnsCluster&) = delete;

  // Creates node i = size(): its namespace, veth pair, latency and process, and returns i once
  // its address accepts TCP connections from the root namespace. On error nothing of that node
  // is left behind and size() is unchanged. INVALID_ARGUMENT for a bad spec, RESOURCE_EXHAUSTED
  // past 32 nodes, FAILED_PRECONDITION when netem was required but is missing, UNAVAILABLE
  // (with the process log) when the node or proxy does not start.
  absl::StatusOr<size_t> AddNode(const NodeSpec& spec);

  size_t size() const { return nodes_.size(); }
  // "ip:port" of node i as the root namespace reaches it (through the proxy when there is one).
  // i < size() is a programmer invariant (aborts otherwise), as for every accessor below.
  const std::string& address(size_t i) const;
  std::vector<std::string> addresses() const;  // address(0..size()-1)
  LatencyMechanism latency_mechanism(size_t i) const;
  const std::string& netns(size_t i) const;    // the namespace name, for `ip netns exec`
  const std::string& host_ip(size_t i) const;  // the root namespace's end of the veth
  pid_t pid(size_t i) const;                   // the node process
  std::string log(size_t i) const;             // the node's stdout + stderr so far

  // SIGTERM to node i: the node drains (keeps serving open sessions, then exits; see
  // tandem-cpu-attention --drain_timeout_s). The namespace, link and proxy stay up.
  void Drain(size_t i);
  // SIGKILL to node i: a lost node. Its proxy (if any) keeps accepting and then cuts every
  // connection, as a host whose process died would reset them.
  void Kill(size_t i);
  // Node i's exit status (128 + signal for a signal death) once it has exited, DEADLINE_EXCEEDED
  // while it still runs after `timeout`. Repeatable.
  absl::StatusOr<int> WaitExit(size_t i, std::chrono::milliseconds timeout);
  bool running(size_t i);

  // Why netem was not used ("" when it worked or was not tried): tc's message, for test output.
  const std::string& netem_error() const { return netem_error_; }

 private:
  struct Node;
  explicit NetnsCluster(ClusterOptions options);
  absl::Status Claim();
  absl::Status StartNode(const NodeSpec& spec, Node* node);
  absl::StatusOr<LatencyMechanism> AddLatency(const NodeSpec& spec, const Node& node);
  void DestroyNode(Node* node);  // stops its processes, deletes its link and namespace

  ClusterOptions options_;
  pid_t pid_ = 0;
  uint32_t block_base_ = 0;  // first address of the claimed /25, host byte order
  int claim_fd_ = -1;        // the bound abstract socket that holds the block
  int netem_ = -1;           // -1 not probed, 0 missing, 1 works
  std::string netem_error_;
  std::string log_dir_;
  std::vector<std::unique_ptr<Node>> nodes_;
};

}  // namespace tandem::multihost
