#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/kernel_self_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <shared_mutex>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "node_requests.h"
#include "paged_plan.h"
#include "session_leases.h"
#include "session_owners.h"
#include "shm_session_server.h"
#include "tandem/common/scan_rate.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/salience.h"
#include "tandem/cpu_attention/session_lease.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/kv_store/int8_rows.h"
#include "tandem/metrics/node_metrics.h"
#include "spdlog/spdlog.h"

namespace tandem::cpu_attention {
namespace {

using internal::KvDTypeFromProto;
using internal::ProtoDType;
using internal::CheckLayer;
using internal::CheckOpen;
using internal::Draining;
using internal::ShardKeys;
using internal::CheckBeta;
using internal::DecodeQueries;
using internal::CopyQueries;
using internal::CheckAppendTokens;
using internal::PageTokensOf;
using kv_store::KvDType;
using kv_store::Session;
using kv_store::Shard;

std::string RandomNodeId() {
  std::random_device device;
  const uint64_t id = (uint64_t{device()} << 32) ^ device();
  return absl::StrFormat("%016x", id);
}

AttentionParams ParamsFor(const Session& session, uint32_t num_tokens, const NodeOptions& options) {
  AttentionParams p;
  p.dtype = session.format().dtype;
  p.head_dim = session.geometry().head_dim;
  p.group = session.geometry().group();
  p.num_tokens = num_tokens;
  p.q_token_stride = size_t{session.geometry().num_q_heads} * p.head_dim;
  p.chunk_keys = options.chunk_keys;
  p.tasks_per_thread = options.tasks_per_thread;
  return p;
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
  if (options.tasks_per_thread < 1 || options.tasks_per_thread > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("tasks_per_thread must be in 1..64, got ", options.tasks_per_thread));
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
          [this](size_t n, const std::function<void(size_t)>& fn) { pool_.ParallelFor(n, fn); }}),
      releaser_(options.release_free_after.count() >= 0
                    ? std::make_unique<kv_store::FreeMemoryReleaser>(store_,
                                                                     options.release_free_after)
                    : nullptr),
      pool_(options.threads, std::chrono::microseconds(options.pool_spin_us)),
      owners_(std::make_unique<internal::SessionOwners>(options.max_sessions_per_principal)),
      leases_(std::make_unique<internal::SessionLeases>()) {
  lease_reaper_ = std::thread([this] { ReapLapsedLeases(); });
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

struct CpuAttentionNode::AttendItem {
  std::shared_ptr<Session> session;
  std::vector<float> q;  // [T, H_q, D]
  uint32_t num_tokens = 0;
  // Pages sessions: [T, H_kv, pages_per_head] page ids; pages_per_head 0 = every held entry.
  std::vector<int32_t> pages;
  uint32_t pages_per_head = 0;
};

absl::Status CpuAttentionNode::Attend(const v1::AttendRequest& request,
                                      v1::AttendResponse* response, const std::string& caller) {
  const int batch = request.queries_size();
  if (batch < 1 || static_cast<uint32_t>(batch) > options_.max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: ", batch, " items, expected 1..", options_.max_batch));
  }
  // Resolve and validate every query before computing anything.
  std::vector<AttendItem> items(batch);
  std::set<std::string> seen;
  for (int i = 0; i < batch; ++i) {
    const v1::AttendQuery& query = request.queries(i);
    if (!seen.insert(query.session_id()).second) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "]: session '",
                                                     query.session_id(),
                                                     "' appears more than once"));
    }
    TANDEM_RETURN_IF_ERROR(owners_->Check(query.session_id(), caller));
    TANDEM_ASSIGN_OR_RETURN(items[i].session, store_.Find(query.session_id()));
    TANDEM_RETURN_IF_ERROR(CheckLayer(*items[i].session, request.layer()));
    TANDEM_RETURN_IF_ERROR(DecodeQueries(query.q(), absl::StrCat("queries[", i, "].q"),
                                         *items[i].session, options_.max_query_tokens,
                                         &items[i].q, &items[i].num_tokens));
    TANDEM_RETURN_IF_ERROR(internal::CopyPages(
        *items[i].session, items[i].num_tokens,
        std::span<const int32_t>(query.pages().data(), static_cast<size_t>(query.pages_size())),
        query.pages_per_head(), absl::StrCat("queries[", i, "]"), &items[i].pages));
    items[i].pages_per_head = query.pages_per_head();
  }
  uint64_t compute_micros = 0, bytes_scanned = 0;
  TANDEM_RETURN_IF_ERROR(AttendItems(
      request.layer(), items,
      [response](size_t, const Session& session, uint32_t num_tokens,
                 std::span<const HeadCount> heads) -> absl::StatusOr<AttendTarget> {
        const auto& g = session.geometry();
        const int64_t rows_per_token = static_cast<int64_t>(heads.size()) * g.group();
        v1::AttendResult* result = response->add_results();
        result->set_session_id(session.id());
        for (const HeadCount& h : heads) {
          result->add_kv_heads(h.kv_head);
          result->add_selected(h.selected);
          result->add_held(h.held);
        }
        const int64_t o_shape[] = {num_tokens, rows_per_token, g.head_dim};
        const int64_t lse_shape[] = {num_tokens, rows_per_token};
        return AttendTarget{InitF32(result->mutable_o(), o_shape),
                            InitF32(result->mutable_lse(), lse_shape)};
      },
      &compute_micros, &bytes_scanned));
  response->set_compute_micros(compute_micros);
  response->set_bytes_scanned(bytes_scanned);
  if (options_.metrics != nullptr) options_.metrics->attends_grpc->Increment(batch);
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::AttendRaw(const std::string& session_id, uint32_t layer,
                                         std::span<const float> q, uint32_t num_tokens,
                                         RawAttendOutput* out, std::span<const int32_t> pages,
                                         uint32_t pages_per_head) {
  return AttendRaw(
      session_id, layer, q, num_tokens,
      [out](size_t) -> absl::StatusOr<RawAttendOutput*> { return out; }, pages, pages_per_head);
}

