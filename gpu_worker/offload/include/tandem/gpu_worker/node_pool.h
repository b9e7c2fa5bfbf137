// NodePool: the CPU attention nodes a GPU worker talks to, and what it knows about each.
//
// Nodes come from a list of host:port addresses, from a DNS name that resolves to several
// addresses (a Kubernetes headless Service), or, when neither is given, from one node running in
// this process (the embedded default, served over an in-process gRPC channel so the code path is
// the same as for remote nodes).
//
// Discovery is live: Refresh() re-reads the list / re-resolves the name and calls Stats on every
// node; with refresh_ms > 0 a thread does it periodically. A node that appears gets the next
// index (indices are stable for the pool's life: a node that leaves keeps its slot, so the
// placement tables of open sessions stay valid). A node is *accepting* new shards while it is
// listed, answers Stats and does not report draining; sessions move their shards off a node that
// stops accepting (RemoteKv::Maintain) and place new sessions on accepting nodes only.
// generation() changes whenever the set of nodes or one's accepting state changes.
//
// Membership (issue 14): a node whose call fails (a session reports it with ReportFailure) is
// out of placement at once (not reachable); a health watch probes such nodes with Stats every
// probe_ms and takes one back as soon as it answers (within probe_ms + its reconnect backoff,
// which is capped at 500 ms); the watch also asks nodes whose connection is not up, so a node
// that dies while no session calls it leaves placement (and readiness) within a probe. Sessions a failed node still held are closed there when it answers
// again with the same node id (DeferClose): a node that was only stopped or cut off frees them.
//
// Leases (issue 26; cpu_attention.proto "Leases"): with a lease_holder and lease_period_ms, every
// session RemoteKv opens on a remote node carries this process's lease (lease()), and a thread
// renews it on every listed node each lease_period_ms / 3, in parallel. The first renewal runs
// in Create, so a restarted worker frees what its previous process held at once; a worker that
// dies is freed by the nodes within 2 x lease_period_ms. The embedded node needs none.
//
// Claims (node_claims.h): every open session claims the bytes it will charge on each node by the
// end of its expected length; state() and Snapshot() report free_bytes less what the other
// sessions' claims will still charge beyond the node's last Stats, so sessions opened together
// are not placed against the same free bytes.
//
// Thread-safe: Refresh may run on its own thread while sessions use stubs and snapshots.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/gpu_worker/node_claims.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::gpu_worker {

// How RemoteKv carries a session's Attend and AppendKv to a node (control calls always use
// gRPC). kAuto: shared memory when the node maps the worker's segment (same host), else gRPC.
// kShm: shared memory or fail at OpenSession. kGrpc: gRPC only.
enum class NodeTransport { kAuto, kShm, kGrpc };
// "auto", "shm" or "grpc"; INVALID_ARGUMENT otherwise.
absl::StatusOr<NodeTransport> ParseNodeTransport(const std::string& name);
const char* NodeTransportName(NodeTransport transport);

// Returns the addresses ("host:port") the pool should hold now.
using NodeDiscovery = std::function<absl::StatusOr<std::vector<std::string>>()>;

struct NodePoolOptions {
  std::vector<std::string> addresses;   // "host:port" each
  std::string dns_name;                 // "name:port": every address the name resolves to
  cpu_attention::NodeOptions embedded;  // the in-process node, used when both are empty
  int max_message_bytes = 64 << 20;
  // Credentials of the channels to remote nodes (tandem/security/credentials.h: TLS with the
  // worker's own certificate for nodes that require mutual TLS); null = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Name the nodes' certificates are checked against instead of the dialled host (nodes found
  // by DNS are dialled by IP); "" = the host of each address.
  std::string tls_server_name;
  int connect_timeout_ms = 5000;        // Create waits this long for every listed node
  int stats_deadline_ms = 2000;         // deadline of the Stats calls of Refresh
  // Period of discovery + Stats (ms); 0 = only at Create and on explicit Refresh() calls.
  int refresh_ms = 0;
  NodeTransport transport = NodeTransport::kAuto;   // RemoteKv's default for these nodes
  // Health watch of nodes that failed a call (or sessions waiting to be closed on them): Stats
  // every probe_ms, each with probe_deadline_ms. 0 = no watch (nodes come back at Refresh).
  int probe_ms = 250;
  int probe_deadline_ms = 500;
  // Replaces the address list and the DNS name as the source of nodes (tests; other discovery
  // systems). Called at Create and on every Refresh.
  NodeDiscovery discovery;
  // The lease of this worker's sessions on remote nodes (see Leases above): the holder name,
  // the same across restarts (--worker_name), and the renewal period; "" or 0 = no lease
  // (sessions stay until closed).
  std::string lease_holder;
  int lease_period_ms = 0;
  // Threads that copy evicted KV into shared-memory append requests (ShmLink::Append), the
  // calling executor thread counted: one memcpy thread (~8-10 GB/s) bounded a settle's appends
  // to the node on the H200 host (BENCHMARKS "Settle slices"). 1..64.
  unsigned shm_fill_threads = 4;
};

