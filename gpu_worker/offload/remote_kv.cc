// RemoteKv's session lifecycle on the nodes (remote_kv.h): open on each node's transport (shm or
// gRPC), fork, reshard, close. Appends and the attend fan-out are in remote_kv_attend.cc,
// placement and migration in remote_kv_placement.cc, node loss in remote_kv_recovery.cc.
#include "tandem/gpu_worker/remote_kv.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "node_link.h"
#include "node_rpc.h"
#include "tandem/common/status_macros.h"
#include "spdlog/spdlog.h"

namespace tandem::gpu_worker {

absl::StatusOr<PlacementPolicy> ParsePlacementPolicy(const std::string& name) {
  if (name == "balanced") return PlacementPolicy::kBalanced;
  if (name == "uniform") return PlacementPolicy::kUniform;
  return absl::InvalidArgumentError(
      absl::StrCat("placement must be balanced or uniform, got '", name, "'"));
}

RemoteKv::RemoteKv(NodePool& pool, const RemoteKvOptions& options)
    : pool_(pool),
      options_(options),
      claim_(pool.Claim()),
      placement_(options.num_layers * options.num_kv_heads, -1),
      shard_selected_(placement_.size(), 0),
      shard_held_(placement_.size(), 0),
      expected_tokens_(std::max<int64_t>(0, options.expected_tokens)),
      last_selection_(options.num_layers),
      share_sum_(options.num_layers, 0.0),
      share_count_(options.num_layers, 0) {
  GrowNodeSlots();
}

void RemoteKv::GrowNodeSlots() {
  const size_t n = pool_.size();
  if (opened_.size() < n) {
    opened_.resize(n, false);
    lost_.resize(n, false);
    suspect_.resize(n, false);
    node_ids_.resize(n);
    shm_.resize(n);
    grpc_.resize(n);
    node_rate_.resize(n, 0.0);
  }
  if (node_int8_.size() < opened_.size()) {
    // Until a session opens there (OpenOn): what the pool last heard.
    const std::vector<NodeState> states = pool_.Snapshot();
    for (size_t i = node_int8_.size(); i < opened_.size(); ++i) {
      node_int8_.push_back(i < states.size() && states[i].int8_kv);
    }
  }
}

std::vector<uint32_t> RemoteKv::HeadsOf(size_t node, int64_t layer) const {
  std::vector<uint32_t> heads;
  for (int64_t h = 0; h < options_.num_kv_heads; ++h) {
    if (placement_[layer * options_.num_kv_heads + h] == static_cast<int>(node)) {
      heads.push_back(static_cast<uint32_t>(h));
    }
  }
  return heads;
}

size_t RemoteKv::ShardsOn(size_t node) const {
  size_t count = 0;
  for (size_t s = 0; s < placement_.size(); ++s) {
    if (placement_[s] == static_cast<int>(node)) ++count;
  }
  for (const auto& [shard, to] : migrating_) {
    if (to == node) ++count;
  }
  return count;
}

std::vector<size_t> RemoteKv::nodes_in_use() const {
  std::vector<size_t> out;
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (ShardsOn(n) > 0) out.push_back(n);
  }
  return out;
}

v1::OpenSessionRequest RemoteKv::OpenRequest(
    const std::vector<std::pair<uint32_t, uint32_t>>& shards) const {
  v1::OpenSessionRequest request;
  request.set_session_id(options_.session_id);
  auto* g = request.mutable_geometry();
  g->set_num_layers(options_.num_layers);
  g->set_num_q_heads(options_.num_q_heads);
  g->set_num_kv_heads(options_.num_kv_heads);
  g->set_head_dim(options_.head_dim);
  request.set_block_size(options_.block_tokens);
  request.set_kv_dtype(WireType(options_.kv_dtype));
  request.set_beta(options_.beta);
  if (options_.selection == SelectionRule::kPages) {
    request.set_selection(v1::SELECTION_PAGES);
    request.set_page_tokens(options_.page_tokens);
  }
  for (const auto& [layer, head] : shards) {
    auto* shard = request.add_shards();
    shard->set_layer(layer);
    shard->set_kv_head(head);
  }
  // Closed by the node when this process is gone (node_pool.h, "Leases").
  if (std::optional<v1::SessionLease> lease = pool_.lease()) *request.mutable_lease() = *lease;
  return request;
}

