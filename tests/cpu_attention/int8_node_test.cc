// A node with --node_kv_dtype=int8 (NodeOptions::kv_dtype = kInt8) over loopback gRPC and shared
// memory: the worker's bf16 AppendKv is quantised on arrival; MAW (beta 0 and beta > 0) and page
// attends equal the reference over the dequantised KV; gRPC and shm answer bit-identically; the
// pool is charged int8 blocks (about half of bf16) and gets every byte back at close; shards
// migrate int8 -> bf16 -> int8 and int8 -> int8 (export dequantises to the session's bf16, the
// importer quantises again: the same codes and scales, so the same answers bit for bit); a bad
// --node_kv_dtype is refused with a message, by the library and by the binary.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "child_process.h"
#include "migration_test_util.h"
#include "service_test_util.h"
#include "shm_test_client.h"
#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/kv_store/int8_rows.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;
using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::ExpectHeadMatches;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ShmClient;

constexpr uint32_t kBlock = 16;
constexpr size_t kHeld = 410;  // 26 blocks, the last one partial
constexpr uint32_t kTokens = 2;
constexpr double kInt8Tol = 1e-5;   // relative O error vs the reference over q * scale in f32
constexpr double kBf16Tol = 2e-4;   // a bf16 node (sparse_attention_test.cc)

std::unique_ptr<grpc::ClientContext> Deadline() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  return ctx;
}

// The entries as an int8 node holds them: q * scale as f32, or rounded to bf16.
std::vector<HeadEntries> Dequantised(const std::vector<HeadEntries>& layer, uint32_t D, bool bf16) {
  std::vector<HeadEntries> out = layer;
  for (HeadEntries& h : out) {
    for (std::vector<float>* x : {&h.k, &h.v}) {
      const size_t n = x->size() / D;
      std::vector<std::byte> rows(n * (D + kv_store::kInt8ScaleBytes));
      kv_store::QuantizeRowsInt8(reinterpret_cast<const std::byte*>(x->data()), KvDType::kF32, n, D,
                                 rows.data());
      kv_store::DequantizeRowsInt8(rows.data(), n, D, KvDType::kF32,
                                   reinterpret_cast<std::byte*>(x->data()));
      if (bf16) {
        for (float& v : *x) v = Bf16ToFloat(FloatToBf16(v));
      }
    }
  }
  return out;
}

