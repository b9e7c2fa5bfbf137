// What the OpenAI gateway needs from tandem.v1.Generation, over a real loopback GpuWorkerServer
// (stories260k on the cpu backend, in a copy of its directory given a tokenizer_config.json with a
// chat template and a generation_config.json with a second EOS id): logprobs and top_logprobs in
// TokenDelta, their validation, ModelInfo's chat template / BOS / EOS texts and EOS id set, special
// tokens in text, and requests that are not UTF-8 or not a message at all.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "service_test_util.h"
#include "tandem/gpu_worker/worker_server.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kChatTemplate[] =
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}";

class WorkerApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::filesystem::path src = testing::Stories260kDir();
    if (!std::filesystem::exists(src / "config.json")) return;
    dir_ = std::filesystem::temp_directory_path() /
           ("tandem_worker_api_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    for (const char* name : {"config.json", "model.safetensors", "tokenizer.model"}) {
      std::filesystem::create_symlink(src / name, dir_ / name);
    }
    // config.json says eos 2 (</s>); the chat turn end is 13 here.
    std::ofstream(dir_ / "generation_config.json")
        << R"({"bos_token_id": 1, "eos_token_id": [13, 2]})";
    nlohmann::json tokenizer_config = {
        {"chat_template", kChatTemplate}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
    std::ofstream(dir_ / "tokenizer_config.json") << tokenizer_config.dump();

    WorkerServerOptions options;
    options.address = "127.0.0.1:0";
    options.engine.model_dir = dir_.string();
    options.engine.backend = "cpu";
    options.engine.cpu_threads = 2;
    options.engine.default_mode = AttentionMode::kGpu;
    options.engine.nodes.embedded.pool_bytes = 16ull << 20;
    options.engine.nodes.embedded.threads = 1;
    auto server = GpuWorkerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  void SetUp() override {
    if (server_ == nullptr) {
      GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
    }
    stub_ = v1::Generation::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(),
        GenerationChannelArguments()));
  }

  // The token messages of one Generate call (and its status).
  std::vector<v1::TokenDelta> Tokens(const v1::GenerateRequest& request, grpc::Status* status) {
    auto ctx = testing::Deadline();
    auto reader = stub_->Generate(ctx.get(), request);
    std::vector<v1::TokenDelta> tokens;
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
      if (message.has_token()) tokens.push_back(message.token());
    }
    *status = reader->Finish();
    return tokens;
  }

  static v1::GenerateRequest Request(int64_t max_tokens) {
    v1::GenerateRequest r;
    r.set_prompt_text("Once upon a time");
    r.set_max_tokens(max_tokens);
    r.set_ignore_eos(true);
    return r;
  }

  static std::filesystem::path dir_;
  static GpuWorkerServer* server_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

std::filesystem::path WorkerApiTest::dir_;
GpuWorkerServer* WorkerApiTest::server_ = nullptr;