absl::Status CpuAttentionNode::AttendRaw(const std::string& session_id, uint32_t layer,
                                         std::span<const float> q, uint32_t num_tokens,
                                         RawOutputFor output_for, std::span<const int32_t> pages,
                                         uint32_t pages_per_head) {
  std::vector<AttendItem> items(1);
  TANDEM_ASSIGN_OR_RETURN(items[0].session, store_.Find(session_id));
  TANDEM_RETURN_IF_ERROR(CheckLayer(*items[0].session, layer));
  TANDEM_RETURN_IF_ERROR(CopyQueries(q, "q", *items[0].session, num_tokens,
                                     options_.max_query_tokens, &items[0].q));
  items[0].num_tokens = num_tokens;
  TANDEM_RETURN_IF_ERROR(internal::CopyPages(*items[0].session, num_tokens, pages,
                                             pages_per_head, "query", &items[0].pages));
  items[0].pages_per_head = pages_per_head;
  RawAttendOutput* out = nullptr;
  uint64_t compute_micros = 0, bytes_scanned = 0;
  TANDEM_RETURN_IF_ERROR(AttendItems(
      layer, items,
      [&out, output_for](size_t, const Session& session, uint32_t tokens,
                         std::span<const HeadCount> heads) -> absl::StatusOr<AttendTarget> {
        TANDEM_ASSIGN_OR_RETURN(out, output_for(heads.size()));
        const auto& g = session.geometry();
        const size_t rows = size_t{tokens} * heads.size() * g.group();
        if (out == nullptr || out->kv_heads.size() != heads.size() ||
            out->selected.size() != heads.size() || out->held.size() != heads.size() ||
            out->o.size() != rows * g.head_dim || out->lse.size() != rows) {
          return absl::InvalidArgumentError(absl::StrCat(
              "output arrays are not sized for ", heads.size(), " owned kv heads x ", tokens,
              " tokens"));
        }
        for (size_t h = 0; h < heads.size(); ++h) {
          out->kv_heads[h] = heads[h].kv_head;
          out->selected[h] = heads[h].selected;
          out->held[h] = heads[h].held;
        }
        return AttendTarget{out->o.data(), out->lse.data()};
      },
      &compute_micros, &bytes_scanned));
  out->compute_micros = compute_micros;
  out->bytes_scanned = bytes_scanned;
  if (options_.metrics != nullptr) options_.metrics->attends_shm->Increment();
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::AttendItems(uint32_t layer, std::vector<AttendItem>& items,
                                           AttendSink sink, uint64_t* compute_micros,
                                           uint64_t* bytes_scanned_out) {
  attend_calls_.fetch_add(1, std::memory_order_relaxed);
  attend_in_flight_.fetch_add(1, std::memory_order_relaxed);
  struct InFlight {
    std::atomic<uint32_t>* n;
    ~InFlight() { n->fetch_sub(1, std::memory_order_relaxed); }
  } in_flight{&attend_in_flight_};

  // Readers hold each session's lock shared for the whole computation; sorted order (ids are
  // unique, the callers checked) keeps lock acquisition consistent across concurrent calls.
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  {
    std::vector<Session*> order;
    for (AttendItem& item : items) order.push_back(item.session.get());
    std::sort(order.begin(), order.end(),
              [](const Session* a, const Session* b) { return a->id() < b->id(); });
    for (Session* s : order) locks.emplace_back(s->mutex());
  }

  // A session closed between Find and the lock has no shards left.
  for (const AttendItem& item : items) TANDEM_RETURN_IF_ERROR(CheckOpen(*item.session));

  // Problems grouped by the parameters SparseAttention takes for a whole call.
  using ParamKey = std::tuple<KvDType, uint32_t, uint32_t, uint32_t>;  // dtype, D, G, T
  std::map<ParamKey, std::pair<AttentionParams, std::vector<HeadProblem>>> groups;
  internal::PagedPlan paged;   // the pages sessions' problems
  uint64_t bytes_scanned = 0;
  std::vector<HeadCount> counts;
  for (size_t i = 0; i < items.size(); ++i) {
    AttendItem& item = items[i];
    const Session& session = *item.session;
    const auto& g = session.geometry();
    const uint32_t G = g.group();
    const auto owned = session.owned_kv_heads(layer);
    const int64_t rows_per_token = static_cast<int64_t>(owned.size()) * G;
    const bool pages_session = session.options().page_tokens > 0;

    counts.clear();
    for (uint32_t kv_head : owned) {
      const Shard* shard = session.shard(layer, kv_head);
      counts.push_back({kv_head, shard->selected_count(), shard->held()});
    }
    if (pages_session) {
      // Checks the named pages against the held counts and collects their runs; the counters
      // become the entries attended per token.
      std::vector<uint64_t> selected(owned.size());
      TANDEM_ASSIGN_OR_RETURN(const uint64_t bytes,
                              paged.AddQuery(session, layer, owned, item.pages,
                                             item.pages_per_head, item.num_tokens, selected));
      bytes_scanned += bytes;
      for (size_t h = 0; h < owned.size(); ++h) counts[h].selected = selected[h];
    }
    TANDEM_ASSIGN_OR_RETURN(const AttendTarget target,
                            sink(i, session, item.num_tokens, counts));
    // A layer owning no kv head (after ReshardSession) has an empty result: nothing to compute.
    if (owned.empty()) continue;

    if (pages_session) {
      paged.AddProblems(session, owned, item.q.data(), target.o, target.lse);
      continue;
    }

    AttentionParams params = ParamsFor(session, item.num_tokens, options_);
    params.o_token_stride = static_cast<size_t>(rows_per_token) * g.head_dim;
    params.lse_token_stride = static_cast<size_t>(rows_per_token);
    auto& group = groups[{params.dtype, params.head_dim, params.group, params.num_tokens}];
    group.first = params;
    for (size_t h = 0; h < owned.size(); ++h) {
      const Shard* shard = session.shard(layer, owned[h]);
      HeadProblem p;
      p.k = shard->selected_k();
      p.v = shard->selected_v();
      p.n = shard->selected_count();
      p.q = item.q.data() + size_t{owned[h]} * G * g.head_dim;
      p.o = target.o + h * G * g.head_dim;
      p.lse = target.lse + h * G;
      group.second.push_back(p);
      bytes_scanned += 2 * shard->selected_count() * shard->format().row_bytes();
    }
  }

  const auto start = std::chrono::steady_clock::now();
  for (auto& [key, group] : groups) {
    TANDEM_RETURN_IF_ERROR(SparseAttention(group.first, group.second, pool_));
  }
  TANDEM_RETURN_IF_ERROR(paged.Run(pool_, options_.tasks_per_thread));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *compute_micros = static_cast<uint64_t>(seconds * 1e6);
  *bytes_scanned_out = bytes_scanned;
  RecordScan(bytes_scanned, seconds);
  if (options_.metrics != nullptr) {
    options_.metrics->scanned_bytes->Increment(static_cast<double>(bytes_scanned));
  }
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::Reselect(const v1::ReselectRequest& request,
                                        v1::ReselectResponse* response,
                                        const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_.Find(request.session_id()));
  TANDEM_RETURN_IF_ERROR(CheckLayer(*session, request.layer()));
  if (request.has_beta()) TANDEM_RETURN_IF_ERROR(CheckBeta(request.beta()));
  std::vector<float> q;
  uint32_t num_tokens = 0;
  TANDEM_RETURN_IF_ERROR(DecodeQueries(request.q(), "q", *session, options_.max_query_tokens, &q,
                                       &num_tokens));

  if (!session->options().has_selection_index()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", session->id(), "' uses SELECTION_PAGES: it keeps no salience index to "
        "re-evaluate (each Attend names its pages)"));
  }
  std::unique_lock lock(session->mutex());
  TANDEM_RETURN_IF_ERROR(CheckOpen(*session));
  const float beta = request.has_beta() ? request.beta() : session->beta();
  const auto owned = session->owned_kv_heads(request.layer());
  const auto& g = session->geometry();
  const AttentionParams params = ParamsFor(*session, num_tokens, options_);

  // Score every head in parallel, then apply the selections; nothing changes on failure.
  std::vector<std::vector<uint8_t>> flags(owned.size());
  std::vector<absl::Status> statuses(owned.size());
  pool_.ParallelFor(owned.size(), [&](size_t h) {
    const Shard& shard = *session->shard(request.layer(), owned[h]);
    const uint64_t held = shard.held();
    flags[h].assign(held, 1);
    if (beta == 0 || held == 0) return;  // dense mode selects everything
    std::vector<float> a(held);
    statuses[h] = ComputeSalience(params, shard, q.data() + size_t{owned[h]} * g.group() *
                                                                g.head_dim,
                                  a);
    const float threshold = beta / static_cast<float>(held);
    for (uint64_t i = 0; i < held; ++i) flags[h][i] = a[i] > threshold;
  });
  for (const absl::Status& s : statuses) TANDEM_RETURN_IF_ERROR(s);
  for (size_t h = 0; h < owned.size(); ++h) {
    TANDEM_RETURN_IF_ERROR(session->shard(request.layer(), owned[h])->SetSelection(flags[h]));
  }
  if (request.has_beta()) session->set_beta(beta);
  for (size_t h = 0; h < owned.size(); ++h) {
    const Shard& shard = *session->shard(request.layer(), owned[h]);
    response->add_kv_heads(owned[h]);
    response->add_selected(shard.selected_count());
    response->add_held(shard.held());
  }
  return absl::OkStatus();
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

