// Security end to end (issue 14 item 3), real processes over TLS: tandem-cpu-attention with
// mutual TLS and --allowed_peers, tandem-gpu-worker with TLS, bearer tokens and its own
// certificate towards the node. Certificates are made at test time by make_certs.sh (openssl):
// a CA, the worker, the node, two clients and a rogue certificate of another CA that claims the
// worker's name.
//
// Every attempt is checked against the status chosen for it and printed as a table (attempt ->
// status) for BENCHMARKS.md. The codes: UNAUTHENTICATED without a valid token; PERMISSION_DENIED
// for a client certificate the node does not allow and for another principal's kept session on
// the worker; NOT_FOUND, worded as for an unknown id, for another principal's session on a
// node (node session ids are no oracle); UNAVAILABLE where the TLS handshake fails.
// Skipped without openssl or ../shared/models/stories260k (worker tests only).
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "child_process.h"
#include "gtest/gtest.h"
#include "health_check.h"
#include "tandem/security/credentials.h"
#include "tandem/v1/cpu_attention.grpc.pb.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::security {
namespace {

namespace fs = std::filesystem;
using test_process::ChildProcess;

// One row of the printed table.
struct Attempt {
  std::string what;
  grpc::StatusCode expected;
  grpc::Status got;
};

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    default:
      return "OTHER";
  }
}

class SecurityE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A TLS peer that hangs up mid-write (the plain-HTTP probe of the HTTPS port) must not
    // end the test with SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    if (std::system("openssl version >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "openssl is not installed: no test certificates";
    }
    dir_ = fs::temp_directory_path() /
           absl::StrCat("tandem-security-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    const std::string cmd = absl::StrCat("/bin/sh ", TANDEM_MAKE_CERTS, " ", dir_.string());
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  void TearDown() override {
    if (!::testing::Test::HasFailure() && !attempts_.empty()) {
      std::printf("\n%-72s %-20s %s\n", "attempt", "expected", "got (message)");
      for (const Attempt& a : attempts_) {
        std::printf("%-72s %-20s %s (%s)\n", a.what.c_str(), CodeName(a.expected),
                    CodeName(a.got.error_code()), a.got.error_message().substr(0, 90).c_str());
      }
    }
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  std::string File(const std::string& name) const { return (dir_ / name).string(); }
  TlsFiles Identity(const std::string& name) const {
    return {File(name + ".pem"), File(name + ".key"), File("ca.pem")};
  }

  std::shared_ptr<grpc::Channel> Channel(int port, const TlsFiles& tls,
                                         const std::string& token = "") {
    auto credentials = ChannelCredentialsFromFiles(tls, token);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    grpc::ChannelArguments args;
    // A fresh connection per channel: each identity does its own handshake.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port),
        credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(), args);
  }

  // Records and checks one attempt.
  void Expect(const std::string& what, grpc::StatusCode expected, const grpc::Status& got) {
    attempts_.push_back({what, expected, got});
    EXPECT_EQ(got.error_code(), expected) << what << ": " << got.error_message();
  }

  std::unique_ptr<ChildProcess> StartNode(std::vector<std::string> extra) {
    std::vector<std::string> argv = {TANDEM_CPU_ATTENTION_BIN,
                                     "--address=127.0.0.1:0",
                                     "--threads=1",
                                     "--executor_threads=2",
                                     "--log_level=warn",
                                     "--tls_cert=" + File("tandem-node.pem"),
                                     "--tls_key=" + File("tandem-node.key"),
                                     "--tls_ca=" + File("ca.pem")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto node = ChildProcess::Start(argv);
    EXPECT_TRUE(node.ok()) << node.status();
    if (!node.ok()) return nullptr;
    absl::StatusOr<int> port = (*node)->WaitListening(20000);
    EXPECT_TRUE(port.ok()) << port.status();
    node_port_ = port.ok() ? *port : 0;
    return std::move(*node);
  }

  fs::path dir_;
  int node_port_ = 0;
  std::vector<Attempt> attempts_;
};

std::unique_ptr<grpc::ClientContext> Deadline(int ms = 10000) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  return ctx;
}