absl::StatusOr<std::unique_ptr<RemoteKv>> RemoteKv::Open(NodePool& pool,
                                                         const RemoteKvOptions& options) {
  // A node that fails its OpenSession leaves placement (OpenOn reports it): plan again over the
  // others, at most once per node.
  absl::StatusOr<std::unique_ptr<RemoteKv>> kv = OpenOnce(pool, options);
  if (absl::IsResourceExhausted(kv.status())) {
    // The pool's free bytes are as fresh as its last Stats: room freed since (sessions closed
    // to make room for this one) is seen after a refresh.
    (void)pool.Refresh();
    kv = OpenOnce(pool, options);
  }
  for (size_t attempt = 0; attempt < pool.size() && !kv.ok() && IsNodeFailure(kv.status()) &&
                           pool.accepting_count() > 0;
       ++attempt) {
    spdlog::warn("session {}: {}; placing it again on the other nodes", options.session_id,
                 std::string(kv.status().message()));
    kv = OpenOnce(pool, options);
  }
  return kv;
}

absl::StatusOr<std::unique_ptr<RemoteKv>> RemoteKv::OpenOnce(NodePool& pool,
                                                             const RemoteKvOptions& options) {
  if (options.kv_dtype != DType::kBF16 && options.kv_dtype != DType::kF32) {
    return absl::InvalidArgumentError("offloaded KV must be bf16 or f32");
  }
  if (options.num_layers <= 0 || options.num_kv_heads <= 0 || options.head_dim <= 0 ||
      options.num_q_heads % options.num_kv_heads != 0) {
    return absl::InvalidArgumentError("RemoteKv: bad geometry");
  }
  if (options.selection == SelectionRule::kPages &&
      (options.page_tokens < 1 || options.page_tokens > 4096)) {
    return absl::InvalidArgumentError(
        absl::StrCat("RemoteKv: page_tokens must be in 1..4096, got ", options.page_tokens));
  }
  if (pool.accepting_count() == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CPU attention node accepts sessions (", pool.size(), " known, none listed, ",
        "reachable and not draining)"));
  }
  auto kv = std::unique_ptr<RemoteKv>(new RemoteKv(pool, options));
  kv->transport_ = options.transport.value_or(pool.transport());
  kv->pool_generation_ = kv->synced_generation_ = pool.generation();
  // Plan before sending anything: a session that does not fit is refused untouched.
  const std::vector<PlacementNode> nodes = kv->PlannerNodes();
  const std::vector<PlacementShard> shards = kv->PlannerShards(kv->expected_tokens_);
  PlacementOptions po;
  po.time_budget = options.plan_budget;
  const auto t0 = Clock::now();
  absl::StatusOr<PlacementPlan> plan = options.placement == PlacementPolicy::kBalanced
                                           ? PlanBalanced(nodes, shards, po)
                                           : PlanUniform(nodes, shards);
  kv->counters_.last_plan_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("placing session ", options.session_id, " (",
                                     kv->expected_tokens_, " entries per shard): ",
                                     plan.status().message()));
  }
  TANDEM_RETURN_IF_ERROR(kv->CheckCapacity(nodes, shards, plan->node_of));
  kv->placement_ = plan->node_of;
  kv->UpdateClaim();   // before the first OpenOn: the next session plans against it
  kv->counters_.modelled_step_seconds = plan->step_seconds;
  for (size_t n = 0; n < kv->opened_.size(); ++n) {
    std::vector<std::pair<uint32_t, uint32_t>> mine;
    for (int64_t l = 0; l < options.num_layers; ++l) {
      for (uint32_t h : kv->HeadsOf(n, l)) mine.emplace_back(static_cast<uint32_t>(l), h);
    }
    if (mine.empty()) continue;
    v1::OpenSessionRequest request = kv->OpenRequest(mine);
    // On failure the destructor closes the sessions opened so far.
    TANDEM_RETURN_IF_ERROR(kv->OpenOn(n, kv->transport_, request));
  }
  kv->CreateMigrator();
  return kv;
}

void RemoteKv::CreateMigrator() {
  ShardMigratorOptions mo;
  mo.session_id = options_.session_id;
  mo.head_dim = options_.head_dim;
  mo.kv_dtype = options_.kv_dtype;
  mo.deadline_ms = options_.control_deadline_ms;
  mo.chunk_entries = options_.migration_chunk_entries;
  migrator_ = std::make_unique<ShardMigrator>(pool_, mo);
}

