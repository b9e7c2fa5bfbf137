// A chat template that writes the BOS (bos_chat.jinja, as Llama-3's and Mistral's do) on
// gutenberg-14m, whose tokenizer adds BOS ("<|endoftext|>"): the prompt holds exactly one BOS as
// Hugging Face's apply_chat_template gives, one-shot or on a session's first turn, and none on
// a later turn of the session (its rendering starts with BOS again).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using test_process::ChildProcess;
using Json = nlohmann::json;

TEST(GatewayChatBos, OneBosAtTheStartOfTheSequenceOnly) {
  const std::filesystem::path model =
      std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "gutenberg-14m";
  if (!std::filesystem::exists(model / "config.json")) {
    GTEST_SKIP() << "gutenberg-14m not found under " << model;
  }
  auto worker = ChildProcess::Start({TANDEM_GPU_WORKER_BIN, "--model=" + model.string(),
                                     "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=1",
                                     "--mode=gpu", "--log_level=warn"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> worker_port = (*worker)->WaitListening();
  ASSERT_TRUE(worker_port.ok()) << worker_port.status();
  const std::string address = absl::StrCat("127.0.0.1:", *worker_port);
  auto stub =
      v1::Generation::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  v1::ModelInfoResponse info;
  ASSERT_TRUE(stub->GetModelInfo(gpu_worker::testing::Deadline().get(), {}, &info).ok());
  ASSERT_EQ(info.bos_token(), "<|endoftext|>");

  // The rendering, tokenized as Hugging Face does (special tokens parsed, nothing added).
  const std::string rendered =
      info.bos_token() + "### user:\nIt was a dark night\n### assistant:\n";
  v1::TokenizeRequest tokenize;
  tokenize.set_text(rendered);
  tokenize.set_add_bos(false);
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(stub->Tokenize(gpu_worker::testing::Deadline().get(), tokenize, &tokens).ok());
  ASSERT_GT(tokens.count(), 2);

  auto gateway = ChildProcess::Start(
      {TANDEM_GATEWAY_BIN, "--workers=" + address, "--address=127.0.0.1:0",
       std::string("--chat_template=") + TANDEM_GATEWAY_BOS_CHAT, "--log_level=warn"});
  ASSERT_TRUE(gateway.ok()) << gateway.status();
  absl::StatusOr<int> port = (*gateway)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  httplib::Client http("127.0.0.1", *port);
  auto prompt_tokens = [&](const std::string& session_id) -> int64_t {
    Json body = {{"messages", {{{"role", "user"}, {"content", "It was a dark night"}}}},
                 {"max_tokens", 2},
                 {"temperature", 0}};
    if (!session_id.empty()) body["session_id"] = session_id;
    auto res = http.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return -1;
    EXPECT_EQ(res->status, 200) << res->body;
    return Json::parse(res->body)["usage"]["prompt_tokens"].get<int64_t>();
  };
  EXPECT_EQ(prompt_tokens(""), tokens.count());            // one-shot: one BOS
  EXPECT_EQ(prompt_tokens("chat-1"), tokens.count());      // first turn: one BOS
  EXPECT_EQ(prompt_tokens("chat-1"), tokens.count() - 1);  // later turn: none
}

}  // namespace
}  // namespace tandem::gateway
