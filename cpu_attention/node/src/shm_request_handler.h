// One shared-memory request (shm_protocol.h) from its bytes to its answer: decodes the message
// against the session's geometry, bounding every count by the message size, runs it through
// CpuAttentionNode::AttendRaw / AppendKvRaw and writes the response into a response area.
// ShmSessionServer calls it for each request of its channel; the fuzz target of tests/fuzz calls
// it with heap buffers, so both go through the same decoder.
//
// Thread-safe as the node is; `request` may live in memory another process writes (the header
// is copied once, the node copies the arrays before it validates them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"

namespace tandem::cpu_attention {

class CpuAttentionNode;

// What the channel needs to know about the session to lay out messages. The owned kv heads are
// not here: ReshardSession changes them, so an Attend answer is laid out for the heads the node
// finds under the session's lock (CpuAttentionNode::AttendRaw's output_for).
struct ShmSessionGeometry {
  uint32_t num_q_heads = 0;
  uint32_t head_dim = 0;
  uint32_t group = 0;         // G = H_q / H_kv
  uint32_t kv_row_bytes = 0;  // D * bytes of the kv dtype
};

// Serves `request` for session `session_id` and writes the answer (a shm::ResponseHeader and its
// arrays) at the start of `response`; returns the bytes written. A malformed request, one the
// node refuses, or an answer that does not fit `response` is answered with the status code and
// message (ShmErrorReply), never a crash.
uint64_t ServeShmRequest(CpuAttentionNode& node, const std::string& session_id,
                         const ShmSessionGeometry& geometry, std::span<const std::byte> request,
                         std::span<std::byte> response);

// Writes an error answer for `status` (code, then at most 4096 bytes of its message as far as
// `response` holds them) and returns its size.
uint64_t ShmErrorReply(const absl::Status& status, std::span<std::byte> response);

}  // namespace tandem::cpu_attention