// A small f32 session: 2 layers, 4 q heads, 2 kv heads, head_dim 8.
v1::OpenSessionRequest SmallSession(const std::string& id) {
  v1::OpenSessionRequest r;
  r.set_session_id(id);
  r.mutable_geometry()->set_num_layers(2);
  r.mutable_geometry()->set_num_q_heads(4);
  r.mutable_geometry()->set_num_kv_heads(2);
  r.mutable_geometry()->set_head_dim(8);
  r.set_block_size(16);
  r.set_kv_dtype(v1::DTYPE_F32);
  r.set_beta(0);
  return r;
}

void SetF32(v1::Tensor* t, std::vector<int64_t> shape, float value) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  t->set_dtype(v1::DTYPE_F32);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  std::vector<float> data(static_cast<size_t>(n), value);
  t->set_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * 4));
}

// 4 entries on both kv heads of layer 0.
v1::AppendKvRequest Append(const std::string& id, float value) {
  v1::AppendKvRequest r;
  r.set_session_id(id);
  r.set_layer(0);
  r.set_window_entries(16);
  SetF32(r.mutable_k(), {2, 4, 8}, value);
  SetF32(r.mutable_v(), {2, 4, 8}, value);
  SetF32(r.mutable_maw(), {2, 4}, 1.0f);
  return r;
}

