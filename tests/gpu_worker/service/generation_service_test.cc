// tandem.v1.Generation over a real loopback gRPC server (GpuWorkerServer, stories260k on the
// cpu backend, the embedded CPU node): greedy streams against golden.json in gpu and hybrid
// mode, request validation, Tokenize/Detokenize/GetModelInfo, health, multi-turn sessions,
// cancellation (on gutenberg-14m: a long request), concurrent streams and shutdown with a stream
// in flight.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include "service_test_util.h"
#include "tandem/gpu_worker/worker_server.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAreArray;
using testing::Golden;
using ::testing::HasSubstr;
using testing::Stream;
using testing::TextRequest;

WorkerServerOptions Stories260kOptions() {
  WorkerServerOptions options;
  options.address = "127.0.0.1:0";
  options.engine.model_dir = testing::Stories260kDir().string();
  options.engine.backend = "cpu";
  options.engine.cpu_threads = 2;
  // Small chunks: a 5-token prompt is prefilled in 3 chunks, so progress is observable.
  options.engine.prefill_chunk = 2;
  options.engine.block_tokens = 16;
  options.engine.nodes.embedded.pool_bytes = 64ull << 20;
  options.engine.nodes.embedded.threads = 2;
  return options;
}

class GenerationServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::LoadGolden(&golden_)) return;
    auto server = GpuWorkerServer::Start(Stories260kOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    if (golden_.greedy_ids.empty()) {
      GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
    }
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(server_->port(), 0);
    channel_ =
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                  grpc::InsecureChannelCredentials(), GenerationChannelArguments());
    stub_ = v1::Generation::NewStub(channel_);
  }

  // The golden continuation of "Once upon a time": greedy_ids[5:5+n].
  std::vector<int32_t> Continuation(size_t n) const { return golden_.Ids(5, 5 + n); }

  // A short valid request succeeds with the golden ids (the server still serves).
  void ExpectStillServing() {
    Stream s = testing::Generate(*stub_, TextRequest(golden_.prompt_text, 4, "gpu"));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_THAT(s.ids, ElementsAreArray(Continuation(4)));
  }

  static Golden golden_;
  static GpuWorkerServer* server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

Golden GenerationServiceTest::golden_;
GpuWorkerServer* GenerationServiceTest::server_ = nullptr;

