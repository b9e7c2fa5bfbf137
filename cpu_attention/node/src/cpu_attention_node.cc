#include "tandem/cpu_attention/cpu_attention_node.h"

#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <shared_mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "node_requests.h"
#include "session_leases.h"
#include "session_owners.h"
#include "shm_session_server.h"
#include "tandem/common/scan_rate.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/kernel_self_check.h"
#include "tandem/cpu_attention/paged_attention.h"
#include "tandem/cpu_attention/session_lease.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/kv_store/int8_rows.h"
#include "tandem/metrics/node_metrics.h"
#include "spdlog/spdlog.h"

namespace tandem::cpu_attention {
namespace {

using internal::KvDTypeFromProto;
using internal::ProtoDType;
using internal::CheckLayer;
using internal::Draining;
using internal::CheckBeta;
using internal::CheckAppendTokens;
using internal::PageTokensOf;
using kv_store::KvDType;
using kv_store::Session;

std::string RandomNodeId() {
  std::random_device device;
  const uint64_t id = (uint64_t{device()} << 32) ^ device();
  return absl::StrFormat("%016x", id);
}

}  // namespace

absl::StatusOr<KvDType> ParseNodeKvDType(absl::string_view name) {
  if (name == "bf16") return KvDType::kBf16;
  if (name == "int8") return KvDType::kInt8;
  return absl::InvalidArgumentError(absl::StrCat(
      "node_kv_dtype must be bf16 (store KV as the worker sends it) or int8 (8-bit rows with a "
      "per-row scale), got '", name, "'"));
}

absl::StatusOr<std::unique_ptr<CpuAttentionNode>> CpuAttentionNode::Create(
    const NodeOptions& options) {
  if (options.pool_bytes == 0) return absl::InvalidArgumentError("pool_bytes must be > 0");
  if (options.block_tokens < 16 || options.block_tokens > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tokens must be in 16..256, got ", options.block_tokens));
  }
  if (options.threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("threads ", options.threads, " > 4096"));
  }
  if (options.max_query_tokens == 0 || options.max_batch == 0 || options.max_sessions == 0) {
    return absl::InvalidArgumentError("max_query_tokens, max_batch, max_sessions must be > 0");
  }
  if (options.chunk_keys < 16 || options.chunk_keys > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_keys must be in 16..65536, got ", options.chunk_keys));
  }
  for (const auto& [name, value] : {std::pair{"tasks_per_thread", options.tasks_per_thread},
                                    {"dense_tasks_per_thread", options.dense_tasks_per_thread}}) {
    if (value < 1 || value > 64) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in 1..64, got ", value));
    }
  }
  if (options.prefetch_entries > PagedParams::kMaxPrefetchEntries) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch_entries must be in 0..",
                                                   PagedParams::kMaxPrefetchEntries, ", got ",
                                                   options.prefetch_entries));
  }
  if (options.pool_spin_us > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_spin_us must be in 0..100000, got ", options.pool_spin_us));
  }
  if (options.kv_dtype != KvDType::kBf16 && options.kv_dtype != KvDType::kInt8) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_dtype must be bf16 (as sent) or int8, got ",
                     kv_store::KvDTypeName(options.kv_dtype)));
  }
  {
    // Refuse to serve with kernels that do not work here (kernel_self_check.h).
    ThreadPool check_pool(1);
    TANDEM_RETURN_IF_ERROR(CheckAttentionKernels(check_pool));
  }
  return std::unique_ptr<CpuAttentionNode>(new CpuAttentionNode(options));
}

CpuAttentionNode::CpuAttentionNode(const NodeOptions& options)
    : options_(options),
      node_id_(RandomNodeId()),
      // Large appends quantise (int8) and fill their shards on the attention pool (pool_ exists
      // by the first Append).
      store_(kv_store::KvStore::Options{
          options.pool_bytes, options.block_tokens, options.max_sessions, options.huge_pages,
          [this](size_t n, const std::function<void(size_t)>& fn) { pool_.ParallelFor(n, fn); },
          options.warm_reserve_bytes}),
      releaser_(options.release_free_after.count() >= 0
                    ? std::make_unique<kv_store::FreeMemoryReleaser>(store_,
                                                                     options.release_free_after)
                    : nullptr),
      pool_(options.threads, std::chrono::microseconds(options.pool_spin_us)),
      owners_(std::make_unique<internal::SessionOwners>(options.max_sessions_per_principal)),
      leases_(std::make_unique<internal::SessionLeases>()) {
  lease_reaper_ = std::thread([this] { ReapLapsedLeases(); });
}