// What the pool last learned about one node.
struct NodeState {
  std::string address;           // "in-process" for the embedded node
  bool listed = true;            // named by the last discovery
  bool reachable = true;         // answered the last Stats call
  // The pool's own Stats call (health watch, Refresh) got UNAVAILABLE (connection refused or
  // reset) and no answer since: its process is taken as gone with the sessions it held (they are
  // rebuilt elsewhere). A missed deadline keeps it; a failure a session reports never sets it.
  bool refused = false;
  bool draining = false;         // reported draining in Stats (e.g. SIGTERM on scale-down)
  std::string node_id;           // Stats.node_id: changes when the process restarts
  uint64_t capacity_bytes = 0;
  // Free in the last Stats less what this worker's open sessions will still charge beyond it
  // (claimed_bytes; the caller's own claim excepted where it names one).
  uint64_t free_bytes = 0;
  uint64_t claimed_bytes = 0;
  double scan_bytes_per_second = 0;   // the node's own moving average (0 = not measured yet)
  uint32_t threads = 0;          // Stats.threads: attention threads (0 = not known yet)
  uint32_t sessions = 0;
  bool int8_kv = false;          // Stats.kv_storage "int8": K/V rows of head_dim + 4 bytes
  bool accepting() const { return listed && reachable && !draining; }
};

class NodePool;

// One open session's claim on node memory (see "Claims"); withdrawn when destroyed or reset.
class NodeClaim {
 public:
  NodeClaim() = default;
  ~NodeClaim() { Reset(); }
  NodeClaim(NodeClaim&& other) noexcept;
  NodeClaim& operator=(NodeClaim&& other) noexcept;
  NodeClaim(const NodeClaim&) = delete;
  NodeClaim& operator=(const NodeClaim&) = delete;

  // The session will charge `projected_bytes` on node `node` by the end of its expected length
  // and has charged `charged_bytes` there so far.
  void Set(size_t node, uint64_t projected_bytes, uint64_t charged_bytes);
  void Reset();
  uint64_t id() const { return id_; }   // 0 = none

 private:
  friend class NodePool;
  NodeClaim(NodePool* pool, uint64_t id) : pool_(pool), id_(id) {}
  NodePool* pool_ = nullptr;
  uint64_t id_ = 0;
};

class NodePool {
 public:
  // UNAVAILABLE when a listed node cannot be reached within connect_timeout_ms or the DNS name
  // does not resolve (with refresh_ms > 0 an unresolvable name starts an empty pool that later
  // refreshes fill: Kubernetes may start the worker before its nodes); INVALID_ARGUMENT for
  // malformed addresses.
  static absl::StatusOr<std::unique_ptr<NodePool>> Create(const NodePoolOptions& options);
  ~NodePool();   // stops the refresh thread