TEST_F(GenerationServiceTest, GreedyGpuModeStreamsTheGoldenContinuation) {
  Stream s = testing::Generate(*stub_, TextRequest(golden_.prompt_text, 56, "gpu"));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_THAT(s.ids, ElementsAreArray(golden_.Ids(5, 61)));
  EXPECT_EQ(s.text, golden_.greedy_text.substr(golden_.prompt_text.size()));
  EXPECT_FALSE(s.bad_index);

  // Prefill progress: 3 chunks of <= 2 tokens, in order, all before the first token.
  ASSERT_EQ(s.prefill.size(), 3u);
  EXPECT_FALSE(s.prefill_after_token);
  const int64_t processed[] = {2, 4, 5};
  for (size_t i = 0; i < s.prefill.size(); ++i) {
    EXPECT_EQ(s.prefill[i].total(), 5);
    EXPECT_EQ(s.prefill[i].processed(), processed[i]);
    if (i > 0) {
      EXPECT_GE(s.prefill[i].elapsed_seconds(), s.prefill[i - 1].elapsed_seconds());
    }
  }

  ASSERT_EQ(s.finals, 1);
  const v1::GenerateFinal& f = s.final;
  EXPECT_EQ(f.usage().prompt_tokens(), 5);
  EXPECT_EQ(f.usage().completion_tokens(), 56);
  EXPECT_EQ(f.usage().total_tokens(), 61);
  EXPECT_EQ(f.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(FinishReasonName(f.finish_reason()), "length");
  EXPECT_EQ(f.mode(), "gpu");
  EXPECT_EQ(f.session_id(), "");
  EXPECT_FALSE(f.degraded());
  EXPECT_EQ(f.degraded_steps(), 0u);
  // Every fed position (5 prompt + 55 generated; the last sampled token is never fed) is on
  // the device in gpu mode.
  EXPECT_EQ(f.device_kv_entries(), 60);
  EXPECT_EQ(f.cpu_kv_entries(), 0);
  EXPECT_GT(f.time_to_first_token_seconds(), 0.0);
  EXPECT_GE(f.total_seconds(), f.time_to_first_token_seconds());
  EXPECT_GT(f.mean_token_latency_seconds(), 0.0);
  EXPECT_LE(f.p50_token_latency_seconds(), f.p99_token_latency_seconds());
}

TEST_F(GenerationServiceTest, DenseHybridModeMatchesGpuMode) {
  v1::GenerateRequest request = TextRequest(golden_.prompt_text, 56, "hybrid");
  request.set_beta(0.0f);
  request.set_window(32);
  request.set_sink(4);
  Stream s = testing::Generate(*stub_, request);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_THAT(s.ids, ElementsAreArray(golden_.Ids(5, 61)));
  EXPECT_EQ(s.text, golden_.greedy_text.substr(golden_.prompt_text.size()));
  ASSERT_EQ(s.finals, 1);
  EXPECT_EQ(s.final.mode(), "hybrid");
  EXPECT_EQ(s.final.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(s.final.degraded_steps(), 0u);
  EXPECT_GT(s.final.cpu_kv_entries(), 0);
  // 60 fed positions: the sinks and the window on the device, the rest on the CPU node.
  EXPECT_EQ(s.final.device_kv_entries() + s.final.cpu_kv_entries(), 60);
  EXPECT_LE(s.final.device_kv_entries(), 4 + 32 + 16);
}

TEST_F(GenerationServiceTest, BadRequestsAreInvalidArgumentNamingTheField) {
  struct Case {
    const char* what;
    std::function<void(v1::GenerateRequest&)> change;
    const char* message;  // expected in the status message
  };
  const std::vector<Case> cases = {
      {"empty prompt", [](v1::GenerateRequest& r) { r.clear_prompt(); }, "prompt"},
      {"empty prompt text", [](v1::GenerateRequest& r) { r.set_prompt_text(""); }, "prompt"},
      {"max_tokens 0", [](v1::GenerateRequest& r) { r.set_max_tokens(0); }, "max_tokens"},
      {"max_tokens -1", [](v1::GenerateRequest& r) { r.set_max_tokens(-1); }, "max_tokens"},
      {"max_tokens past the context", [](v1::GenerateRequest& r) { r.set_max_tokens(513); },
       "max_tokens"},
      {"unknown mode", [](v1::GenerateRequest& r) { r.set_mode("fast"); }, "mode"},
      {"beta -1", [](v1::GenerateRequest& r) { r.set_beta(-1.0f); }, "beta"},
      {"beta NaN", [](v1::GenerateRequest& r) { r.set_beta(std::nanf("")); }, "beta"},
      {"beta Inf", [](v1::GenerateRequest& r) { r.set_beta(INFINITY); }, "beta"},
      {"temperature -1", [](v1::GenerateRequest& r) { r.set_temperature(-1.0f); }, "temperature"},
      {"temperature NaN", [](v1::GenerateRequest& r) { r.set_temperature(std::nanf("")); },
       "temperature"},
      {"top_p 1.5", [](v1::GenerateRequest& r) { r.set_top_p(1.5f); }, "top_p"},
      {"top_p -0.5", [](v1::GenerateRequest& r) { r.set_top_p(-0.5f); }, "top_p"},
      {"top_k -1", [](v1::GenerateRequest& r) { r.set_top_k(-1); }, "top_k"},
      {"17 stop strings",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 17; ++i) r.add_stop()->push_back('x');
       },
       "stop"},
      {"empty stop string", [](v1::GenerateRequest& r) { r.add_stop(""); }, "stop"},
      {"257-byte stop string", [](v1::GenerateRequest& r) { r.add_stop(std::string(257, 'a')); },
       "stop"},
      {"window -1", [](v1::GenerateRequest& r) { r.set_window(-1); }, "window"},
      {"sink -1", [](v1::GenerateRequest& r) { r.set_sink(-1); }, "sink"},
      {"bad session id", [](v1::GenerateRequest& r) { r.set_session_id("a b"); }, "session_id"},
      {"token id >= vocab",
       [](v1::GenerateRequest& r) {
         r.mutable_prompt_ids()->add_ids(1);
         r.mutable_prompt_ids()->add_ids(512);
       },
       "vocabulary"},
      {"negative token id", [](v1::GenerateRequest& r) { r.mutable_prompt_ids()->add_ids(-3); },
       "vocabulary"},
      {"prompt longer than the context",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 600; ++i) r.mutable_prompt_ids()->add_ids(403);
       },
       "context"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::GenerateRequest request = TextRequest(golden_.prompt_text, 8, "gpu");
    c.change(request);
    Stream s = testing::Generate(*stub_, request);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.status.error_message();
    EXPECT_THAT(s.status.error_message(), HasSubstr(c.message));
    EXPECT_TRUE(s.ids.empty());
    EXPECT_EQ(s.finals, 0);
    ExpectStillServing();
  }
}

