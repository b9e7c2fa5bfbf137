#include "tandem/gpu_worker/remote_kv.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/scan_rate.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/shm_protocol.h"
#include "spdlog/spdlog.h"

namespace tandem::gpu_worker {
namespace {

// Largest payload of one AppendKv message; a longer eviction is split by tokens.
constexpr size_t kAppendMessageBytes = 4 << 20;

v1::DType WireType(DType dtype) { return dtype == DType::kBF16 ? v1::DTYPE_BF16 : v1::DTYPE_F32; }

void SetDeadline(grpc::ClientContext& ctx, int ms) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

absl::Status NodeError(const std::string& address, const char* what, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat("CPU node ", address, ": ", what, ": ", status.message()));
}

absl::Status NodeError(const std::string& address, const char* what, const grpc::Status& s) {
  return NodeError(address, what, FromGrpcStatus(s));
}

// The status a node wrote into a shm response (its header and error text), bounded by `message`.
absl::Status ShmStatus(std::span<const std::byte> message, cpu_attention::shm::ResponseHeader* h) {
  namespace shm = cpu_attention::shm;
  if (message.size() < shm::kPayloadOffset) {
    return absl::DataLossError("shm response shorter than its header");
  }
  std::memcpy(h, message.data(), sizeof(*h));
  if (h->code == 0) return absl::OkStatus();
  const size_t text = std::min<size_t>(h->message_bytes, message.size() - shm::kPayloadOffset);
  const absl::StatusCode code = h->code <= 16 ? static_cast<absl::StatusCode>(h->code)
                                              : absl::StatusCode::kUnknown;
  return absl::Status(
      code, std::string(reinterpret_cast<const char*>(message.data()) + shm::kPayloadOffset, text));
}

}  // namespace

absl::StatusOr<PlacementPolicy> ParsePlacementPolicy(const std::string& name) {
  if (name == "balanced") return PlacementPolicy::kBalanced;
  if (name == "uniform") return PlacementPolicy::kUniform;
  return absl::InvalidArgumentError(
      absl::StrCat("placement must be balanced or uniform, got '", name, "'"));
}

RemoteKv::RemoteKv(NodePool& pool, const RemoteKvOptions& options)
    : pool_(pool),
      options_(options),
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
  if (opened_.size() >= n) return;
  opened_.resize(n, false);
  lost_.resize(n, false);
  shm_.resize(n);
  node_rate_.resize(n, 0.0);
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
  return request;
}

absl::StatusOr<std::unique_ptr<RemoteKv>> RemoteKv::Open(NodePool& pool,
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
  kv->pool_generation_ = pool.generation();
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
  ShardMigratorOptions mo;
  mo.session_id = options.session_id;
  mo.head_dim = options.head_dim;
  mo.kv_dtype = options.kv_dtype;
  mo.deadline_ms = options.control_deadline_ms;
  mo.chunk_entries = options.migration_chunk_entries;
  kv->migrator_ = std::make_unique<ShardMigrator>(pool, mo);
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
  if (!s.ok()) return NodeError(pool_.address(n), "OpenSession", s);
  opened_[n] = true;
  if (channel != nullptr && response.transport() == v1::TRANSPORT_SHM) {
    shm_[n] = std::move(channel);
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

absl::Status RemoteKv::Append(int64_t layer, const void* k, const void* v, const float* maw,
                              int64_t num_tokens, int64_t window_entries) {
  // window_entries sets the MAW threshold; pages sessions do not use it (0 allowed).
  const int64_t min_window = options_.selection == SelectionRule::kPages ? 0 : 1;
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0 ||
      window_entries < min_window) {
    return absl::InvalidArgumentError("RemoteKv::Append: bad layer, token count or window");
  }
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n]) continue;
    const std::vector<uint32_t> heads = HeadsOf(n, layer);
    if (heads.empty()) continue;
    const absl::Status s =
        shm_[n] != nullptr
            ? AppendShm(n, layer, heads, k, v, maw, num_tokens, window_entries)
            : AppendGrpc(n, layer, heads, k, v, maw, num_tokens, window_entries);
    if (!s.ok()) {
      lost_[n] = true;
      return s;
    }
  }
  if (layer == options_.num_layers - 1) offloaded_tokens_ += num_tokens;
  return absl::OkStatus();
}

