// tandem-cpu-attention over a real loopback gRPC server: the AppendKv stream, Attend results
// against the reference, health, message limits, stream errors, deadlines, concurrency and the
// in-process channel.
#include "tandem/cpu_attention/server.h"

#include <chrono>
#include <future>
#include <random>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "health_check.h"
#include "service_test_util.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::ExpectHeadMatches;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;

constexpr double kBf16Tolerance = 1e-3;  // relative, max |err| / max |ref| per head

std::unique_ptr<grpc::ClientContext> Deadline(int ms = 20000) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  return ctx;
}

class GrpcServiceTest : public ::testing::Test {
 protected:
  void StartServer(int max_message_bytes = 4 << 20, uint64_t pool_bytes = 256ull << 20) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.node.pool_bytes = pool_bytes;
    options.node.threads = 2;
    options.max_message_bytes = max_message_bytes;
    auto server = CpuAttentionServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials(),
        CpuAttentionChannelArguments(64 << 20));
    stub_ = v1::CpuAttention::NewStub(channel_);
  }

  void SetUp() override { StartServer(); }

  grpc::Status Open(const v1::OpenSessionRequest& req) {
    v1::OpenSessionResponse resp;
    auto ctx = Deadline();
    return stub_->OpenSession(ctx.get(), req, &resp);
  }

  // Streams the messages; returns the final status and totals.
  grpc::Status Stream(const std::vector<v1::AppendKvRequest>& messages,
                      v1::AppendKvResponse* totals) {
    auto ctx = Deadline();
    auto writer = stub_->AppendKv(ctx.get(), totals);
    for (const auto& m : messages) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  v1::StatsResponse Stats() {
    v1::StatsResponse s;
    auto ctx = Deadline();
    EXPECT_TRUE(stub_->Stats(ctx.get(), {}, &s).ok());
    return s;
  }

  // Attends layer 0 of `session` and checks every kv head against the reference.
  void ExpectAttendMatches(v1::CpuAttention::Stub& stub, const std::string& session,
                           const Geometry& g, const std::vector<HeadEntries>& entries,
                           uint64_t seed) {
    std::mt19937 rng(seed);
    const std::vector<float> q = RandomQueries(1, g, rng);
    v1::AttendRequest req;
    req.set_layer(0);
    v1::AttendQuery* query = req.add_queries();
    query->set_session_id(session);
    EncodeF32(q, std::vector<int64_t>{1, g.q_heads, g.head_dim}, query->mutable_q());
    v1::AttendResponse resp;
    auto ctx = Deadline();
    const grpc::Status s = stub.Attend(ctx.get(), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::AttendResult& r = resp.results(0);
    for (uint32_t h = 0; h < g.kv_heads; ++h) {
      ExpectHeadMatches(r, h, g.kv_heads, h, q, 1, g, entries[h], {}, kBf16Tolerance);
      EXPECT_EQ(r.held(h), entries[h].n());
    }
  }

  std::unique_ptr<CpuAttentionServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CpuAttention::Stub> stub_;
};

TEST_F(GrpcServiceTest, StreamAttendCloseRoundTrip) {
  Geometry g{2, 8, 2, 128};
  ASSERT_TRUE(Open(OpenRequest("s", g, 64, true, 0)).ok());
  std::mt19937 rng(1);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 3000, 128, true, 1e-3f, rng);
  std::vector<v1::AppendKvRequest> msgs;
  for (size_t first = 0; first < 3000; first += 700) {
    msgs.push_back(AppendRequest("s", 0, entries, first, std::min<size_t>(700, 3000 - first),
                                 128, true, 512));
  }
  v1::AppendKvResponse totals;
  const grpc::Status s = Stream(msgs, &totals);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(totals.messages(), msgs.size());
  EXPECT_EQ(totals.entries_appended(), 6000u);
  ExpectAttendMatches(*stub_, "s", g, entries, 2);

  const v1::StatsResponse loaded = Stats();
  EXPECT_EQ(loaded.sessions(), 1u);
  EXPECT_EQ(loaded.stored_bytes(), 6000u * (2 * 128 * 2 + 4));
  EXPECT_EQ(loaded.attend_calls(), 1u);
  v1::CloseSessionRequest close;
  close.set_session_id("s");
  v1::CloseSessionResponse closed;
  auto ctx = Deadline();
  ASSERT_TRUE(stub_->CloseSession(ctx.get(), close, &closed).ok());
  EXPECT_EQ(closed.blocks_released(), 2u * ((3000 + 63) / 64));
  const v1::StatsResponse after = Stats();
  EXPECT_EQ(after.blocks_in_use(), 0u);
  EXPECT_EQ(after.used_bytes(), 0u);
  EXPECT_EQ(after.sessions(), 0u);
}

