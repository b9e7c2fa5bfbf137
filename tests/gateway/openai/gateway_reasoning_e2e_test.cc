// --reasoning_parser end to end: the real tandem-gpu-worker (cpu backend, stories260k) behind
// three tandem-gateways that differ only in the flag (off, qwen3, deepseek_r1), all rendering
// think_chat.jinja, a ChatML template whose generation prompt opens a think block
// ("<|im_start|>assistant\n<think>\n", as Qwen3-Thinking-2507 and Qwen3.5 do) or, with
// enable_thinking false, closes an empty one (as Qwen3 does). stories260k never writes a
// "</think>", so each answer is wholly reasoning or wholly content, decided by the prompt and
// the parser: the tests check that each gateway puts the flag-off gateway's greedy text in the
// field the rules say, streamed and not, with the same usage, and that /v1/completions is left
// alone. The tag handling itself is covered by reasoning_parser_test.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using test_process::ChildProcess;
using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// What the streamed chunks of one chat answer add up to.
struct Streamed {
  std::string reasoning;
  std::string content;
  std::string finish_reason;
  Json usage;
};

class GatewayReasoningE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(gpu_worker::testing::Stories260kDir() / "config.json")) {
      GTEST_SKIP() << "stories260k not found under " << gpu_worker::testing::Stories260kDir();
    }
    auto worker = ChildProcess::Start({TANDEM_GPU_WORKER_BIN,
                                       "--model=" + gpu_worker::testing::Stories260kDir().string(),
                                       "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=1",
                                       "--mode=gpu", "--log_level=warn"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> worker_port = worker_->WaitListening();
    ASSERT_TRUE(worker_port.ok()) << worker_port.status();
    const std::string workers = absl::StrCat("--workers=127.0.0.1:", *worker_port);
    for (const char* parser : {"", "qwen3", "deepseek_r1"}) {
      auto gateway = ChildProcess::Start(
          {TANDEM_GATEWAY_BIN, workers, "--address=127.0.0.1:0", "--log_level=warn",
           std::string("--chat_template=") + TANDEM_GATEWAY_THINK_CHAT,
           std::string("--reasoning_parser=") + parser});
      ASSERT_TRUE(gateway.ok()) << gateway.status();
      absl::StatusOr<int> port = (*gateway)->WaitListening();
      ASSERT_TRUE(port.ok()) << port.status();
      gateways_.push_back(std::move(*gateway));
      ports_.push_back(*port);
    }
  }

  // The JSON answer of `gateway` (0 off, 1 qwen3, 2 deepseek_r1) to POST `path` `body`.
  Json Post(int gateway, const std::string& path, const Json& body) {
    httplib::Client http("127.0.0.1", ports_[gateway]);
    http.set_read_timeout(60);
    auto res = http.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(res) << "no answer from gateway " << gateway;
    if (!res) return Json();
    EXPECT_EQ(res->status, 200) << res->body;
    return Json::parse(res->body, nullptr, false);
  }

  // The chunks of `gateway`'s streamed answer to the chat request `body`, added up. Every chunk
  // but the role chunk and the usage chunk must have one choice whose delta holds text only in
  // the fields the parser allows.
  Streamed Stream(int gateway, Json body) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    httplib::Client http("127.0.0.1", ports_[gateway]);
    http.set_read_timeout(60);
    auto res = http.Post("/v1/chat/completions", body.dump(), "application/json");
    Streamed s;
    EXPECT_TRUE(res);
    if (!res) return s;
    EXPECT_EQ(res->status, 200) << res->body;
    bool done = false;
    for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
      if (!absl::StartsWith(line, "data: ")) continue;
      line.remove_prefix(6);
      if (line == "[DONE]") {
        done = true;
        continue;
      }
      const Json chunk = Json::parse(line);
      if (chunk["choices"].empty()) {
        s.usage = chunk["usage"];
        continue;
      }
      const Json& choice = chunk["choices"][0];
      for (const auto& [key, value] : choice["delta"].items()) {
        EXPECT_THAT(key, ::testing::AnyOf("role", "content", "reasoning_content")) << line;
      }
      s.reasoning += choice["delta"].value("reasoning_content", "");
      s.content += choice["delta"].value("content", "");
      if (!choice["finish_reason"].is_null()) s.finish_reason = choice["finish_reason"];
    }
    EXPECT_TRUE(done) << res->body;
    return s;
  }

  std::unique_ptr<ChildProcess> worker_;
  std::vector<std::unique_ptr<ChildProcess>> gateways_;
  std::vector<int> ports_;
};

constexpr int kOff = 0, kQwen3 = 1, kDeepSeekR1 = 2;

Json ChatBody() {
  return {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
          {"max_tokens", 16},
          {"temperature", 0}};
}

// prompt_tokens and completion_tokens: the same whoever splits the text (cached_tokens depends
// on what ran before on the worker).
Json Counts(const Json& usage) {
  return {{"prompt_tokens", usage["prompt_tokens"]},
          {"completion_tokens", usage["completion_tokens"]},
          {"total_tokens", usage["total_tokens"]}};
}