absl::Status RemoteKv::AppendGrpc(size_t n, int64_t layer, const std::vector<uint32_t>& heads,
                                  const void* k, const void* v, const float* maw,
                                  int64_t num_tokens, int64_t window_entries) {
  const size_t row = options_.head_dim * DTypeBytes(options_.kv_dtype);
  const int64_t per_message = std::max<int64_t>(
      1, static_cast<int64_t>(kAppendMessageBytes / (2 * row * heads.size())));
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.control_deadline_ms);
  v1::AppendKvResponse response;
  auto writer = pool_.stub(n).AppendKv(&ctx, &response);
  bool write_ok = true;
  for (int64_t t0 = 0; t0 < num_tokens && write_ok; t0 += per_message) {
    const int64_t count = std::min(per_message, num_tokens - t0);
    v1::AppendKvRequest request;
    request.set_session_id(options_.session_id);
    request.set_layer(layer);
    request.set_window_entries(window_entries);
    for (uint32_t h : heads) request.add_kv_heads(h);
    std::string* kd = nullptr;
    std::string* vd = nullptr;
    for (auto [tensor, data] : {std::pair{request.mutable_k(), &kd},
                                std::pair{request.mutable_v(), &vd}}) {
      tensor->set_dtype(WireType(options_.kv_dtype));
      tensor->add_shape(heads.size());
      tensor->add_shape(count);
      tensor->add_shape(options_.head_dim);
      *data = tensor->mutable_data();
      (*data)->resize(heads.size() * count * row);
    }
    auto* mt = request.mutable_maw();
    mt->set_dtype(v1::DTYPE_F32);
    mt->add_shape(heads.size());
    mt->add_shape(count);
    std::string* md = mt->mutable_data();
    md->resize(heads.size() * count * sizeof(float));
    for (size_t i = 0; i < heads.size(); ++i) {
      const size_t src = (heads[i] * num_tokens + t0) * row;
      std::memcpy(kd->data() + i * count * row, static_cast<const char*>(k) + src, count * row);
      std::memcpy(vd->data() + i * count * row, static_cast<const char*>(v) + src, count * row);
      std::memcpy(md->data() + i * count * sizeof(float), maw + heads[i] * num_tokens + t0,
                  count * sizeof(float));
    }
    write_ok = writer->Write(request);
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return NodeError(pool_.address(n), "AppendKv", s);
  return absl::OkStatus();
}