grpc::Status AppendKv(v1::CpuAttention::Stub& stub, const v1::AppendKvRequest& request) {
  auto ctx = Deadline();
  v1::AppendKvResponse response;
  auto writer = stub.AppendKv(ctx.get(), &response);
  writer->Write(request);
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status Attend(v1::CpuAttention::Stub& stub, const std::string& id,
                    v1::AttendResponse* response) {
  v1::AttendRequest r;
  r.set_layer(0);
  v1::AttendQuery* q = r.add_queries();
  q->set_session_id(id);
  SetF32(q->mutable_q(), {1, 4, 8}, 0.5f);
  auto ctx = Deadline();
  return stub.Attend(ctx.get(), r, response);
}

grpc::Status Export(v1::CpuAttention::Stub& stub, const std::string& id, int* chunks) {
  v1::ExportShardRequest r;
  r.set_session_id(id);
  r.mutable_shard()->set_layer(0);
  r.mutable_shard()->set_kv_head(0);
  auto ctx = Deadline();
  auto reader = stub.ExportShard(ctx.get(), r);
  v1::ExportShardChunk chunk;
  *chunks = 0;
  while (reader->Read(&chunk)) ++*chunks;
  return reader->Finish();
}

TEST_F(SecurityE2eTest, NodeServesOnlyAllowedPeersAndHidesOtherPrincipalsSessions) {
  // client-a is allowed too, so that it can try the worker's sessions as another principal.
  auto node = StartNode({"--pool_bytes=64MiB", "--allowed_peers=tandem-worker,client-a",
                         "--max_sessions_per_principal=3"});
  ASSERT_NE(node, nullptr);
  auto worker = v1::CpuAttention::NewStub(Channel(node_port_, Identity("tandem-worker")));
  auto other = v1::CpuAttention::NewStub(Channel(node_port_, Identity("client-a")));
  auto stranger = v1::CpuAttention::NewStub(Channel(node_port_, Identity("client-b")));
  auto rogue = v1::CpuAttention::NewStub(
      Channel(node_port_, {File("rogue.pem"), File("rogue.key"), File("ca.pem")}));
  auto no_cert = v1::CpuAttention::NewStub(Channel(node_port_, {"", "", File("ca.pem")}));
  auto plaintext = v1::CpuAttention::NewStub(Channel(node_port_, {}));

  // The owner (the worker's identity) opens a session and stores KV.
  {
    auto ctx = Deadline();
    v1::OpenSessionResponse response;
    Expect("node: worker opens session 'victim'", grpc::StatusCode::OK,
           worker->OpenSession(ctx.get(), SmallSession("victim"), &response));
  }
  Expect("node: worker appends 4 entries to 'victim'", grpc::StatusCode::OK,
         AppendKv(*worker, Append("victim", 1.0f)));
  v1::AttendResponse before;
  Expect("node: worker attends 'victim'", grpc::StatusCode::OK, Attend(*worker, "victim", &before));

  // Another allowed principal: every call on the session reads as for an unknown id.
  auto same_as_unknown = [&](const std::string& what, auto call) {
    const grpc::Status on_victim = call("victim");
    const grpc::Status on_unknown = call("no-such-session");
    Expect("node: other principal " + what + " 'victim'", grpc::StatusCode::NOT_FOUND, on_victim);
    EXPECT_EQ(on_victim.error_message(),
              absl::StrReplaceAll(on_unknown.error_message(), {{"no-such-session", "victim"}}))
        << what << ": another principal's session must read exactly as an unknown one";
  };
  same_as_unknown("Attend", [&](const std::string& id) {
    v1::AttendResponse r;
    return Attend(*other, id, &r);
  });
  same_as_unknown("AppendKv (inject)",
                  [&](const std::string& id) { return AppendKv(*other, Append(id, 9.0f)); });
  same_as_unknown("ExportShard (read K/V)", [&](const std::string& id) {
    int chunks = 0;
    grpc::Status s = Export(*other, id, &chunks);
    EXPECT_EQ(chunks, 0);
    return s;
  });
  same_as_unknown("OpenSession fork_from (probe)", [&](const std::string& id) {
    v1::OpenSessionRequest r = SmallSession("fork-" + id);
    r.mutable_fork_from()->set_parent_session_id(id);
    r.mutable_fork_from()->set_prefix_tokens(4);
    v1::OpenSessionResponse response;
    return other->OpenSession(Deadline().get(), r, &response);
  });
  same_as_unknown("ReshardSession", [&](const std::string& id) {
    v1::ReshardSessionRequest r;
    r.set_session_id(id);
    r.add_drop()->set_layer(1);
    v1::ReshardSessionResponse response;
    return other->ReshardSession(Deadline().get(), r, &response);
  });
  same_as_unknown("Reselect", [&](const std::string& id) {
    v1::ReselectRequest r;
    r.set_session_id(id);
    r.set_layer(0);
    SetF32(r.mutable_q(), {1, 4, 8}, 0.5f);
    v1::ReselectResponse response;
    return other->Reselect(Deadline().get(), r, &response);
  });
  same_as_unknown("CloseSession", [&](const std::string& id) {
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    v1::CloseSessionResponse response;
    return other->CloseSession(Deadline().get(), r, &response);
  });

  // A certificate of the CA that is not in --allowed_peers: refused whatever it calls.
  {
    v1::OpenSessionResponse response;
    Expect("node: non-worker identity (client-b) OpenSession", grpc::StatusCode::PERMISSION_DENIED,
           stranger->OpenSession(Deadline().get(), SmallSession("mine"), &response));
    v1::AttendResponse attend;
    Expect("node: non-worker identity (client-b) Attend 'victim'",
           grpc::StatusCode::PERMISSION_DENIED, Attend(*stranger, "victim", &attend));
    int chunks = 0;
    Expect("node: non-worker identity (client-b) ExportShard 'victim'",
           grpc::StatusCode::PERMISSION_DENIED, Export(*stranger, "victim", &chunks));
    v1::StatsResponse stats;
    Expect("node: non-worker identity (client-b) Stats", grpc::StatusCode::PERMISSION_DENIED,
           stranger->Stats(Deadline().get(), v1::StatsRequest(), &stats));
  }
  // No handshake at all: another CA (even with the worker's name), no certificate, plaintext.
  {
    v1::StatsResponse stats;
    Expect("node: rogue cert (other CA, CN=tandem-worker) Stats", grpc::StatusCode::UNAVAILABLE,
           rogue->Stats(Deadline(3000).get(), v1::StatsRequest(), &stats));
    Expect("node: TLS without a client certificate Stats", grpc::StatusCode::UNAVAILABLE,
           no_cert->Stats(Deadline(3000).get(), v1::StatsRequest(), &stats));
    Expect("node: plaintext client Stats", grpc::StatusCode::UNAVAILABLE,
           plaintext->Stats(Deadline(3000).get(), v1::StatsRequest(), &stats));
  }

  // The owner's session is untouched: same entries, same output.
  v1::AttendResponse after;
  Expect("node: worker attends 'victim' afterwards", grpc::StatusCode::OK,
         Attend(*worker, "victim", &after));
  ASSERT_EQ(after.results_size(), 1);
  ASSERT_EQ(before.results_size(), 1);
  EXPECT_EQ(after.results(0).held(0), 4u);
  EXPECT_EQ(after.results(0).o().data(), before.results(0).o().data());

  // Sessions per principal: the worker has 'victim' + 2 more, the 4th is refused; client-a
  // still has its own room.
  for (const char* id : {"w1", "w2"}) {
    v1::OpenSessionResponse response;
    ASSERT_TRUE(worker->OpenSession(Deadline().get(), SmallSession(id), &response).ok());
  }
  {
    v1::OpenSessionResponse response;
    Expect("node: worker's 4th session (--max_sessions_per_principal=3)",
           grpc::StatusCode::RESOURCE_EXHAUSTED,
           worker->OpenSession(Deadline().get(), SmallSession("w3"), &response));
    Expect("node: client-a's 1st session", grpc::StatusCode::OK,
           other->OpenSession(Deadline().get(), SmallSession("a1"), &response));
  }
  v1::CloseSessionRequest close;
  close.set_session_id("victim");
  v1::CloseSessionResponse closed;
  Expect("node: worker closes 'victim'", grpc::StatusCode::OK,
         worker->CloseSession(Deadline().get(), close, &closed));

  // Health carries no identity check (only the handshake): SERVING to any certificate of the CA.
  absl::StatusOr<int> health = test_health::HealthStatus(Channel(node_port_, Identity("client-b")),
                                                         "tandem.v1.CpuAttention");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, test_health::kServing);
}