// The prompt opens a think block: with either parser the whole greedy answer is (truncated)
// reasoning, streamed or not; without one it is content, as before the flag existed.
TEST_F(GatewayReasoningE2eTest, AnAnswerInsideAnOpenedBlockIsReasoning) {
  const Json off = Post(kOff, "/v1/chat/completions", ChatBody());
  const Json& off_message = off["choices"][0]["message"];
  ASSERT_TRUE(off_message["content"].is_string()) << off.dump();
  const std::string text = off_message["content"];
  ASSERT_FALSE(text.empty());
  ASSERT_THAT(text, ::testing::Not(HasSubstr("think>")));  // the premise: no tag generated
  EXPECT_FALSE(off_message.contains("reasoning_content")) << off.dump();

  for (int gateway : {kQwen3, kDeepSeekR1}) {
    const Json j = Post(gateway, "/v1/chat/completions", ChatBody());
    EXPECT_EQ(j["choices"][0]["message"],
              Json({{"role", "assistant"}, {"content", nullptr}, {"reasoning_content", text}}))
        << "gateway " << gateway;
    EXPECT_EQ(j["choices"][0]["finish_reason"], off["choices"][0]["finish_reason"]);
    EXPECT_EQ(Counts(j["usage"]), Counts(off["usage"]));

    const Streamed s = Stream(gateway, ChatBody());
    EXPECT_EQ(s.reasoning, text) << "gateway " << gateway;
    EXPECT_EQ(s.content, "");
    EXPECT_EQ(s.finish_reason, off["choices"][0]["finish_reason"]);
    EXPECT_EQ(Counts(s.usage), Counts(off["usage"]));
  }
  const Streamed plain = Stream(kOff, ChatBody());
  EXPECT_EQ(plain.content, text);
  EXPECT_EQ(plain.reasoning, "");
}

// enable_thinking false: the prompt closes an empty block, so the answer is content with either
// parser (deepseek_r1's default of starting in reasoning does not apply).
TEST_F(GatewayReasoningE2eTest, ThinkingDisabledInThePromptIsContent) {
  Json body = ChatBody();
  body["chat_template_kwargs"] = {{"enable_thinking", false}};
  const Json off = Post(kOff, "/v1/chat/completions", body);
  const std::string text = off["choices"][0]["message"]["content"];
  ASSERT_FALSE(text.empty()) << off.dump();
  for (int gateway : {kQwen3, kDeepSeekR1}) {
    const Json j = Post(gateway, "/v1/chat/completions", body);
    EXPECT_EQ(j["choices"][0]["message"],
              Json({{"role", "assistant"}, {"content", text}, {"reasoning_content", nullptr}}))
        << "gateway " << gateway;
    const Streamed s = Stream(gateway, body);
    EXPECT_EQ(s.content, text) << "gateway " << gateway;
    EXPECT_EQ(s.reasoning, "");
  }
}

// A prompt that neither opens nor closes a block (no generation prompt here): the answer did
// not open one either, so qwen3 reads it as content (thinking off) and deepseek_r1 as
// reasoning (R1 models may leave out the opening tag).
TEST_F(GatewayReasoningE2eTest, WithoutAThinkTagTheSyntaxDecides) {
  Json body = ChatBody();
  body["add_generation_prompt"] = false;
  const Json off = Post(kOff, "/v1/chat/completions", body);
  const std::string text = off["choices"][0]["message"]["content"];
  ASSERT_FALSE(text.empty()) << off.dump();
  ASSERT_FALSE(absl::StartsWith(text, "<think>"));
  EXPECT_EQ(Post(kQwen3, "/v1/chat/completions", body)["choices"][0]["message"],
            Json({{"role", "assistant"}, {"content", text}, {"reasoning_content", nullptr}}));
  EXPECT_EQ(Post(kDeepSeekR1, "/v1/chat/completions", body)["choices"][0]["message"],
            Json({{"role", "assistant"}, {"content", nullptr}, {"reasoning_content", text}}));
  EXPECT_EQ(Stream(kDeepSeekR1, body).reasoning, text);
  EXPECT_EQ(Stream(kQwen3, body).content, text);
}

// /v1/completions is never split: the same text with the parser on as off.
TEST_F(GatewayReasoningE2eTest, CompletionsAreLeftAlone) {
  const Json body = {
      {"prompt", "<think>\nOnce upon a time"}, {"max_tokens", 12}, {"temperature", 0}};
  const Json off = Post(kOff, "/v1/completions", body);
  const Json on = Post(kQwen3, "/v1/completions", body);
  ASSERT_TRUE(off["choices"][0]["text"].is_string()) << off.dump();
  EXPECT_EQ(on["choices"][0]["text"], off["choices"][0]["text"]);
  EXPECT_FALSE(on["choices"][0].contains("reasoning_content"));
}

TEST(GatewayReasoningFlag, BadValueRefusedAtStartUp) {
  absl::StatusOr<CommandResult> bad =
      RunCommand({TANDEM_GATEWAY_BIN, "--workers=127.0.0.1:1", "--reasoning_parser=qwen"});
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->exit_code, 2);
  EXPECT_THAT(bad->err, HasSubstr("--reasoning_parser: unknown parser 'qwen'"));
  EXPECT_THAT(bad->err, HasSubstr("qwen3, deepseek_r1"));
}

}  // namespace
}  // namespace tandem::gateway
