// Splits a chat answer's thinking from its reply, as vLLM's `--reasoning-parser qwen3` and
// `deepseek_r1` do: the text of the model's <think>...</think> block becomes
// `reasoning_content`, the text after it `content`. Only the text is looked at (the tags are
// matched as characters, not token ids), so a tag split across deltas ("</th" + "ink>") is held
// back until it can be told, and neither field ever carries part of a tag.
//
// The rules, for one answer:
// - before `</think>` is reasoning; a leading `<think>` (after optional whitespace) is dropped;
//   the first `</think>` ends the reasoning, later tags are content text;
// - after `</think>` is content, its leading newlines dropped (Qwen3 writes "</think>\n\n"; its
//   chat template drops them too when the message comes back in a later turn);
// - where the answer starts: a prompt that ends inside a think block the template opened
//   (Qwen3-Thinking-2507, Qwen3.5 and DeepSeek-R1-0528 end the generation prompt with
//   "<think>\n") starts in reasoning; a prompt that ends right after a closed block (Qwen3 with
//   enable_thinking false writes "<think>\n\n</think>\n\n") is all content, as vLLM's
//   prompt_is_reasoning_end; otherwise an answer that opens with `<think>` is reasoning, and one
//   that does not is content for qwen3 (thinking disabled or a model that does not think) and
//   reasoning for deepseek_r1 (R1 models may omit the opening tag);
// - no `</think>`: what has started as reasoning stays reasoning (truncated thinking).
// The start is decided from the prompt and the answer's first characters only, so a streamed
// answer is split exactly as the whole text is, whatever its deltas.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::gateway {

enum class ReasoningSyntax { kQwen3, kDeepSeekR1 };

// --reasoning_parser's value: "" -> nullopt (off: thinking stays in content), "qwen3",
// "deepseek_r1"; INVALID_ARGUMENT naming the accepted values for anything else.
absl::StatusOr<std::optional<ReasoningSyntax>> ParseReasoningSyntax(std::string_view name);

// Where a rendered chat prompt leaves the answer (its end, trailing whitespace ignored).
enum class PromptThinking {
  kNone,    // neither: the answer itself says whether it thinks
  kOpen,    // the prompt ends with "<think>": the answer starts inside the block
  kClosed,  // the prompt ends with "</think>": thinking is over before the answer starts
};
PromptThinking PromptThinkingOf(std::string_view prompt);

// How one answer is split: the gateway's syntax and the request's prompt.
struct ReasoningMode {
  ReasoningSyntax syntax = ReasoningSyntax::kQwen3;
  PromptThinking prompt = PromptThinking::kNone;
};

// Either part may be empty.
struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

// One answer's splitter, fed the generated text in order. Not thread-safe: one per answer.
class ReasoningParser {
 public:
  explicit ReasoningParser(ReasoningMode mode);

  // The part of the text so far that can be told now. Text that may still turn out to be a tag
  // (a leading "<thi", a trailing "</th") is held back until the next Feed or Finish.
  ReasoningSplit Feed(std::string_view delta);
  // At the end of the answer: the held-back text (a partial tag that never completed is text).
  ReasoningSplit Finish();

  const ReasoningMode& mode() const { return mode_; }

 private:
  enum class State {
    kStart,          // waiting to see whether the answer opens with "<think>"
    kReasoning,      // inside the think block
    kAfterThinking,  // after "</think>": dropping the newlines before the content
    kContent,
  };
  // Moves what can be told from pending_ into `out`; `final`: nothing more will come.
  void Drain(bool final, ReasoningSplit* out);

  ReasoningMode mode_;
  State state_;
  State fallback_;       // kStart's state when the answer does not open with "<think>"
  std::string pending_;  // text received but not told yet
};

// The split of a whole answer: the same as feeding it in any pieces.
ReasoningSplit SplitReasoning(ReasoningMode mode, std::string_view text);

}  // namespace tandem::gateway