// A prompt text far past the context (3 MB for 512 tokens) is refused before it is tokenized,
// by Generate and by Tokenize, and the worker goes on serving.
TEST_F(GenerationServiceTest, APromptTextPastTheContextIsRefusedBeforeTokenizing) {
  const std::string huge(3 << 20, 'a');
  const auto start = std::chrono::steady_clock::now();
  Stream s = testing::Generate(*stub_, TextRequest(huge, 8, "gpu"));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.status.error_message(), HasSubstr("refused before tokenizing"));
  v1::TokenizeRequest tokenize;
  tokenize.set_text(huge);
  v1::TokenizeResponse tokens;
  const grpc::Status status = stub_->Tokenize(testing::Deadline().get(), tokenize, &tokens);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("refused before tokenizing"));
  // Tokenizing 3 MB takes seconds here; the refusals take the transfer only.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ExpectStillServing();
}

TEST_F(GenerationServiceTest, TokenizeDetokenizeAndModelInfo) {
  v1::TokenizeRequest tokenize;
  tokenize.set_text(golden_.prompt_text);
  tokenize.set_add_bos(true);
  v1::TokenizeResponse tokens;
  grpc::Status status = stub_->Tokenize(testing::Deadline().get(), tokenize, &tokens);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(tokens.token_ids(), ElementsAreArray(golden_.prompt_ids));
  EXPECT_EQ(tokens.count(), 5);
  tokenize.set_add_bos(false);
  ASSERT_TRUE(stub_->Tokenize(testing::Deadline().get(), tokenize, &tokens).ok());
  EXPECT_THAT(tokens.token_ids(), ElementsAreArray(golden_.Ids(1, 5)));

  v1::DetokenizeRequest detokenize;
  for (int32_t id : golden_.Ids(1, 61)) detokenize.add_token_ids(id);
  v1::DetokenizeResponse text;
  status = stub_->Detokenize(testing::Deadline().get(), detokenize, &text);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(text.text(), golden_.greedy_text);
  detokenize.add_token_ids(512);
  status = stub_->Detokenize(testing::Deadline().get(), detokenize, &text);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("token_ids[60]"));

  v1::ModelInfoResponse info;
  status = stub_->GetModelInfo(testing::Deadline().get(), {}, &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(info.num_layers(), 5);
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.num_q_heads(), 8);
  EXPECT_EQ(info.num_kv_heads(), 4);
  EXPECT_EQ(info.head_dim(), 8);
  EXPECT_EQ(info.hidden_size(), 64);
  EXPECT_EQ(info.max_context(), 512);
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.cpu_nodes(), 1u);
  EXPECT_EQ(info.model_type(), "llama");
  EXPECT_EQ(info.tokenizer_kind(), "sentencepiece");
  EXPECT_EQ(info.weight_dtype(), "f32");
}

TEST_F(GenerationServiceTest, HealthReportsServing) {
  for (const std::string service : {"", "tandem.v1.Generation"}) {
    EXPECT_EQ(testing::HealthCheck(channel_, service), std::string("\x08\x01", 2))
        << "status SERVING for '" << service << "'";
  }
}

// Two turns of one kept session continue the golden sequence: turn 1 generates
// greedy_ids[5:15]; turn 2 feeds greedy_ids[15:20] as its prompt and must then generate
// greedy_ids[20:30], which is only right if turn 1's KV (and its last, unfed token) was kept.
class MultiTurnTest : public GenerationServiceTest,
                      public ::testing::WithParamInterface<const char*> {};