absl::Status CpuAttentionNode::ReshardSession(const v1::ReshardSessionRequest& request,
                                              v1::ReshardSessionResponse* response,
                                              const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_.Find(request.session_id()));
  if (request.add_size() > 0 && draining()) return Draining("adding shards");
  TANDEM_ASSIGN_OR_RETURN(const std::vector<kv_store::ShardKey> add,
                          ShardKeys(request.add(), "add", session->geometry()));
  TANDEM_ASSIGN_OR_RETURN(const std::vector<kv_store::ShardKey> drop,
                          ShardKeys(request.drop(), "drop", session->geometry()));
  // Added shards are charged before they exist; the charge is then set to the owned count.
  const uint64_t extra = internal::SessionMetadataBytes(0, add.size()) -
                         internal::SessionMetadataBytes(0, 0);
  TANDEM_RETURN_IF_ERROR(Budget().Charge(extra));
  absl::StatusOr<kv_store::ReshardStats> resharded = store_.Reshard(*session, add, drop);
  if (!resharded.ok()) {
    Budget().Release(extra);
    return resharded.status();
  }
  const kv_store::ReshardStats& stats = *resharded;
  const uint64_t before = owners_->charged(request.session_id());
  if (before > 0) {   // sessions opened through OpenSession (the store's own ones are not charged)
    const uint64_t now =
        internal::SessionMetadataBytes(session->geometry().num_layers, stats.shards);
    Budget().Release(before + extra - now);
    owners_->SetCharged(request.session_id(), now);
  } else {
    Budget().Release(extra);
  }
  response->set_free_bytes(store_.budget().free());
  response->set_blocks_released(stats.blocks_released);
  response->set_shards(static_cast<uint32_t>(stats.shards));
  return absl::OkStatus();
}

