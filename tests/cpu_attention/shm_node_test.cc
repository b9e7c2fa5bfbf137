// The node's shared-memory transport: a session opened with a shm channel answers Attend over
// it with exactly the bytes of the proto path, AppendKv over it stores what the proto path
// stores, errors come back as statuses with the node's messages, a node that cannot map the
// channel declines it, and CloseSession stops the channel's thread.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "migration_test_util.h"
#include "service_test_util.h"
#include "shm_test_client.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/shm_channel.h"
#include "tandem/cpu_attention/shm_protocol.h"
#include "tandem/cpu_attention/tensor_codec.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ShmClient;
using Clock = ShmChannel::Clock;

std::unique_ptr<CpuAttentionNode> MakeNode(bool allow_shm = true) {
  NodeOptions o;
  o.pool_bytes = 256ull << 20;
  o.block_tokens = 16;
  o.threads = 2;
  o.allow_shm = allow_shm;
  auto node = CpuAttentionNode::Create(o);
  EXPECT_TRUE(node.ok());
  return std::move(*node);
}

v1::AttendRequest ProtoAttend(const std::string& id, uint32_t layer, const std::vector<float>& q,
                              uint32_t tokens, const Geometry& g) {
  v1::AttendRequest r;
  r.set_layer(layer);
  auto* query = r.add_queries();
  query->set_session_id(id);
  const int64_t shape[] = {tokens, g.q_heads, g.head_dim};
  EncodeF32(q, shape, query->mutable_q());
  return r;
}

void ExpectSameResult(const v1::AttendResult& proto, const v1::AttendResult& shm) {
  EXPECT_EQ(std::vector<uint32_t>(proto.kv_heads().begin(), proto.kv_heads().end()),
            std::vector<uint32_t>(shm.kv_heads().begin(), shm.kv_heads().end()));
  EXPECT_EQ(std::vector<uint64_t>(proto.selected().begin(), proto.selected().end()),
            std::vector<uint64_t>(shm.selected().begin(), shm.selected().end()));
  EXPECT_EQ(std::vector<uint64_t>(proto.held().begin(), proto.held().end()),
            std::vector<uint64_t>(shm.held().begin(), shm.held().end()));
  ASSERT_EQ(proto.o().data().size(), shm.o().data().size());
  ASSERT_EQ(proto.lse().data().size(), shm.lse().data().size());
  EXPECT_EQ(proto.o().data(), shm.o().data()) << "o differs bytewise";
  EXPECT_EQ(proto.lse().data(), shm.lse().data()) << "lse differs bytewise";
}

class ShmNodeTest : public ::testing::Test {
 protected:
  // Opens `id` with a shm channel, owning (layer 0: head 1) and (layer 1: heads 0, 1), so the
  // owned subset differs per layer.
  void Open(const std::string& id, ShmClient* client) {
    v1::OpenSessionRequest r = OpenRequest(id, g_, 16, /*bf16=*/true, /*beta=*/0.5f);
    for (auto [layer, head] : {std::pair{0u, 1u}, {1u, 0u}, {1u, 1u}}) {
      auto* s = r.add_shards();
      s->set_layer(layer);
      s->set_kv_head(head);
    }
    if (client != nullptr) client->Describe(&r);
    v1::OpenSessionResponse resp;
    ASSERT_TRUE(node_->OpenSession(r, &resp).ok());
    EXPECT_EQ(resp.transport(), client != nullptr ? v1::TRANSPORT_SHM : v1::TRANSPORT_GRPC)
        << resp.shm_declined();
  }
  // Entries of layer 0 (head 1) and layer 1 (heads 0, 1), `count` per head.
  v1::AppendKvRequest Chunk(const std::string& id, uint32_t layer, size_t first, size_t count) {
    v1::AppendKvRequest m;
    if (layer == 0) {
      m = AppendRequest(id, 0, {entries_[0][1]}, first, count, g_.head_dim, true, 64);
      m.add_kv_heads(1);
    } else {
      m = AppendRequest(id, 1, entries_[1], first, count, g_.head_dim, true, 64);
      m.add_kv_heads(0);
      m.add_kv_heads(1);
    }
    return m;
  }
  void SetUp() override {
    node_ = MakeNode();
    std::mt19937 rng(7);
    entries_.assign(2, std::vector<HeadEntries>(2));
    for (auto& layer : entries_) AddRandomEntries(layer, 300, g_.head_dim, true, 0.02f, rng);
  }

