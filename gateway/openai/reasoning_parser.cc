#include "tandem/gateway/reasoning_parser.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

constexpr std::string_view kOpenTag = "<think>";
constexpr std::string_view kCloseTag = "</think>";
constexpr std::string_view kWhitespace = " \t\r\n";

// The length of the longest proper prefix of `tag` that `text` ends with: the bytes that may
// be the start of a tag whose rest has not arrived yet.
size_t PartialTagSuffix(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.ends_with(tag.substr(0, n))) return n;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::optional<ReasoningSyntax>> ParseReasoningSyntax(std::string_view name) {
  if (name.empty()) return std::nullopt;
  if (name == "qwen3") return ReasoningSyntax::kQwen3;
  if (name == "deepseek_r1") return ReasoningSyntax::kDeepSeekR1;
  return absl::InvalidArgumentError(
      absl::StrCat("--reasoning_parser: unknown parser '", std::string(name),
                   "'; use qwen3, deepseek_r1, or leave it empty to keep thinking in content"));
}

PromptThinking PromptThinkingOf(std::string_view prompt) {
  const size_t last = prompt.find_last_not_of(kWhitespace);
  if (last == std::string_view::npos) return PromptThinking::kNone;
  prompt = prompt.substr(0, last + 1);
  if (prompt.ends_with(kOpenTag)) return PromptThinking::kOpen;
  if (prompt.ends_with(kCloseTag)) return PromptThinking::kClosed;
  return PromptThinking::kNone;
}

ReasoningParser::ReasoningParser(ReasoningMode mode) : mode_(mode) {
  if (mode.prompt == PromptThinking::kClosed) {
    state_ = fallback_ = State::kContent;
    return;
  }
  state_ = State::kStart;
  fallback_ = mode.prompt == PromptThinking::kOpen || mode.syntax == ReasoningSyntax::kDeepSeekR1
                  ? State::kReasoning
                  : State::kContent;
}

ReasoningSplit ReasoningParser::Feed(std::string_view delta) {
  pending_.append(delta);
  ReasoningSplit out;
  Drain(false, &out);
  return out;
}

ReasoningSplit ReasoningParser::Finish() {
  ReasoningSplit out;
  Drain(true, &out);
  return out;
}

void ReasoningParser::Drain(bool final, ReasoningSplit* out) {
  while (true) {
    switch (state_) {
      case State::kStart: {
        const size_t text = std::min(pending_.find_first_not_of(kWhitespace), pending_.size());
        const std::string_view rest = std::string_view(pending_).substr(text);
        if (rest.starts_with(kOpenTag)) {
          pending_.erase(0, text + kOpenTag.size());
          state_ = State::kReasoning;
          break;
        }
        // Whitespace only, or the start of "<think>": the next delta decides.
        if (!final && kOpenTag.starts_with(rest)) return;
        state_ = fallback_;
        break;
      }
      case State::kReasoning: {
        const size_t end = pending_.find(kCloseTag);
        if (end != std::string::npos) {
          out->reasoning.append(pending_, 0, end);
          pending_.erase(0, end + kCloseTag.size());
          state_ = State::kAfterThinking;
          break;
        }
        const size_t told = pending_.size() - (final ? 0 : PartialTagSuffix(pending_, kCloseTag));
        out->reasoning.append(pending_, 0, told);
        pending_.erase(0, told);
        return;
      }
      case State::kAfterThinking: {
        const size_t text = pending_.find_first_not_of('\n');
        if (text == std::string::npos) {
          pending_.clear();
          return;
        }
        pending_.erase(0, text);
        state_ = State::kContent;
        break;
      }
      case State::kContent:
        out->content.append(pending_);
        pending_.clear();
        return;
    }
  }
}

ReasoningSplit SplitReasoning(ReasoningMode mode, std::string_view text) {
  ReasoningParser parser(mode);
  ReasoningSplit split = parser.Feed(text);
  ReasoningSplit rest = parser.Finish();
  split.reasoning += rest.reasoning;
  split.content += rest.content;
  return split;
}

}  // namespace tandem::gateway
