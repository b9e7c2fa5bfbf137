// LoadChatConfig on hand-written model directories (every form transformers writes, and the
// errors) and on gutenberg-14m; DescribeToken on gutenberg-14m's byte-level tokens.
#include "tandem/gpu_worker/chat_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tandem/gpu_worker/tokenizer.h"
#include "tokenizer_test_util.h"

namespace tandem::gpu_worker {
namespace {

std::filesystem::path Gutenberg() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "gutenberg-14m";
}

TEST(ChatConfigTest, AbsentFileGivesEmptyStrings) {
  TempModelDir dir;
  absl::StatusOr<ChatConfig> chat = LoadChatConfig(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template, "");
  EXPECT_EQ(chat->bos_token, "");
  EXPECT_EQ(chat->eos_token, "");
}

TEST(ChatConfigTest, StringTemplateAndAddedTokenObjects) {
  TempModelDir dir;
  dir.Write("tokenizer_config.json", R"({
    "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
    "eos_token": "</s>"})");
  absl::StatusOr<ChatConfig> chat = LoadChatConfig(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template,
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
  EXPECT_EQ(chat->bos_token, "<s>");
  EXPECT_EQ(chat->eos_token, "</s>");
}

TEST(ChatConfigTest, NamedTemplatesUseDefault) {
  TempModelDir dir;
  dir.Write("tokenizer_config.json", R"({"chat_template": [
    {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    "eos_token": null})");
  absl::StatusOr<ChatConfig> chat = LoadChatConfig(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template, "D");
  EXPECT_EQ(chat->eos_token, "");

  dir.Write("tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "R"}]})");
  chat = LoadChatConfig(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template, "");  // no default: none for plain chat
}

TEST(ChatConfigTest, JinjaFileIsPreferred) {
  TempModelDir dir;
  dir.Write("tokenizer_config.json", R"({"chat_template": "old", "eos_token": "<e>"})");
  dir.Write("chat_template.jinja", "{{ messages }}\n");
  absl::StatusOr<ChatConfig> chat = LoadChatConfig(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template, "{{ messages }}\n");
  EXPECT_EQ(chat->eos_token, "<e>");
}

TEST(ChatConfigTest, MalformedFilesNameFileAndField) {
  struct Case {
    const char* contents;
    const char* message_part;
  };
  const Case cases[] = {
      {"{not json", "tokenizer_config.json"},
      {"[1, 2]", "not a JSON object"},
      {R"({"chat_template": 7})", "chat_template"},
      {R"({"chat_template": [{"name": "default", "template": 3}]})", "chat_template"},
      {R"({"chat_template": ["x"]})", "chat_template"},
      {R"({"bos_token": ["<s>"]})", "bos_token"},
      {R"({"eos_token": {"text": "</s>"}})", "eos_token"},
  };
  for (const Case& c : cases) {
    TempModelDir dir;
    dir.Write("tokenizer_config.json", c.contents);
    absl::StatusOr<ChatConfig> chat = LoadChatConfig(dir.path());
    ASSERT_FALSE(chat.ok()) << c.contents;
    EXPECT_EQ(chat.status().code(), absl::StatusCode::kInvalidArgument) << chat.status();
    EXPECT_NE(chat.status().message().find(c.message_part), std::string::npos)
        << chat.status() << " for " << c.contents;
    EXPECT_NE(chat.status().message().find("tokenizer_config.json"), std::string::npos);
  }
}

TEST(ChatConfigTest, Gutenberg14m) {
  if (!std::filesystem::exists(Gutenberg() / "tokenizer_config.json")) {
    GTEST_SKIP() << "gutenberg-14m not found at " << Gutenberg();
  }
  absl::StatusOr<ChatConfig> chat = LoadChatConfig(Gutenberg());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->chat_template, "");
  EXPECT_EQ(chat->bos_token, "<|endoftext|>");
  EXPECT_EQ(chat->eos_token, "<|endoftext|>");
}

TEST(DescribeTokenTest, BytesTextAndSpecialTokens) {
  if (!std::filesystem::exists(Gutenberg() / "tokenizer.json")) {
    GTEST_SKIP() << "gutenberg-14m not found at " << Gutenberg();
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(Gutenberg());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Tokenizer& t = **tokenizer;

  TokenPiece the = DescribeToken(t, 262);  // " the" (bpe_tokenizer_test)
  EXPECT_EQ(the.raw, " the");
  EXPECT_EQ(the.text, " the");

  TokenPiece eot = DescribeToken(t, 0);  // special: its text, not ""
  EXPECT_EQ(eot.raw, "<|endoftext|>");
  EXPECT_EQ(eot.text, "<|endoftext|>");

  // A lone lead byte of a 3-byte character is a token of its own in byte-level BPE.
  absl::StatusOr<std::vector<int32_t>> lead = t.Encode("\xE2", false);
  ASSERT_TRUE(lead.ok()) << lead.status();
  ASSERT_EQ(lead->size(), 1u);
  TokenPiece partial = DescribeToken(t, (*lead)[0]);
  EXPECT_EQ(partial.raw, "\xE2");
  EXPECT_EQ(partial.text, "\xEF\xBF\xBD");  // U+FFFD

  EXPECT_EQ(DescribeToken(t, -1).raw, "");
  EXPECT_EQ(DescribeToken(t, t.vocab_size()).text, "");
}

}  // namespace
}  // namespace tandem::gpu_worker
