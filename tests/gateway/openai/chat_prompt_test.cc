// Chat rendering for the worker: a BOS-led rendering keeps its BOS as text for a one-shot request
// and loses it for a session (the worker adds BOS on the first turn only), a template without
// BOS is marked for tokenizing without one, template errors name `messages`, and a model without
// a template is refused with what to do.
#include "tandem/gateway/chat_prompt.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "tandem/gateway/api_error.h"

namespace tandem::gateway {
namespace {

constexpr char kLlamaLike[] =
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}";
constexpr char kChatMl[] =
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

OpenAiRequest Chat(const char* messages_json) {
  absl::StatusOr<OpenAiRequest> r =
      ParseChatRequest(std::string(R"({"messages": )") + messages_json + "}");
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

v1::ModelInfoResponse Info(const std::string& bos, const std::string& chat_template = "") {
  v1::ModelInfoResponse info;
  info.set_bos_token(bos);
  info.set_eos_token("</s>");
  info.set_chat_template(chat_template);
  return info;
}

TEST(GatewayChatPrompt, BosLedRenderingKeepsItsBosOnceAndNoneMidSession) {
  ChatTemplateSource source{""};
  const v1::ModelInfoResponse info = Info("<s>", kLlamaLike);
  auto t = source.Get(info);
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<RenderedPrompt> p =
      RenderChatPrompt(**t, Chat(R"([{"role": "user", "content": "Hi"}])"), info);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->text, "<s>[user] Hi\n[assistant] ");
  EXPECT_EQ(p->bos_text_bytes, 3u);

  // Both go as prompt_text without any RPC: nothing listens at port 1.
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
  // One-shot or a first turn: as rendered (the worker maps "<s>" to the BOS id, adds no other).
  v1::GenerateRequest one_shot;
  ASSERT_TRUE(SetChatPrompt(*p, false, *stub, 1000, &one_shot).ok());
  EXPECT_EQ(one_shot.prompt_text(), "<s>[user] Hi\n[assistant] ");
  // A later turn of a session: the BOS text cut (the worker adds none to a continued session).
  v1::GenerateRequest turn;
  turn.set_session_id("s");
  ASSERT_TRUE(SetChatPrompt(*p, true, *stub, 1000, &turn).ok());
  EXPECT_EQ(turn.prompt_text(), "[user] Hi\n[assistant] ");
}

TEST(GatewayChatPrompt, TemplateWithoutBosIsTokenizedWithoutOne) {
  ChatTemplateSource source{kChatMl};  // --chat_template overrides the model's
  ASSERT_TRUE(source.CheckOverride().ok());
  const v1::ModelInfoResponse info = Info("<s>", kLlamaLike);
  auto t = source.Get(info);
  ASSERT_TRUE(t.ok()) << t.status();
  OpenAiRequest r = Chat(R"([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}])");
  r.add_generation_prompt = false;
  absl::StatusOr<RenderedPrompt> p = RenderChatPrompt(**t, r, info);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->bos_text_bytes, 0u);
  EXPECT_EQ(p->text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(GatewayChatPrompt, ErrorsNameMessages) {
  ChatTemplateSource none{""};
  absl::StatusOr<std::shared_ptr<const chat_template::Template>> t = none.Get(Info(""));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(t.status()), "messages");
  EXPECT_NE(t.status().message().find("--chat_template"), std::string::npos);

  ChatTemplateSource broken{"{% for m in messages %}"};
  EXPECT_EQ(broken.CheckOverride().code(), absl::StatusCode::kInvalidArgument);

  ChatTemplateSource strict{
      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
      "{% endif %}{{ messages[0]['content'] }}"};
  auto st = strict.Get(Info(""));
  ASSERT_TRUE(st.ok()) << st.status();
  absl::StatusOr<RenderedPrompt> p =
      RenderChatPrompt(**st, Chat(R"([{"role": "assistant", "content": "x"}])"), Info(""));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(p.status()), "messages");
  EXPECT_NE(p.status().message().find("first must be user"), std::string::npos);
}

}  // namespace
}  // namespace tandem::gateway
