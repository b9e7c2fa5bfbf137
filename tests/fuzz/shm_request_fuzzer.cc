// Fuzzes the shared-memory message decoder and the node's raw entry points behind it
// (ServeShmRequest: the code a session's channel thread runs for every request) with one
// message against a small live session (node_fuzz_util.h), answered into a 64 KiB response area.
//
// Input: byte 0 picks the base session's kind, the rest is the request message (a 64-byte
// shm::RequestHeader and its arrays). The answer must fit the area and, when OK, be laid out as
// shm_protocol.h says; afterwards the session is closed and the pool must be empty.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "node_fuzz_util.h"
#include "shm_request_handler.h"
#include "tandem/cpu_attention/shm_protocol.h"

namespace ca = tandem::cpu_attention;
namespace shm = tandem::cpu_attention::shm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ca::CpuAttentionNode* node = ca::fuzz::MakeNode().release();  // lives for the process
  if (size < 1) return 0;
  const auto kind = static_cast<ca::fuzz::BaseKind>(data[0] % 3);
  ca::fuzz::OpenBase(*node, kind);

  ca::ShmSessionGeometry geometry;
  geometry.num_q_heads = ca::fuzz::kQHeads;
  geometry.head_dim = ca::fuzz::kHeadDim;
  geometry.group = ca::fuzz::kQHeads / ca::fuzz::kKvHeads;
  geometry.kv_row_bytes = ca::fuzz::kHeadDim * (kind == ca::fuzz::BaseKind::kMawBf16 ? 2 : 4);
  // The message as the channel holds it: 64-byte aligned (libFuzzer's copy is only malloc's).
  std::vector<uint64_t> message((size - 1 + 7) / 8);
  if (size > 1) std::memcpy(message.data(), data + 1, size - 1);
  std::vector<uint64_t> area(64 << 10 >> 3);
  const std::span<const std::byte> request(reinterpret_cast<const std::byte*>(message.data()),
                                           size - 1);
  const std::span<std::byte> response(reinterpret_cast<std::byte*>(area.data()), area.size() * 8);
  const uint64_t bytes =
      ca::ServeShmRequest(*node, ca::fuzz::kSessionId, geometry, request, response);
  FUZZ_CHECK(bytes >= shm::kPayloadOffset && bytes <= response.size(),
             absl::StrCat("answer of ", bytes, " bytes"));
  shm::ResponseHeader header;
  std::memcpy(&header, response.data(), sizeof(header));
  if (header.code != 0) {
    FUZZ_CHECK(header.message_bytes > 0 && shm::kPayloadOffset + header.message_bytes == bytes,
               "error answer without its message");
  } else {
    shm::RequestHeader h;
    std::memcpy(&h, request.data(), sizeof(h));
    if (static_cast<shm::Kind>(h.kind) == shm::Kind::kAttend) {
      const auto layout =
          shm::AttendLayoutFor(header.num_heads, header.num_tokens, header.group, header.head_dim);
      FUZZ_CHECK(layout && layout->end == bytes && header.num_tokens == h.num_tokens &&
                     header.num_heads <= ca::fuzz::kKvHeads,
                 "attend answer layout");
    } else {
      FUZZ_CHECK(bytes == shm::kPayloadOffset, "append answer size");
    }
  }
  ca::fuzz::Close(*node, ca::fuzz::kSessionId);
  ca::fuzz::CheckEmpty(*node);
  return 0;
}
