// The worker side of chat serving, on gutenberg-14m (byte-level BPE whose `<|endoftext|>` is a
// special added token, id 0) and stories260k (SentencePiece, adds BOS): the EOS set is
// config.json's eos_token_id union generation_config.json's and generation stops at any of its
// ids; malformed files fail at load naming file and field; ModelInfo carries the chat template and
// the BOS / EOS texts; special tokens written in prompt_text are parsed; BOS is never doubled.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "tandem/gpu_worker/engine.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A copy of a model directory: the weights and tokenizer linked, the JSON files copied so that a
// test can rewrite them. Removed when the object goes away.
class ModelCopy {
 public:
  explicit ModelCopy(const std::filesystem::path& src) {
    static std::atomic<int> counter{0};
    path_ =
        std::filesystem::temp_directory_path() /
        ("tandem_eos_chat_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
    for (const auto& entry : std::filesystem::directory_iterator(src)) {
      const std::filesystem::path name = entry.path().filename();
      if (entry.path().extension() == ".json" && name != "tokenizer.json") {
        Write(name.string(), testing::ReadText(entry.path()));
      } else {
        std::filesystem::create_symlink(std::filesystem::absolute(entry.path()), path_ / name);
      }
    }
  }
  ~ModelCopy() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ModelCopy(const ModelCopy&) = delete;
  ModelCopy& operator=(const ModelCopy&) = delete;

  void Write(const std::string& name, const std::string& contents) const {
    std::filesystem::remove(path_ / name);
    std::ofstream file(path_ / name, std::ios::binary);
    file << contents;
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

EngineOptions Options(const std::filesystem::path& dir) {
  EngineOptions options;
  options.model_dir = dir.string();
  options.backend = testing::TestBackendName();
  options.default_mode = AttentionMode::kGpu;
  options.max_context = 1024;
  options.nodes.embedded.pool_bytes = 16ull << 20;
  return options;
}

class EosChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
    TANDEM_SKIP_WITHOUT_BACKEND();
  }

  static std::filesystem::path Gutenberg() { return testing::ModelDir("gutenberg-14m"); }

  static std::unique_ptr<Engine> Create(const std::filesystem::path& dir) {
    auto engine = Engine::Create(Options(dir));
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  static GenerateRequest Greedy(const std::string& prompt, int64_t max_tokens) {
    GenerateRequest r;
    r.prompt_text = prompt;
    r.max_tokens = max_tokens;
    return r;
  }
};

// generation_config.json lists the greedy first token of a prompt as a second EOS (as
// Llama-3-Instruct lists <|eot_id|> beside config.json's <|end_of_text|>): generation stops there.
TEST_F(EosChatTest, GenerationStopsAtAnyIdOfTheUnionOfBothFiles) {
  const std::string prompt = "It was a dark and stormy night; the rain fell in";
  std::unique_ptr<Engine> plain = Create(Gutenberg());
  ASSERT_NE(plain, nullptr);
  EXPECT_THAT(plain->info().eos_token_ids, ElementsAre(0));
  auto reference = plain->Generate(Greedy(prompt, 6));
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->finish_reason, FinishReason::kLength);
  const int32_t first = reference->token_ids[0];
  ASSERT_NE(first, 0);

  ModelCopy copy(Gutenberg());
  copy.Write("generation_config.json",
             "{\"eos_token_id\": [" + std::to_string(first) + ", 0], \"bos_token_id\": 0}");
  std::unique_ptr<Engine> chat = Create(copy.path());
  ASSERT_NE(chat, nullptr);
  std::vector<int32_t> expected = {0, first};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(chat->info().eos_token_ids, expected);

  auto stopped = chat->Generate(Greedy(prompt, 6));
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->finish_reason, FinishReason::kEos);
  EXPECT_THAT(stopped->token_ids, ElementsAre(first));
  EXPECT_EQ(stopped->text, "");  // the EOS token's text is not generated text

  GenerateRequest ignoring = Greedy(prompt, 6);
  ignoring.ignore_eos = true;
  auto through = chat->Generate(ignoring);
  ASSERT_TRUE(through.ok()) << through.status();
  EXPECT_EQ(through->finish_reason, FinishReason::kLength);
  EXPECT_EQ(through->token_ids, reference->token_ids);

  // config.json alone may list several as well (an int or a list in either file);
  // tokenizer_config.json's eos_token (<|endoftext|>, 0) is in the set too, as in vLLM.
  copy.Write("generation_config.json", "{}");
  nlohmann::json config = testing::ReadJson(Gutenberg() / "config.json");
  config["eos_token_id"] = {first, 7};
  copy.Write("config.json", config.dump());
  std::unique_ptr<Engine> listed = Create(copy.path());
  ASSERT_NE(listed, nullptr);
  expected = {0, 7, first};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(listed->info().eos_token_ids, expected);
}