absl::Status RemoteKv::AppendShm(size_t n, int64_t layer, const std::vector<uint32_t>& heads,
                                 const void* k, const void* v, const float* maw,
                                 int64_t num_tokens, int64_t window_entries) {
  namespace shm = cpu_attention::shm;
  cpu_attention::ShmChannel& channel = *shm_[n];
  const size_t row = options_.head_dim * DTypeBytes(options_.kv_dtype);
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(options_.control_deadline_ms);
  // An Attend that missed its deadline may still run on the node: let it finish first.
  if (channel.Busy()) {
    const absl::Status drained = channel.WaitResponse(deadline).status();
    if (!drained.ok()) return NodeError(pool_.address(n), "AppendKv over shm", drained);
  }
  // Two halves of the request area take alternate chunks: the next chunk is copied in while
  // the node stores the previous one (one request is still outstanding at a time).
  const std::span<std::byte> area = channel.request_area();
  const uint64_t half = (area.size() / 2) & ~uint64_t{63};
  const uint64_t bases[2] = {shm::kPayloadOffset, std::max<uint64_t>(half, shm::kPayloadOffset)};
  // Bytes a chunk may take from its base without reaching the other slot or the area's end.
  const uint64_t room = std::min(area.size() - bases[1], bases[1] - bases[0]);
  const uint64_t budget = std::min(room, std::max<uint64_t>(options_.shm_append_chunk_bytes, 1));
  const uint64_t per_token = heads.size() * (2 * row + sizeof(float));
  const uint64_t overhead = 4 * 64 + heads.size() * sizeof(uint32_t);
  int64_t chunk = static_cast<int64_t>(
      std::min<uint64_t>(65536, budget > overhead ? (budget - overhead) / per_token : 0));
  auto fits = [&](int64_t tokens) {
    return shm::AppendLayoutFor(heads.size(), tokens, row, bases[0])->end <= bases[1] &&
           shm::AppendLayoutFor(heads.size(), tokens, row, bases[1])->end <= area.size();
  };
  while (chunk > 0 && !fits(chunk)) --chunk;
  if (chunk <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("the shm request area of ", area.size(),
                                                   " bytes holds no append chunk"));
  }
  // Copies chunk `index` (tokens [index * chunk, ...)) into its slot; returns its layout.
  auto fill = [&](int64_t index) {
    const int64_t t0 = index * chunk;
    const int64_t count = std::min(chunk, num_tokens - t0);
    const shm::AppendLayout layout =
        *shm::AppendLayoutFor(heads.size(), count, row, bases[index % 2]);
    std::byte* dst = area.data();
    std::memcpy(dst + layout.heads, heads.data(), heads.size() * sizeof(uint32_t));
    // Head-major source [H_kv, num_tokens, D]: one contiguous run per head and array.
    for (size_t i = 0; i < heads.size(); ++i) {
      const size_t src = (heads[i] * num_tokens + t0) * row;
      std::memcpy(dst + layout.k + i * count * row, static_cast<const char*>(k) + src,
                  count * row);
      std::memcpy(dst + layout.v + i * count * row, static_cast<const char*>(v) + src,
                  count * row);
      std::memcpy(dst + layout.maw + i * count * sizeof(float), maw + heads[i] * num_tokens + t0,
                  count * sizeof(float));
    }
    return std::pair{layout, count};
  };
  const int64_t chunks = (num_tokens + chunk - 1) / chunk;
  auto next = fill(0);
  for (int64_t index = 0; index < chunks; ++index) {
    const auto [layout, count] = next;
    shm::RequestHeader header{};
    header.kind = static_cast<uint32_t>(shm::Kind::kAppend);
    header.layer = static_cast<uint32_t>(layer);
    header.num_tokens = static_cast<uint32_t>(count);
    header.num_heads = static_cast<uint32_t>(heads.size());
    header.window_entries = static_cast<uint32_t>(window_entries);
    header.payload_offset = static_cast<uint32_t>(bases[index % 2]);
    std::memcpy(area.data(), &header, sizeof(header));
    TANDEM_RETURN_IF_ERROR(channel.Send(layout.end));
    if (index + 1 < chunks) next = fill(index + 1);   // overlaps with the node's copy
    absl::StatusOr<std::span<const std::byte>> answer = channel.WaitResponse(deadline);
    if (!answer.ok()) return NodeError(pool_.address(n), "AppendKv over shm", answer.status());
    shm::ResponseHeader rh;
    const absl::Status s = ShmStatus(*answer, &rh);
    if (!s.ok()) return NodeError(pool_.address(n), "AppendKv over shm", s);
    ++shm_append_chunks_;
  }
  return absl::OkStatus();
}

absl::Status RemoteKv::StartAttend(int64_t layer, const float* q, int64_t num_tokens,
                                   const PageSelection* pages) {
  if (attend_layer_ >= 0) return absl::FailedPreconditionError("an Attend is already in flight");
  if (layer < 0 || layer >= options_.num_layers || num_tokens <= 0) {
    return absl::InvalidArgumentError("RemoteKv::StartAttend: bad layer or token count");
  }
  if (pages != nullptr) {
    if (options_.selection != SelectionRule::kPages) {
      return absl::InvalidArgumentError(
          "RemoteKv::StartAttend: pages given for a session with maw selection");
    }
    if (pages->per_head < 0 || pages->per_head > (int64_t{1} << 20) ||
        (pages->per_head > 0 && pages->ids == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RemoteKv::StartAttend: pages per_head ", pages->per_head,
          " outside 0..2^20 or ids missing"));
    }
    if (pages->per_head == 0) pages = nullptr;   // no ids: dense, as without pages
  }
  const size_t page_ids =
      pages == nullptr ? 0 : num_tokens * options_.num_kv_heads * pages->per_head;
  attend_layer_ = layer;
  attend_tokens_ = num_tokens;
  attend_deadline_ = Clock::now() + std::chrono::milliseconds(options_.attend_deadline_ms);
  const size_t q_bytes = num_tokens * options_.num_q_heads * options_.head_dim * sizeof(float);
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n] || HeadsOf(n, layer).empty()) continue;
    if (shm_[n] != nullptr) {
      const ShmStart started = StartAttendShm(n, q, pages);
      if (started == ShmStart::kSent) shm_calls_.push_back(n);
      // A busy channel leaves the node unanswered (degraded); a query too large for the areas
      // goes over gRPC.
      if (started != ShmStart::kTooLarge) continue;
    }
    auto call = std::make_unique<PendingCall>();
    call->node = n;
    call->request.set_layer(layer);
    auto* query = call->request.add_queries();
    query->set_session_id(options_.session_id);
    auto* qt = query->mutable_q();
    qt->set_dtype(v1::DTYPE_F32);
    qt->add_shape(num_tokens);
    qt->add_shape(options_.num_q_heads);
    qt->add_shape(options_.head_dim);
    qt->mutable_data()->assign(reinterpret_cast<const char*>(q), q_bytes);
    if (pages != nullptr) {
      query->set_pages_per_head(static_cast<uint32_t>(pages->per_head));
      query->mutable_pages()->Add(pages->ids, pages->ids + page_ids);
    }
    SetDeadline(call->context, options_.attend_deadline_ms);
    calls_.push_back(std::move(call));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_ = calls_.size();
  }
  for (auto& call : calls_) {
    PendingCall* c = call.get();
    pool_.stub(c->node).async()->Attend(&c->context, &c->request, &c->response,
                                        [this, c](grpc::Status status) {
                                          std::lock_guard<std::mutex> lock(mu_);
                                          c->status = std::move(status);
                                          if (--outstanding_ == 0) done_cv_.notify_all();
                                        });
  }
  return absl::OkStatus();
}