class Int8NodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (KvDType dtype : {KvDType::kInt8, KvDType::kBf16}) {
      ServerOptions options;
      options.address = "127.0.0.1:0";
      options.node.pool_bytes = 256ull << 20;
      options.node.threads = 2;
      options.node.kv_dtype = dtype;
      options.node.release_free_after = std::chrono::milliseconds(-1);
      auto server = CpuAttentionServer::Start(options);
      ASSERT_TRUE(server.ok()) << server.status();
      stubs_.push_back(v1::CpuAttention::NewStub(grpc::CreateChannel(
          "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials())));
      servers_.push_back(std::move(*server));
    }
    std::mt19937 rng(41);
    layer_.resize(g_.kv_heads);
    AddRandomEntries(layer_, kHeld, g_.head_dim, /*bf16=*/true, 0.01f, rng);
    q_ = RandomQueries(kTokens, g_, rng);
  }

  v1::CpuAttention::Stub& int8() { return *stubs_[0]; }
  v1::CpuAttention::Stub& bf16() { return *stubs_[1]; }

  static v1::OpenSessionRequest Open(const std::string& id, const Geometry& g, float beta,
                                     bool pages) {
    v1::OpenSessionRequest r = OpenRequest(id, g, kBlock, /*bf16=*/true, beta);
    if (pages) {
      r.set_selection(v1::SELECTION_PAGES);
      r.set_page_tokens(16);
    }
    return r;
  }

  grpc::Status OpenOn(v1::CpuAttention::Stub& stub, const v1::OpenSessionRequest& r,
                      v1::OpenSessionResponse* resp = nullptr) {
    v1::OpenSessionResponse ignored;
    return stub.OpenSession(Deadline().get(), r, resp ? resp : &ignored);
  }

  grpc::Status Stream(v1::CpuAttention::Stub& stub, const std::vector<v1::AppendKvRequest>& ms) {
    v1::AppendKvResponse totals;
    auto ctx = Deadline();
    auto writer = stub.AppendKv(ctx.get(), &totals);
    for (const auto& m : ms) writer->Write(m);
    writer->WritesDone();
    return writer->Finish();
  }

  // Layer 1's entries in two messages (the second starts inside a block).
  std::vector<v1::AppendKvRequest> Appends(const std::string& id) const {
    return {AppendRequest(id, 1, layer_, 0, 300, g_.head_dim, true, 64),
            AppendRequest(id, 1, layer_, 300, kHeld - 300, g_.head_dim, true, 64)};
  }

  v1::AttendResult Attend(v1::CpuAttention::Stub& stub, const std::string& id) {
    v1::AttendRequest r;
    r.set_layer(1);
    v1::AttendQuery* query = r.add_queries();
    query->set_session_id(id);
    const int64_t shape[] = {kTokens, g_.q_heads, g_.head_dim};
    EncodeF32(q_, shape, query->mutable_q());
    v1::AttendResponse resp;
    const grpc::Status s = stub.Attend(Deadline().get(), r, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return s.ok() ? resp.results(0) : v1::AttendResult();
  }

  // Exports layer 1 of `from_id` on `from` and imports it into `to_id` on `to` (which owns the
  // shards already, empty). Checks the chunks carry the session's dtype (bf16).
  void Migrate(v1::CpuAttention::Stub& from, const std::string& from_id, v1::CpuAttention::Stub& to,
               const std::string& to_id) {
    for (uint32_t h = 0; h < g_.kv_heads; ++h) {
      auto ctx = Deadline();
      auto reader = from.ExportShard(ctx.get(), testing::ExportRequest(from_id, 1, h, 0, 0, 100));
      v1::ExportShardChunk chunk;
      std::vector<v1::AppendKvRequest> imports;
      while (reader->Read(&chunk)) {
        EXPECT_EQ(chunk.k().dtype(), v1::DTYPE_BF16);
        EXPECT_EQ(chunk.k().data().size(), chunk.num_entries() * g_.head_dim * 2u);
        imports.push_back(testing::ImportRequest(to_id, 1, h, chunk));
      }
      ASSERT_TRUE(reader->Finish().ok());
      const grpc::Status s = Stream(to, imports);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
  }

  v1::StatsResponse Stats(v1::CpuAttention::Stub& stub) {
    v1::StatsResponse r;
    EXPECT_TRUE(stub.Stats(Deadline().get(), v1::StatsRequest(), &r).ok());
    return r;
  }

  void Close(v1::CpuAttention::Stub& stub, const std::string& id) {
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    v1::CloseSessionResponse resp;
    EXPECT_TRUE(stub.CloseSession(Deadline().get(), r, &resp).ok()) << id;
  }

  Geometry g_;  // 2 layers, 8 q heads, 2 kv heads, D 64
  std::vector<std::unique_ptr<CpuAttentionServer>> servers_;  // [int8, bf16]
  std::vector<std::unique_ptr<v1::CpuAttention::Stub>> stubs_;
  std::vector<HeadEntries> layer_;
  std::vector<float> q_;
};

TEST_F(Int8NodeTest, AttendsOverTheDequantisedKvOnBothTransportsAndFreesItsPool) {
  EXPECT_EQ(Stats(int8()).kv_storage(), "int8");
  EXPECT_EQ(Stats(bf16()).kv_storage(), "bf16");
  v1::OpenSessionResponse int8_open, bf16_open;
  ASSERT_TRUE(OpenOn(int8(), Open("dense", g_, 0.0f, false), &int8_open).ok());
  ASSERT_TRUE(OpenOn(bf16(), Open("dense", g_, 0.0f, false), &bf16_open).ok());
  // Block bytes: 16 x (2 x (64 + 4) + 4) = 2240 vs 16 x (2 x 128 + 4) = 4160 (54%).
  EXPECT_EQ(int8_open.bytes_per_block(), 2240u);
  EXPECT_EQ(bf16_open.bytes_per_block(), 4160u);
  ASSERT_TRUE(Stream(int8(), Appends("dense")).ok());
  ASSERT_TRUE(OpenOn(int8(), Open("maw", g_, 0.5f, false)).ok());
  ASSERT_TRUE(Stream(int8(), Appends("maw")).ok());
  ASSERT_TRUE(OpenOn(int8(), Open("pages", g_, 0.0f, true)).ok());
  ASSERT_TRUE(Stream(int8(), Appends("pages")).ok());
  ShmClient shm;
  v1::OpenSessionRequest shm_open = Open("shm", g_, 0.0f, false);
  shm.Describe(&shm_open);
  v1::OpenSessionResponse shm_resp;
  ASSERT_TRUE(OpenOn(int8(), shm_open, &shm_resp).ok());
  ASSERT_EQ(shm_resp.transport(), v1::TRANSPORT_SHM) << shm_resp.shm_declined();
  for (v1::AppendKvRequest m : Appends("shm")) {
    for (uint32_t h = 0; h < g_.kv_heads; ++h) m.add_kv_heads(h);  // the shm form lists them
    ASSERT_TRUE(shm.Append(m).ok());
  }

  const auto as_f32 = Dequantised(layer_, g_.head_dim, /*bf16=*/false);
  const v1::AttendResult dense = Attend(int8(), "dense");
  const v1::AttendResult maw = Attend(int8(), "maw");
  const v1::AttendResult pages = Attend(int8(), "pages");
  v1::AttendResult over_shm;
  ASSERT_TRUE(shm.Attend(1, q_, kTokens, &over_shm).ok());
  for (uint32_t h = 0; h < g_.kv_heads; ++h) {
    ExpectHeadMatches(dense, h, g_.kv_heads, h, q_, kTokens, g_, as_f32[h], {}, kInt8Tol);
    ExpectHeadMatches(pages, h, g_.kv_heads, h, q_, kTokens, g_, as_f32[h], {}, kInt8Tol);
    // beta 0.5 with 64 window entries: selected iff maw > 0.5 / 64.
    std::vector<uint8_t> keep(kHeld);
    for (size_t i = 0; i < kHeld; ++i) keep[i] = layer_[h].maw[i] > 0.5f / 64 ? 1 : 0;
    ExpectHeadMatches(maw, h, g_.kv_heads, h, q_, kTokens, g_, as_f32[h], keep, kInt8Tol);
    EXPECT_EQ(maw.held(h), kHeld);
  }
  EXPECT_EQ(over_shm.o().data(), dense.o().data());
  EXPECT_EQ(over_shm.lse().data(), dense.lse().data());

  // Pool bytes: 26 blocks per shard of int8 rows, for the 2 shards of layer 1 of 4 sessions.
  const v1::StatsResponse stats = Stats(int8());
  EXPECT_EQ(stats.blocks_in_use(), 4u * 2 * 26);
  EXPECT_EQ(stats.block_bytes_in_use(), stats.blocks_in_use() * 2240);
  EXPECT_EQ(stats.stored_bytes(), 4u * 2 * kHeld * (2 * 68 + 4));
  for (const char* id : {"dense", "maw", "pages", "shm"}) Close(int8(), id);
  Close(bf16(), "dense");
  for (v1::CpuAttention::Stub* stub : {&int8(), &bf16()}) {
    const v1::StatsResponse after = Stats(*stub);
    EXPECT_EQ(after.used_bytes(), 0u);
    EXPECT_EQ(after.blocks_in_use(), 0u);
    EXPECT_EQ(after.sessions(), 0u);
  }
}

TEST_F(Int8NodeTest, ShardsMigrateBetweenInt8AndBf16Nodes) {
  // a (int8) -> b (bf16) -> c (int8); a -> d (int8, same node). beta 0.5 keeps flags.
  ASSERT_TRUE(OpenOn(int8(), Open("a", g_, 0.5f, false)).ok());
  ASSERT_TRUE(Stream(int8(), Appends("a")).ok());
  ASSERT_TRUE(OpenOn(bf16(), Open("b", g_, 0.5f, false)).ok());
  ASSERT_TRUE(OpenOn(int8(), Open("c", g_, 0.5f, false)).ok());
  ASSERT_TRUE(OpenOn(int8(), Open("d", g_, 0.5f, false)).ok());
  ASSERT_NO_FATAL_FAILURE(Migrate(int8(), "a", bf16(), "b"));
  ASSERT_NO_FATAL_FAILURE(Migrate(bf16(), "b", int8(), "c"));
  ASSERT_NO_FATAL_FAILURE(Migrate(int8(), "a", int8(), "d"));
  const v1::AttendResult a = Attend(int8(), "a");
  const v1::AttendResult b = Attend(bf16(), "b");
  const v1::AttendResult c = Attend(int8(), "c");
  const v1::AttendResult d = Attend(int8(), "d");
  for (const v1::AttendResult* r : {&b, &c, &d}) {
    for (uint32_t h = 0; h < g_.kv_heads; ++h) {
      EXPECT_EQ(r->selected(h), a.selected(h));
      EXPECT_EQ(r->held(h), kHeld);
    }
  }
  // The bf16 node holds bf16(q * scale) (the export rounds q * scale to the session's bf16).
  const auto as_bf16 = Dequantised(layer_, g_.head_dim, true);
  for (uint32_t h = 0; h < g_.kv_heads; ++h) {
    std::vector<uint8_t> keep(kHeld);
    for (size_t i = 0; i < kHeld; ++i) keep[i] = layer_[h].maw[i] > 0.5f / 64 ? 1 : 0;
    ExpectHeadMatches(b, h, g_.kv_heads, h, q_, kTokens, g_, as_bf16[h], keep, kBf16Tol);
  }
  // Quantising bf16(q * scale) gives back q and scale exactly: c and d equal a bit for bit.
  EXPECT_EQ(c.o().data(), a.o().data());
  EXPECT_EQ(c.lse().data(), a.lse().data());
  EXPECT_EQ(d.o().data(), a.o().data());
  EXPECT_EQ(d.lse().data(), a.lse().data());
}

TEST(Int8NodeFlags, BadValuesAreRefusedWithAMessage) {
  for (const char* bad : {"fp8", "", "INT8", "f32"}) {
    const absl::StatusOr<KvDType> parsed = ParseNodeKvDType(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("bf16"), std::string::npos);
    EXPECT_NE(parsed.status().message().find("int8"), std::string::npos);
  }
  EXPECT_EQ(*ParseNodeKvDType("int8"), KvDType::kInt8);
  EXPECT_EQ(*ParseNodeKvDType("bf16"), KvDType::kBf16);
  NodeOptions options;
  options.kv_dtype = KvDType::kF32;
  EXPECT_EQ(CpuAttentionNode::Create(options).status().code(), absl::StatusCode::kInvalidArgument);

  const auto run = test_process::RunCommand(
      {TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0", "--node_kv_dtype=fp8"}, 30000);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 2);
  EXPECT_NE(run->err.find("node_kv_dtype must be bf16"), std::string::npos) << run->err;
}

}  // namespace
}  // namespace tandem::cpu_attention