TEST_P(MultiTurnTest, KeptSessionContinuesAndCloses) {
  const std::string mode = GetParam();
  const std::string session = absl::StrCat("chat1-", mode);
  v1::GenerateRequest first = TextRequest(golden_.prompt_text, 10, mode);
  first.set_session_id(session);
  if (mode == "hybrid") {
    first.set_beta(0.0f);
    first.set_window(16);
    first.set_sink(4);
  }
  Stream s1 = testing::Generate(*stub_, first);
  ASSERT_TRUE(s1.status.ok()) << s1.status.error_message();
  EXPECT_THAT(s1.ids, ElementsAreArray(golden_.Ids(5, 15)));
  EXPECT_EQ(s1.final.usage().prompt_tokens(), 5);
  EXPECT_EQ(s1.final.session_id(), session);

  v1::GenerateRequest second;
  second.set_session_id(session);
  for (int32_t id : golden_.Ids(15, 20)) second.mutable_prompt_ids()->add_ids(id);
  second.set_max_tokens(10);
  Stream s2 = testing::Generate(*stub_, second);
  ASSERT_TRUE(s2.status.ok()) << s2.status.error_message();
  EXPECT_THAT(s2.ids, ElementsAreArray(golden_.Ids(20, 30)));
  EXPECT_EQ(s2.final.usage().prompt_tokens(), 5);  // only this turn's new tokens
  EXPECT_EQ(s2.final.mode(), mode);
  // Fed: 5 + 9 (turn 1) + 1 pending + 5 + 9 (turn 2) = 29 positions.
  EXPECT_EQ(s2.final.device_kv_entries() + s2.final.cpu_kv_entries(), 29);
  if (mode == "hybrid") {
    EXPECT_GT(s2.final.cpu_kv_entries(), 0);
  }

  // A continued session keeps its mode.
  v1::GenerateRequest other_mode = second;
  other_mode.set_mode(mode == "gpu" ? "hybrid" : "gpu");
  EXPECT_EQ(testing::Generate(*stub_, other_mode).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  v1::ModelInfoResponse info;
  ASSERT_TRUE(stub_->GetModelInfo(testing::Deadline().get(), {}, &info).ok());
  EXPECT_EQ(info.open_sessions(), 1u);

  v1::CloseGenerationSessionRequest close;
  close.set_session_id(session);
  v1::CloseGenerationSessionResponse closed;
  grpc::Status status = stub_->CloseSession(testing::Deadline().get(), close, &closed);
  EXPECT_TRUE(status.ok()) << status.error_message();
  status = stub_->CloseSession(testing::Deadline().get(), close, &closed);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(stub_->GetModelInfo(testing::Deadline().get(), {}, &info).ok());
  EXPECT_EQ(info.open_sessions(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, MultiTurnTest, ::testing::Values("gpu", "hybrid"));

// Cancellation, on gutenberg-14m rather than the suite's stories260k: its 8192-token context
// lets the cancelled request ask for 8000 tokens (~2 ms each on one cpu thread, 16 s or more),
// so the cancel, sent after the first token, lands long before the request could end even when
// a loaded CI machine delays it by seconds. (stories260k's 512 positions left ~0.5 s of work
// after the first token: a descheduled client lost that race.)
TEST(GenerationCancelTest, ClientCancellationStopsGenerationAndTheServerKeepsServing) {
  const std::filesystem::path model = std::filesystem::path(TANDEM_SHARED_DIR) / "models" /
                                      "gutenberg-14m";
  if (!std::filesystem::exists(model / "config.json")) {
    GTEST_SKIP() << "gutenberg-14m not found under " << model;
  }
  WorkerServerOptions options;
  options.address = "127.0.0.1:0";
  options.engine.model_dir = model.string();
  options.engine.backend = "cpu";
  options.engine.cpu_threads = 1;
  options.engine.nodes.embedded.pool_bytes = 64ull << 20;
  options.engine.nodes.embedded.threads = 1;
  auto server = GpuWorkerServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel =
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                grpc::InsecureChannelCredentials(), GenerationChannelArguments());
  auto stub = v1::Generation::NewStub(channel);
  constexpr int64_t kLong = 8000;
  const std::string prompt = "It was a dark and stormy night";
  // The greedy first token, from a request that is not cancelled.
  const Stream reference = testing::Generate(*stub, TextRequest(prompt, 1, "gpu"));
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_EQ(reference.ids.size(), 1u);
  const int64_t prompt_tokens = reference.final.usage().prompt_tokens();
  ASSERT_GT(prompt_tokens, 0);

  // A kept session lets the next turn tell how many tokens the cancelled turn generated.
  v1::GenerateRequest request = TextRequest(prompt, kLong, "gpu");
  request.set_ignore_eos(true);
  request.set_session_id("cancelled");
  Stream s = testing::Generate(*stub, request, /*cancel_after_tokens=*/1);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED) << s.status.error_message();
  EXPECT_EQ(s.finals, 0);
  ASSERT_GE(s.ids.size(), 1u);
  EXPECT_EQ(s.ids[0], reference.ids[0]);

  v1::GenerateRequest next;
  next.set_session_id("cancelled");
  next.mutable_prompt_ids()->add_ids(s.ids[0]);
  next.set_max_tokens(1);
  Stream after = testing::Generate(*stub, next);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  // Fed: the prompt + (k - 1) generated + the pending one + 1 new = prompt + k + 1 positions.
  const int64_t generated = after.final.device_kv_entries() - prompt_tokens - 1;
  std::printf("cancelled after the first token: %lld of %lld tokens generated\n",
              static_cast<long long>(generated), static_cast<long long>(kLong));
  EXPECT_GE(generated, 1);
  EXPECT_LT(generated, kLong) << "the cancelled generation ran to max_tokens";
  v1::CloseGenerationSessionRequest close;
  close.set_session_id("cancelled");
  v1::CloseGenerationSessionResponse closed;
  EXPECT_TRUE(stub->CloseSession(testing::Deadline().get(), close, &closed).ok());
  // The server keeps serving: healthy, and a new request gets the same greedy token.
  EXPECT_EQ(testing::HealthCheck(channel, "tandem.v1.Generation"), std::string("\x08\x01", 2));
  const Stream again = testing::Generate(*stub, TextRequest(prompt, 1, "gpu"));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.ids, reference.ids);
}

