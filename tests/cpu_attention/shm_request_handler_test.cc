// ServeShmRequest (shm_request_handler.h), the decoder and dispatcher every shm channel thread
// runs, called directly with heap buffers: well-formed Attend and AppendKv answers, and the
// malformed messages the fuzz target (tests/fuzz/shm_request_fuzzer) found or probes, each
// answered with a status and message instead of undefined behaviour.
#include "shm_request_handler.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "service_test_util.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/shm_protocol.h"

namespace tandem::cpu_attention {
namespace {

using testing::Geometry;
using testing::OpenRequest;

class ShmRequestHandlerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NodeOptions o;
    o.pool_bytes = 16ull << 20;
    o.block_tokens = 16;
    o.threads = 1;
    o.allow_shm = false;
    auto node = CpuAttentionNode::Create(o);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node);
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(node_->OpenSession(OpenRequest("s", g_, 16, false, 0.5f), &opened).ok());
    geometry_.num_q_heads = g_.q_heads;
    geometry_.head_dim = g_.head_dim;
    geometry_.group = g_.group();
    geometry_.kv_row_bytes = g_.head_dim * 4;
  }

  // Serves `message` (copied into 64-byte aligned memory, as the channel holds it).
  shm::ResponseHeader Serve(const std::vector<uint8_t>& message, uint64_t* bytes = nullptr) {
    std::vector<uint64_t> aligned((message.size() + 7) / 8 + 8);
    uint8_t* base = reinterpret_cast<uint8_t*>(aligned.data());
    while (reinterpret_cast<uintptr_t>(base) % 64 != 0) ++base;
    if (!message.empty()) std::memcpy(base, message.data(), message.size());
    const uint64_t n = ServeShmRequest(
        *node_, "s", geometry_, {reinterpret_cast<const std::byte*>(base), message.size()},
        {reinterpret_cast<std::byte*>(area_.data()), area_.size() * 8});
    if (bytes != nullptr) *bytes = n;
    shm::ResponseHeader header;
    std::memcpy(&header, area_.data(), sizeof(header));
    return header;
  }

  std::string Message(const shm::ResponseHeader& header) const {
    return std::string(reinterpret_cast<const char*>(area_.data()) + shm::kPayloadOffset,
                       header.message_bytes);
  }

  static std::vector<uint8_t> Header(shm::Kind kind, uint32_t layer, uint32_t tokens,
                                     uint32_t heads) {
    shm::RequestHeader h{};
    h.kind = static_cast<uint32_t>(kind);
    h.layer = layer;
    h.num_tokens = tokens;
    h.num_heads = heads;
    h.window_entries = 1;
    std::vector<uint8_t> m(sizeof(h));
    std::memcpy(m.data(), &h, sizeof(h));
    return m;
  }

  Geometry g_{2, 4, 2, 8};
  ShmSessionGeometry geometry_;
  std::unique_ptr<CpuAttentionNode> node_;
  std::vector<uint64_t> area_ = std::vector<uint64_t>(8192);  // 64 KiB response area
};

// Found by the fuzzer: an append listing no kv heads copied its (empty) head list with
// memcpy(nullptr, ..., 0), which UBSan reports as undefined behaviour.
TEST_F(ShmRequestHandlerTest, AppendWithNoHeadsIsAnsweredWithoutUndefinedBehaviour) {
  uint64_t bytes = 0;
  const shm::ResponseHeader r = Serve(Header(shm::Kind::kAppend, 0, 0, 0), &bytes);
  // No heads = every owned head; 0 entries each is refused by the node's own check.
  EXPECT_EQ(r.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(Message(r).find("num_tokens in 1..65536, got num_tokens 0"), std::string::npos)
      << Message(r);
  EXPECT_EQ(bytes, shm::kPayloadOffset + r.message_bytes);
}

TEST_F(ShmRequestHandlerTest, AppendThenAttendAnswersInTheProtocolLayout) {
  // 3 entries for kv head 1 of layer 0: heads | k | v | maw at AppendLayoutFor's offsets.
  const auto layout = shm::AppendLayoutFor(1, 3, geometry_.kv_row_bytes);
  ASSERT_TRUE(layout.has_value());
  std::vector<uint8_t> append = Header(shm::Kind::kAppend, 0, 3, 1);
  append.resize(layout->end);
  const uint32_t head = 1;
  std::memcpy(append.data() + layout->heads, &head, 4);
  std::vector<float> kv(3 * g_.head_dim, 0.5f), maw = {0.1f, 2.0f, 0.3f};
  std::memcpy(append.data() + layout->k, kv.data(), layout->kv_bytes);
  std::memcpy(append.data() + layout->v, kv.data(), layout->kv_bytes);
  std::memcpy(append.data() + layout->maw, maw.data(), layout->maw_bytes);
  shm::ResponseHeader r = Serve(append);
  ASSERT_EQ(r.code, 0u) << Message(r);
  EXPECT_EQ(r.entries_appended, 3u);

  const auto in = shm::AttendRequestLayoutFor(1, g_.q_heads, g_.head_dim, g_.kv_heads, 0);
  ASSERT_TRUE(in.has_value());
  std::vector<uint8_t> attend = Header(shm::Kind::kAttend, 0, 1, 0);
  attend.resize(in->end);
  std::vector<float> q(g_.q_heads * g_.head_dim, 0.25f);
  std::memcpy(attend.data() + in->q, q.data(), q.size() * 4);
  uint64_t bytes = 0;
  r = Serve(attend, &bytes);
  ASSERT_EQ(r.code, 0u) << Message(r);
  EXPECT_EQ(r.num_heads, g_.kv_heads);
  EXPECT_EQ(r.num_tokens, 1u);
  EXPECT_EQ(bytes, shm::AttendLayoutFor(g_.kv_heads, 1, g_.group(), g_.head_dim)->end);
  // kv head 1 holds 3 entries of v = 0.5 everywhere, so its output rows are exactly 0.5.
  const auto out = shm::AttendLayoutFor(g_.kv_heads, 1, g_.group(), g_.head_dim);
  const float* o =
      reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(area_.data()) + out->o);
  for (uint32_t d = 0; d < g_.head_dim; ++d) EXPECT_FLOAT_EQ(o[g_.group() * g_.head_dim + d], 0.5f);
}

TEST_F(ShmRequestHandlerTest, MalformedMessagesAreRefusedWithAMessage) {
  shm::ResponseHeader r = Serve(std::vector<uint8_t>(10));
  EXPECT_EQ(r.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(Message(r), "shm request of 10 bytes has no header");

  r = Serve(Header(static_cast<shm::Kind>(7), 0, 0, 0));
  EXPECT_EQ(Message(r), "shm request kind 7 is unknown");

  // An attend whose size does not hold its q.
  r = Serve(Header(shm::Kind::kAttend, 0, 2, 0));
  EXPECT_EQ(r.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(Message(r).find("does not hold q [2, 4, 8]"), std::string::npos) << Message(r);

  // An append of more heads than the layer has (sized exactly for them).
  const auto layout = shm::AppendLayoutFor(3, 1, geometry_.kv_row_bytes);
  std::vector<uint8_t> append = Header(shm::Kind::kAppend, 0, 1, 3);
  append.resize(layout->end);
  r = Serve(append);
  EXPECT_EQ(Message(r), "3 kv_heads listed, layer has 2");
}

}  // namespace
}  // namespace tandem::cpu_attention
