// Shard migration over real loopback gRPC servers: ExportShard's server stream (chunking does
// not change the bytes, chunks stay under the max message size, errors carry their codes),
// ReshardSession, and a migration from server A to server B streamed chunk by chunk into
// AppendKv, after which B's Attend answers with A's bytes.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "migration_test_util.h"
#include "service_test_util.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::ExportRequest;
using testing::Geometry;
using testing::HeadEntries;
using testing::ImportRequest;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ReshardRequest;

std::unique_ptr<grpc::ClientContext> Deadline(int ms = 30000) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  return ctx;
}

struct Endpoint {
  std::unique_ptr<CpuAttentionServer> server;
  std::unique_ptr<v1::CpuAttention::Stub> stub;
};

Endpoint StartServer(int max_message_bytes) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.node.pool_bytes = 256ull << 20;
  options.node.threads = 2;
  options.max_message_bytes = max_message_bytes;
  auto server = CpuAttentionServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  Endpoint e;
  e.server = std::move(*server);
  e.stub = v1::CpuAttention::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(e.server->port()), grpc::InsecureChannelCredentials(),
      CpuAttentionChannelArguments(64 << 20)));
  return e;
}

grpc::Status ExportAll(v1::CpuAttention::Stub& stub, const v1::ExportShardRequest& request,
                       std::vector<v1::ExportShardChunk>* chunks) {
  chunks->clear();
  auto ctx = Deadline();
  auto reader = stub.ExportShard(ctx.get(), request);
  v1::ExportShardChunk chunk;
  while (reader->Read(&chunk)) chunks->push_back(chunk);
  return reader->Finish();
}

// The chunks laid end to end: K, V, MAW and flag bytes of every entry, in order.
struct Concatenated {
  std::string k, v, maw, selected;
  uint64_t entries = 0;
};

Concatenated Concatenate(const std::vector<v1::ExportShardChunk>& chunks, uint64_t first) {
  Concatenated c;
  uint64_t next = first;
  for (const v1::ExportShardChunk& chunk : chunks) {
    EXPECT_EQ(chunk.first_entry(), next);
    next += chunk.num_entries();
    c.k += chunk.k().data();
    c.v += chunk.v().data();
    c.maw += chunk.maw().data();
    c.selected += chunk.selected();
    c.entries += chunk.num_entries();
  }
  return c;
}

class GrpcMigrationTest : public ::testing::Test {
 protected:
  // Server A (4 MiB messages) holds session "s": 1 layer x 2 kv heads x 64 dims, bf16, beta 1,
  // 500 entries per head, re-selected with fresh queries.
  void SetUp() override {
    a_ = StartServer(4 << 20);
    b_ = StartServer(4 << 20);
    ASSERT_TRUE(Open(a_, OpenRequest("s", g_, 32, true, 1.0f)).ok());
    std::mt19937 rng(21);
    entries_.resize(2);
    AddRandomEntries(entries_, 500, 64, true, 1.0f / 64, rng);
    ASSERT_TRUE(Append(a_, {AppendRequest("s", 0, entries_, 0, 300, 64, true, 64),
                            AppendRequest("s", 0, entries_, 300, 200, 64, true, 64)})
                    .ok());
    v1::ReselectRequest reselect;
    reselect.set_session_id("s");
    reselect.set_layer(0);
    EncodeF32(RandomQueries(2, g_, rng), std::vector<int64_t>{2, 8, 64}, reselect.mutable_q());
    v1::ReselectResponse reselected;
    auto ctx = Deadline();
    ASSERT_TRUE(a_.stub->Reselect(ctx.get(), reselect, &reselected).ok());
  }

  static grpc::Status Open(Endpoint& e, const v1::OpenSessionRequest& r) {
    v1::OpenSessionResponse resp;
    auto ctx = Deadline();
    return e.stub->OpenSession(ctx.get(), r, &resp);
  }