TEST_F(EosChatTest, MalformedFilesFailAtLoadNamingFileAndField) {
  struct Case {
    const char* file;
    const char* contents;
    const char* message_part;
  };
  const Case cases[] = {
      {"generation_config.json", "{broken", "generation_config.json"},
      {"generation_config.json", R"({"eos_token_id": "x"})", "eos_token_id"},
      {"generation_config.json", R"({"eos_token_id": [1, "x"]})", "eos_token_id"},
      {"tokenizer_config.json", "{broken", "tokenizer_config.json"},
      {"tokenizer_config.json", R"({"chat_template": 5})", "chat_template"},
      {"tokenizer_config.json", R"({"chat_template": [{"name": "default"}]})", "chat_template"},
      {"tokenizer_config.json", R"({"eos_token": 3})", "eos_token"},
  };
  for (const Case& c : cases) {
    ModelCopy copy(Gutenberg());
    copy.Write(c.file, c.contents);
    auto engine = Engine::Create(Options(copy.path()));
    ASSERT_FALSE(engine.ok()) << c.file << " " << c.contents;
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << engine.status();
    EXPECT_THAT(engine.status().message(), HasSubstr(c.message_part)) << c.contents;
  }
}

TEST_F(EosChatTest, ModelInfoCarriesTheChatTemplateAndTokenTexts) {
  std::unique_ptr<Engine> plain = Create(Gutenberg());
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->info().chat_template, "");  // a base model: none
  EXPECT_EQ(plain->info().bos_token, "<|endoftext|>");
  EXPECT_EQ(plain->info().eos_token, "<|endoftext|>");

  ModelCopy copy(Gutenberg());
  const std::string chat_template =
      "{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}";
  nlohmann::json config = testing::ReadJson(Gutenberg() / "tokenizer_config.json");
  config["chat_template"] = {{{"name", "tool_use"}, {"template", "unused"}},
                             {{"name", "default"}, {"template", chat_template}}};
  config["bos_token"] = {{"__type", "AddedToken"}, {"content", "<|pad|>"}, {"special", true}};
  copy.Write("tokenizer_config.json", config.dump());
  std::unique_ptr<Engine> chat = Create(copy.path());
  ASSERT_NE(chat, nullptr);
  EXPECT_EQ(chat->info().chat_template, chat_template);
  EXPECT_EQ(chat->info().bos_token, "<|pad|>");
  EXPECT_EQ(chat->info().eos_token, "<|endoftext|>");

  copy.Write("chat_template.jinja", "{{ messages[0]['content'] }}");  // preferred, as transformers
  std::unique_ptr<Engine> jinja = Create(copy.path());
  ASSERT_NE(jinja, nullptr);
  EXPECT_EQ(jinja->info().chat_template, "{{ messages[0]['content'] }}");
}

// A rendered chat template writes special tokens as text: they must become their ids.
TEST_F(EosChatTest, SpecialTokensInPromptTextBecomeTheirIds) {
  std::unique_ptr<Engine> engine = Create(Gutenberg());
  ASSERT_NE(engine, nullptr);
  auto head = engine->Tokenize("The end.", false);
  auto tail = engine->Tokenize("Chapter one", false);
  auto joined = engine->Tokenize("The end.<|endoftext|>Chapter one", false);
  ASSERT_TRUE(head.ok() && tail.ok() && joined.ok());
  std::vector<int32_t> expected = *head;
  expected.push_back(0);
  expected.insert(expected.end(), tail->begin(), tail->end());
  EXPECT_EQ(*joined, expected);

  auto summary = engine->Generate(Greedy("The end.<|endoftext|>Chapter one", 2));
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->prompt_tokens, static_cast<int64_t>(expected.size()));
}

TEST_F(EosChatTest, BosIsNotAddedTwice) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  std::unique_ptr<Engine> engine = Create(testing::ModelDir("stories260k"));
  ASSERT_NE(engine, nullptr);
  const int32_t bos = engine->tokenizer().bos_id();
  ASSERT_GE(bos, 0);
  auto plain = engine->Tokenize("Once upon a time", true);
  auto written = engine->Tokenize("<s>Once upon a time", true);
  ASSERT_TRUE(plain.ok() && written.ok());
  ASSERT_GE(written->size(), 2u);
  EXPECT_EQ((*plain)[0], bos);
  EXPECT_EQ((*written)[0], bos);
  EXPECT_NE((*written)[1], bos);
  EXPECT_EQ(*written, *plain) << "the written <s> is the BOS, once";
  auto summary = engine->Generate(Greedy("<s>Once upon a time", 1));
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->prompt_tokens, static_cast<int64_t>(written->size()));
}

}  // namespace
}  // namespace tandem::gpu_worker
