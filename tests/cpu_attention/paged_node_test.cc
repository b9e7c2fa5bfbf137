// SELECTION_PAGES sessions on a node served over loopback gRPC and shared memory: Attend over
// named pages equals the reference and is bit-identical over both transports; pages_per_head 0
// equals a beta = 0 MAW session on the same KV; the session keeps no selected copy; migration
// (ExportShard -> AppendKv with flags) works; every malformed request is INVALID_ARGUMENT with a
// message naming the problem, and the node keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "service_test_util.h"
#include "shm_test_client.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ShmClient;

constexpr uint32_t kPageTokens = 24;  // does not divide the 16-entry blocks
constexpr uint32_t kBlock = 16;
constexpr size_t kHeld = 410;  // 18 pages, the last one partial (2 entries)
constexpr uint32_t kPph = 5;
constexpr double kOTol = 1e-5;  // relative to the reference's max |O| (fp32 accumulation)
constexpr double kLseTol = 1e-4;

std::unique_ptr<grpc::ClientContext> Deadline() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  return ctx;
}

class PagedNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.node.pool_bytes = 256ull << 20;
    options.node.threads = 2;
    auto server = CpuAttentionServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::CpuAttention::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
    std::mt19937 rng(29);
    layer_.resize(g_.kv_heads);
    AddRandomEntries(layer_, kHeld, g_.head_dim, /*bf16=*/true, 0.01f, rng);
    q_ = RandomQueries(kTokens, g_, rng);
    // Token 0: adjacent pages and the partial last one; token 1: spread pages; token 2: one page
    // for head 0 and nothing for head 1.
    const std::vector<std::vector<int32_t>> rows = {{0, 1, 2, 17, -1},   {3, 4, 16, 17, -1},
                                                    {1, 5, 9, 13, -1},   {0, 2, 4, 6, 8},
                                                    {7, -1, -1, -1, -1}, {-1, -1, -1, -1, -1}};
    for (const auto& r : rows) pages_.insert(pages_.end(), r.begin(), r.end());
  }

  v1::OpenSessionRequest PagesOpen(const std::string& id) const {
    v1::OpenSessionRequest r = OpenRequest(id, g_, kBlock, /*bf16=*/true, /*beta=*/0.5f);
    r.set_selection(v1::SELECTION_PAGES);
    r.set_page_tokens(kPageTokens);
    return r;
  }

  grpc::Status Open(const v1::OpenSessionRequest& r, v1::OpenSessionResponse* resp = nullptr) {
    v1::OpenSessionResponse ignored;
    return stub_->OpenSession(Deadline().get(), r, resp ? resp : &ignored);
  }

  // Appends the layer's entries to `layer` of session `id` in two messages.
  grpc::Status Append(const std::string& id, uint32_t layer) {
    v1::AppendKvResponse totals;
    auto ctx = Deadline();
    auto writer = stub_->AppendKv(ctx.get(), &totals);
    writer->Write(AppendRequest(id, layer, layer_, 0, 300, g_.head_dim, true, 64));
    writer->Write(AppendRequest(id, layer, layer_, 300, kHeld - 300, g_.head_dim, true, 64));
    writer->WritesDone();
    return writer->Finish();
  }

  // q: [tokens, H_q, D]; q_ (kTokens tokens) when null.
  v1::AttendRequest AttendProto(const std::string& id, uint32_t layer,
                                const std::vector<int32_t>& pages, uint32_t pph,
                                const std::vector<float>* q = nullptr,
                                int64_t tokens = kTokens) const {
    v1::AttendRequest r;
    r.set_layer(layer);
    v1::AttendQuery* query = r.add_queries();
    query->set_session_id(id);
    const int64_t shape[] = {tokens, g_.q_heads, g_.head_dim};
    EncodeF32(q == nullptr ? q_ : *q, shape, query->mutable_q());
    query->set_pages_per_head(pph);
    query->mutable_pages()->Add(pages.begin(), pages.end());
    return r;
  }

  grpc::Status Attend(const v1::AttendRequest& r, v1::AttendResponse* resp) {
    return stub_->Attend(Deadline().get(), r, resp);
  }

  // Checks every (token, head) of `result` against the reference over the named pages.
  void ExpectMatchesReference(const v1::AttendResult& result) const {
    const uint32_t G = g_.group(), D = g_.head_dim, H = g_.kv_heads;
    const float* o = reinterpret_cast<const float*>(result.o().data().data());
    const float* lse = reinterpret_cast<const float*>(result.lse().data().data());
    for (uint32_t t = 0; t < kTokens; ++t) {
      std::vector<float> qt(q_.begin() + t * g_.q_heads * D, q_.begin() + (t + 1) * g_.q_heads * D);
      for (uint32_t h = 0; h < H; ++h) {
        std::vector<uint8_t> keep(kHeld, 0);
        for (uint32_t i = 0; i < kPph; ++i) {
          const int32_t p = pages_[(t * H + h) * kPph + i];
          for (size_t e = size_t(std::max(p, 0)) * kPageTokens;
               p >= 0 && e < std::min<size_t>(kHeld, (p + 1) * kPageTokens); ++e) {
            keep[e] = 1;
          }
        }
        std::vector<double> ref_o, ref_lse;
        testing::ReferenceForHead(qt, 1, g_, h, layer_[h], keep, &ref_o, &ref_lse);
        const size_t row0 = (size_t{t} * H + h) * G;
        const bool empty = std::count(keep.begin(), keep.end(), 1) == 0;
        for (uint32_t j = 0; j < G; ++j) {
          if (empty) {
            EXPECT_TRUE(std::isinf(lse[row0 + j]) && lse[row0 + j] < 0);
          } else {
            EXPECT_NEAR(lse[row0 + j], ref_lse[j], kLseTol) << "t " << t << " h " << h;
          }
        }
        if (empty) {
          for (size_t i = 0; i < G * D; ++i) ASSERT_EQ(o[row0 * D + i], 0.0f);
        } else {
          EXPECT_LE(RelativeError(o + row0 * D, ref_o.data(), G * D), kOTol)
              << "t " << t << " h " << h;
        }
      }
    }
  }

  static constexpr uint32_t kTokens = 3;
  Geometry g_;  // 2 layers, 8 q heads, 2 kv heads, D 64
  std::unique_ptr<CpuAttentionServer> server_;
  std::unique_ptr<v1::CpuAttention::Stub> stub_;
  std::vector<HeadEntries> layer_;
  std::vector<float> q_;
  std::vector<int32_t> pages_;  // [kTokens, H_kv, kPph]
};