TEST_F(SecurityE2eTest, NodeChargesSessionMetadataToThePool) {
  auto node = StartNode({"--pool_bytes=32MiB"});
  ASSERT_NE(node, nullptr);
  auto worker = v1::CpuAttention::NewStub(Channel(node_port_, Identity("tandem-worker")));
  // The largest geometry the store takes: 256 x 256 = 65536 shards, ~10.5 MB of bookkeeping.
  auto big = [](const std::string& id) {
    v1::OpenSessionRequest r = SmallSession(id);
    r.mutable_geometry()->set_num_layers(256);
    r.mutable_geometry()->set_num_q_heads(256);
    r.mutable_geometry()->set_num_kv_heads(256);
    return r;
  };
  int opened = 0;
  grpc::Status last;
  for (int i = 0; i < 10; ++i) {
    v1::OpenSessionResponse response;
    last = worker->OpenSession(Deadline().get(), big(absl::StrCat("big-", i)), &response);
    if (!last.ok()) break;
    ++opened;
  }
  // 32 MiB / (4096 + 256 x 64 + 65536 x 168 B) = 3.04: three fit.
  EXPECT_EQ(opened, 3);
  Expect("node: 4th OpenSession of 65536 shards in a 32 MiB pool",
         grpc::StatusCode::RESOURCE_EXHAUSTED, last);
  EXPECT_NE(last.error_message().find("session metadata"), std::string::npos)
      << last.error_message();
  v1::StatsResponse stats;
  ASSERT_TRUE(worker->Stats(Deadline().get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.used_bytes(), 3u * (4096 + 256 * 64 + 65536ull * 168));
  // Closing one gives its charge back.
  v1::CloseSessionRequest close;
  close.set_session_id("big-0");
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(worker->CloseSession(Deadline().get(), close, &closed).ok());
  v1::OpenSessionResponse response;
  Expect("node: OpenSession of 65536 shards after one closed", grpc::StatusCode::OK,
         worker->OpenSession(Deadline().get(), big("big-again"), &response));
}

fs::path Stories260kDir() { return fs::path(TANDEM_SHARED_DIR) / "models" / "stories260k"; }

// 4 tokens of a hybrid generation whose prompt outgrows the 16-token window, so the node holds
// and attends KV (reached over mutual TLS with the worker's certificate). `cpu_entries`: the
// final's cpu_kv_entries.
grpc::Status Generate(v1::Generation::Stub& stub, const std::string& session, int* tokens,
                      int64_t* cpu_entries = nullptr) {
  v1::GenerateRequest r;
  r.set_prompt_text(
      "Once upon a time there was a little girl named Lily. She liked to play outside in the "
      "park with her friends every day.");
  r.set_max_tokens(4);
  r.set_ignore_eos(true);
  r.set_session_id(session);
  r.set_mode("hybrid");
  r.set_window(16);
  r.set_sink(4);
  auto ctx = Deadline(60000);
  auto reader = stub.Generate(ctx.get(), r);
  v1::GenerateResponse message;
  *tokens = 0;
  while (reader->Read(&message)) {
    if (message.has_token()) ++*tokens;
    if (message.has_final() && cpu_entries != nullptr) {
      *cpu_entries = message.final().cpu_kv_entries();
    }
  }
  return reader->Finish();
}

TEST_F(SecurityE2eTest, WorkerNeedsTokensAndKeepsSessionsToTheirOwner) {
  if (!fs::exists(Stories260kDir() / "config.json")) {
    GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  }
  auto node = StartNode({"--pool_bytes=64MiB", "--allowed_peers=tandem-worker"});
  ASSERT_NE(node, nullptr);
  {
    std::ofstream tokens(File("tokens"));
    tokens << "# token principal\n"
           << "alice-token-0123456789abcdef alice\n"
           << "bob-token-0123456789abcdef00 bob\n";
  }
  auto started = ChildProcess::Start(
      {TANDEM_GPU_WORKER_BIN, "--model=" + Stories260kDir().string(), "--backend=cpu",
       "--cpu_threads=2", "--address=127.0.0.1:0", "--block_tokens=16", "--log_level=warn",
       absl::StrCat("--cpu_nodes=127.0.0.1:", node_port_), "--transport=grpc",
       "--tls_cert=" + File("tandem-worker.pem"), "--tls_key=" + File("tandem-worker.key"),
       "--auth_token_file=" + File("tokens"), "--max_sessions_per_principal=2",
       "--node_tls_cert=" + File("tandem-worker.pem"),
       "--node_tls_key=" + File("tandem-worker.key"), "--node_tls_ca=" + File("ca.pem")});
  ASSERT_TRUE(started.ok()) << started.status();
  absl::StatusOr<int> port = (*started)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  const TlsFiles server_ca = {"", "", File("ca.pem")};
  auto alice = v1::Generation::NewStub(Channel(*port, server_ca, "alice-token-0123456789abcdef"));
  auto bob = v1::Generation::NewStub(Channel(*port, server_ca, "bob-token-0123456789abcdef00"));
  auto anonymous = v1::Generation::NewStub(Channel(*port, server_ca));
  auto forger = v1::Generation::NewStub(Channel(*port, server_ca, "guessed-token-000000000000"));
  auto plaintext = v1::Generation::NewStub(Channel(*port, {}));

  int tokens = 0;
  Expect("worker: no token, Generate", grpc::StatusCode::UNAUTHENTICATED,
         Generate(*anonymous, "", &tokens));
  EXPECT_EQ(tokens, 0);
  {
    v1::ModelInfoResponse info;
    Expect("worker: no token, GetModelInfo", grpc::StatusCode::UNAUTHENTICATED,
           anonymous->GetModelInfo(Deadline().get(), v1::GetModelInfoRequest(), &info));
  }
  Expect("worker: unknown token, Generate", grpc::StatusCode::UNAUTHENTICATED,
         Generate(*forger, "", &tokens));
  Expect("worker: plaintext client, Generate", grpc::StatusCode::UNAVAILABLE,
         Generate(*plaintext, "", &tokens));

  int64_t cpu_entries = 0;
  Expect("worker: alice opens kept session 'chat-1' (hybrid, node over mTLS)", grpc::StatusCode::OK,
         Generate(*alice, "chat-1", &tokens, &cpu_entries));
  EXPECT_EQ(tokens, 4);
  EXPECT_GT(cpu_entries, 0) << "the node held none of the KV";
  Expect("worker: bob continues alice's 'chat-1'", grpc::StatusCode::PERMISSION_DENIED,
         Generate(*bob, "chat-1", &tokens));
  EXPECT_EQ(tokens, 0);
  v1::CloseGenerationSessionRequest close;
  close.set_session_id("chat-1");
  v1::CloseGenerationSessionResponse closed;
  Expect("worker: bob closes alice's 'chat-1'", grpc::StatusCode::PERMISSION_DENIED,
         bob->CloseSession(Deadline().get(), close, &closed));
  Expect("worker: no token closes 'chat-1'", grpc::StatusCode::UNAUTHENTICATED,
         anonymous->CloseSession(Deadline().get(), close, &closed));
  Expect("worker: alice continues 'chat-1'", grpc::StatusCode::OK,
         Generate(*alice, "chat-1", &tokens));
  EXPECT_EQ(tokens, 4);

  // Sessions per principal: alice holds 'chat-1' + 'chat-2'; a third is refused, bob is not.
  Expect("worker: alice opens 'chat-2'", grpc::StatusCode::OK, Generate(*alice, "chat-2", &tokens));
  Expect("worker: alice's 3rd session (--max_sessions_per_principal=2)",
         grpc::StatusCode::RESOURCE_EXHAUSTED, Generate(*alice, "chat-3", &tokens));
  Expect("worker: bob opens 'chat-b'", grpc::StatusCode::OK, Generate(*bob, "chat-b", &tokens));
  Expect("worker: alice closes 'chat-1'", grpc::StatusCode::OK,
         alice->CloseSession(Deadline().get(), close, &closed));
  Expect("worker: alice opens 'chat-3' after closing one", grpc::StatusCode::OK,
         Generate(*alice, "chat-3", &tokens));

  // Health needs no token.
  absl::StatusOr<int> health =
      test_health::HealthStatus(Channel(*port, server_ca), "tandem.v1.Generation");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, test_health::kServing);
}

