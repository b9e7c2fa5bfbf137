#include "node_link.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "node_rpc.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/shm_protocol.h"

namespace tandem::gpu_worker {
namespace {

namespace shm = cpu_attention::shm;

// Largest payload of one AppendKv message; a longer eviction is split by tokens.
constexpr size_t kAppendMessageBytes = 4 << 20;
// An shm append of at least kPipelineChunks x kMinPipelineChunkBytes goes in at least
// kPipelineChunks chunks: the fill of a chunk overlaps the node's copy of the one before only
// when there is one before (one 8 MiB chunk per layer left both copies serial).
constexpr int64_t kPipelineChunks = 4;
constexpr uint64_t kMinPipelineChunkBytes = 512 << 10;

// The status a node wrote into a shm response (its header and error text), bounded by `message`.
absl::Status ShmStatus(std::span<const std::byte> message, shm::ResponseHeader* h) {
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

// --- GrpcLink

absl::Status GrpcLink::Append(int64_t layer, std::span<const uint32_t> heads, const void* k,
                              const void* v, const float* maw, int64_t num_tokens,
                              int64_t window_entries) {
  const size_t row = session_.head_dim * DTypeBytes(session_.kv_dtype);
  const int64_t per_message = std::max<int64_t>(
      1, static_cast<int64_t>(kAppendMessageBytes / (2 * row * heads.size())));
  grpc::ClientContext ctx;
  SetDeadline(ctx, session_.control_deadline_ms);
  v1::AppendKvResponse response;
  auto writer = pool_.stub(node_).AppendKv(&ctx, &response);
  bool write_ok = true;
  for (int64_t t0 = 0; t0 < num_tokens && write_ok; t0 += per_message) {
    const int64_t count = std::min(per_message, num_tokens - t0);
    v1::AppendKvRequest request;
    request.set_session_id(session_.session_id);
    request.set_layer(layer);
    request.set_window_entries(window_entries);
    for (uint32_t h : heads) request.add_kv_heads(h);
    std::string* kd = nullptr;
    std::string* vd = nullptr;
    for (auto [tensor, data] : {std::pair{request.mutable_k(), &kd},
                                std::pair{request.mutable_v(), &vd}}) {
      tensor->set_dtype(WireType(session_.kv_dtype));
      tensor->add_shape(heads.size());
      tensor->add_shape(count);
      tensor->add_shape(session_.head_dim);
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
  if (!s.ok()) return NodeError(pool_.address(node_), "AppendKv", FromGrpcStatus(s));
  return absl::OkStatus();
}

void GrpcLink::StartAttend(const NodeQuery& query) {
  Join();   // (never in flight here: RemoteKv finishes every Attend)
  tokens_ = query.tokens;
  context_ = std::make_unique<grpc::ClientContext>();
  request_.Clear();
  response_.Clear();
  request_.set_layer(query.layer);
  auto* q = request_.add_queries();
  q->set_session_id(session_.session_id);
  auto* qt = q->mutable_q();
  qt->set_dtype(v1::DTYPE_F32);
  qt->add_shape(query.tokens);
  qt->add_shape(session_.num_q_heads);
  qt->add_shape(session_.head_dim);
  const size_t q_bytes = query.tokens * session_.num_q_heads * session_.head_dim * sizeof(float);
  qt->mutable_data()->assign(reinterpret_cast<const char*>(query.q), q_bytes);
  if (query.pages != nullptr) {
    const size_t ids = query.tokens * session_.num_kv_heads * query.pages->per_head;
    q->set_pages_per_head(static_cast<uint32_t>(query.pages->per_head));
    q->mutable_pages()->Add(query.pages->ids, query.pages->ids + ids);
  }
  SetDeadline(*context_, session_.attend_deadline_ms);
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ = true;
  }
  pool_.stub(node_).async()->Attend(context_.get(), &request_, &response_,
                                    [this](grpc::Status status) {
                                      std::lock_guard<std::mutex> lock(mu_);
                                      status_ = std::move(status);
                                      in_flight_ = false;
                                      done_cv_.notify_all();
                                    });
}

void GrpcLink::Join() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return !in_flight_; });
}

std::optional<NodeAnswer> GrpcLink::FinishAttend() {
  Join();
  if (!status_.ok() || response_.results_size() != 1) return std::nullopt;
  const int64_t G = session_.num_q_heads / session_.num_kv_heads, D = session_.head_dim;
  const v1::AttendResult& r = response_.results(0);
  const int64_t own = r.kv_heads_size();
  if (r.o().data().size() != static_cast<size_t>(tokens_ * own * G * D) * 4 ||
      r.lse().data().size() != static_cast<size_t>(tokens_ * own * G) * 4) {
    return std::nullopt;
  }
  NodeAnswer answer;
  answer.kv_heads = std::span<const uint32_t>(r.kv_heads().data(), static_cast<size_t>(own));
  answer.o = reinterpret_cast<const float*>(r.o().data().data());
  answer.lse = reinterpret_cast<const float*>(r.lse().data().data());
  if (r.selected_size() == own && r.held_size() == own) {
    answer.selected = std::span<const uint64_t>(r.selected().data(), static_cast<size_t>(own));
    answer.held = std::span<const uint64_t>(r.held().data(), static_cast<size_t>(own));
  }
  answer.compute_micros = response_.compute_micros();
  answer.bytes_scanned = response_.bytes_scanned();
  return answer;
}

// --- ShmLink

absl::Status ShmLink::Append(int64_t layer, std::span<const uint32_t> heads, const void* k,
                             const void* v, const float* maw, int64_t num_tokens,
                             int64_t window_entries, uint64_t* chunks) {
  cpu_attention::ShmChannel& channel = *channel_;
  const size_t row = session_.head_dim * DTypeBytes(session_.kv_dtype);
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(session_.control_deadline_ms);
  // An Attend that missed its deadline may still run on the node: let it finish first.
  if (channel.Busy()) {
    const absl::Status drained = channel.WaitResponse(deadline).status();
    if (!drained.ok()) return NodeError(address_, "AppendKv over shm", drained);
  }
  // Two halves of the request area take alternate chunks: the next chunk is copied in while
  // the node stores the previous one (one request is still outstanding at a time).
  const std::span<std::byte> area = channel.request_area();
  const uint64_t half = (area.size() / 2) & ~uint64_t{63};
  const uint64_t bases[2] = {shm::kPayloadOffset, std::max<uint64_t>(half, shm::kPayloadOffset)};
  // Bytes a chunk may take from its base without reaching the other slot or the area's end.
  const uint64_t room = std::min(area.size() - bases[1], bases[1] - bases[0]);
  const uint64_t budget = std::min(room, std::max<uint64_t>(session_.shm_append_chunk_bytes, 1));
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
  const int64_t min_pipeline_tokens =
      static_cast<int64_t>((kMinPipelineChunkBytes + per_token - 1) / per_token);
  chunk = std::min(chunk, std::max((num_tokens + kPipelineChunks - 1) / kPipelineChunks,
                                   min_pipeline_tokens));
  // Copies chunk `index` (tokens [index * chunk, ...)) into its slot; returns its layout.
  auto fill = [&](int64_t index) {
    const int64_t t0 = index * chunk;
    const int64_t count = std::min(chunk, num_tokens - t0);
    const shm::AppendLayout layout =
        *shm::AppendLayoutFor(heads.size(), count, row, bases[index % 2]);
    std::byte* dst = area.data();
    std::memcpy(dst + layout.heads, heads.data(), heads.size() * sizeof(uint32_t));
    // Head-major source [H_kv, num_tokens, D]: one contiguous run per (head, K|V|MAW), copied
    // on the fill threads (a chunk is megabytes: one core's memcpy bounded the settle).
    fill_.ParallelFor(3 * heads.size(), [&](size_t task) {
      const size_t i = task / 3;
      const size_t src = (heads[i] * num_tokens + t0) * row;
      switch (task % 3) {
        case 0:
          std::memcpy(dst + layout.k + i * count * row, static_cast<const char*>(k) + src,
                      count * row);
          break;
        case 1:
          std::memcpy(dst + layout.v + i * count * row, static_cast<const char*>(v) + src,
                      count * row);
          break;
        default:
          std::memcpy(dst + layout.maw + i * count * sizeof(float),
                      maw + heads[i] * num_tokens + t0, count * sizeof(float));
      }
    });
    return std::pair{layout, count};
  };
  const int64_t count_chunks = (num_tokens + chunk - 1) / chunk;
  auto next = fill(0);
  for (int64_t index = 0; index < count_chunks; ++index) {
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
    if (index + 1 < count_chunks) next = fill(index + 1);   // overlaps with the node's copy
    absl::StatusOr<std::span<const std::byte>> answer = channel.WaitResponse(deadline);
    if (!answer.ok()) return NodeError(address_, "AppendKv over shm", answer.status());
    shm::ResponseHeader rh;
    const absl::Status s = ShmStatus(*answer, &rh);
    if (!s.ok()) return NodeError(address_, "AppendKv over shm", s);
    ++*chunks;
  }
  return absl::OkStatus();
}

ShmLink::Start ShmLink::StartAttend(const NodeQuery& query) {
  cpu_attention::ShmChannel& channel = *channel_;
  const int64_t G = session_.num_q_heads / session_.num_kv_heads;
  const uint64_t per_head =
      query.pages == nullptr ? 0 : static_cast<uint64_t>(query.pages->per_head);
  const std::optional<shm::AttendRequestLayout> request = shm::AttendRequestLayoutFor(
      query.tokens, session_.num_q_heads, session_.head_dim, session_.num_kv_heads, per_head);
  const std::optional<shm::AttendLayout> answer =
      shm::AttendLayoutFor(query.answer_heads, query.tokens, G, session_.head_dim);
  if (!request || !answer || request->end > channel.request_area().size() ||
      answer->end > channel.response_area().size()) {
    return Start::kTooLarge;
  }
  if (channel.Busy()) return Start::kBusy;
  std::byte* dst = channel.request_area().data();
  shm::RequestHeader header{};
  header.kind = static_cast<uint32_t>(shm::Kind::kAttend);
  header.layer = static_cast<uint32_t>(query.layer);
  header.num_tokens = static_cast<uint32_t>(query.tokens);
  header.pages_per_head = static_cast<uint32_t>(per_head);
  std::memcpy(dst, &header, sizeof(header));
  std::memcpy(dst + request->q, query.q, request->q_floats * sizeof(float));
  if (request->page_ids > 0) {
    std::memcpy(dst + request->pages, query.pages->ids, request->page_ids * sizeof(int32_t));
  }
  if (!channel.Send(request->end).ok()) return Start::kBusy;
  tokens_ = query.tokens;
  return Start::kSent;
}

std::optional<NodeAnswer> ShmLink::FinishAttend(Clock::time_point deadline) {
  absl::StatusOr<std::span<const std::byte>> message = channel_->WaitResponse(deadline);
  error_ = message.status();
  if (!message.ok()) return std::nullopt;
  shm::ResponseHeader h;
  error_ = ShmStatus(*message, &h);
  if (!error_.ok()) return std::nullopt;
  error_ = absl::DataLossError("malformed shm Attend answer");
  // Everything below was written by the node: check it against what was asked.
  const int64_t G = session_.num_q_heads / session_.num_kv_heads;
  if (h.num_tokens != tokens_ || h.group != G || h.head_dim != session_.head_dim ||
      h.num_heads > session_.num_kv_heads) {
    return std::nullopt;
  }
  const std::optional<shm::AttendLayout> layout =
      shm::AttendLayoutFor(h.num_heads, h.num_tokens, h.group, h.head_dim);
  if (!layout || layout->end > message->size()) return std::nullopt;
  const std::byte* base = message->data();
  NodeAnswer answer;
  answer.kv_heads =
      std::span<const uint32_t>(reinterpret_cast<const uint32_t*>(base + layout->kv_heads),
                                h.num_heads);
  answer.o = reinterpret_cast<const float*>(base + layout->o);
  answer.lse = reinterpret_cast<const float*>(base + layout->lse);
  answer.selected = std::span<const uint64_t>(
      reinterpret_cast<const uint64_t*>(base + layout->selected), h.num_heads);
  answer.held =
      std::span<const uint64_t>(reinterpret_cast<const uint64_t*>(base + layout->held), h.num_heads);
  answer.compute_micros = h.compute_micros;
  answer.bytes_scanned = h.bytes_scanned;
  answer.handle_micros = h.handle_micros;
  error_ = absl::OkStatus();
  return answer;
}

}  // namespace tandem::gpu_worker