CpuAttentionNode::~CpuAttentionNode() {
  leases_->Stop();
  lease_reaper_.join();
  std::map<std::string, std::unique_ptr<ShmSessionServer>> servers;
  {
    std::lock_guard lock(shm_mu_);
    servers.swap(shm_servers_);
  }
  servers.clear();   // stops and joins every channel thread while the store is alive
}

absl::Status CpuAttentionNode::OpenSession(const v1::OpenSessionRequest& request,
                                           v1::OpenSessionResponse* response,
                                           const std::string& caller) {
  if (draining()) return Draining("a new session");
  if (!request.has_geometry()) return absl::InvalidArgumentError("geometry is required");
  kv_store::SessionOptions options;
  const v1::ModelGeometry& g = request.geometry();
  options.geometry = {g.num_layers(), g.num_q_heads(), g.num_kv_heads(), g.head_dim()};
  options.block_tokens = request.block_size();
  TANDEM_ASSIGN_OR_RETURN(options.dtype, KvDTypeFromProto(request.kv_dtype()));
  options.int8_storage = options_.kv_dtype == KvDType::kInt8;
  TANDEM_RETURN_IF_ERROR(CheckBeta(request.beta()));
  options.beta = request.beta();
  TANDEM_ASSIGN_OR_RETURN(options.page_tokens, PageTokensOf(request));
  // Bound the shard list by the geometry before copying it (the store checks each entry).
  const uint64_t max_shards = uint64_t{g.num_layers()} * g.num_kv_heads();
  if (static_cast<uint64_t>(request.shards_size()) > max_shards) {
    return absl::InvalidArgumentError(absl::StrCat(request.shards_size(),
                                                   " shards listed, the geometry has ",
                                                   max_shards));
  }
  for (const v1::ShardId& s : request.shards()) options.shards.push_back({s.layer(), s.kv_head()});
  if (request.has_fork_from()) {
    // Another principal's parent reads as an unknown one: fork_from is no oracle of ids.
    TANDEM_RETURN_IF_ERROR(
        owners_->Check(request.fork_from().parent_session_id(), caller, /*parent=*/true));
  }
  if (request.has_lease()) {
    TANDEM_RETURN_IF_ERROR(CheckSessionLease(request.lease()));
    TANDEM_ASSIGN_OR_RETURN(
        internal::SessionLeases::Renewal renewal,
        leases_->Renew(caller, request.lease(), internal::SessionLeases::Clock::now()));
    CloseExpired(renewal.superseded, "superseded by a newer incarnation of their holder");
  }

  // The session's bookkeeping is charged to the pool before it is allocated (the store bounds
  // the shard count; the charge bounds the bytes).
  // Capped at the store's 65536 shards per session: a larger request is refused there.
  const uint64_t shards = std::min<uint64_t>(
      request.shards_size() > 0 ? static_cast<uint64_t>(request.shards_size())
                                : uint64_t{g.num_layers()} * g.num_kv_heads(),
      65536);
  const uint64_t charge = internal::SessionMetadataBytes(g.num_layers(), shards);
  TANDEM_RETURN_IF_ERROR(owners_->Reserve(caller));
  if (absl::Status charged = Budget().Charge(charge); !charged.ok()) {
    owners_->Unreserve(caller);
    return absl::ResourceExhaustedError(
        absl::StrCat("session metadata (", shards, " shards): ", charged.message()));
  }
  absl::StatusOr<std::shared_ptr<Session>> opened =
      request.has_fork_from()
          ? store_.ForkSession(request.session_id(), std::move(options),
                               request.fork_from().parent_session_id(),
                               request.fork_from().prefix_tokens())
          : store_.OpenSession(request.session_id(), std::move(options));
  if (!opened.ok()) {
    Budget().Release(charge);
    owners_->Unreserve(caller);
    return opened.status();
  }
  owners_->Add(request.session_id(), caller, charge);
  std::shared_ptr<Session> session = *std::move(opened);
  if (request.has_lease()) {
    if (absl::Status attached = leases_->Attach(request.session_id(), caller, request.lease());
        !attached.ok()) {
      (void)CloseOpenSession(request.session_id());
      return attached;
    }
  }
  if (request.has_fork_from()) response->set_shared_entries(request.fork_from().prefix_tokens());
  response->set_block_size(session->format().block_tokens);
  response->set_bytes_per_block(session->format().block_bytes());
  response->set_free_bytes(store_.budget().free());
  response->set_transport(v1::TRANSPORT_GRPC);
  if (request.has_shm()) StartShm(session, request.shm(), response);
  return absl::OkStatus();
}

