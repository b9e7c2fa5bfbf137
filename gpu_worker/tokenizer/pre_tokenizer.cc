#include "pre_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

using nlohmann::json;

constexpr int kMaxDepth = 8;  // nesting of Sequence entries

absl::StatusOr<bool> OptionalBool(const json& object, const char* key, bool default_value) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return default_value;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json pre_tokenizer field \"", key, "\" is not a boolean"));
  }
  return it->get<bool>();
}

absl::StatusOr<PreTokenizer::Behavior> ParseBehavior(const json& object) {
  const auto it = object.find("behavior");
  if (it == object.end() || !it->is_string()) {
    return absl::InvalidArgumentError(
        "tokenizer.json Split pre-tokenizer has no string \"behavior\"");
  }
  const std::string& name = it->get_ref<const std::string&>();
  if (name == "Isolated") return PreTokenizer::Behavior::kIsolated;
  if (name == "Removed") return PreTokenizer::Behavior::kRemoved;
  if (name == "MergedWithPrevious") return PreTokenizer::Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return PreTokenizer::Behavior::kMergedWithNext;
  return absl::UnimplementedError(
      absl::StrCat("tokenizer.json Split pre-tokenizer behavior \"", name, "\" is not supported"));
}

// Appends the pieces `spans` of `subject` give under `behavior` (the rules of Hugging Face's
// SplitDelimiterBehavior: a match merges into its neighbour unless that neighbour is a match).
void ApplyBehavior(std::string_view subject, const std::vector<Regex::Span>& spans,
                   PreTokenizer::Behavior behavior, std::vector<std::string_view>* out) {
  const auto view = [&](size_t begin, size_t end) { return subject.substr(begin, end - begin); };
  switch (behavior) {
    case PreTokenizer::Behavior::kIsolated:
      for (const Regex::Span& s : spans) out->push_back(view(s.begin, s.end));
      return;
    case PreTokenizer::Behavior::kRemoved:
      for (const Regex::Span& s : spans) {
        if (!s.is_match) out->push_back(view(s.begin, s.end));
      }
      return;
    case PreTokenizer::Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      size_t first = out->size();
      for (const Regex::Span& s : spans) {
        if (s.is_match && !previous_match && out->size() > first) {
          const std::string_view last = out->back();
          out->back() = view(static_cast<size_t>(last.data() - subject.data()), s.end);
        } else {
          out->push_back(view(s.begin, s.end));
        }
        previous_match = s.is_match;
      }
      return;
    }
    case PreTokenizer::Behavior::kMergedWithNext: {
      // Walk right to left, then restore the order.
      const size_t first = out->size();
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && out->size() > first) {
          const std::string_view last = out->back();
          out->back() =
              view(it->begin, static_cast<size_t>(last.data() - subject.data()) + last.size());
        } else {
          out->push_back(view(it->begin, it->end));
        }
        previous_match = it->is_match;
      }
      std::reverse(out->begin() + static_cast<std::ptrdiff_t>(first), out->end());
      return;
    }
  }
}

}  // namespace

