#include "shm_session_server.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/shm_protocol.h"

namespace tandem::cpu_attention {

// A request as read from the channel: the header copied out of shared memory (so the checks
// below and the use see the same values), and the whole message.
struct ShmRequestView {
  shm::RequestHeader header;
  std::span<const std::byte> message;
};

absl::StatusOr<std::unique_ptr<ShmSessionServer>> ShmSessionServer::Start(
    CpuAttentionNode* node, std::string session_id, ShmSessionGeometry geometry,
    const std::string& name, uint64_t segment_bytes, uint64_t nonce, uint32_t spin_us,
    std::atomic<uint64_t>* requests_served) {
  absl::StatusOr<std::unique_ptr<ShmChannel>> channel =
      ShmChannel::Attach(name, segment_bytes, nonce, spin_us);
  if (!channel.ok()) return channel.status();
  std::unique_ptr<ShmSessionServer> server(new ShmSessionServer());
  server->node_ = node;
  server->session_id_ = std::move(session_id);
  server->geometry_ = std::move(geometry);
  server->channel_ = std::move(*channel);
  server->requests_served_ = requests_served;
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ShmSessionServer::~ShmSessionServer() {
  if (channel_ != nullptr) channel_->Stop();
  if (thread_.joinable()) thread_.join();
}

void ShmSessionServer::Loop() {
  for (;;) {
    absl::StatusOr<std::span<const std::byte>> request = channel_->WaitRequest();
    if (absl::IsCancelled(request.status())) return;
    const uint64_t bytes = request.ok() ? Serve(*request) : Error(request.status());
    channel_->Reply(bytes);
    requests_served_->fetch_add(1, std::memory_order_relaxed);
  }
}

uint64_t ShmSessionServer::Error(const absl::Status& status) {
  std::span<std::byte> area = channel_->response_area();
  shm::ResponseHeader header{};
  header.code = static_cast<uint32_t>(status.code());
  const uint64_t room = area.size() > shm::kPayloadOffset ? area.size() - shm::kPayloadOffset : 0;
  const uint64_t text = std::min<uint64_t>(status.message().size(), std::min<uint64_t>(room, 4096));
  header.message_bytes = static_cast<uint32_t>(text);
  std::memcpy(area.data(), &header, std::min<uint64_t>(sizeof(header), area.size()));
  std::memcpy(area.data() + shm::kPayloadOffset, status.message().data(), text);
  return shm::kPayloadOffset + text;
}

uint64_t ShmSessionServer::Serve(std::span<const std::byte> message) {
  if (message.size() < shm::kPayloadOffset) {
    return Error(absl::InvalidArgumentError(
        absl::StrCat("shm request of ", message.size(), " bytes has no header")));
  }
  ShmRequestView request;
  std::memcpy(&request.header, message.data(), sizeof(request.header));
  request.message = message;
  switch (static_cast<shm::Kind>(request.header.kind)) {
    case shm::Kind::kAttend:
      return ServeAttend(request);
    case shm::Kind::kAppend:
      return ServeAppend(request);
  }
  return Error(absl::InvalidArgumentError(
      absl::StrCat("shm request kind ", request.header.kind, " is unknown")));
}

uint64_t ShmSessionServer::ServeAttend(const ShmRequestView& request) {
  const shm::RequestHeader& h = request.header;
  const uint32_t num_kv_heads = geometry_.num_q_heads / geometry_.group;
  const std::optional<shm::AttendRequestLayout> in = shm::AttendRequestLayoutFor(
      h.num_tokens, geometry_.num_q_heads, geometry_.head_dim, num_kv_heads, h.pages_per_head);
  if (!in || in->end != request.message.size()) {
    return Error(absl::InvalidArgumentError(absl::StrCat(
        "shm attend request of ", request.message.size(), " bytes does not hold q [",
        h.num_tokens, ", ", geometry_.num_q_heads, ", ", geometry_.head_dim, "] and pages [",
        h.num_tokens, ", ", num_kv_heads, ", ", h.pages_per_head, "]")));
  }
  const std::span<const float> q(
      reinterpret_cast<const float*>(request.message.data() + in->q), in->q_floats);
  const std::span<const int32_t> pages(
      reinterpret_cast<const int32_t*>(request.message.data() + in->pages), in->page_ids);
  RawAttendOutput out;
  std::span<std::byte> area = channel_->response_area();
  // The answer is laid out once the node knows the layer's owned kv heads (H_own).
  const absl::Status status = node_->AttendRaw(
      session_id_, h.layer, q, h.num_tokens, [&](size_t own) -> absl::StatusOr<RawAttendOutput*> {
        const std::optional<shm::AttendLayout> layout =
            shm::AttendLayoutFor(own, h.num_tokens, geometry_.group, geometry_.head_dim);
        if (!layout || layout->end > area.size()) {
          return absl::ResourceExhaustedError(
              absl::StrCat("the answer for ", h.num_tokens, " query tokens x ", own,
                           " kv heads does not fit the shm response area of ", area.size(),
                           " bytes; send it over gRPC"));
        }
        std::byte* base = area.data();
        out.kv_heads = {reinterpret_cast<uint32_t*>(base + layout->kv_heads), own};
        out.selected = {reinterpret_cast<uint64_t*>(base + layout->selected), own};
        out.held = {reinterpret_cast<uint64_t*>(base + layout->held), own};
        out.o = {reinterpret_cast<float*>(base + layout->o), layout->rows * geometry_.head_dim};
        out.lse = {reinterpret_cast<float*>(base + layout->lse), layout->rows};
        return &out;
      },
      pages, h.pages_per_head);
  if (!status.ok()) return Error(status);
  shm::ResponseHeader header{};
  header.num_heads = static_cast<uint32_t>(out.kv_heads.size());
  header.num_tokens = h.num_tokens;
  header.group = geometry_.group;
  header.head_dim = geometry_.head_dim;
  header.compute_micros = out.compute_micros;
  header.bytes_scanned = out.bytes_scanned;
  std::memcpy(area.data(), &header, sizeof(header));
  return shm::AttendLayoutFor(out.kv_heads.size(), h.num_tokens, geometry_.group,
                              geometry_.head_dim)
      ->end;
}

uint64_t ShmSessionServer::ServeAppend(const ShmRequestView& request) {
  const shm::RequestHeader& h = request.header;
  const uint64_t base = h.payload_offset == 0 ? shm::kPayloadOffset : h.payload_offset;
  const std::optional<shm::AppendLayout> layout =
      shm::AppendLayoutFor(h.num_heads, h.num_tokens, geometry_.kv_row_bytes, base);
  if (!layout || layout->end != request.message.size()) {
    return Error(absl::InvalidArgumentError(
        absl::StrCat("shm append request of ", request.message.size(), " bytes does not hold ",
                     h.num_heads, " heads x ", h.num_tokens, " entries")));
  }
  const uint32_t num_kv_heads = geometry_.num_q_heads / geometry_.group;
  if (h.num_heads > num_kv_heads) {
    return Error(absl::InvalidArgumentError(
        absl::StrCat(h.num_heads, " kv_heads listed, layer has ", num_kv_heads)));
  }
  // The head list is copied: the node validates it and then uses it.
  std::vector<uint32_t> heads(h.num_heads);
  std::memcpy(heads.data(), request.message.data() + layout->heads, heads.size() * 4);
  const std::byte* m = request.message.data();
  v1::AppendKvResponse totals;
  const absl::Status status =
      node_->AppendKvRaw(session_id_, h.layer, heads, {m + layout->k, layout->kv_bytes},
                         {m + layout->v, layout->kv_bytes}, {m + layout->maw, layout->maw_bytes},
                         h.num_tokens, h.window_entries, &totals);
  if (!status.ok()) return Error(status);
  shm::ResponseHeader header{};
  header.entries_appended = totals.entries_appended();
  header.entries_selected = totals.entries_selected();
  std::memcpy(channel_->response_area().data(), &header, sizeof(header));
  return shm::kPayloadOffset;
}

}  // namespace tandem::cpu_attention