TEST_F(WorkerApiTest, ModelInfoCarriesChatTemplateTokenTextsAndEosSet) {
  v1::ModelInfoResponse info;
  grpc::Status status = stub_->GetModelInfo(testing::Deadline().get(), {}, &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(info.chat_template(), kChatTemplate);
  EXPECT_EQ(info.bos_token(), "<s>");
  EXPECT_EQ(info.eos_token(), "</s>");
  EXPECT_THAT(info.eos_token_ids(), ElementsAre(2, 13));
}

TEST_F(WorkerApiTest, GreedyTokensCarryTheirLogprobAsTopOne) {
  v1::GenerateRequest r = Request(6);
  r.set_logprobs(true);
  r.set_top_logprobs(4);
  grpc::Status status;
  const std::vector<v1::TokenDelta> tokens = Tokens(r, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(tokens.size(), 6u);
  for (const v1::TokenDelta& t : tokens) {
    ASSERT_TRUE(t.has_logprob());
    EXPECT_LE(t.logprob(), 0.0f);
    ASSERT_EQ(t.top_logprobs_size(), 4);
    EXPECT_EQ(t.top_logprobs(0).token_id(), t.token_id());
    EXPECT_EQ(t.top_logprobs(0).logprob(), t.logprob());
    double mass = 0.0;
    for (int k = 0; k < 4; ++k) {
      const v1::TokenLogprob& c = t.top_logprobs(k);
      if (k > 0) {
        EXPECT_GE(t.top_logprobs(k - 1).logprob(), c.logprob());
      }
      EXPECT_FALSE(c.raw().empty()) << c.token_id();
      mass += std::exp(static_cast<double>(c.logprob()));
    }
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
  // A candidate's text is its piece alone: SentencePiece "▁time" is " time", with its space.
  v1::DetokenizeRequest detokenize;
  detokenize.add_token_ids(tokens[0].top_logprobs(0).token_id());
  v1::DetokenizeResponse alone;
  ASSERT_TRUE(stub_->Detokenize(testing::Deadline().get(), detokenize, &alone).ok());
  const std::string& text = tokens[0].top_logprobs(0).text();
  ASSERT_GE(text.size(), alone.text().size());
  EXPECT_EQ(text.substr(text.size() - alone.text().size()), alone.text());

  // Not asked: nothing computed, nothing sent.
  for (const v1::TokenDelta& t : Tokens(Request(3), &status)) {
    EXPECT_FALSE(t.has_logprob());
    EXPECT_EQ(t.top_logprobs_size(), 0);
  }
  ASSERT_TRUE(status.ok()) << status.error_message();
}

TEST_F(WorkerApiTest, BadLogprobRequestsAreInvalidArgument) {
  struct Case {
    bool logprobs;
    int32_t top_logprobs;
    const char* message_part;
  };
  for (const Case& c : {Case{true, 21, "top_logprobs must be in 0..20"},
                        Case{true, -1, "top_logprobs must be in 0..20"},
                        Case{false, 2, "top_logprobs > 0 requires logprobs"}}) {
    v1::GenerateRequest r = Request(2);
    r.set_logprobs(c.logprobs);
    r.set_top_logprobs(c.top_logprobs);
    grpc::Status status;
    Tokens(r, &status);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.top_logprobs;
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part));
  }
}

TEST_F(WorkerApiTest, SpecialTokenTextIsParsedAndBosNotDoubled) {
  v1::TokenizeRequest tokenize;
  tokenize.set_text("<s>Once upon a time</s>");
  tokenize.set_add_bos(true);
  v1::TokenizeResponse tokens;
  grpc::Status status = stub_->Tokenize(testing::Deadline().get(), tokenize, &tokens);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_GE(tokens.token_ids_size(), 3);
  EXPECT_EQ(tokens.token_ids(0), 1);
  EXPECT_NE(tokens.token_ids(1), 1);
  EXPECT_EQ(tokens.token_ids(tokens.token_ids_size() - 1), 2);
}

// proto3 strings must be UTF-8. The service parses Generate's and Tokenize's bytes itself, so
// such a request is INVALID_ARGUMENT naming the field (gRPC's own parser answers UNIMPLEMENTED
// with no message); the worker keeps serving.
TEST_F(WorkerApiTest, InvalidUtf8IsInvalidArgumentNamingTheField) {
  v1::GenerateRequest r = Request(2);
  r.set_prompt_text("Once \xff\xfe upon");
  grpc::Status status;
  Tokens(r, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("prompt_text is not valid UTF-8"));
  EXPECT_THAT(status.error_message(), HasSubstr("prompt_ids"));

  r = Request(2);
  r.add_stop("ok");
  r.add_stop("\xc3(");
  Tokens(r, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("stop is not valid UTF-8"));

  v1::TokenizeRequest tokenize;
  tokenize.set_text("a\x80 b");
  v1::TokenizeResponse tokens;
  status = stub_->Tokenize(testing::Deadline().get(), tokenize, &tokens);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("text is not valid UTF-8"));

  // The same text as token ids is fine, and a valid request still streams.
  r = Request(2);
  r.mutable_prompt_ids()->add_ids(1);
  r.mutable_prompt_ids()->add_ids(403);
  EXPECT_EQ(Tokens(r, &status).size(), 2u);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Tokens(Request(2), &status).size(), 2u);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// Bytes that are no GenerateRequest at all: INVALID_ARGUMENT, not a crash or UNIMPLEMENTED.
TEST_F(WorkerApiTest, MalformedRequestBytesAreInvalidArgument) {
  grpc::GenericStub generic(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                grpc::InsecureChannelCredentials()));
  const std::string garbage = "\x12\xff\xff\xff\xff\x0f";  // field 2, length past the end
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1);
  auto ctx = testing::Deadline();
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      generic.PrepareCall(ctx.get(), "/tandem.v1.Generation/Generate", &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("not a valid tandem.v1.GenerateRequest"));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