TEST_F(PagedNodeTest, GrpcAndShmMatchReferenceAndEachOther) {
  ShmClient client;
  v1::OpenSessionRequest open = PagesOpen("p");
  client.Describe(&open);
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(Open(open, &opened).ok());
  ASSERT_EQ(opened.transport(), v1::TRANSPORT_SHM) << opened.shm_declined();
  ASSERT_TRUE(Append("p", 1).ok());
  // A pages session keeps no selected copy.
  EXPECT_EQ(server_->node().Stats().selected_bytes(), 0u);

  v1::AttendResponse grpc_resp;
  ASSERT_TRUE(Attend(AttendProto("p", 1, pages_, kPph), &grpc_resp).ok());
  const v1::AttendResult& r = grpc_resp.results(0);
  ExpectMatchesReference(r);
  // Entries per token, mean rounded up: head 0 = (72 + 96 + 24) / 3 = 64; head 1 = (24 + 2 +
  // 26 + 2) ... computed from the rows.
  uint64_t scanned = 0;
  for (uint32_t h = 0; h < g_.kv_heads; ++h) {
    uint64_t sum = 0;
    for (uint32_t t = 0; t < kTokens; ++t) {
      for (uint32_t i = 0; i < kPph; ++i) {
        const int32_t p = pages_[(t * g_.kv_heads + h) * kPph + i];
        if (p >= 0) sum += std::min<uint64_t>(kHeld, (p + 1ull) * kPageTokens) - p * kPageTokens;
      }
    }
    EXPECT_EQ(r.selected(h), (sum + kTokens - 1) / kTokens) << "head " << h;
    EXPECT_EQ(r.held(h), kHeld);
    scanned += sum * 2 * g_.head_dim * 2;
  }
  EXPECT_EQ(grpc_resp.bytes_scanned(), scanned);

  v1::AttendResult shm_result;
  ASSERT_TRUE(client.Attend(1, q_, kTokens, &shm_result, pages_, kPph).ok());
  ASSERT_EQ(shm_result.o().data(), r.o().data()) << "shm and gRPC must agree bit for bit";
  ASSERT_EQ(shm_result.lse().data(), r.lse().data());
  for (uint32_t h = 0; h < g_.kv_heads; ++h) EXPECT_EQ(shm_result.selected(h), r.selected(h));

  // A layer with nothing offloaded: every row is empty.
  v1::AttendResponse empty;
  ASSERT_TRUE(Attend(AttendProto("p", 0, {}, 0), &empty).ok());
  for (size_t i = 0; i < kTokens * g_.q_heads; ++i) {
    const float lse = reinterpret_cast<const float*>(empty.results(0).lse().data().data())[i];
    EXPECT_TRUE(std::isinf(lse) && lse < 0);
  }
}