TEST_F(SecurityE2eTest, WorkerKeysSessionsByClientCertificate) {
  if (!fs::exists(Stories260kDir() / "config.json")) {
    GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  }
  // Mutual TLS to the clients, no tokens: each client's certificate identity is its principal.
  // The node is embedded (no --cpu_nodes).
  auto started = ChildProcess::Start(
      {TANDEM_GPU_WORKER_BIN, "--model=" + Stories260kDir().string(), "--backend=cpu",
       "--cpu_threads=2", "--address=127.0.0.1:0", "--block_tokens=16", "--log_level=warn",
       "--tls_cert=" + File("tandem-worker.pem"), "--tls_key=" + File("tandem-worker.key"),
       "--tls_ca=" + File("ca.pem")});
  ASSERT_TRUE(started.ok()) << started.status();
  absl::StatusOr<int> port = (*started)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  auto a = v1::Generation::NewStub(Channel(*port, Identity("client-a")));
  auto b = v1::Generation::NewStub(Channel(*port, Identity("client-b")));
  auto rogue = v1::Generation::NewStub(
      Channel(*port, {File("rogue.pem"), File("rogue.key"), File("ca.pem")}));
  auto no_cert = v1::Generation::NewStub(Channel(*port, {"", "", File("ca.pem")}));

  int tokens = 0;
  Expect("worker (mTLS): client-a opens 'cert-chat'", grpc::StatusCode::OK,
         Generate(*a, "cert-chat", &tokens));
  Expect("worker (mTLS): client-b continues client-a's 'cert-chat'",
         grpc::StatusCode::PERMISSION_DENIED, Generate(*b, "cert-chat", &tokens));
  v1::CloseGenerationSessionRequest close;
  close.set_session_id("cert-chat");
  v1::CloseGenerationSessionResponse closed;
  Expect("worker (mTLS): client-b closes client-a's 'cert-chat'",
         grpc::StatusCode::PERMISSION_DENIED, b->CloseSession(Deadline().get(), close, &closed));
  Expect("worker (mTLS): rogue cert (other CA) Generate", grpc::StatusCode::UNAVAILABLE,
         Generate(*rogue, "", &tokens));
  Expect("worker (mTLS): no client certificate Generate", grpc::StatusCode::UNAVAILABLE,
         Generate(*no_cert, "", &tokens));
  Expect("worker (mTLS): client-a continues 'cert-chat'", grpc::StatusCode::OK,
         Generate(*a, "cert-chat", &tokens));
  Expect("worker (mTLS): client-a closes 'cert-chat'", grpc::StatusCode::OK,
         a->CloseSession(Deadline().get(), close, &closed));
}

