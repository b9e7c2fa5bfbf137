#include "tandem/gpu_worker/node_pool.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/session_lease.h"
#include "tandem/security/credentials.h"

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

NodePool::NodePool(const NodePoolOptions& options)
    : options_(options), transport_(options.transport) {}

NodePool::~NodePool() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (refresher_.joinable()) refresher_.join();
  if (prober_.joinable()) prober_.join();
  if (leaser_.joinable()) leaser_.join();
}

absl::StatusOr<std::unique_ptr<NodePool>> NodePool::Create(const NodePoolOptions& options) {
  if (options.refresh_ms < 0 || options.stats_deadline_ms <= 0 || options.connect_timeout_ms < 0 ||
      options.probe_ms < 0 || options.probe_deadline_ms <= 0 || options.lease_period_ms < 0) {
    return absl::InvalidArgumentError(
        "node pool: refresh_ms, stats_deadline_ms, connect_timeout_ms, probe_ms, "
        "probe_deadline_ms and lease_period_ms must be >= 0 (deadlines > 0)");
  }
  if (options.shm_fill_threads < 1 || options.shm_fill_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node pool: shm_fill_threads must be in 1..64, got ", options.shm_fill_threads));
  }
  // This process's lease, checked by the nodes' own rule before any node is called; remote
  // nodes only (the embedded one goes with the process).
  std::optional<v1::SessionLease> lease;
  if (!options.lease_holder.empty() && options.lease_period_ms > 0) {
    lease.emplace();
    lease->set_holder(options.lease_holder);
    lease->set_incarnation(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::system_clock::now().time_since_epoch())
            .count()));
    lease->set_period_ms(static_cast<uint32_t>(options.lease_period_ms));
    if (absl::Status valid = cpu_attention::CheckSessionLease(*lease); !valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("node pool: ", valid.message()));
    }
  }
  auto pool = std::unique_ptr<NodePool>(new NodePool(options));
  pool->shm_fill_threads_ = std::make_unique<cpu_attention::ThreadPool>(options.shm_fill_threads);
  const bool remote = options.discovery != nullptr || !options.addresses.empty() ||
                      !options.dns_name.empty();
  if (!remote) {
    cpu_attention::ServerOptions server_options;
    server_options.address = "";   // no port: in-process only
    server_options.node = options.embedded;
    server_options.max_message_bytes = options.max_message_bytes;
    TANDEM_ASSIGN_OR_RETURN(pool->embedded_,
                            cpu_attention::CpuAttentionServer::Start(server_options));
    auto node = std::make_unique<Node>();
    node->state.address = "in-process";
    node->channel = pool->embedded_->InProcessChannel();
    node->stub = v1::CpuAttention::NewStub(node->channel);
    pool->nodes_.push_back(std::move(node));
    (void)pool->Refresh();   // capacity and rate of the embedded node
    if (options.probe_ms > 0) {   // (a node that misses a deadline is out until it answers)
      NodePool* p = pool.get();
      pool->prober_ = std::thread([p] { p->ProbeLoop(); });
    }
    return pool;
  }
  absl::StatusOr<std::vector<std::string>> addresses = pool->Discover();
  if (!addresses.ok()) {
    // Kubernetes may start the worker before any node is ready: with periodic refresh an
    // unresolvable name is an empty pool for now, not a failure.
    if (options.refresh_ms == 0 || addresses.status().code() != absl::StatusCode::kUnavailable) {
      return addresses.status();
    }
    spdlog::warn("CPU nodes: {}; retrying every {} ms", std::string(addresses.status().message()),
                 options.refresh_ms);
    addresses = std::vector<std::string>{};
  }
  for (const std::string& address : *addresses) {
    size_t index;
    {
      std::lock_guard<std::mutex> lock(pool->mu_);
      index = pool->AddLocked(address);
    }
    const auto deadline =
        std::chrono::system_clock::now() + std::chrono::milliseconds(options.connect_timeout_ms);
    if (!pool->nodes_[index]->channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("CPU attention node ", address,
                                                 " is not reachable within ",
                                                 options.connect_timeout_ms, " ms"));
    }
  }
  (void)pool->Refresh();
  if (lease.has_value()) {
    pool->lease_ = std::move(lease);
    pool->RenewLeases();   // frees the sessions a previous process of this holder left
    NodePool* p = pool.get();
    pool->leaser_ = std::thread([p] { p->LeaseLoop(); });
  }
  if (options.refresh_ms > 0) {
    NodePool* p = pool.get();
    pool->refresher_ = std::thread([p] { p->RefreshLoop(); });
  }
  if (options.probe_ms > 0) {
    NodePool* p = pool.get();
    pool->prober_ = std::thread([p] { p->ProbeLoop(); });
  }
  return pool;
}