  Geometry g_;  // 2 layers, 8 q heads, 2 kv heads, D 64
  std::unique_ptr<CpuAttentionNode> node_;
  std::vector<std::vector<HeadEntries>> entries_;  // [layer][kv head]
};

TEST_F(ShmNodeTest, AttendOverShmReturnsTheProtoBytes) {
  ShmClient client;
  Open("a", &client);
  v1::AppendKvResponse totals;
  for (uint32_t layer : {0u, 1u}) {
    ASSERT_TRUE(node_->AppendKv(Chunk("a", layer, 0, 200), &totals).ok());
    ASSERT_TRUE(node_->AppendKv(Chunk("a", layer, 200, 100), &totals).ok());
  }
  std::mt19937 rng(11);
  for (uint32_t layer : {0u, 1u}) {
    for (uint32_t tokens : {1u, 3u}) {
      const std::vector<float> q = RandomQueries(tokens, g_, rng);
      v1::AttendResponse proto;
      ASSERT_TRUE(node_->Attend(ProtoAttend("a", layer, q, tokens, g_), &proto).ok());
      v1::AttendResult shm;
      const absl::Status s = client.Attend(layer, q, tokens, &shm);
      ASSERT_TRUE(s.ok()) << s;
      ExpectSameResult(proto.results(0), shm);
      EXPECT_EQ(shm.kv_heads_size(), layer == 0 ? 1 : 2);
      EXPECT_GT(shm.selected(0), 0u);
      EXPECT_LT(shm.selected(0), 300u);  // beta 0.5 drops some entries
    }
  }
  const v1::StatsResponse stats = node_->Stats();
  EXPECT_EQ(stats.shm_channels(), 1u);
  EXPECT_EQ(stats.shm_requests(), 4u);
}

// The shm answer is laid out for the heads the session owns when the request is served, so it
// follows ReshardSession: heads added, dropped, a layer left with none.
TEST_F(ShmNodeTest, AttendOverShmFollowsReshard) {
  ShmClient client;
  Open("a", &client);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node_->AppendKv(Chunk("a", 1, 0, 120), &totals).ok());
  ASSERT_TRUE(node_->AppendKv(Chunk("a", 0, 0, 50), &totals).ok());
  v1::ReshardSessionResponse resharded;
  ASSERT_TRUE(
      node_->ReshardSession(testing::ReshardRequest("a", {{0, 0}}, {{1, 0}}), &resharded).ok());
  EXPECT_EQ(resharded.shards(), 3u);
  std::mt19937 rng(12);
  for (uint32_t tokens : {1u, 2u}) {
    for (uint32_t layer : {0u, 1u}) {
      const std::vector<float> q = RandomQueries(tokens, g_, rng);
      v1::AttendResponse proto;
      ASSERT_TRUE(node_->Attend(ProtoAttend("a", layer, q, tokens, g_), &proto).ok());
      v1::AttendResult shm;
      const absl::Status s = client.Attend(layer, q, tokens, &shm);
      ASSERT_TRUE(s.ok()) << s;
      ExpectSameResult(proto.results(0), shm);
      if (layer == 0) {
        ASSERT_EQ(shm.kv_heads_size(), 2);
        EXPECT_EQ(shm.held(0), 0u);  // the added head 0, empty
        EXPECT_EQ(shm.held(1), 50u);
      } else {
        ASSERT_EQ(shm.kv_heads_size(), 1);
        EXPECT_EQ(shm.kv_heads(0), 1u);
        EXPECT_EQ(shm.held(0), 120u);
      }
    }
  }
  // A layer owning nothing: an empty answer, not an error.
  ASSERT_TRUE(node_->ReshardSession(testing::ReshardRequest("a", {}, {{1, 1}}), &resharded).ok());
  const std::vector<float> q = RandomQueries(2, g_, rng);
  v1::AttendResult shm;
  const absl::Status s = client.Attend(1, q, 2, &shm);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(shm.kv_heads_size(), 0);
  EXPECT_TRUE(shm.o().data().empty());
}