absl::StatusOr<ShardExport> CpuAttentionNode::StartExport(const v1::ExportShardRequest& request,
                                                          uint64_t max_chunk_bytes,
                                                          const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  constexpr uint32_t kDefaultChunkEntries = 4096;
  constexpr uint32_t kMaxChunkEntries = 65536;
  if (request.max_chunk_entries() > kMaxChunkEntries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_entries ", request.max_chunk_entries(), " exceeds ", kMaxChunkEntries));
  }
  ShardExport e;
  TANDEM_ASSIGN_OR_RETURN(e.session_, store_.Find(request.session_id()));
  const Session& session = *e.session_;
  e.key_ = {request.shard().layer(), request.shard().kv_head()};
  {
    std::shared_lock lock(session.mutex());
    TANDEM_RETURN_IF_ERROR(CheckOpen(session));
    const Shard* shard = session.shard(e.key_.layer, e.key_.kv_head);
    if (shard == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("session '", session.id(),
                                                     "' does not own (layer ", e.key_.layer,
                                                     ", kv_head ", e.key_.kv_head, ")"));
    }
    const uint64_t held = shard->held();
    const uint64_t to = request.to_entry() == 0 ? held : request.to_entry();
    if (request.from_entry() > held || to > held) {
      return absl::OutOfRangeError(
          absl::StrCat("entries [", request.from_entry(), ", ", to, ") of (layer ", e.key_.layer,
                       ", kv_head ", e.key_.kv_head, ") are not all held: it holds ", held));
    }
    if (request.from_entry() > to) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_entry ", request.from_entry(), " > to_entry ", to));
    }
    e.serial_ = shard->serial();
    e.next_ = request.from_entry();
    e.end_ = to;
  }
  // Bytes per entry in a chunk: K and V rows (of the session's kv_dtype, as AppendKv takes
  // them), the MAW float, the flag.
  const uint64_t entry_bytes = 2 * session.options().input_row_bytes() + sizeof(float) + 1;
  const uint64_t by_bytes = std::max<uint64_t>(1, max_chunk_bytes / entry_bytes);
  const uint32_t wanted =
      request.max_chunk_entries() == 0 ? kDefaultChunkEntries : request.max_chunk_entries();
  e.chunk_entries_ = static_cast<uint32_t>(std::min<uint64_t>(wanted, by_bytes));
  return e;
}