  static grpc::Status Append(Endpoint& e, const std::vector<v1::AppendKvRequest>& messages) {
    v1::AppendKvResponse totals;
    auto ctx = Deadline();
    auto writer = e.stub->AppendKv(ctx.get(), &totals);
    for (const auto& m : messages) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  static grpc::Status Reshard(Endpoint& e, const v1::ReshardSessionRequest& r,
                              v1::ReshardSessionResponse* resp) {
    auto ctx = Deadline();
    return e.stub->ReshardSession(ctx.get(), r, resp);
  }

  static v1::AttendResponse Attend(Endpoint& e, const std::vector<float>& q) {
    v1::AttendRequest req;
    req.set_layer(0);
    v1::AttendQuery* query = req.add_queries();
    query->set_session_id("s");
    EncodeF32(q, std::vector<int64_t>{1, 8, 64}, query->mutable_q());
    v1::AttendResponse resp;
    auto ctx = Deadline();
    const grpc::Status s = e.stub->Attend(ctx.get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  Geometry g_{1, 8, 2, 64};
  Endpoint a_, b_;
  std::vector<HeadEntries> entries_;
};

TEST_F(GrpcMigrationTest, ChunkingDoesNotChangeTheBytes) {
  std::vector<v1::ExportShardChunk> small, one;
  grpc::Status s = ExportAll(*a_.stub, ExportRequest("s", 0, 1, 0, 0, 7), &small);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(small.size(), (500u + 6) / 7);
  for (size_t i = 0; i + 1 < small.size(); ++i) EXPECT_EQ(small[i].num_entries(), 7u);
  EXPECT_EQ(small.back().num_entries(), 500u % 7);
  s = ExportAll(*a_.stub, ExportRequest("s", 0, 1), &one);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(one.size(), 1u);
  const Concatenated x = Concatenate(small, 0), y = Concatenate(one, 0);
  EXPECT_EQ(x.entries, 500u);
  EXPECT_EQ(x.k, y.k);
  EXPECT_EQ(x.v, y.v);
  EXPECT_EQ(x.maw, y.maw);
  EXPECT_EQ(x.selected, y.selected);
  // And both are what the node reads in-process.
  std::vector<v1::ExportShardChunk> direct;
  ASSERT_TRUE(a_.server->node()
                  .ExportShard(ExportRequest("s", 0, 1),
                               [&](const v1::ExportShardChunk& c) {
                                 direct.push_back(c);
                                 return absl::OkStatus();
                               })
                  .ok());
  const Concatenated z = Concatenate(direct, 0);
  EXPECT_EQ(z.k, y.k);
  EXPECT_EQ(z.selected, y.selected);
  // The K rows are the bf16 entries appended.
  std::vector<float> k;
  ASSERT_TRUE(DecodeFloats(one[0].k(), "k", std::vector<int64_t>{500, 64}, true, &k).ok());
  EXPECT_EQ(k, entries_[1].k);
  // A range in odd chunks matches the same slice of the whole.
  s = ExportAll(*a_.stub, ExportRequest("s", 0, 1, 123, 321, 50), &small);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const Concatenated part = Concatenate(small, 123);
  EXPECT_EQ(part.entries, 198u);
  EXPECT_EQ(part.k, y.k.substr(123 * 128, 198 * 128));
  EXPECT_EQ(part.selected, y.selected.substr(123, 198));
}

TEST_F(GrpcMigrationTest, ErrorsCarryTheirCodes) {
  std::vector<v1::ExportShardChunk> chunks;
  EXPECT_EQ(ExportAll(*a_.stub, ExportRequest("nobody", 0, 0), &chunks).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ExportAll(*a_.stub, ExportRequest("s", 0, 2), &chunks).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ExportAll(*a_.stub, ExportRequest("s", 0, 0, 501), &chunks).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(ExportAll(*a_.stub, ExportRequest("s", 0, 0, 0, 501), &chunks).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(chunks.empty());
  EXPECT_TRUE(ExportAll(*a_.stub, ExportRequest("s", 0, 0, 500, 500), &chunks).ok());
  EXPECT_TRUE(chunks.empty());
  v1::ReshardSessionResponse r;
  EXPECT_EQ(Reshard(a_, ReshardRequest("nobody", {}, {{0, 0}}), &r).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Reshard(a_, ReshardRequest("s", {{0, 0}}, {}), &r).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  a_.server->StartDraining();
  EXPECT_TRUE(a_.server->draining());
  EXPECT_EQ(Reshard(a_, ReshardRequest("s", {{0, 0}}, {{0, 0}}), &r).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Open(a_, OpenRequest("t", g_, 32, true, 0)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // Export and drop still work while draining.
  EXPECT_TRUE(ExportAll(*a_.stub, ExportRequest("s", 0, 0), &chunks).ok());
  ASSERT_TRUE(Reshard(a_, ReshardRequest("s", {}, {{0, 0}}), &r).ok());
  EXPECT_EQ(r.shards(), 1u);
  EXPECT_EQ(r.blocks_released(), (500u + 31) / 32);
}

// 9000 entries of 128 dims (4.6 MB of K + V) asked in one chunk: the server splits them so no
// message exceeds its 4 MiB limit.
TEST_F(GrpcMigrationTest, ChunksStayBelowTheMaxMessageSize) {
  Geometry g{1, 4, 1, 128};
  ASSERT_TRUE(Open(a_, OpenRequest("big", g, 64, true, 0)).ok());
  std::mt19937 rng(22);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 9000, 128, true, 1e-3f, rng);
  std::vector<v1::AppendKvRequest> msgs;
  for (size_t first = 0; first < 9000; first += 3000) {
    msgs.push_back(AppendRequest("big", 0, entries, first, 3000, 128, true, 64));
  }
  ASSERT_TRUE(Append(a_, msgs).ok());
  std::vector<v1::ExportShardChunk> chunks;
  const grpc::Status s = ExportAll(*a_.stub, ExportRequest("big", 0, 0, 0, 0, 65536), &chunks);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(chunks.size(), 2u);
  for (const auto& c : chunks) EXPECT_LT(c.ByteSizeLong(), size_t{4} << 20);
  const Concatenated all = Concatenate(chunks, 0);
  EXPECT_EQ(all.entries, 9000u);
  std::vector<float> v;
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(9000);
  t.add_shape(128);
  t.set_data(all.v);
  ASSERT_TRUE(DecodeFloats(t, "v", std::vector<int64_t>{9000, 128}, true, &v).ok());
  EXPECT_EQ(v, entries[0].v);
}

TEST_F(GrpcMigrationTest, MigrateBetweenServersStreamingChunkByChunk) {
  std::mt19937 rng(23);
  const std::vector<float> q = RandomQueries(1, g_, rng);
  const v1::AttendResponse before = Attend(a_, q);

  // B serves the session with no shard of layer 0 yet (it owns nothing after dropping the
  // initial one), then adds both.
  v1::OpenSessionRequest open = OpenRequest("s", g_, 32, true, 1.0f);
  testing::AddShards({{0, 0}}, open.mutable_shards());
  ASSERT_TRUE(Open(b_, open).ok());
  v1::ReshardSessionResponse r;
  ASSERT_TRUE(Reshard(b_, ReshardRequest("s", {}, {{0, 0}}), &r).ok());
  EXPECT_EQ(r.shards(), 0u);
  ASSERT_TRUE(Reshard(b_, ReshardRequest("s", {{0, 1}, {0, 0}}, {}), &r).ok());
  EXPECT_EQ(r.shards(), 2u);

  for (uint32_t head : {0u, 1u}) {
    auto export_ctx = Deadline();
    auto reader = a_.stub->ExportShard(export_ctx.get(), ExportRequest("s", 0, head, 0, 0, 64));
    v1::AppendKvResponse totals;
    auto import_ctx = Deadline();
    auto writer = b_.stub->AppendKv(import_ctx.get(), &totals);
    v1::ExportShardChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) {
      ASSERT_TRUE(writer->Write(ImportRequest("s", 0, head, chunk)));
      ++chunks;
    }
    const grpc::Status exported = reader->Finish();
    ASSERT_TRUE(exported.ok()) << exported.error_message();
    writer->WritesDone();
    const grpc::Status imported = writer->Finish();
    ASSERT_TRUE(imported.ok()) << imported.error_message();
    EXPECT_EQ(chunks, 8);  // 500 entries in chunks of 64
    EXPECT_EQ(totals.entries_appended(), 500u);
    EXPECT_EQ(totals.entries_selected(), before.results(0).selected(head));
  }

  const v1::AttendResponse after = Attend(b_, q);
  const v1::AttendResult& x = before.results(0);
  const v1::AttendResult& y = after.results(0);
  ASSERT_EQ(y.kv_heads_size(), 2);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(y.selected(h), x.selected(h));
    EXPECT_EQ(y.held(h), 500u);
  }
  EXPECT_LT(x.selected(0) + x.selected(1), 1000u);  // Reselect dropped some entries
  EXPECT_EQ(y.o().data(), x.o().data());
  EXPECT_EQ(y.lse().data(), x.lse().data());

  // A lets go of both shards.
  ASSERT_TRUE(Reshard(a_, ReshardRequest("s", {}, {{0, 0}, {0, 1}}), &r).ok());
  EXPECT_EQ(r.blocks_released(), 2u * ((500 + 31) / 32));
  // Only the open session's bookkeeping stays charged.
  EXPECT_EQ(r.free_bytes(), (256ull << 20) - CpuAttentionNode::SessionMetadataBytes(g_.layers, 0));
  const v1::AttendResponse gone = Attend(a_, q);
  EXPECT_EQ(gone.results(0).kv_heads_size(), 0);
}

}  // namespace
}  // namespace tandem::cpu_attention