TEST_F(ShmNodeTest, AppendOverShmStoresWhatTheProtoPathStores) {
  ShmClient client;
  Open("shm", &client);
  Open("proto", nullptr);
  v1::AppendKvResponse totals;
  for (uint32_t layer : {0u, 1u}) {
    for (auto [first, count] : {std::pair<size_t, size_t>{0, 17}, {17, 200}, {217, 83}}) {
      ASSERT_TRUE(node_->AppendKv(Chunk("proto", layer, first, count), &totals).ok());
      const absl::Status s = client.Append(Chunk("shm", layer, first, count));
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  std::mt19937 rng(5);
  for (uint32_t layer : {0u, 1u}) {
    const std::vector<float> q = RandomQueries(2, g_, rng);
    v1::AttendResponse a, b;
    ASSERT_TRUE(node_->Attend(ProtoAttend("proto", layer, q, 2, g_), &a).ok());
    ASSERT_TRUE(node_->Attend(ProtoAttend("shm", layer, q, 2, g_), &b).ok());
    ExpectSameResult(a.results(0), b.results(0));
    EXPECT_EQ(a.results(0).held(0), 300u);
  }
}

TEST_F(ShmNodeTest, AppendArraysMayStartAtAnyAlignedOffset) {
  ShmClient client;
  Open("a", &client);
  const v1::AppendKvRequest m = Chunk("a", 1, 0, 30);
  const auto layout = shm::AppendLayoutFor(2, 30, g_.head_dim * 2, /*base=*/4096);
  ASSERT_TRUE(layout.has_value());
  std::vector<std::byte> payload(layout->end - shm::kPayloadOffset);
  auto put = [&](uint64_t offset, const void* src, size_t bytes) {
    std::memcpy(payload.data() + offset - shm::kPayloadOffset, src, bytes);
  };
  put(layout->heads, m.kv_heads().data(), 8);
  put(layout->k, m.k().data().data(), m.k().data().size());
  put(layout->v, m.v().data().data(), m.v().data().size());
  put(layout->maw, m.maw().data().data(), m.maw().data().size());
  shm::RequestHeader h{};
  h.kind = static_cast<uint32_t>(shm::Kind::kAppend);
  h.layer = 1;
  h.num_tokens = 30;
  h.num_heads = 2;
  h.window_entries = 64;
  h.payload_offset = 4096;
  shm::ResponseHeader out;
  const absl::Status s = client.Call(h, payload.data(), payload.size(), &out);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out.entries_appended, 60u);
  // The same entries over the proto path into another session attend identically.
  Open("b", nullptr);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node_->AppendKv(Chunk("b", 1, 0, 30), &totals).ok());
  std::mt19937 rng(9);
  const std::vector<float> q = RandomQueries(1, g_, rng);
  v1::AttendResponse a, b;
  ASSERT_TRUE(node_->Attend(ProtoAttend("a", 1, q, 1, g_), &a).ok());
  ASSERT_TRUE(node_->Attend(ProtoAttend("b", 1, q, 1, g_), &b).ok());
  ExpectSameResult(a.results(0), b.results(0));
}

TEST_F(ShmNodeTest, BadRequestsOverShmGetTheNodesErrors) {
  ShmClient client;
  Open("a", &client);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node_->AppendKv(Chunk("a", 1, 0, 50), &totals).ok());
  std::mt19937 rng(3);
  std::vector<float> q = RandomQueries(1, g_, rng);
  v1::AttendResult r;

  // A layer out of range: the proto path's message.
  v1::AttendResponse proto;
  const absl::Status proto_status = node_->Attend(ProtoAttend("a", 9, q, 1, g_), &proto);
  absl::Status s = client.Attend(9, q, 1, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), proto_status.message());

  // A NaN in q.
  q[5] = std::numeric_limits<float>::quiet_NaN();
  s = client.Attend(1, q, 1, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element 5"), absl::string_view::npos) << s;
  q[5] = 0.5f;

  // Garbage headers: a token count the message does not hold, an unknown kind, a huge head
  // count, a short message.
  shm::RequestHeader h{};
  shm::ResponseHeader out;
  h.kind = static_cast<uint32_t>(shm::Kind::kAttend);
  h.layer = 1;
  h.num_tokens = 0xffffffffu;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out).code(),
            absl::StatusCode::kInvalidArgument);
  h.kind = 77;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out).code(),
            absl::StatusCode::kInvalidArgument);
  h.kind = static_cast<uint32_t>(shm::Kind::kAppend);
  h.num_tokens = 1;
  h.num_heads = 1u << 30;
  h.window_entries = 64;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out).code(),
            absl::StatusCode::kInvalidArgument);
  h.num_heads = 1;  // arrays at an offset that is not 64-aligned, then past the message
  h.payload_offset = 100;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out).code(),
            absl::StatusCode::kInvalidArgument);
  h.payload_offset = 1u << 30;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client.channel().Send(10).ok());
  auto answer = client.channel().WaitResponse(Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(answer.ok());
  std::memcpy(&out, answer->data(), sizeof(out));
  EXPECT_EQ(out.code, static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));

  // A NaN MAW over shm fails like over proto and changes nothing.
  v1::AppendKvRequest bad = Chunk("a", 1, 50, 10);
  float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.mutable_maw()->mutable_data()->data() + 4 * 3, &nan, 4);
  const absl::Status proto_append = node_->AppendKv(bad, &totals);
  s = client.Append(bad);
  EXPECT_EQ(s.code(), proto_append.code());
  EXPECT_EQ(s.message(), proto_append.message());

  // The session still works and holds only the first 50 entries.
  s = client.Attend(1, q, 1, &r);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(r.held(0), 50u);
}