TEST_F(GrpcServiceTest, HealthServiceReportsServing) {
  for (const std::string service : {"", "tandem.v1.CpuAttention"}) {
    absl::StatusOr<std::string> bytes = test_health::HealthCheckBytes(channel_, service);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, std::string("\x08\x01", 2)) << "status SERVING for '" << service << "'";
  }
}

TEST_F(GrpcServiceTest, OversizedMessageIsRefusedAndServerKeepsServing) {
  Geometry g{1, 4, 1, 128};
  ASSERT_TRUE(Open(OpenRequest("s", g, 64, true, 0)).ok());
  std::mt19937 rng(3);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 9000, 128, true, 1e-3f, rng);  // 9000*128*2*2 = 4.6 MB > 4 MiB
  v1::AppendKvResponse totals;
  const grpc::Status big = Stream({AppendRequest("s", 0, entries, 0, 9000, 128, true, 64)},
                                  &totals);
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.error_message();
  EXPECT_EQ(Stats().stored_bytes(), 0u);
  // Same data in bounded chunks goes through.
  std::vector<v1::AppendKvRequest> msgs;
  for (size_t first = 0; first < 9000; first += 3000) {
    msgs.push_back(AppendRequest("s", 0, entries, first, 3000, 128, true, 64));
  }
  const grpc::Status ok = Stream(msgs, &totals);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  ExpectAttendMatches(*stub_, "s", g, entries, 4);
}

TEST_F(GrpcServiceTest, BadMessageEndsStreamAndEarlierOnesStay) {
  Geometry g{1, 4, 1, 64};
  ASSERT_TRUE(Open(OpenRequest("s", g, 16, true, 0)).ok());
  std::mt19937 rng(5);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 100, 64, true, 1e-3f, rng);
  v1::AppendKvRequest bad = AppendRequest("s", 0, entries, 50, 50, 64, true, 64);
  bad.mutable_k()->set_shape(2, 32);
  v1::AppendKvResponse totals;
  const grpc::Status s = Stream({AppendRequest("s", 0, entries, 0, 50, 64, true, 64), bad,
                                 AppendRequest("s", 0, entries, 50, 50, 64, true, 64)},
                                &totals);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("message 1"), std::string::npos) << s.error_message();
  EXPECT_EQ(Stats().stored_bytes(), 50u * (2 * 64 * 2 + 4));
  entries[0].k.resize(50 * 64);
  entries[0].v.resize(50 * 64);
  entries[0].maw.resize(50);
  ExpectAttendMatches(*stub_, "s", g, entries, 6);
}

// Bytes that do not parse as the method's request are INVALID_ARGUMENT with a message on every
// method (gRPC's generated handlers answered UNIMPLEMENTED with none), and a garbage AppendKv
// message ends its stream with INVALID_ARGUMENT naming it (it used to end it as a clean
// half-close: OK); the earlier messages stay and the node keeps serving.
TEST_F(GrpcServiceTest, UnparseableRequestsAreInvalidArgumentOnEveryMethod) {
  grpc::GenericStub generic(channel_);
  grpc::ByteBuffer garbage;
  {
    const std::string bytes = "\xff\xff\xff\xff";   // a tag whose varint never ends
    grpc::Slice slice(bytes);
    garbage = grpc::ByteBuffer(&slice, 1);
  }
  for (const char* method : {"OpenSession", "Attend", "Reselect", "CloseSession", "Stats",
                             "ReshardSession", "RenewLease"}) {
    SCOPED_TRACE(method);
    auto ctx = Deadline();
    grpc::ByteBuffer reply;
    std::promise<grpc::Status> done;
    generic.UnaryCall(ctx.get(), absl::StrCat("/tandem.v1.CpuAttention/", method),
                      grpc::StubOptions(), &garbage, &reply,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("is not a valid tandem.v1."), std::string::npos)
        << s.error_message();
  }
  // ExportShard (a server stream): the same answer before any chunk.
  {
    v1::ExportShardRequest request;
    request.set_session_id("\xff\xfe");   // not UTF-8: protobuf's parser would refuse it
    auto ctx = Deadline();
    auto reader = stub_->ExportShard(ctx.get(), request);
    v1::ExportShardChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("session_id is not valid UTF-8"), std::string::npos)
        << s.error_message();
  }
  // AppendKv: one good message, then one that does not parse.
  Geometry g{1, 4, 1, 64};
  ASSERT_TRUE(Open(OpenRequest("s", g, 16, true, 0)).ok());
  std::mt19937 rng(9);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 20, 64, true, 1e-3f, rng);
  v1::AppendKvRequest bad = AppendRequest("s", 0, entries, 10, 10, 64, true, 64);
  bad.set_session_id("s\xff");
  v1::AppendKvResponse totals;
  const grpc::Status s =
      Stream({AppendRequest("s", 0, entries, 0, 10, 64, true, 64), bad}, &totals);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("message 1: session_id is not valid UTF-8"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Stats().stored_bytes(), 10u * (2 * 64 * 2 + 4));
  entries[0].k.resize(10 * 64);
  entries[0].v.resize(10 * 64);
  entries[0].maw.resize(10);
  ExpectAttendMatches(*stub_, "s", g, entries, 7);
}