absl::StatusOr<std::unique_ptr<RemoteKv>> RemoteKv::Fork(const std::string& session_id,
                                                         int64_t expected_tokens) const {
  if (closed_ || attend_layer_ >= 0) {
    return absl::FailedPreconditionError("RemoteKv: fork of a closed session or mid-attend");
  }
  if (!migrating_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", options_.session_id, ": a shard migration is under way"));
  }
  for (int node : placement_) {
    if (node < 0 || lost_[node] || suspect_[node]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", options_.session_id, ": a node holding its shards is lost or suspect"));
    }
  }
  RemoteKvOptions options = options_;
  options.session_id = session_id;
  options.expected_tokens = std::max<int64_t>(expected_tokens, offloaded_tokens_);
  auto kv = std::unique_ptr<RemoteKv>(new RemoteKv(pool_, options));
  kv->transport_ = transport_;
  kv->pool_generation_ = pool_generation_;
  kv->synced_generation_ = synced_generation_;
  kv->placement_ = placement_;
  for (size_t n = 0; n < std::min(node_int8_.size(), kv->node_int8_.size()); ++n) {
    kv->node_int8_[n] = node_int8_[n];
  }
  kv->fork_prefix_tokens_ = offloaded_tokens_;
  kv->node_rate_ = node_rate_;
  kv->node_rate_.resize(kv->opened_.size(), 0.0);
  kv->shard_selected_ = shard_selected_;
  kv->shard_held_ = shard_held_;
  kv->counters_.modelled_step_seconds = counters_.modelled_step_seconds;
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n]) continue;
    std::vector<std::pair<uint32_t, uint32_t>> mine;
    for (int64_t l = 0; l < options.num_layers; ++l) {
      for (uint32_t h : HeadsOf(n, l)) mine.emplace_back(static_cast<uint32_t>(l), h);
    }
    if (mine.empty()) continue;
    v1::OpenSessionRequest request = kv->OpenRequest(mine);
    if (offloaded_tokens_ > 0) {
      v1::ForkFrom* from = request.mutable_fork_from();
      from->set_parent_session_id(options_.session_id);
      from->set_prefix_tokens(static_cast<uint64_t>(offloaded_tokens_));
    }
    // On failure the destructor closes the sessions opened so far.
    TANDEM_RETURN_IF_ERROR(kv->OpenOn(n, transport_, request));
  }
  kv->offloaded_tokens_ = offloaded_tokens_;
  kv->UpdateClaim();
  kv->CreateMigrator();
  return kv;
}

absl::Status RemoteKv::OpenOn(size_t n, NodeTransport transport,
                              v1::OpenSessionRequest& request) {
  std::unique_ptr<cpu_attention::ShmChannel> channel;
  if (transport != NodeTransport::kGrpc) {
    cpu_attention::ShmChannelOptions so;
    so.request_capacity = options_.shm_request_bytes;
    so.response_capacity = options_.shm_response_bytes;
    so.spin_us = options_.shm_spin_us;
    absl::StatusOr<std::unique_ptr<cpu_attention::ShmChannel>> created =
        cpu_attention::ShmChannel::Create(so);
    if (created.ok()) {
      channel = std::move(*created);
      auto* spec = request.mutable_shm();
      spec->set_name(channel->name());
      spec->set_segment_bytes(channel->segment_bytes());
      spec->set_nonce(channel->nonce());
    } else if (transport == NodeTransport::kShm) {
      return NodeError(pool_.address(n), "creating the shm channel", created.status());
    }
  }
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.control_deadline_ms);
  v1::OpenSessionResponse response;
  const grpc::Status s = pool_.stub(n).OpenSession(&ctx, request, &response);
  if (channel != nullptr) channel->Unlink();   // the node has mapped it, or never will
  if (!s.ok()) {
    const absl::Status error = NodeError(pool_.address(n), "OpenSession", s);
    if (IsNodeFailure(error)) pool_.ReportFailure(n, error);
    return error;
  }
  opened_[n] = true;
  lost_[n] = suspect_[n] = false;
  const NodeState state = pool_.state(n);
  node_ids_[n] = state.node_id;
  node_int8_[n] = state.int8_kv;
  if (channel != nullptr && response.transport() == v1::TRANSPORT_SHM) {
    shm_[n] = std::make_unique<ShmLink>(std::move(channel), pool_.address(n), Session(),
                                        pool_.shm_fill_threads());
  } else if (transport == NodeTransport::kShm) {
    return absl::FailedPreconditionError(
        absl::StrCat("CPU node ", pool_.address(n), " declined shared memory: ",
                     response.shm_declined().empty() ? "it does not support it"
                                                     : response.shm_declined()));
  }
  return absl::OkStatus();
}