  // Nodes ever known (listed now or not); indices are stable.
  size_t size() const;
  v1::CpuAttention::Stub& stub(size_t i) const;
  std::string address(size_t i) const;
  // Node i's state (every claim subtracted from free_bytes), and every node's with the claim
  // `except` (an id of NodeClaim, 0 = none) left out: a session re-planning itself.
  NodeState state(size_t i) const;
  std::vector<NodeState> Snapshot(uint64_t except_claim = 0) const;
  // A new, empty claim on node memory for one session (see "Claims").
  NodeClaim Claim();
  size_t accepting_count() const;
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Discovery, then Stats on every listed node. Adds new nodes (a node that cannot be reached is
  // added but not accepting until it answers) and marks unlisted ones. Returns the discovery
  // error, if any (the known nodes stay as they were).
  absl::Status Refresh();

  // A call to node i failed with `why`: it stops accepting until the health watch (or Refresh)
  // hears from it again. Thread-safe; cheap when it is already marked.
  void ReportFailure(size_t i, const absl::Status& why);
  // Closes `session_id` on node i once it answers again with node id `node_id` (a session left
  // behind on a node that failed; a restarted node lost it anyway). Thread-safe.
  void DeferClose(size_t i, const std::string& session_id, const std::string& node_id);
  // Calls `on_change(any_accepting)` now and whenever accepting_count() moves between 0 and
  // more (from the thread that saw the change; keep it short, never call back into the pool).
  // The pool holds it until destroyed or Unwatch. One watcher.
  void WatchAccepting(std::function<void(bool)> on_change);
  void UnwatchAccepting();
  // Sessions waiting to be closed on nodes that failed (DeferClose), all nodes together.
  size_t deferred_closes() const;

  // The in-process node, or nullptr when the nodes are remote.
  cpu_attention::CpuAttentionServer* embedded() const { return embedded_.get(); }
  NodeTransport transport() const { return transport_; }
  // The lease RemoteKv puts on the sessions it opens, or nullopt (no holder or period, or the
  // embedded node). Its incarnation is this pool's start time in microseconds since the epoch.
  std::optional<v1::SessionLease> lease() const { return lease_; }
  // NodePoolOptions::shm_fill_threads, for the sessions' shm links (ParallelFor may be called
  // from several threads: extra calls run on their callers).
  cpu_attention::ThreadPool& shm_fill_threads() const { return *shm_fill_threads_; }

 private:
  struct Node {
    NodeState state;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::CpuAttention::Stub> stub;
    // Stats calls sent (AskStats numbers them) and the latest one whose answer was stored: an
    // answer that lands after a later call's is stale and dropped.
    uint64_t stats_asked = 0;
    uint64_t stats_applied = 0;
  };
  explicit NodePool(const NodePoolOptions& options);
  absl::StatusOr<std::vector<std::string>> Discover() const;
  // Adds a node for `address` (not yet reachable-checked); returns its index. Needs mu_.
  size_t AddLocked(const std::string& address);
  void RefreshLoop();
  void ProbeLoop();
  // One pass of the health watch: Stats of unreachable nodes, deferred closes of reachable ones.
  void ProbeOnce();
  // Stores a Stats answer (or failure) into node i's state; returns whether accepting changed.
  // Needs mu_.
  bool ApplyStatsLocked(size_t i, const grpc::Status& s, const v1::StatsResponse& stats);
  // state of node i with the claims other than `except_claim` subtracted. Needs mu_.
  NodeState StateLocked(size_t i, uint64_t except_claim) const;
  // Sends Stats to node i and stores the answer unless an answer to a later call is already in
  // (claims' charges noted as seen by it; forgotten when the node restarted); returns whether
  // accepting changed. Takes mu_ around the bookkeeping, not the call.
  bool AskStats(size_t i, int deadline_ms, v1::StatsResponse* stats, grpc::Status* status);
  // Calls the accepting watcher if any_accepting changed since its last call.
  void NotifyAccepting();
  void LeaseLoop();
  // Renews the lease on every listed node at once and waits for the answers (each within
  // probe_deadline_ms); logs what the nodes say the worker lost.
  void RenewLeases();

  const NodePoolOptions options_;
  std::unique_ptr<cpu_attention::CpuAttentionServer> embedded_;
  NodeTransport transport_ = NodeTransport::kAuto;
  std::unique_ptr<cpu_attention::ThreadPool> shm_fill_threads_;

  mutable std::mutex mu_;
  // Nodes are never destroyed before the pool, so references to their stubs stay valid.
  std::vector<std::unique_ptr<Node>> nodes_;   // guarded by mu_ (the vector; see above)
  NodeClaims claims_;                          // guarded by mu_
  std::atomic<uint64_t> generation_{0};
  std::mutex refresh_mu_;   // one Refresh at a time

  struct PendingClose {
    size_t node;
    std::string session_id;
    std::string node_id;
  };
  std::vector<PendingClose> pending_closes_;   // guarded by mu_

  std::mutex watch_mu_;   // the watcher and its last value; never held while calling the pool
  std::function<void(bool)> on_accepting_;
  int last_accepting_ = -1;   // -1 = not told yet

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread refresher_;
  std::thread prober_;
  std::optional<v1::SessionLease> lease_;   // set by Create, then constant
  std::thread leaser_;

  friend class NodeClaim;
};

// Resolves "name:port" to "ip:port" strings (IPv6 as "[ip]:port"), sorted and deduplicated.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& name_and_port);

}  // namespace tandem::gpu_worker
