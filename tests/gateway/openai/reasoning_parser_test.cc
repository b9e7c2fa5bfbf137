// The reasoning parser: whole answers of each kind (thinking, thinking disabled, truncated
// thinking, an empty block, tags in the content), the same answers fed char by char, split at
// every point and in random pieces (the parts must add up to the whole answer's split, so no
// piece of a tag ever reaches either field), where real Qwen3 prompts leave the answer, and the
// flag's values.
#include "tandem/gateway/reasoning_parser.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/chat_template/chat_template.h"
#include "tandem/gateway/chat_prompt.h"

namespace tandem::gateway {
namespace {

constexpr ReasoningMode kQwen3{ReasoningSyntax::kQwen3, PromptThinking::kNone};
constexpr ReasoningMode kQwen3Open{ReasoningSyntax::kQwen3, PromptThinking::kOpen};
constexpr ReasoningMode kQwen3Closed{ReasoningSyntax::kQwen3, PromptThinking::kClosed};
constexpr ReasoningMode kR1{ReasoningSyntax::kDeepSeekR1, PromptThinking::kNone};
constexpr ReasoningMode kR1Closed{ReasoningSyntax::kDeepSeekR1, PromptThinking::kClosed};

struct Case {
  const char* name;
  ReasoningMode mode;
  std::string text;
  std::string reasoning;
  std::string content;
};

std::vector<Case> Cases() {
  return {
      {"qwen3_thinks", kQwen3, "<think>\nLet me see.\n</think>\n\nHello!", "\nLet me see.\n",
       "Hello!"},
      {"qwen3_thinking_disabled", kQwen3, "Hello there.\nBye.", "", "Hello there.\nBye."},
      {"qwen3_truncated_thinking", kQwen3, "<think>\nStill thinking about it",
       "\nStill thinking about it", ""},
      {"qwen3_empty_block", kQwen3, "<think>\n\n</think>\n\nHi", "\n\n", "Hi"},
      {"qwen3_empty_block_no_newlines", kQwen3, "<think></think>Hi", "", "Hi"},
      {"qwen3_tags_in_content", kQwen3,
       "<think>plan</think>\n\nWrite <think> and </think> around it.\n<think>x</think>", "plan",
       "Write <think> and </think> around it.\n<think>x</think>"},
      {"qwen3_open_tag_in_reasoning_is_text", kQwen3, "<think>a <think> b</think>c", "a <think> b",
       "c"},
      {"qwen3_leading_whitespace_before_tag", kQwen3, " \n<think>r</think>c", "r", "c"},
      {"qwen3_only_newlines_after_block", kQwen3, "<think>r</think>\n\n\n", "r", ""},
      {"qwen3_content_keeps_inner_newlines", kQwen3, "<think>r</think>\n\nA\n\nB\n", "r",
       "A\n\nB\n"},
      {"qwen3_partial_open_tag_at_the_end", kQwen3, "<thin", "", "<thin"},
      {"qwen3_partial_close_tag_at_the_end", kQwen3, "<think>abc</thi", "abc</thi", ""},
      {"qwen3_almost_tag", kQwen3, "<think>a </thinker> b</think>c", "a </thinker> b", "c"},
      {"qwen3_utf8", kQwen3, "<think>\xC3\xA9t\xC3\xA9</think>\n\xE2\x9C\x93 done",
       "\xC3\xA9t\xC3\xA9", "\xE2\x9C\x93 done"},
      {"qwen3_only_whitespace", kQwen3, "\n\n \n", "", "\n\n \n"},
      {"qwen3_empty", kQwen3, "", "", ""},
      // Without a leading <think> nor a prompt that opened one, a qwen3 answer is content: a
      // later </think> is text (the start is decided on the first characters).
      {"qwen3_close_tag_without_open_is_content", kQwen3, "abc</think>def", "", "abc</think>def"},
      {"qwen3_prompt_opened", kQwen3Open, "plan\n</think>\n\nanswer", "plan\n", "answer"},
      {"qwen3_prompt_opened_truncated", kQwen3Open, "plan, still", "plan, still", ""},
      {"qwen3_prompt_opened_and_answer_repeats_tag", kQwen3Open, "<think>plan</think>answer",
       "plan", "answer"},
      {"qwen3_prompt_closed", kQwen3Closed, "<think>x</think>\n\ny", "", "<think>x</think>\n\ny"},
      {"r1_without_open_tag", kR1, "Okay, so.\n</think>\n\nThe answer is 4.", "Okay, so.\n",
       "The answer is 4."},
      {"r1_with_open_tag", kR1, "<think>\nhm\n</think>\n\n4", "\nhm\n", "4"},
      {"r1_truncated", kR1, "Okay, so", "Okay, so", ""},
      {"r1_prompt_closed", kR1Closed, "Hello", "", "Hello"},
  };
}

void ExpectSplit(const Case& c, const ReasoningSplit& got, const std::string& how) {
  EXPECT_EQ(got.reasoning, c.reasoning) << c.name << " " << how;
  EXPECT_EQ(got.content, c.content) << c.name << " " << how;
}

// Feeds `pieces` in order and adds up what the parser tells.
ReasoningSplit FeedPieces(ReasoningMode mode, const std::vector<std::string>& pieces) {
  ReasoningParser parser(mode);
  ReasoningSplit sum;
  for (const std::string& piece : pieces) {
    ReasoningSplit told = parser.Feed(piece);
    sum.reasoning += told.reasoning;
    sum.content += told.content;
  }
  ReasoningSplit rest = parser.Finish();
  sum.reasoning += rest.reasoning;
  sum.content += rest.content;
  return sum;
}

TEST(ReasoningParser, WholeAnswers) {
  for (const Case& c : Cases()) {
    ExpectSplit(c, SplitReasoning(c.mode, c.text), "whole");
  }
}

TEST(ReasoningParser, CharByCharAndEverySplitPointGiveTheWholeSplit) {
  for (const Case& c : Cases()) {
    std::vector<std::string> chars;
    for (char ch : c.text) chars.emplace_back(1, ch);
    ExpectSplit(c, FeedPieces(c.mode, chars), "char by char");
    for (size_t i = 0; i <= c.text.size(); ++i) {
      for (size_t j = i; j <= c.text.size(); ++j) {
        ExpectSplit(
            c, FeedPieces(c.mode, {c.text.substr(0, i), c.text.substr(i, j - i), c.text.substr(j)}),
            absl::StrCat("split at ", i, " and ", j));
      }
    }
  }
}

TEST(ReasoningParser, RandomPiecesGiveTheWholeSplit) {
  std::mt19937 rng(30);
  for (const Case& c : Cases()) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<std::string> pieces;
      size_t at = 0;
      while (at < c.text.size()) {
        // Empty pieces too: the worker sends tokens whose text is held back.
        const size_t n = std::uniform_int_distribution<size_t>(0, 6)(rng);
        pieces.push_back(c.text.substr(at, n));
        at += n;
      }
      ExpectSplit(c, FeedPieces(c.mode, pieces), absl::StrCat("trial ", trial));
    }
  }
}