RemoteKv::ShmStart RemoteKv::StartAttendShm(size_t n, const float* q,
                                            const PageSelection* pages) {
  namespace shm = cpu_attention::shm;
  cpu_attention::ShmChannel& channel = *shm_[n];
  // The node answers for every head it holds, shards still migrating in included.
  int64_t own = static_cast<int64_t>(HeadsOf(n, attend_layer_).size());
  for (const auto& [shard, to] : migrating_) {
    if (to == n && static_cast<int64_t>(shard) / options_.num_kv_heads == attend_layer_) ++own;
  }
  const int64_t G = options_.num_q_heads / options_.num_kv_heads;
  const uint64_t per_head = pages == nullptr ? 0 : static_cast<uint64_t>(pages->per_head);
  const std::optional<shm::AttendRequestLayout> request = shm::AttendRequestLayoutFor(
      attend_tokens_, options_.num_q_heads, options_.head_dim, options_.num_kv_heads, per_head);
  const std::optional<shm::AttendLayout> answer =
      shm::AttendLayoutFor(own, attend_tokens_, G, options_.head_dim);
  if (!request || !answer || request->end > channel.request_area().size() ||
      answer->end > channel.response_area().size()) {
    return ShmStart::kTooLarge;
  }
  if (channel.Busy()) return ShmStart::kBusy;
  std::byte* dst = channel.request_area().data();
  shm::RequestHeader header{};
  header.kind = static_cast<uint32_t>(shm::Kind::kAttend);
  header.layer = static_cast<uint32_t>(attend_layer_);
  header.num_tokens = static_cast<uint32_t>(attend_tokens_);
  header.pages_per_head = static_cast<uint32_t>(per_head);
  std::memcpy(dst, &header, sizeof(header));
  std::memcpy(dst + request->q, q, request->q_floats * sizeof(float));
  if (request->page_ids > 0) {
    std::memcpy(dst + request->pages, pages->ids, request->page_ids * sizeof(int32_t));
  }
  if (!channel.Send(request->end).ok()) return ShmStart::kBusy;
  ++shm_attends_;
  return ShmStart::kSent;
}