void CpuAttentionNode::StartShm(const std::shared_ptr<Session>& session,
                                const v1::ShmChannelSpec& spec,
                                v1::OpenSessionResponse* response) {
  if (!options_.allow_shm) {
    response->set_shm_declined("shared memory is disabled on this node");
    return;
  }
  ShmSessionGeometry geometry;
  const auto& g = session->geometry();
  geometry.num_q_heads = g.num_q_heads;
  geometry.head_dim = g.head_dim;
  geometry.group = g.group();
  geometry.kv_row_bytes = static_cast<uint32_t>(session->options().input_row_bytes());
  absl::StatusOr<std::unique_ptr<ShmSessionServer>> server = ShmSessionServer::Start(
      this, session->id(), std::move(geometry), spec.name(), spec.segment_bytes(), spec.nonce(),
      options_.shm_spin_us, &shm_requests_);
  if (!server.ok()) {
    response->set_shm_declined(std::string(server.status().message()));
    return;
  }
  std::lock_guard lock(shm_mu_);
  shm_servers_[session->id()] = std::move(*server);
  response->set_transport(v1::TRANSPORT_SHM);
}

struct CpuAttentionNode::AppendTarget {
  std::shared_ptr<Session> session;
  std::vector<uint32_t> heads;   // resolved: the listed heads, or every owned head of the layer
};

absl::StatusOr<CpuAttentionNode::AppendTarget> CpuAttentionNode::ResolveAppend(
    const std::string& session_id, uint32_t layer, std::span<const uint32_t> kv_heads) {
  AppendTarget target;
  TANDEM_ASSIGN_OR_RETURN(target.session, store_.Find(session_id));
  const Session& session = *target.session;
  TANDEM_RETURN_IF_ERROR(CheckLayer(session, layer));
  if (kv_heads.size() > session.geometry().num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(kv_heads.size(), " kv_heads listed, layer has ",
                                                   session.geometry().num_kv_heads));
  }
  target.heads.assign(kv_heads.begin(), kv_heads.end());
  if (target.heads.empty()) {
    // The owned set may change (ReshardSession); the store checks ownership again under the
    // exclusive lock when it appends.
    std::shared_lock lock(session.mutex());
    // Closed since Find: the session is gone (NOT_FOUND), not a session without heads.
    if (session.closed()) {
      return absl::NotFoundError(absl::StrCat("session '", session.id(), "' was closed"));
    }
    auto owned = session.owned_kv_heads(layer);
    target.heads.assign(owned.begin(), owned.end());
  }
  if (target.heads.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", session.id(), "' owns no kv head of layer ", layer));
  }
  return target;
}