absl::Status ShardExport::Next(v1::ExportShardChunk* chunk) {
  if (done()) return absl::FailedPreconditionError("the export is complete");
  const Session& session = *session_;
  std::shared_lock lock(session.mutex());
  TANDEM_RETURN_IF_ERROR(CheckOpen(session));
  const Shard* shard = session.shard(key_.layer, key_.kv_head);
  if (shard == nullptr || shard->serial() != serial_ || shard->held() < end_) {
    return absl::AbortedError(absl::StrCat("shard (layer ", key_.layer, ", kv_head ", key_.kv_head,
                                           ") of session '", session.id(),
                                           "' was dropped during the export"));
  }
  const uint64_t n = std::min<uint64_t>(chunk_entries_, end_ - next_);
  const auto& g = session.geometry();
  const v1::DType dtype = ProtoDType(session.options().dtype);
  const size_t row = session.options().input_row_bytes();
  chunk->Clear();
  chunk->set_first_entry(next_);
  chunk->set_num_entries(static_cast<uint32_t>(n));
  chunk->set_held(shard->held());
  auto init = [n](v1::Tensor* t, v1::DType type, std::initializer_list<int64_t> shape,
                  size_t bytes) {
    t->set_dtype(type);
    t->mutable_shape()->Assign(shape.begin(), shape.end());
    std::string* data = t->mutable_data();
    data->resize(bytes);
    return reinterpret_cast<std::byte*>(data->data());
  };
  const int64_t rows = static_cast<int64_t>(n);
  std::byte* k = init(chunk->mutable_k(), dtype, {rows, g.head_dim}, n * row);
  std::byte* v = init(chunk->mutable_v(), dtype, {rows, g.head_dim}, n * row);
  auto* maw = reinterpret_cast<float*>(
      init(chunk->mutable_maw(), v1::DTYPE_F32, {rows}, n * sizeof(float)));
  std::string* flags = chunk->mutable_selected();
  flags->resize(n);
  uint8_t* selected = reinterpret_cast<uint8_t*>(flags->data());
  if (!session.options().int8_storage) {
    TANDEM_RETURN_IF_ERROR(shard->ReadEntries(next_, n, k, v, maw, selected));
  } else {
    // Stored rows out, dequantised to the session's kv_dtype: the importing node quantises
    // again (an int8 node gets the same codes back: see int8_rows.h) or keeps them as sent.
    const size_t stored = shard->format().row_bytes();
    std::vector<std::byte> rows(2 * n * stored);
    TANDEM_RETURN_IF_ERROR(
        shard->ReadEntries(next_, n, rows.data(), rows.data() + n * stored, maw, selected));
    kv_store::ConvertRows(rows.data(), KvDType::kInt8, n, g.head_dim, k, session.options().dtype);
    kv_store::ConvertRows(rows.data() + n * stored, KvDType::kInt8, n, g.head_dim, v,
                          session.options().dtype);
  }
  next_ += n;
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::ExportShard(
    const v1::ExportShardRequest& request,
    absl::FunctionRef<absl::Status(const v1::ExportShardChunk&)> emit, uint64_t max_chunk_bytes) {
  TANDEM_ASSIGN_OR_RETURN(ShardExport e, StartExport(request, max_chunk_bytes));
  v1::ExportShardChunk chunk;
  while (!e.done()) {
    TANDEM_RETURN_IF_ERROR(e.Next(&chunk));
    TANDEM_RETURN_IF_ERROR(emit(chunk));
  }
  return absl::OkStatus();
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