absl::StatusOr<std::vector<std::string>> NodePool::Discover() const {
  std::vector<std::string> addresses;
  if (options_.discovery) {
    TANDEM_ASSIGN_OR_RETURN(addresses, options_.discovery());
  } else {
    addresses = options_.addresses;
    if (!options_.dns_name.empty()) {
      TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> resolved, ResolveAll(options_.dns_name));
      addresses.insert(addresses.end(), resolved.begin(), resolved.end());
    }
  }
  for (const std::string& address : addresses) {
    const size_t colon = address.rfind(':');
    if (address.empty() || colon == std::string::npos || colon == 0 ||
        colon + 1 == address.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CPU node address must be host:port, got '", address, "'"));
    }
  }
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()), addresses.end());
  return addresses;
}

size_t NodePool::AddLocked(const std::string& address) {
  auto node = std::make_unique<Node>();
  node->state.address = address;
  node->state.reachable = false;   // until it answers Stats
  grpc::ChannelArguments args =
      cpu_attention::CpuAttentionChannelArguments(options_.max_message_bytes);
  // A node that restarts on its address must be reachable again within a probe or two: gRPC's
  // default reconnect backoff grows to 120 s.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  security::SetTlsServerName(options_.tls_server_name, &args);
  node->channel = grpc::CreateCustomChannel(
      address,
      options_.credentials != nullptr ? options_.credentials : grpc::InsecureChannelCredentials(),
      args);
  node->stub = v1::CpuAttention::NewStub(node->channel);
  nodes_.push_back(std::move(node));
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return nodes_.size() - 1;
}

absl::Status NodePool::Refresh() {
  std::lock_guard<std::mutex> refresh_lock(refresh_mu_);
  absl::Status discovery_status;
  if (embedded_ == nullptr) {
    absl::StatusOr<std::vector<std::string>> addresses = Discover();
    if (addresses.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const std::string& address : *addresses) {
        const bool known = std::any_of(nodes_.begin(), nodes_.end(), [&](const auto& n) {
          return n->state.address == address;
        });
        if (!known) {
          AddLocked(address);
          spdlog::info("CPU node {} joined", address);
        }
      }
      for (auto& node : nodes_) {
        const bool listed = std::binary_search(addresses->begin(), addresses->end(),
                                               node->state.address);
        if (listed != node->state.listed) {
          node->state.listed = listed;
          generation_.fetch_add(1, std::memory_order_acq_rel);
          spdlog::info("CPU node {} {}", node->state.address, listed ? "is listed again" : "left");
        }
      }
    } else {
      discovery_status = addresses.status();
    }
  }
  // Stats of every listed node, outside the lock (each call may take up to its deadline).
  const size_t count = size();
  for (size_t i = 0; i < count; ++i) {
    if (!state(i).listed) continue;
    v1::StatsResponse stats;
    grpc::Status s;
    AskStats(i, options_.stats_deadline_ms, &stats, &s);
  }
  NotifyAccepting();
  return discovery_status;
}

bool NodePool::AskStats(size_t i, int deadline_ms, v1::StatsResponse* stats,
                        grpc::Status* status) {
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = ++nodes_.at(i)->stats_asked;
    claims_.AskingStats(i);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  *status = stub(i).Stats(&ctx, v1::StatsRequest(), stats);
  std::lock_guard<std::mutex> lock(mu_);
  Node& node = *nodes_[i];
  // Stale: a later call's answer is in (the probe and Refresh asked at once), or a failure was
  // reported after this call was sent (ReportFailure).
  if (ticket <= node.stats_applied) return false;
  node.stats_applied = ticket;
  if (status->ok()) {
    if (!node.state.node_id.empty() && node.state.node_id != stats->node_id()) {
      claims_.Forget(i);
    } else if (ticket == node.stats_asked) {
      // (With a later call in flight, the charges it noted may be missing here: its answer
      // marks them seen.)
      claims_.SawStats(i);
    }
  }
  return ApplyStatsLocked(i, *status, *stats);
}