TEST_F(SecurityE2eTest, GatewayServesHttpsWithApiKeysToATokenWorker) {
  if (!fs::exists(Stories260kDir() / "config.json")) {
    GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  }
  {
    std::ofstream worker_tokens(File("worker-tokens"));
    worker_tokens << "gateway-token-0123456789abcdef tandem-gateway\n";
    std::ofstream api_keys(File("api-keys"));
    api_keys << "sk-alice-0123456789abcdef alice\n"
             << "sk-bob-0123456789abcdef00 bob\n";
  }
  auto worker = ChildProcess::Start({TANDEM_GPU_WORKER_BIN, "--model=" + Stories260kDir().string(),
                                     "--backend=cpu", "--cpu_threads=2", "--address=127.0.0.1:0",
                                     "--log_level=warn", "--tls_cert=" + File("tandem-worker.pem"),
                                     "--tls_key=" + File("tandem-worker.key"),
                                     "--auth_token_file=" + File("worker-tokens")});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> worker_port = (*worker)->WaitListening();
  ASSERT_TRUE(worker_port.ok()) << worker_port.status();
  // The gateway serves HTTPS with the node's certificate (any certificate naming 127.0.0.1).
  auto gateway = ChildProcess::Start(
      {TANDEM_GATEWAY_BIN, absl::StrCat("--workers=127.0.0.1:", *worker_port),
       "--address=127.0.0.1:0", "--log_level=warn", "--tls_cert=" + File("tandem-node.pem"),
       "--tls_key=" + File("tandem-node.key"), "--api_key_file=" + File("api-keys"),
       "--worker_tls_ca=" + File("ca.pem"), "--worker_token_file=" + File("worker-tokens")});
  ASSERT_TRUE(gateway.ok()) << gateway.status();
  absl::StatusOr<int> port = (*gateway)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();

  httplib::SSLClient https("127.0.0.1", *port);
  https.set_ca_cert_path(File("ca.pem").c_str());
  https.enable_server_certificate_verification(true);
  https.set_read_timeout(60, 0);
  const std::string body =
      R"({"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4})";
  auto status_of = [](const httplib::Result& r) { return r ? r->status : -1; };
  struct Row {
    std::string what;
    int expected;
    int got;
  };
  std::vector<Row> rows;
  auto expect = [&rows](const std::string& what, int expected, int got) {
    rows.push_back({what, expected, got});
    EXPECT_EQ(got, expected) << what;
  };
  expect("gateway: GET /health without a key", 200, status_of(https.Get("/health")));
  httplib::Result missing = https.Post("/v1/completions", body, "application/json");
  expect("gateway: POST /v1/completions without a key", 401, status_of(missing));
  if (missing) {
    EXPECT_NE(missing->body.find("invalid_api_key"), std::string::npos) << missing->body;
  }
  expect("gateway: GET /v1/models without a key", 401, status_of(https.Get("/v1/models")));
  httplib::Headers wrong = {{"Authorization", "Bearer sk-guessed-00000000000000"}};
  expect("gateway: POST /v1/completions with an unknown key", 401,
         status_of(https.Post("/v1/completions", wrong, body, "application/json")));
  httplib::Headers alice = {{"Authorization", "Bearer sk-alice-0123456789abcdef"}};
  httplib::Result ok = https.Post("/v1/completions", alice, body, "application/json");
  expect("gateway: POST /v1/completions with alice's key (worker over TLS + token)", 200,
         status_of(ok));
  if (ok) {
    EXPECT_NE(ok->body.find("\"completion_tokens\":4"), std::string::npos) << ok->body;
  }
  // The scheme is case-insensitive (RFC 7235): "BEARER" is the same key.
  httplib::Headers alice_upper = {{"Authorization", "BEARER sk-alice-0123456789abcdef"}};
  expect("gateway: POST /v1/completions with alice's key, scheme in capitals", 200,
         status_of(https.Post("/v1/completions", alice_upper, body, "application/json")));
  // Every HTTP client reaches the worker as the gateway's principal: the gateway itself keeps
  // kept sessions to the key that started them.
  httplib::Headers bob = {{"Authorization", "Bearer sk-bob-0123456789abcdef00"}};
  const std::string in_session =
      R"({"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4, )"
      R"("session_id": "gw-chat"})";
  expect("gateway: alice starts kept session 'gw-chat'", 200,
         status_of(https.Post("/v1/completions", alice, in_session, "application/json")));
  expect("gateway: bob continues alice's 'gw-chat'", 403,
         status_of(https.Post("/v1/completions", bob, in_session, "application/json")));
  expect("gateway: bob deletes alice's 'gw-chat'", 403,
         status_of(https.Delete("/v1/sessions/gw-chat", bob)));
  expect("gateway: alice continues 'gw-chat'", 200,
         status_of(https.Post("/v1/completions", alice, in_session, "application/json")));
  expect("gateway: alice deletes 'gw-chat'", 200,
         status_of(https.Delete("/v1/sessions/gw-chat", alice)));
  httplib::Client plain("127.0.0.1", *port);
  plain.set_read_timeout(5, 0);
  expect("gateway: plain HTTP to the HTTPS port", -1, status_of(plain.Get("/health")));
  std::printf("\n%-72s %-8s %s\n", "attempt", "expected", "got (HTTP status; -1: no answer)");
  for (const Row& r : rows) std::printf("%-72s %-8d %d\n", r.what.c_str(), r.expected, r.got);
}

}  // namespace
}  // namespace tandem::security