TEST_F(PagedNodeTest, DenseEqualsBetaZeroMawSession) {
  ASSERT_TRUE(Open(PagesOpen("p")).ok());
  ASSERT_TRUE(Open(OpenRequest("m", g_, kBlock, true, /*beta=*/0.0f)).ok());
  ASSERT_TRUE(Append("p", 1).ok());
  ASSERT_TRUE(Append("m", 1).ok());
  // 3 tokens: one scan; 70 (a prefill chunk): blocks of 32 + 32 + 6 query tokens.
  std::mt19937 rng(5);
  for (int64_t tokens : {int64_t{kTokens}, int64_t{70}}) {
    SCOPED_TRACE(tokens);
    const std::vector<float> q = RandomQueries(tokens, g_, rng);
    v1::AttendResponse paged, maw;
    ASSERT_TRUE(Attend(AttendProto("p", 1, {}, 0, &q, tokens), &paged).ok());
    ASSERT_TRUE(Attend(AttendProto("m", 1, {}, 0, &q, tokens), &maw).ok());
    const auto& a = paged.results(0);
    const auto& b = maw.results(0);
    for (uint32_t h = 0; h < g_.kv_heads; ++h) {
      EXPECT_EQ(a.selected(h), kHeld);
      EXPECT_EQ(b.selected(h), kHeld);
    }
    const uint64_t blocks = (tokens + 31) / 32;
    EXPECT_EQ(paged.bytes_scanned(), blocks * maw.bytes_scanned());
    const size_t rows = tokens * g_.q_heads;
    const float* ao = reinterpret_cast<const float*>(a.o().data().data());
    const float* bo = reinterpret_cast<const float*>(b.o().data().data());
    const float* al = reinterpret_cast<const float*>(a.lse().data().data());
    const float* bl = reinterpret_cast<const float*>(b.lse().data().data());
    std::vector<double> ref(bo, bo + rows * g_.head_dim);
    EXPECT_LE(RelativeError(ao, ref.data(), ref.size()), 2e-5);
    for (size_t i = 0; i < rows; ++i) EXPECT_NEAR(al[i], bl[i], kLseTol) << "row " << i;
  }
}