bool RemoteKv::FinishAttendShm(size_t n, float* o, float* lse, LayerSelection* selection) {
  namespace shm = cpu_attention::shm;
  absl::StatusOr<std::span<const std::byte>> answer = shm_[n]->WaitResponse(attend_deadline_);
  if (!answer.ok()) return false;
  shm::ResponseHeader h;
  if (!ShmStatus(*answer, &h).ok()) return false;
  // Everything below was written by the node: check it against what was asked.
  const int64_t G = options_.num_q_heads / options_.num_kv_heads;
  if (h.num_tokens != attend_tokens_ || h.group != G || h.head_dim != options_.head_dim ||
      h.num_heads > options_.num_kv_heads) {
    return false;
  }
  const std::optional<shm::AttendLayout> layout =
      shm::AttendLayoutFor(h.num_heads, h.num_tokens, h.group, h.head_dim);
  if (!layout || layout->end > answer->size()) return false;
  const std::byte* base = answer->data();
  const std::span<const uint32_t> kv_heads(reinterpret_cast<const uint32_t*>(base + layout->kv_heads),
                                           h.num_heads);
  Scatter(n, kv_heads, reinterpret_cast<const float*>(base + layout->o),
          reinterpret_cast<const float*>(base + layout->lse), o, lse);
  const std::span<const uint64_t> selected(
      reinterpret_cast<const uint64_t*>(base + layout->selected), h.num_heads);
  const std::span<const uint64_t> held(reinterpret_cast<const uint64_t*>(base + layout->held),
                                       h.num_heads);
  for (uint32_t i = 0; i < h.num_heads; ++i) {
    if (kv_heads[i] >= options_.num_kv_heads || NodeOf(attend_layer_, kv_heads[i]) != n) continue;
    selection->selected += selected[i];
    selection->held += held[i];
  }
  RecordAnswer(n, kv_heads, selected, held, h.compute_micros, h.bytes_scanned);
  return true;
}

void RemoteKv::Scatter(size_t node, std::span<const uint32_t> kv_heads, const float* src_o,
                       const float* src_lse, float* o, float* lse) const {
  const int64_t T = attend_tokens_, Hq = options_.num_q_heads, D = options_.head_dim;
  const int64_t G = Hq / options_.num_kv_heads;
  const int64_t own = static_cast<int64_t>(kv_heads.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < own; ++h) {
      const int64_t kv_head = kv_heads[h];
      if (kv_head >= options_.num_kv_heads || NodeOf(attend_layer_, kv_head) != node) continue;
      for (int64_t j = 0; j < G; ++j) {
        const int64_t src_row = t * own * G + h * G + j;
        const int64_t dst_row = t * Hq + kv_head * G + j;
        std::memcpy(o + dst_row * D, src_o + src_row * D, D * sizeof(float));
        lse[dst_row] = src_lse[src_row];
      }
    }
  }
}

absl::StatusOr<bool> RemoteKv::FinishAttend(float* o, float* lse) {
  if (attend_layer_ < 0) return absl::FailedPreconditionError("no Attend in flight");
  const int64_t T = attend_tokens_, Hq = options_.num_q_heads, D = options_.head_dim;
  const int64_t G = Hq / options_.num_kv_heads;
  std::fill_n(o, T * Hq * D, 0.0f);
  std::fill_n(lse, T * Hq, -std::numeric_limits<float>::infinity());
  const int64_t layer = attend_layer_;
  bool degraded = false;
  // A node without a call (lost, busy, or its session never opened) owns heads nobody answers
  // for.
  std::vector<bool> answered(opened_.size(), false);
  LayerSelection selection;
  for (size_t n : shm_calls_) answered[n] = FinishAttendShm(n, o, lse, &selection);
  shm_calls_.clear();
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return outstanding_ == 0; });
  }
  for (auto& call : calls_) {
    if (!call->status.ok() || call->response.results_size() != 1) continue;
    const v1::AttendResult& r = call->response.results(0);
    const int64_t own = r.kv_heads_size();
    if (r.o().data().size() != static_cast<size_t>(T * own * G * D) * 4 ||
        r.lse().data().size() != static_cast<size_t>(T * own * G) * 4) {
      continue;
    }
    const std::span<const uint32_t> kv_heads(r.kv_heads().data(), static_cast<size_t>(own));
    Scatter(call->node, kv_heads, reinterpret_cast<const float*>(r.o().data().data()),
            reinterpret_cast<const float*>(r.lse().data().data()), o, lse);
    if (r.selected_size() == own && r.held_size() == own) {
      for (int i = 0; i < own; ++i) {
        if (r.kv_heads(i) >= options_.num_kv_heads || NodeOf(layer, r.kv_heads(i)) != call->node) {
          continue;
        }
        selection.selected += r.selected(i);
        selection.held += r.held(i);
      }
      RecordAnswer(call->node, kv_heads,
                   std::span<const uint64_t>(r.selected().data(), static_cast<size_t>(own)),
                   std::span<const uint64_t>(r.held().data(), static_cast<size_t>(own)),
                   call->response.compute_micros(), call->response.bytes_scanned());
    }
    answered[call->node] = true;
  }
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!HeadsOf(n, layer).empty() && !answered[n]) degraded = true;
  }
  calls_.clear();
  attend_layer_ = -1;
  last_selection_[layer] = selection;
  if (selection.held > 0) {
    share_sum_[layer] += static_cast<double>(selection.selected) / selection.held;
    share_count_[layer] += 1;
  }
  if (degraded) ++degraded_attends_;
  return degraded;
}

