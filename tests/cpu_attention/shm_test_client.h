// A test client of a session's shared-memory channel (shm_channel.h), speaking
// shm_protocol.h: raw calls, Attend (with or without pages) and AppendKv.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tandem/cpu_attention/shm_channel.h"
#include "tandem/cpu_attention/shm_protocol.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention::testing {

using Clock = ShmChannel::Clock;

// The client side of one session's channel, speaking shm_protocol.h.
class ShmClient {
 public:
  explicit ShmClient(uint64_t request_bytes = 4 << 20, uint64_t response_bytes = 4 << 20) {
    ShmChannelOptions o;
    o.request_capacity = request_bytes;
    o.response_capacity = response_bytes;
    auto ch = ShmChannel::Create(o);
    EXPECT_TRUE(ch.ok()) << ch.status();
    channel_ = std::move(*ch);
  }
  void Describe(v1::OpenSessionRequest* r) const {
    r->mutable_shm()->set_name(channel_->name());
    r->mutable_shm()->set_segment_bytes(channel_->segment_bytes());
    r->mutable_shm()->set_nonce(channel_->nonce());
  }
  ShmChannel& channel() { return *channel_; }

  // Sends raw request bytes (header + payload) and returns the answer's status and header.
  absl::Status Call(const shm::RequestHeader& header, const void* payload, size_t payload_bytes,
                    shm::ResponseHeader* out, int deadline_ms = 10000) {
    std::memcpy(channel_->request_area().data(), &header, sizeof(header));
    std::memcpy(channel_->request_area().data() + shm::kPayloadOffset, payload, payload_bytes);
    if (absl::Status s = channel_->Send(shm::kPayloadOffset + payload_bytes); !s.ok()) return s;
    auto answer = channel_->WaitResponse(Clock::now() + std::chrono::milliseconds(deadline_ms));
    if (!answer.ok()) return answer.status();
    answer_ = *answer;
    std::memcpy(out, answer->data(), sizeof(*out));
    if (out->code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(out->code),
          std::string(reinterpret_cast<const char*>(answer->data()) + shm::kPayloadOffset,
                      out->message_bytes));
    }
    return absl::OkStatus();
  }

  // Attend of q [T, H_q, D] f32 and, when pages_per_head > 0, pages [T, H_kv, pages_per_head]
  // (laid out by AttendRequestLayoutFor); fills an AttendResult like the proto path's.
  absl::Status Attend(uint32_t layer, const std::vector<float>& q, uint32_t tokens,
                      v1::AttendResult* result, const std::vector<int32_t>& pages = {},
                      uint32_t pages_per_head = 0) {
    shm::RequestHeader h{};
    h.kind = static_cast<uint32_t>(shm::Kind::kAttend);
    h.layer = layer;
    h.num_tokens = tokens;
    h.pages_per_head = pages_per_head;
    std::vector<std::byte> payload(q.size() * 4);
    std::memcpy(payload.data(), q.data(), q.size() * 4);
    if (pages_per_head > 0) {
      // The pages start at the next 64-byte boundary after q (shm_protocol.h).
      const uint64_t at = shm::Align64(shm::kPayloadOffset + q.size() * 4) - shm::kPayloadOffset;
      payload.resize(at + pages.size() * 4);
      // (No memcpy of an empty list: its data() may be null, undefined even for 0 bytes.)
      if (!pages.empty()) std::memcpy(payload.data() + at, pages.data(), pages.size() * 4);
    }
    shm::ResponseHeader r;
    if (absl::Status s = Call(h, payload.data(), payload.size(), &r); !s.ok()) return s;
    const auto layout = shm::AttendLayoutFor(r.num_heads, r.num_tokens, r.group, r.head_dim);
    EXPECT_TRUE(layout && layout->end <= answer_.size());
    const std::byte* base = answer_.data();
    for (uint32_t i = 0; i < r.num_heads; ++i) {
      uint32_t head;
      uint64_t sel, held;
      std::memcpy(&head, base + layout->kv_heads + 4 * i, 4);
      std::memcpy(&sel, base + layout->selected + 8 * i, 8);
      std::memcpy(&held, base + layout->held + 8 * i, 8);
      result->add_kv_heads(head);
      result->add_selected(sel);
      result->add_held(held);
    }
    result->mutable_o()->mutable_data()->assign(reinterpret_cast<const char*>(base + layout->o),
                                                layout->rows * r.head_dim * 4);
    result->mutable_lse()->mutable_data()->assign(reinterpret_cast<const char*>(base + layout->lse),
                                                  layout->rows * 4);
    return absl::OkStatus();
  }

  // AppendKv of the proto message's tensors over shm.
  absl::Status Append(const v1::AppendKvRequest& m) {
    const uint64_t heads = m.kv_heads_size();
    const uint64_t n = m.maw().shape(1);
    const uint64_t row = m.k().data().size() / (heads * n);
    const auto layout = shm::AppendLayoutFor(heads, n, row);
    std::vector<std::byte> payload(layout->end - shm::kPayloadOffset);
    auto put = [&](uint64_t offset, const void* src, size_t bytes) {
      std::memcpy(payload.data() + offset - shm::kPayloadOffset, src, bytes);
    };
    put(layout->heads, m.kv_heads().data(), heads * 4);
    put(layout->k, m.k().data().data(), m.k().data().size());
    put(layout->v, m.v().data().data(), m.v().data().size());
    put(layout->maw, m.maw().data().data(), m.maw().data().size());
    shm::RequestHeader h{};
    h.kind = static_cast<uint32_t>(shm::Kind::kAppend);
    h.layer = m.layer();
    h.num_tokens = static_cast<uint32_t>(n);
    h.num_heads = static_cast<uint32_t>(heads);
    h.window_entries = m.window_entries();
    shm::ResponseHeader r;
    return Call(h, payload.data(), payload.size(), &r);
  }

 private:
  std::unique_ptr<ShmChannel> channel_;
  std::span<const std::byte> answer_;
};

}  // namespace tandem::cpu_attention::testing