TEST_F(PagedNodeTest, BadPagesAreInvalidArgumentAndTheNodeKeepsServing) {
  ShmClient client;
  v1::OpenSessionRequest open = PagesOpen("p");
  client.Describe(&open);
  ASSERT_TRUE(Open(open).ok());
  ASSERT_TRUE(Open(OpenRequest("m", g_, kBlock, true, 0.0f)).ok());
  ASSERT_TRUE(Append("p", 1).ok());
  ASSERT_TRUE(Append("m", 1).ok());

  struct Case {
    const char* name;
    std::vector<int32_t> pages;
    uint32_t pph;
    const char* message;
    // Over shm (nullptr: not expressible there, the header's pages_per_head sizes the array).
    const char* shm_message;
  };
  auto with = [&](size_t index, int32_t id) {
    std::vector<int32_t> p = pages_;
    p[index] = id;
    return p;
  };
  const std::vector<Case> cases = {
      {"beyond held", with(3, 18), kPph, "holds 410 entries", "holds 410 entries"},
      {"duplicate", with(1, 0), kPph, "strictly ascending", "strictly ascending"},
      {"unsorted", with(3, 1), kPph, "strictly ascending", "strictly ascending"},
      {"id after -1", with(kPph * 4 + 2, 9), kPph, "follows -1", "follows -1"},
      {"below -1", with(0, -5), kPph, "negative", "negative"},
      {"size mismatch", std::vector<int32_t>(pages_.begin(), pages_.end() - 1), kPph, "expected",
       "does not hold"},
      {"pages without pages_per_head", pages_, 0, "expected", nullptr},
      {"pages_per_head too large", {}, 2000000, "exceeds", "does not hold"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::AttendResponse resp;
    const grpc::Status s = Attend(AttendProto("p", 1, c.pages, c.pph), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
    if (c.shm_message != nullptr) {
      v1::AttendResult ignored;
      const absl::Status shm = client.Attend(1, q_, kTokens, &ignored, c.pages, c.pph);
      EXPECT_EQ(shm.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(shm.message().find(c.shm_message), std::string::npos) << shm.message();
    }
  }
  // Pages on a MAW session.
  v1::AttendResponse resp;
  grpc::Status s = Attend(AttendProto("m", 1, pages_, kPph), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("MAW selection"), std::string::npos) << s.error_message();
  // Reselect has no index to re-evaluate.
  v1::ReselectRequest reselect;
  reselect.set_session_id("p");
  reselect.set_layer(1);
  const int64_t shape[] = {kTokens, g_.q_heads, g_.head_dim};
  EncodeF32(q_, shape, reselect.mutable_q());
  v1::ReselectResponse reselected;
  EXPECT_EQ(stub_->Reselect(Deadline().get(), reselect, &reselected).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Bad page_tokens at open.
  for (uint32_t bad : {0u, 4097u}) {
    v1::OpenSessionRequest r = PagesOpen("bad");
    r.set_page_tokens(bad);
    EXPECT_EQ(Open(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }

  // Still serving, on both transports.
  ASSERT_TRUE(Attend(AttendProto("p", 1, pages_, kPph), &resp).ok());
  ExpectMatchesReference(resp.results(0));
  v1::AttendResult shm_result;
  ASSERT_TRUE(client.Attend(1, q_, kTokens, &shm_result, pages_, kPph).ok());
  EXPECT_EQ(shm_result.o().data(), resp.results(0).o().data());
}

TEST_F(PagedNodeTest, MigratedShardAttendsAsTheOriginal) {
  ASSERT_TRUE(Open(PagesOpen("a")).ok());
  ASSERT_TRUE(Append("a", 1).ok());
  // Node B's session owns nothing of layer 1 at first; the shards are added and imported.
  v1::OpenSessionRequest b = PagesOpen("b");
  b.add_shards()->set_layer(0);
  ASSERT_TRUE(Open(b).ok());
  v1::ReshardSessionRequest add;
  add.set_session_id("b");
  for (uint32_t h = 0; h < g_.kv_heads; ++h) {
    v1::ShardId* id = add.add_add();
    id->set_layer(1);
    id->set_kv_head(h);
  }
  v1::ReshardSessionResponse resharded;
  ASSERT_TRUE(stub_->ReshardSession(Deadline().get(), add, &resharded).ok());
  for (uint32_t h = 0; h < g_.kv_heads; ++h) {
    v1::ExportShardRequest req;
    req.set_session_id("a");
    req.mutable_shard()->set_layer(1);
    req.mutable_shard()->set_kv_head(h);
    req.set_max_chunk_entries(100);
    auto ctx = Deadline();
    auto reader = stub_->ExportShard(ctx.get(), req);
    v1::ExportShardChunk chunk;
    std::vector<v1::AppendKvRequest> imports;
    while (reader->Read(&chunk)) {
      EXPECT_EQ(chunk.selected(), std::string(chunk.num_entries(), '\0'));
      v1::AppendKvRequest m;
      m.set_session_id("b");
      m.set_layer(1);
      m.add_kv_heads(h);
      for (auto [src, dst] : {std::pair{&chunk.k(), m.mutable_k()}, {&chunk.v(), m.mutable_v()}}) {
        *dst = *src;
        dst->mutable_shape()->Clear();
        dst->add_shape(1);
        dst->add_shape(chunk.num_entries());
        dst->add_shape(g_.head_dim);
      }
      *m.mutable_maw() = chunk.maw();
      m.mutable_maw()->mutable_shape()->Clear();
      m.mutable_maw()->add_shape(1);
      m.mutable_maw()->add_shape(chunk.num_entries());
      m.set_selected(chunk.selected());
      imports.push_back(std::move(m));
    }
    ASSERT_TRUE(reader->Finish().ok());
    v1::AppendKvResponse totals;
    auto actx = Deadline();
    auto writer = stub_->AppendKv(actx.get(), &totals);
    for (const auto& m : imports) writer->Write(m);
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    EXPECT_EQ(totals.entries_selected(), 0u);
  }
  // A flag set on a pages session is refused.
  v1::AppendKvRequest flagged = AppendRequest("b", 1, layer_, 0, 4, g_.head_dim, true, 64);
  flagged.set_selected(std::string(g_.kv_heads * 4, '\1'));
  v1::AppendKvResponse totals;
  {
    auto ctx = Deadline();
    auto writer = stub_->AppendKv(ctx.get(), &totals);
    writer->Write(flagged);
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("no selection index"), std::string::npos) << s.error_message();
  }
  v1::AttendResponse from_a, from_b;
  ASSERT_TRUE(Attend(AttendProto("a", 1, pages_, kPph), &from_a).ok());
  ASSERT_TRUE(Attend(AttendProto("b", 1, pages_, kPph), &from_b).ok());
  EXPECT_EQ(from_a.results(0).o().data(), from_b.results(0).o().data());
  EXPECT_EQ(from_a.results(0).lse().data(), from_b.results(0).lse().data());
  EXPECT_EQ(server_->node().Stats().selected_bytes(), 0u);
}

}  // namespace
}  // namespace tandem::cpu_attention