TEST_F(GrpcServiceTest, ErrorsCarryCodesAndMessages) {
  v1::AttendRequest req;
  req.set_layer(0);
  req.add_queries()->set_session_id("missing");
  v1::AttendResponse resp;
  auto ctx = Deadline();
  const grpc::Status s = stub_->Attend(ctx.get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("missing"), std::string::npos) << s.error_message();
  EXPECT_EQ(Open(OpenRequest("x", {1, 4, 1, 63}, 16, true, 0)).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(GrpcServiceTest, ExpiredDeadlineDoesNotBreakTheServer) {
  Geometry g{1, 32, 8, 128};
  ASSERT_TRUE(Open(OpenRequest("s", g, 64, true, 0)).ok());
  std::mt19937 rng(7);
  std::vector<HeadEntries> entries(8);
  AddRandomEntries(entries, 1024, 128, true, 1e-3f, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(Stream({AppendRequest("s", 0, entries, 0, 512, 128, true, 64),
                      AppendRequest("s", 0, entries, 512, 512, 128, true, 64)},
                     &totals)
                  .ok());
  v1::AttendRequest req;
  req.set_layer(0);
  v1::AttendQuery* query = req.add_queries();
  query->set_session_id("s");
  EncodeF32(RandomQueries(1, g, rng), std::vector<int64_t>{1, 32, 128}, query->mutable_q());
  v1::AttendResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() - std::chrono::milliseconds(1));
  EXPECT_EQ(stub_->Attend(&ctx, req, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectAttendMatches(*stub_, "s", g, entries, 8);
}

TEST_F(GrpcServiceTest, ConcurrentSessionsGetTheirOwnResults) {
  Geometry g{1, 8, 2, 64};
  constexpr int kClients = 4;
  std::vector<std::vector<HeadEntries>> data(kClients, std::vector<HeadEntries>(2));
  for (int c = 0; c < kClients; ++c) {
    const std::string id = absl::StrCat("c", c);
    ASSERT_TRUE(Open(OpenRequest(id, g, 32, true, 0)).ok());
    std::mt19937 rng(100 + c);
    AddRandomEntries(data[c], 500 + 100 * c, 64, true, 1e-3f, rng);
    v1::AppendKvResponse totals;
    ASSERT_TRUE(
        Stream({AppendRequest(id, 0, data[c], 0, data[c][0].n(), 64, true, 64)}, &totals).ok());
  }
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      for (int rep = 0; rep < 5; ++rep) {
        ExpectAttendMatches(*stub_, absl::StrCat("c", c), g, data[c], 1000 * c + rep);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(Stats().attend_calls(), uint64_t{kClients} * 5);
}

TEST_F(GrpcServiceTest, InProcessChannelServesTheSameNode) {
  Geometry g{1, 4, 2, 64};
  ASSERT_TRUE(Open(OpenRequest("s", g, 16, true, 0)).ok());
  std::mt19937 rng(9);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 77, 64, true, 1e-3f, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(Stream({AppendRequest("s", 0, entries, 0, 77, 64, true, 64)}, &totals).ok());
  auto in_process = v1::CpuAttention::NewStub(server_->InProcessChannel());
  ExpectAttendMatches(*in_process, "s", g, entries, 10);
}

TEST(GrpcServerStart, RejectsBadOptionsAndBusyPorts) {
  ServerOptions bad;
  bad.address = "127.0.0.1:0";
  bad.node.block_tokens = 3;
  EXPECT_EQ(CpuAttentionServer::Start(bad).status().code(), absl::StatusCode::kInvalidArgument);
  ServerOptions first;
  first.address = "127.0.0.1:0";
  first.node.threads = 1;
  auto a = CpuAttentionServer::Start(first);
  ASSERT_TRUE(a.ok()) << a.status();
  ServerOptions second = first;
  second.address = "127.0.0.1:" + std::to_string((*a)->port());
  EXPECT_EQ(CpuAttentionServer::Start(second).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tandem::cpu_attention