bool NodePool::ApplyStatsLocked(size_t i, const grpc::Status& s, const v1::StatsResponse& stats) {
  NodeState& st = nodes_[i]->state;
  const bool was_accepting = st.accepting();
  const bool was_refused = st.refused;
  st.reachable = s.ok();
  // Kept through a missed deadline (a dead host's probes may alternate), cleared by an answer.
  if (s.ok()) st.refused = false;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) st.refused = true;
  if (s.ok()) {
    if (!st.node_id.empty() && st.node_id != stats.node_id()) {
      spdlog::warn("CPU node {} restarted (id {} -> {}): its shards are lost", st.address,
                   st.node_id, stats.node_id());
    }
    st.node_id = stats.node_id();
    st.draining = stats.draining();
    st.capacity_bytes = stats.capacity_bytes();
    st.free_bytes = stats.capacity_bytes() > stats.used_bytes()
                        ? stats.capacity_bytes() - stats.used_bytes()
                        : 0;
    st.scan_bytes_per_second = stats.scan_bytes_per_second();
    st.threads = stats.threads();
    st.sessions = stats.sessions();
    st.int8_kv = stats.kv_storage() == "int8";
  }
  // A node that only missed a deadline and is now found refusing: its sessions look again.
  if (st.refused && !was_refused && !was_accepting) {
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (st.accepting() == was_accepting) return false;
  generation_.fetch_add(1, std::memory_order_acq_rel);
  spdlog::info("CPU node {} {} new shards", st.address,
               st.accepting() ? "accepts" : "no longer accepts");
  return true;
}

void NodePool::RefreshLoop() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.refresh_ms),
                            [this] { return stop_; })) {
    lock.unlock();
    const absl::Status s = Refresh();
    if (!s.ok()) spdlog::warn("CPU node discovery: {}", std::string(s.message()));
    lock.lock();
  }
}

size_t NodePool::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return nodes_.size();
}

v1::CpuAttention::Stub& NodePool::stub(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return *nodes_.at(i)->stub;
}

std::string NodePool::address(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return nodes_.at(i)->state.address;
}

NodeState NodePool::state(size_t i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return StateLocked(i, 0);
}

std::vector<NodeState> NodePool::Snapshot(uint64_t except_claim) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<NodeState> out;
  out.reserve(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) out.push_back(StateLocked(i, except_claim));
  return out;
}

NodeState NodePool::StateLocked(size_t i, uint64_t except_claim) const {
  NodeState st = nodes_.at(i)->state;
  st.claimed_bytes = claims_.Pending(i, except_claim);
  st.free_bytes = st.free_bytes > st.claimed_bytes ? st.free_bytes - st.claimed_bytes : 0;
  return st;
}

NodeClaim NodePool::Claim() {
  std::lock_guard<std::mutex> lock(mu_);
  return NodeClaim(this, claims_.Add());
}

NodeClaim::NodeClaim(NodeClaim&& other) noexcept : pool_(other.pool_), id_(other.id_) {
  other.pool_ = nullptr;
  other.id_ = 0;
}

NodeClaim& NodeClaim::operator=(NodeClaim&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = other.pool_;
    id_ = other.id_;
    other.pool_ = nullptr;
    other.id_ = 0;
  }
  return *this;
}

void NodeClaim::Set(size_t node, uint64_t projected_bytes, uint64_t charged_bytes) {
  if (pool_ == nullptr) return;
  std::lock_guard<std::mutex> lock(pool_->mu_);
  pool_->claims_.Set(id_, node, projected_bytes, charged_bytes);
}

void NodeClaim::Reset() {
  if (pool_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    pool_->claims_.Remove(id_);
  }
  pool_ = nullptr;
  id_ = 0;
}

size_t NodePool::accepting_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(),
                                           [](const auto& n) { return n->state.accepting(); }));
}

}  // namespace tandem::gpu_worker