absl::Status RemoteKv::Reselect(int64_t layer, const float* q, int64_t num_tokens,
                                std::optional<float> beta) {
  // Pages sessions keep no salience index on the nodes: nothing to re-evaluate.
  if (options_.selection == SelectionRule::kPages) return absl::OkStatus();
  // A copy in flight would keep the old flags of entries re-evaluated here: start over later.
  if (migrator_ != nullptr && !migrating_.empty()) {
    for (const MigrationJob& job : migrator_->CancelAll()) AbandonMigration(job);
    replan_due_ = true;
  }
  const size_t q_bytes = num_tokens * options_.num_q_heads * options_.head_dim * sizeof(float);
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (!opened_[n] || lost_[n] || HeadsOf(n, layer).empty()) continue;
    v1::ReselectRequest request;
    request.set_session_id(options_.session_id);
    request.set_layer(layer);
    auto* qt = request.mutable_q();
    qt->set_dtype(v1::DTYPE_F32);
    qt->add_shape(num_tokens);
    qt->add_shape(options_.num_q_heads);
    qt->add_shape(options_.head_dim);
    qt->mutable_data()->assign(reinterpret_cast<const char*>(q), q_bytes);
    if (beta.has_value()) request.set_beta(*beta);
    grpc::ClientContext ctx;
    SetDeadline(ctx, options_.control_deadline_ms);
    v1::ReselectResponse response;
    const grpc::Status s = pool_.stub(n).Reselect(&ctx, request, &response);
    if (!s.ok()) return NodeError(pool_.address(n), "Reselect", s);
  }
  if (beta.has_value()) options_.beta = *beta;
  return absl::OkStatus();
}

absl::Status RemoteKv::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  if (attend_layer_ >= 0) {   // never leave a completion pointing at this object
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return outstanding_ == 0; });
  }
  migrator_.reset();   // stops the copy in progress; the targets' sessions close below
  absl::Status first_error;
  for (size_t n = 0; n < opened_.size(); ++n) {
    if (absl::Status s = CloseOn(n); !s.ok() && first_error.ok()) first_error = s;
  }
  return first_error;
}

void RemoteKv::RecordAnswer(size_t node, std::span<const uint32_t> kv_heads,
                            std::span<const uint64_t> selected, std::span<const uint64_t> held,
                            uint64_t compute_micros, uint64_t bytes_scanned) {
  for (size_t i = 0; i < kv_heads.size(); ++i) {
    if (kv_heads[i] >= options_.num_kv_heads) continue;
    const size_t shard = attend_layer_ * options_.num_kv_heads + kv_heads[i];
    if (placement_[shard] != static_cast<int>(node)) continue;
    shard_selected_[shard] = selected[i];
    shard_held_[shard] = held[i];
  }
  // The node's scan rate, from calls large enough to measure (a moving average).
  if (compute_micros > 0 && bytes_scanned >= kMinTimedScanBytes && node < node_rate_.size()) {
    const double rate = static_cast<double>(bytes_scanned) / (compute_micros * 1e-6);
    node_rate_[node] = node_rate_[node] > 0 ? 0.8 * node_rate_[node] + 0.2 * rate : rate;
  }
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
  // CloseSession stops the node's channel thread before the worker unmaps its side.
  v1::CloseSessionRequest request;
  request.set_session_id(options_.session_id);
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.control_deadline_ms);
  v1::CloseSessionResponse response;
  const grpc::Status s = pool_.stub(node).CloseSession(&ctx, request, &response);
  opened_[node] = false;
  shm_[node].reset();
  if (!s.ok()) return NodeError(pool_.address(node), "CloseSession", s);
  return absl::OkStatus();
}

void RemoteKv::CloseEmptyOn(size_t node) {
  if (absl::Status s = CloseOn(node); !s.ok()) {
    spdlog::warn("session {}: {}", options_.session_id, std::string(s.message()));
  }
}

std::vector<double> RemoteKv::MeanSelectedShare() const {
  std::vector<double> share(options_.num_layers, 0.0);
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    if (share_count_[l] > 0) share[l] = share_sum_[l] / share_count_[l];
  }
  return share;
}

}  // namespace tandem::gpu_worker
