#include "shm_request_handler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/shm_protocol.h"

namespace tandem::cpu_attention {
namespace {

// A request as read: the header copied out of the message (so the checks and the use see the
// same values), and the whole message.
struct ShmRequestView {
  shm::RequestHeader header;
  std::span<const std::byte> message;
};

uint64_t ServeAttend(CpuAttentionNode& node, const std::string& session_id,
                     const ShmSessionGeometry& geometry, const ShmRequestView& request,
                     std::span<std::byte> area) {
  const auto received = std::chrono::steady_clock::now();
  const shm::RequestHeader& h = request.header;
  if (geometry.group == 0) {
    return ShmErrorReply(absl::FailedPreconditionError("shm session has no geometry"), area);
  }
  const uint32_t num_kv_heads = geometry.num_q_heads / geometry.group;
  const std::optional<shm::AttendRequestLayout> in = shm::AttendRequestLayoutFor(
      h.num_tokens, geometry.num_q_heads, geometry.head_dim, num_kv_heads, h.pages_per_head);
  if (!in || in->end != request.message.size()) {
    return ShmErrorReply(
        absl::InvalidArgumentError(absl::StrCat(
            "shm attend request of ", request.message.size(), " bytes does not hold q [",
            h.num_tokens, ", ", geometry.num_q_heads, ", ", geometry.head_dim, "] and pages [",
            h.num_tokens, ", ", num_kv_heads, ", ", h.pages_per_head, "]")),
        area);
  }
  const std::span<const float> q(reinterpret_cast<const float*>(request.message.data() + in->q),
                                 in->q_floats);
  const std::span<const int32_t> pages(
      reinterpret_cast<const int32_t*>(request.message.data() + in->pages), in->page_ids);
  RawAttendOutput out;
  // The answer is laid out once the node knows the layer's owned kv heads (H_own).
  const absl::Status status = node.AttendRaw(
      session_id, h.layer, q, h.num_tokens,
      [&](size_t own) -> absl::StatusOr<RawAttendOutput*> {
        const std::optional<shm::AttendLayout> layout =
            shm::AttendLayoutFor(own, h.num_tokens, geometry.group, geometry.head_dim);
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
        out.o = {reinterpret_cast<float*>(base + layout->o), layout->rows * geometry.head_dim};
        out.lse = {reinterpret_cast<float*>(base + layout->lse), layout->rows};
        return &out;
      },
      pages, h.pages_per_head);
  if (!status.ok()) return ShmErrorReply(status, area);
  shm::ResponseHeader header{};
  header.num_heads = static_cast<uint32_t>(out.kv_heads.size());
  header.num_tokens = h.num_tokens;
  header.group = geometry.group;
  header.head_dim = geometry.head_dim;
  header.compute_micros = out.compute_micros;
  header.bytes_scanned = out.bytes_scanned;
  header.handle_micros = static_cast<uint64_t>(
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - received)
          .count());
  std::memcpy(area.data(), &header, sizeof(header));
  return shm::AttendLayoutFor(out.kv_heads.size(), h.num_tokens, geometry.group, geometry.head_dim)
      ->end;
}

uint64_t ServeAppend(CpuAttentionNode& node, const std::string& session_id,
                     const ShmSessionGeometry& geometry, const ShmRequestView& request,
                     std::span<std::byte> area) {
  const shm::RequestHeader& h = request.header;
  const uint64_t base = h.payload_offset == 0 ? shm::kPayloadOffset : h.payload_offset;
  const std::optional<shm::AppendLayout> layout =
      shm::AppendLayoutFor(h.num_heads, h.num_tokens, geometry.kv_row_bytes, base);
  if (!layout || layout->end != request.message.size()) {
    return ShmErrorReply(
        absl::InvalidArgumentError(absl::StrCat("shm append request of ", request.message.size(),
                                                " bytes does not hold ", h.num_heads, " heads x ",
                                                h.num_tokens, " entries")),
        area);
  }
  const uint32_t num_kv_heads = geometry.group == 0 ? 0 : geometry.num_q_heads / geometry.group;
  if (h.num_heads > num_kv_heads) {
    return ShmErrorReply(absl::InvalidArgumentError(absl::StrCat(
                             h.num_heads, " kv_heads listed, layer has ", num_kv_heads)),
                         area);
  }
  // The head list is copied: the node validates it and then uses it. (No memcpy for an empty
  // list: its data() may be null, and memcpy from or to null is undefined even for 0 bytes.)
  std::vector<uint32_t> heads(h.num_heads);
  if (!heads.empty()) {
    std::memcpy(heads.data(), request.message.data() + layout->heads, heads.size() * 4);
  }
  const std::byte* m = request.message.data();
  v1::AppendKvResponse totals;
  const absl::Status status =
      node.AppendKvRaw(session_id, h.layer, heads, {m + layout->k, layout->kv_bytes},
                       {m + layout->v, layout->kv_bytes}, {m + layout->maw, layout->maw_bytes},
                       h.num_tokens, h.window_entries, &totals);
  if (!status.ok()) return ShmErrorReply(status, area);
  shm::ResponseHeader header{};
  header.entries_appended = totals.entries_appended();
  header.entries_selected = totals.entries_selected();
  std::memcpy(area.data(), &header, sizeof(header));
  return shm::kPayloadOffset;
}

}  // namespace

uint64_t ShmErrorReply(const absl::Status& status, std::span<std::byte> response) {
  shm::ResponseHeader header{};
  header.code = static_cast<uint32_t>(status.code());
  const uint64_t room =
      response.size() > shm::kPayloadOffset ? response.size() - shm::kPayloadOffset : 0;
  const uint64_t text = std::min<uint64_t>(status.message().size(), std::min<uint64_t>(room, 4096));
  header.message_bytes = static_cast<uint32_t>(text);
  std::memcpy(response.data(), &header, std::min<uint64_t>(sizeof(header), response.size()));
  if (text > 0) {
    std::memcpy(response.data() + shm::kPayloadOffset, status.message().data(), text);
  }
  return shm::kPayloadOffset + text;
}

uint64_t ServeShmRequest(CpuAttentionNode& node, const std::string& session_id,
                         const ShmSessionGeometry& geometry, std::span<const std::byte> request,
                         std::span<std::byte> response) {
  if (request.size() < shm::kPayloadOffset) {
    return ShmErrorReply(absl::InvalidArgumentError(absl::StrCat("shm request of ", request.size(),
                                                                 " bytes has no header")),
                         response);
  }
  ShmRequestView view;
  std::memcpy(&view.header, request.data(), sizeof(view.header));
  view.message = request;
  switch (static_cast<shm::Kind>(view.header.kind)) {
    case shm::Kind::kAttend:
      return ServeAttend(node, session_id, geometry, view, response);
    case shm::Kind::kAppend:
      return ServeAppend(node, session_id, geometry, view, response);
  }
  return ShmErrorReply(absl::InvalidArgumentError(
                           absl::StrCat("shm request kind ", view.header.kind, " is unknown")),
                       response);
}

}  // namespace tandem::cpu_attention