TEST_F(GenerationServiceTest, ConcurrentStreamsAreEachCorrect) {
  constexpr int kClients = 4;
  std::vector<Stream> streams(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      v1::GenerateRequest request =
          TextRequest(golden_.prompt_text, 20 + 10 * i, i % 2 ? "hybrid" : "gpu");
      if (i % 2) {
        request.set_beta(0.0f);
        request.set_window(16);
      }
      streams[i] = testing::Generate(*stub_, request);
    });
  }
  for (std::thread& t : clients) t.join();
  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(streams[i].status.ok()) << streams[i].status.error_message();
    EXPECT_THAT(streams[i].ids, ElementsAreArray(Continuation(20 + 10 * i)));
    EXPECT_EQ(streams[i].finals, 1);
  }
}

TEST(GpuWorkerServerTest, ShutdownWithAStreamInFlightFinishes) {
  Golden golden;
  if (!testing::LoadGolden(&golden)) GTEST_SKIP() << "stories260k not found";
  auto server = GpuWorkerServer::Start(Stories260kOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Generation::NewStub((*server)->InProcessChannel());
  Stream in_flight;
  std::thread client([&] {
    v1::GenerateRequest request = TextRequest(golden.prompt_text, 500, "hybrid");
    request.set_ignore_eos(true);
    request.set_window(16);
    in_flight = testing::Generate(*stub, request);
  });
  // Let the stream start (or even finish: either way Shutdown must not hang).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  (*server)->Shutdown(0);
  (*server)->Wait();
  client.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // Either the generation finished first, or the call was cancelled/unavailable: never a hang.
  if (in_flight.status.ok()) {
    EXPECT_EQ(in_flight.finals, 1);
  } else {
    EXPECT_THAT(in_flight.status.error_code(),
                ::testing::AnyOf(grpc::StatusCode::CANCELLED, grpc::StatusCode::UNAVAILABLE));
  }
  server->reset();
}

TEST(GpuWorkerServerTest, StartReportsBadOptions) {
  WorkerServerOptions options = Stories260kOptions();
  options.engine.model_dir = "/nonexistent/model";
  EXPECT_FALSE(GpuWorkerServer::Start(options).ok());
  options = Stories260kOptions();
  options.max_message_bytes = 1000;
  EXPECT_EQ(GpuWorkerServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