absl::Status CpuAttentionNode::ApplyAppend(AppendTarget& target, uint32_t layer, const std::byte* k,
                                           const std::byte* v, const std::byte* maw_bytes,
                                           uint32_t n, uint32_t window_entries,
                                           std::span<const uint8_t> selected,
                                           v1::AppendKvResponse* totals) {
  // Copy MAW so the floats are aligned and cannot change between the store's check and use.
  std::vector<float> maw(target.heads.size() * static_cast<size_t>(n));
  std::memcpy(maw.data(), maw_bytes, maw.size() * sizeof(float));
  TANDEM_ASSIGN_OR_RETURN(kv_store::AppendStats stats,
                          store_.Append(*target.session, layer, target.heads, k, v, maw.data(), n,
                                        window_entries, selected));
  totals->set_messages(totals->messages() + 1);
  totals->set_entries_appended(totals->entries_appended() + stats.entries_appended);
  totals->set_entries_selected(totals->entries_selected() + stats.entries_selected);
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::AppendKv(const v1::AppendKvRequest& request,
                                        v1::AppendKvResponse* totals, const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(
      AppendTarget target,
      ResolveAppend(request.session_id(), request.layer(),
                    std::span<const uint32_t>(request.kv_heads().data(),
                                              static_cast<size_t>(request.kv_heads_size()))));
  const v1::Tensor& k = request.k();
  if (k.shape_size() != 3) {
    return absl::InvalidArgumentError(
        "k: expected shape [num_heads, num_tokens, head_dim] with num_tokens in 1..65536");
  }
  TANDEM_RETURN_IF_ERROR(CheckAppendTokens(k.shape(1)));
  const int64_t n = k.shape(1);
  const int64_t kv_shape[] = {static_cast<int64_t>(target.heads.size()), n,
                              target.session->geometry().head_dim};
  const int64_t maw_shape[] = {static_cast<int64_t>(target.heads.size()), n};
  const v1::DType dtype = ProtoDType(target.session->options().dtype);
  TANDEM_RETURN_IF_ERROR(CheckTensor(k, "k", dtype, kv_shape));
  TANDEM_RETURN_IF_ERROR(CheckTensor(request.v(), "v", dtype, kv_shape));
  TANDEM_RETURN_IF_ERROR(CheckTensor(request.maw(), "maw", v1::DTYPE_F32, maw_shape));
  const std::string& flags = request.selected();
  const uint64_t entries = target.heads.size() * static_cast<uint64_t>(n);
  if (!flags.empty() && flags.size() != entries) {
    return absl::InvalidArgumentError(absl::StrCat("selected: ", flags.size(),
                                                   " bytes, expected num_heads x num_tokens = ",
                                                   target.heads.size(), " x ", n, " = ", entries));
  }
  return ApplyAppend(
      target, request.layer(), reinterpret_cast<const std::byte*>(k.data().data()),
      reinterpret_cast<const std::byte*>(request.v().data().data()),
      reinterpret_cast<const std::byte*>(request.maw().data().data()), static_cast<uint32_t>(n),
      request.window_entries(),
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(flags.data()), flags.size()),
      totals);
}

absl::Status CpuAttentionNode::AppendKvRaw(const std::string& session_id, uint32_t layer,
                                           std::span<const uint32_t> kv_heads,
                                           std::span<const std::byte> k,
                                           std::span<const std::byte> v,
                                           std::span<const std::byte> maw, uint32_t n,
                                           uint32_t window_entries,
                                           v1::AppendKvResponse* totals) {
  TANDEM_ASSIGN_OR_RETURN(AppendTarget target, ResolveAppend(session_id, layer, kv_heads));
  TANDEM_RETURN_IF_ERROR(CheckAppendTokens(n));
  const uint64_t entries = uint64_t{n} * target.heads.size();
  const uint64_t kv_bytes = entries * target.session->options().input_row_bytes();
  if (k.size() != kv_bytes || v.size() != kv_bytes || maw.size() != entries * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k, v, maw: ", k.size(), ", ", v.size(), ", ", maw.size(), " bytes, expected ", kv_bytes,
        ", ", kv_bytes, ", ", entries * sizeof(float), " for ", target.heads.size(),
        " heads x ", n, " entries"));
  }
  return ApplyAppend(target, layer, k.data(), v.data(), maw.data(), n, window_entries, {}, totals);
}