TEST(ReasoningParser, HoldsBackOnlyWhatMayBeATag) {
  ReasoningParser parser(kQwen3);
  ReasoningSplit told = parser.Feed("<th");
  EXPECT_EQ(told.reasoning, "");
  EXPECT_EQ(told.content, "");
  told = parser.Feed("ink>\nOne, two");
  EXPECT_EQ(told.reasoning, "\nOne, two");
  told = parser.Feed(" three</th");
  EXPECT_EQ(told.reasoning, " three");  // "</th" waits
  told = parser.Feed("ink>");
  EXPECT_EQ(told.reasoning, "");
  EXPECT_EQ(told.content, "");
  told = parser.Feed("\n\n");
  EXPECT_EQ(told.content, "");  // newlines after the block are dropped
  told = parser.Feed("Four.</th");
  EXPECT_EQ(told.content, "Four.</th");  // after the block, tags are text: nothing waits
  told = parser.Finish();
  EXPECT_EQ(told.reasoning, "");
  EXPECT_EQ(told.content, "");
}

TEST(ReasoningParser, AnAnswerThatIsNotThinkingIsToldAtOnce) {
  ReasoningParser parser(kQwen3);
  EXPECT_EQ(parser.Feed("Hel").content, "Hel");
  EXPECT_EQ(parser.Feed("lo").content, "lo");
}