size_t RemoteKv::shm_nodes() const {
  return static_cast<size_t>(
      std::count_if(shm_.begin(), shm_.end(), [](const auto& c) { return c != nullptr; }));
}

RemoteKv::~RemoteKv() { (void)Close(); }

LinkSession RemoteKv::Session() const {
  LinkSession s;
  s.session_id = options_.session_id;
  s.num_q_heads = options_.num_q_heads;
  s.num_kv_heads = options_.num_kv_heads;
  s.head_dim = options_.head_dim;
  s.kv_dtype = options_.kv_dtype;
  s.attend_deadline_ms = options_.attend_deadline_ms;
  s.control_deadline_ms = options_.control_deadline_ms;
  s.shm_append_chunk_bytes = options_.shm_append_chunk_bytes;
  return s;
}

absl::Status RemoteKv::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (attend_layer_ >= 0) {   // never leave a completion pointing at a link
    for (const std::unique_ptr<GrpcLink>& link : grpc_) {
      if (link != nullptr) link->Join();
    }
  }
  migrator_.reset();   // stops the copy in progress; the targets' sessions close below
  UpdateClaim();       // withdrawn
  absl::Status first_error;
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (absl::Status s = CloseOn(n); !s.ok() && first_error.ok()) first_error = s;
  }
  return first_error;
}

absl::Status RemoteKv::Reshard(size_t node, const std::vector<size_t>& add,
                               const std::vector<size_t>& drop) {
  v1::ReshardSessionRequest request;
  request.set_session_id(options_.session_id);
  for (auto [list, shards] : {std::pair{request.mutable_add(), &add},
                              std::pair{request.mutable_drop(), &drop}}) {
    for (size_t s : *shards) {
      auto* id = list->Add();
      id->set_layer(static_cast<uint32_t>(s / options_.num_kv_heads));
      id->set_kv_head(static_cast<uint32_t>(s % options_.num_kv_heads));
    }
  }
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.control_deadline_ms);
  v1::ReshardSessionResponse response;
  const grpc::Status s = pool_.stub(node).ReshardSession(&ctx, request, &response);
  if (!s.ok()) return NodeError(pool_.address(node), "ReshardSession", s);
  return absl::OkStatus();
}

absl::Status RemoteKv::CloseOn(size_t node) {
  if (!opened_[node]) return absl::OkStatus();
  if (suspect_[node]) {   // it may not answer for a while: closed once it does
    pool_.DeferClose(node, options_.session_id, node_ids_[node]);
    opened_[node] = false;
    shm_[node].reset();
    return absl::OkStatus();
  }
  // CloseSession stops the node's channel thread before the worker unmaps its side.
  v1::CloseSessionRequest request;
  request.set_session_id(options_.session_id);
  grpc::ClientContext ctx;
  // Freeing a session is quick on a healthy node; a node that does not answer within the attend
  // deadline (stopped, overloaded) frees it later (DeferClose): the executor does not wait.
  SetDeadline(ctx,
              std::min(options_.control_deadline_ms, std::max(options_.attend_deadline_ms, 50)));
  v1::CloseSessionResponse response;
  const grpc::Status s = pool_.stub(node).CloseSession(&ctx, request, &response);
  opened_[node] = false;
  shm_[node].reset();
  if (!s.ok()) {
    const absl::Status error = NodeError(pool_.address(node), "CloseSession", s);
    // A node that is gone or stopped frees the session when it answers again.
    if (IsNodeFailure(error)) {
      pool_.ReportFailure(node, error);
      pool_.DeferClose(node, options_.session_id, node_ids_[node]);
    }
    return error;
  }
  return absl::OkStatus();
}

void RemoteKv::CloseEmptyOn(size_t node) {
  if (absl::Status s = CloseOn(node); !s.ok()) {
    spdlog::warn("session {}: {}", options_.session_id, std::string(s.message()));
  }
}

}  // namespace tandem::gpu_worker