absl::Status CpuAttentionNode::CloseSession(const v1::CloseSessionRequest& request,
                                            v1::CloseSessionResponse* response,
                                            const std::string& caller) {
  // Before anything is torn down: another principal must not stop the owner's shm channel.
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(uint64_t released, CloseOpenSession(request.session_id()));
  response->set_blocks_released(released);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CpuAttentionNode::CloseOpenSession(const std::string& id) {
  std::unique_ptr<ShmSessionServer> shm;   // joined outside the lock
  {
    std::lock_guard lock(shm_mu_);
    auto it = shm_servers_.find(id);
    if (it != shm_servers_.end()) {
      shm = std::move(it->second);
      shm_servers_.erase(it);
    }
  }
  shm.reset();
  TANDEM_ASSIGN_OR_RETURN(uint64_t released, store_.CloseSession(id));
  Budget().Release(owners_->Remove(id));
  leases_->Detach(id);
  return released;
}

absl::Status CpuAttentionNode::RenewLease(const v1::RenewLeaseRequest& request,
                                          v1::RenewLeaseResponse* response,
                                          const std::string& caller) {
  if (!request.has_lease()) return absl::InvalidArgumentError("lease is required");
  TANDEM_RETURN_IF_ERROR(CheckSessionLease(request.lease()));
  TANDEM_ASSIGN_OR_RETURN(
      internal::SessionLeases::Renewal renewal,
      leases_->Renew(caller, request.lease(), internal::SessionLeases::Clock::now()));
  CloseExpired(renewal.superseded, "superseded by a newer incarnation of their holder");
  response->set_sessions(renewal.sessions);
  response->set_lapsed_sessions(renewal.lapsed);
  response->set_superseded_sessions(static_cast<uint32_t>(renewal.superseded.size()));
  return absl::OkStatus();
}

void CpuAttentionNode::CloseExpired(const std::vector<std::string>& ids, const char* why) {
  if (ids.empty()) return;
  size_t closed = 0;
  for (const std::string& id : ids) {
    // NOT_FOUND: its owner closed it meanwhile.
    if (CloseOpenSession(id).ok()) ++closed;
  }
  sessions_expired_.fetch_add(closed, std::memory_order_relaxed);
  spdlog::info("closed {} session(s) {}", closed, why);
}

void CpuAttentionNode::ReapLapsedLeases() {
  for (;;) {
    const std::vector<std::string> lapsed = leases_->WaitLapsed();
    if (lapsed.empty()) return;   // stopped
    CloseExpired(lapsed, "whose lease lapsed (not renewed for 2 x its period)");
  }
}

v1::StatsResponse CpuAttentionNode::Stats() const {
  const kv_store::StoreStats s = store_.Stats();
  v1::StatsResponse r;
  r.set_capacity_bytes(s.capacity_bytes);
  r.set_used_bytes(s.used_bytes);
  r.set_block_bytes_in_use(s.block_bytes_in_use);
  r.set_stored_bytes(s.stored_bytes);
  r.set_selected_bytes(s.selected_bytes);
  r.set_resident_block_bytes(s.resident_block_bytes);
  r.set_blocks_in_use(s.blocks_in_use);
  r.set_sessions(s.sessions);
  r.set_threads(pool_.num_threads());
  r.set_attend_calls(attend_calls_.load(std::memory_order_relaxed));
  r.set_attend_in_flight(attend_in_flight_.load(std::memory_order_relaxed));
  r.set_shm_requests(shm_requests_.load(std::memory_order_relaxed));
  r.set_draining(draining());
  r.set_free_bytes(s.capacity_bytes - std::min(s.used_bytes, s.capacity_bytes));
  r.set_node_id(node_id_);
  r.set_kv_storage(kv_store::KvDTypeName(options_.kv_dtype));
  r.set_leases(static_cast<uint32_t>(leases_->leases()));
  r.set_sessions_expired(sessions_expired_.load(std::memory_order_relaxed));
  {
    std::lock_guard lock(shm_mu_);
    r.set_shm_channels(static_cast<uint32_t>(shm_servers_.size()));
  }
  std::lock_guard lock(scan_mu_);
  r.set_scan_bytes_per_second(scan_bytes_per_second_);
  return r;
}

uint64_t CpuAttentionNode::SessionMetadataBytes(uint64_t num_layers, uint64_t num_shards) {
  return internal::SessionMetadataBytes(num_layers, num_shards);
}

kv_store::MemoryBudget& CpuAttentionNode::Budget() {
  // KvStore exposes its budget read-only; the node is the one other party that charges it (for
  // session metadata), and the budget object itself is not const (atomics, thread-safe).
  return const_cast<kv_store::MemoryBudget&>(store_.budget());
}

void CpuAttentionNode::RecordScan(uint64_t bytes, double seconds) {
  // Only calls that scanned enough to time meaningfully update the rate the planner reads.
  if (bytes < kMinTimedScanBytes || seconds <= 0) return;
  const double rate = static_cast<double>(bytes) / seconds;
  std::lock_guard lock(scan_mu_);
  scan_bytes_per_second_ =
      scan_bytes_per_second_ == 0 ? rate : 0.8 * scan_bytes_per_second_ + 0.2 * rate;
}

}  // namespace tandem::cpu_attention