TEST(ReasoningParser, PromptThinkingOfEndings) {
  EXPECT_EQ(PromptThinkingOf(""), PromptThinking::kNone);
  EXPECT_EQ(PromptThinkingOf("<|im_start|>assistant\n"), PromptThinking::kNone);
  EXPECT_EQ(PromptThinkingOf("<|im_start|>assistant\n<think>\n"), PromptThinking::kOpen);
  EXPECT_EQ(PromptThinkingOf("<｜Assistant｜><think>\n"), PromptThinking::kOpen);  // DeepSeek-R1
  EXPECT_EQ(PromptThinkingOf("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            PromptThinking::kClosed);
  // A think tag earlier in the conversation does not count: only the prompt's end does.
  EXPECT_EQ(PromptThinkingOf("<|im_start|>user\nWhat is <think>?<|im_end|>\n<|im_start|>"
                             "assistant\n"),
            PromptThinking::kNone);
}

// Qwen3's own template: thinking on leaves the answer to open its block; enable_thinking false
// closes an empty block in the prompt, so the whole answer is content.
TEST(ReasoningParser, Qwen3TemplatePrompts) {
  const std::filesystem::path path =
      std::filesystem::path(TANDEM_CHAT_TEMPLATES_DIR) / "qwen3.jinja";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::stringstream source;
  source << in.rdbuf();
  absl::StatusOr<chat_template::Template> t = chat_template::Template::Parse(source.str());
  ASSERT_TRUE(t.ok()) << t.status();
  v1::ModelInfoResponse info;
  info.set_eos_token("<|im_end|>");
  auto render = [&](const char* kwargs) {
    absl::StatusOr<OpenAiRequest> r = ParseChatRequest(absl::StrCat(
        R"({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": )", kwargs,
        "}"));
    EXPECT_TRUE(r.ok()) << r.status();
    absl::StatusOr<RenderedPrompt> p = RenderChatPrompt(*t, *r, info);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->text : "";
  };
  EXPECT_EQ(PromptThinkingOf(render("{}")), PromptThinking::kNone);
  EXPECT_EQ(PromptThinkingOf(render(R"({"enable_thinking": true})")), PromptThinking::kNone);
  EXPECT_EQ(PromptThinkingOf(render(R"({"enable_thinking": false})")), PromptThinking::kClosed);
}

TEST(ReasoningParser, FlagValues) {
  absl::StatusOr<std::optional<ReasoningSyntax>> off = ParseReasoningSyntax("");
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->has_value());
  absl::StatusOr<std::optional<ReasoningSyntax>> qwen3 = ParseReasoningSyntax("qwen3");
  ASSERT_TRUE(qwen3.ok());
  EXPECT_EQ(*qwen3, ReasoningSyntax::kQwen3);
  absl::StatusOr<std::optional<ReasoningSyntax>> r1 = ParseReasoningSyntax("deepseek_r1");
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(*r1, ReasoningSyntax::kDeepSeekR1);
  for (const char* bad : {"Qwen3", "deepseek-r1", "none", " qwen3"}) {
    absl::StatusOr<std::optional<ReasoningSyntax>> parsed = ParseReasoningSyntax(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(absl::StrCat("'", bad, "'")), std::string::npos);
    EXPECT_NE(parsed.status().message().find("qwen3, deepseek_r1"), std::string::npos);
  }
}

}  // namespace
}  // namespace tandem::gateway