TEST_F(ShmNodeTest, ChannelsTheNodeCannotMapAreDeclined) {
  ShmClient client;
  // Wrong nonce (what a segment of the same name on another host looks like).
  v1::OpenSessionRequest r = OpenRequest("nonce", g_, 16, true, 0);
  client.Describe(&r);
  r.mutable_shm()->set_nonce(client.channel().nonce() ^ 1);
  v1::OpenSessionResponse resp;
  ASSERT_TRUE(node_->OpenSession(r, &resp).ok());
  EXPECT_EQ(resp.transport(), v1::TRANSPORT_GRPC);
  EXPECT_FALSE(resp.shm_declined().empty());
  // A name that does not exist here.
  r = OpenRequest("missing", g_, 16, true, 0);
  r.mutable_shm()->set_name("/tandem-no-such-segment");
  r.mutable_shm()->set_segment_bytes(1 << 20);
  resp.Clear();
  ASSERT_TRUE(node_->OpenSession(r, &resp).ok());
  EXPECT_EQ(resp.transport(), v1::TRANSPORT_GRPC);
  EXPECT_NE(resp.shm_declined().find("no shm segment"), std::string::npos) << resp.shm_declined();
  // A node with shared memory disabled.
  auto no_shm = MakeNode(/*allow_shm=*/false);
  r = OpenRequest("off", g_, 16, true, 0);
  client.Describe(&r);
  resp.Clear();
  ASSERT_TRUE(no_shm->OpenSession(r, &resp).ok());
  EXPECT_EQ(resp.transport(), v1::TRANSPORT_GRPC);
  EXPECT_FALSE(client.channel().PeerAttached());
  EXPECT_EQ(node_->Stats().shm_channels(), 0u);
}

TEST_F(ShmNodeTest, CloseSessionStopsTheChannel) {
  ShmClient client;
  Open("a", &client);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(client.Append(Chunk("a", 1, 0, 40)).ok());
  EXPECT_GT(node_->Stats().blocks_in_use(), 0u);
  v1::CloseSessionRequest close;
  close.set_session_id("a");
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(node_->CloseSession(close, &closed).ok());
  const v1::StatsResponse stats = node_->Stats();
  EXPECT_EQ(stats.shm_channels(), 0u);
  EXPECT_EQ(stats.blocks_in_use(), 0u);
  // Nobody serves the channel any more: a request times out.
  std::mt19937 rng(1);
  v1::AttendResult r;
  shm::RequestHeader h{};
  h.kind = static_cast<uint32_t>(shm::Kind::kAttend);
  h.layer = 1;
  h.num_tokens = 1;
  const std::vector<float> q = RandomQueries(1, g_, rng);
  shm::ResponseHeader out;
  EXPECT_EQ(client.Call(h, q.data(), q.size() * 4, &out, /*deadline_ms=*/50).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ShmNodeTest, NodeDestructionStopsOpenChannels) {
  ShmClient a, b;
  Open("a", &a);
  Open("b", &b);
  EXPECT_EQ(node_->Stats().shm_channels(), 2u);
  node_.reset();  // must not hang or touch freed sessions
  // Nobody serves the channels any more.
  std::mt19937 rng(1);
  const std::vector<float> q = RandomQueries(1, g_, rng);
  shm::RequestHeader h{};
  h.kind = static_cast<uint32_t>(shm::Kind::kAttend);
  h.layer = 1;
  h.num_tokens = 1;
  shm::ResponseHeader out;
  EXPECT_EQ(a.Call(h, q.data(), q.size() * 4, &out, /*deadline_ms=*/50).code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace tandem::cpu_attention