absl::Status PreTokenizer::AddSteps(const json& config, int depth) {
  if (depth > kMaxDepth) {
    return absl::InvalidArgumentError("tokenizer.json pre_tokenizer is nested too deeply");
  }
  if (!config.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json pre_tokenizer entry is not an object");
  }
  const auto type_it = config.find("type");
  if (type_it == config.end() || !type_it->is_string()) {
    return absl::InvalidArgumentError("tokenizer.json pre_tokenizer entry has no string \"type\"");
  }
  const std::string& type = type_it->get_ref<const std::string&>();
  if (byte_level_seen_) {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer.json pre_tokenizer has a ", type,
                     " step after ByteLevel; only ByteLevel as the last step is supported"));
  }
  if (type == "Sequence") {
    const auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array()) {
      return absl::InvalidArgumentError(
          "tokenizer.json Sequence pre-tokenizer has no \"pretokenizers\" list");
    }
    for (const json& entry : *it) TANDEM_RETURN_IF_ERROR(AddSteps(entry, depth + 1));
    return absl::OkStatus();
  }
  Step step;
  if (type == "ByteLevel") {
    TANDEM_ASSIGN_OR_RETURN(step.add_prefix_space, OptionalBool(config, "add_prefix_space", true));
    TANDEM_ASSIGN_OR_RETURN(const bool use_regex, OptionalBool(config, "use_regex", true));
    if (use_regex) {
      TANDEM_ASSIGN_OR_RETURN(Regex regex, Regex::Compile(kGpt2Pattern, /*literal=*/false));
      step.regex = std::move(regex);
    }
    byte_level_seen_ = true;
  } else if (type == "Split") {
    TANDEM_ASSIGN_OR_RETURN(const bool invert, OptionalBool(config, "invert", false));
    if (invert) {
      return absl::UnimplementedError("tokenizer.json Split pre-tokenizer with invert=true");
    }
    TANDEM_ASSIGN_OR_RETURN(step.behavior, ParseBehavior(config));
    const auto pattern = config.find("pattern");
    if (pattern == config.end() || !pattern->is_object()) {
      return absl::InvalidArgumentError(
          "tokenizer.json Split pre-tokenizer has no \"pattern\" object");
    }
    const auto regex_it = pattern->find("Regex");
    const auto string_it = pattern->find("String");
    const bool literal = regex_it == pattern->end();
    const auto source = literal ? string_it : regex_it;
    if (source == pattern->end() || !source->is_string()) {
      return absl::InvalidArgumentError(
          "tokenizer.json Split pattern has neither a \"Regex\" nor a \"String\" string");
    }
    TANDEM_ASSIGN_OR_RETURN(Regex regex,
                            Regex::Compile(source->get_ref<const std::string&>(), literal));
    step.regex = std::move(regex);
  } else if (type == "Digits") {
    TANDEM_ASSIGN_OR_RETURN(const bool individual,
                            OptionalBool(config, "individual_digits", false));
    // Hugging Face splits on ASCII digits: each alone, or runs of them together.
    TANDEM_ASSIGN_OR_RETURN(Regex regex, Regex::Compile(individual ? "[0-9]" : "[0-9]+", false));
    step.regex = std::move(regex);
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer.json pre-tokenizer type \"", type,
        "\" is not supported (only byte-level BPE: ByteLevel, Split, Digits, Sequence)"));
  }
  steps_.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<PreTokenizer> PreTokenizer::FromJson(const json& config) {
  if (config.is_null()) {
    return absl::UnimplementedError(
        "tokenizer.json has no pre_tokenizer; only byte-level BPE (a ByteLevel pre-tokenizer) is "
        "supported");
  }
  PreTokenizer pre_tokenizer;
  TANDEM_RETURN_IF_ERROR(pre_tokenizer.AddSteps(config, 0));
  if (!pre_tokenizer.byte_level_seen_) {
    return absl::UnimplementedError(
        "tokenizer.json pre_tokenizer has no ByteLevel step; only byte-level BPE is supported");
  }
  return pre_tokenizer;
}

PreTokenizer::Scratch PreTokenizer::NewScratch() const {
  Scratch scratch;
  scratch.match_data_.reserve(steps_.size());
  for (const Step& step : steps_) {
    if (step.regex.has_value()) {
      scratch.match_data_.emplace_back(*step.regex);
    } else {
      scratch.match_data_.emplace_back();
    }
  }
  return scratch;
}

absl::Status PreTokenizer::Split(std::string_view text, Scratch& scratch,
                                 std::vector<std::string_view>* out) const {
  if (text.empty()) return absl::OkStatus();
  std::vector<std::string_view>& pieces = scratch.pieces_;
  std::vector<std::string_view>& next = scratch.next_pieces_;
  pieces.assign(1, text);
  for (size_t i = 0; i < steps_.size(); ++i) {
    const Step& step = steps_[i];
    if (step.add_prefix_space) {
      for (std::string_view& piece : pieces) {
        if (piece.front() != ' ') {
          std::string& prefixed = scratch.arena_.emplace_back(" ");
          prefixed.append(piece);
          piece = prefixed;
        }
      }
    }
    if (!step.regex.has_value()) continue;
    next.clear();
    for (const std::string_view piece : pieces) {
      scratch.spans_.clear();
      TANDEM_RETURN_IF_ERROR(step.regex->Segment(piece, scratch.match_data_[i], &scratch.spans_));
      ApplyBehavior(piece, scratch.spans_, step.behavior, &next);
    }
    pieces.swap(next);
  }
  out->insert(out->end(), pieces.begin(), pieces.end());
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::tokenizer_internal
