// The pre-tokenizer of a byte-level BPE tokenizer.json: cuts text into pre-tokens that BPE merges
// never cross. Understood forms (what GPT-2, Llama-3, Qwen2 and SmolLM ship):
//   {"type": "ByteLevel", "add_prefix_space": b, "use_regex": b}      GPT-2 regex split
//   {"type": "Split", "pattern": {"Regex": r} | {"String": s}, "behavior": ..., "invert": false}
//   {"type": "Digits", "individual_digits": b}
//   {"type": "Sequence", "pretokenizers": [...]}                        applied in order
// with exactly one ByteLevel, as the last step (the byte -> character map itself is applied by
// the BPE model afterwards; a Split after it would see mapped characters, which is not supported).
// Split behaviors: Isolated, Removed, MergedWithPrevious, MergedWithNext.
//
// Errors of FromJson: INVALID_ARGUMENT for malformed entries and patterns that do not compile;
// UNIMPLEMENTED for other types (Metaspace, Whitespace, ...), behaviors or layouts.
#pragma once

#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "pcre2_regex.h"

namespace tandem::gpu_worker::tokenizer_internal {

// GPT-2's pre-tokenizer regex, used by ByteLevel with use_regex = true.
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class PreTokenizer {
 public:
  enum class Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext };

  // Per-call working memory: match data of every regex, and storage for pre-tokens that are not
  // substrings of the input (those with a prefix space added). Pre-tokens returned by Split stay
  // valid as long as the Scratch does.
  class Scratch {
   private:
    friend class PreTokenizer;
    std::vector<Regex::MatchData> match_data_;  // one per step
    std::vector<Regex::Span> spans_;
    std::vector<std::string_view> pieces_;
    std::vector<std::string_view> next_pieces_;
    std::deque<std::string> arena_;
  };

  static absl::StatusOr<PreTokenizer> FromJson(const nlohmann::json& config);

  Scratch NewScratch() const;

  // Appends the pre-tokens of `text` (raw bytes, before the byte-level map; non-empty) to `out`.
  // Errors: INTERNAL when a regex match gives up.
  absl::Status Split(std::string_view text, Scratch& scratch,
                     std::vector<std::string_view>* out) const;

 private:
  struct Step {
    bool add_prefix_space = false;  // ByteLevel: prepend " " to pieces not starting with one
    std::optional<Regex> regex;     // absent: the step does not cut
    Behavior behavior = Behavior::kIsolated;
  };

  absl::Status AddSteps(const nlohmann::json& config, int depth);

  std::vector<Step> steps_;
  bool byte_level_seen_ = false;
};

}  // namespace tandem::gpu_worker::tokenizer_internal
