#include "load_workload.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::bench {

absl::StatusOr<LengthDist> ParseLengthDist(absl::string_view name) {
  if (name == "fixed") return LengthDist::kFixed;
  if (name == "uniform") return LengthDist::kUniform;
  if (name == "normal") return LengthDist::kNormal;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown length distribution '", name, "' (fixed, uniform or normal)"));
}

const char* LengthDistName(LengthDist dist) {
  switch (dist) {
    case LengthDist::kFixed:
      return "fixed";
    case LengthDist::kUniform:
      return "uniform";
    case LengthDist::kNormal:
      return "normal";
  }
  return "?";
}

absl::StatusOr<LengthSampler> LengthSampler::Create(const LengthSpec& spec,
                                                    absl::string_view what) {
  if (spec.mean < 1) return absl::InvalidArgumentError(absl::StrCat(what, " must be >= 1"));
  if (!std::isfinite(spec.spread) || spec.spread < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the spread must be >= 0"));
  }
  if (spec.dist == LengthDist::kUniform && spec.spread > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a uniform spread must be <= 1 (lengths mean * (1 +- spread))"));
  }
  return LengthSampler(spec);
}

int64_t LengthSampler::Sample(std::mt19937_64& rng, int64_t max) const {
  const double mean = static_cast<double>(spec_.mean);
  int64_t n = spec_.mean;
  switch (spec_.dist) {
    case LengthDist::kFixed:
      break;
    case LengthDist::kUniform: {
      const auto lo = static_cast<int64_t>(std::ceil(mean * (1 - spec_.spread)));
      const auto hi = static_cast<int64_t>(std::floor(mean * (1 + spec_.spread)));
      n = std::uniform_int_distribution<int64_t>(std::min(lo, hi), std::max(lo, hi))(rng);
      break;
    }
    case LengthDist::kNormal:
      n = std::llround(std::normal_distribution<double>(mean, spec_.spread * mean)(rng));
      break;
  }
  return std::clamp<int64_t>(n, 1, std::max<int64_t>(max, 1));
}

double ArrivalSchedule::Next() {
  if (rate_ <= 0) return 0;
  now_s_ += std::exponential_distribution<double>(rate_)(rng_);
  return now_s_;
}

absl::StatusOr<PromptSource> PromptSource::Random(int64_t vocab_size) {
  if (vocab_size < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("random prompts need a vocabulary of >= 2 ids, the model has ", vocab_size));
  }
  PromptSource source;
  source.vocab_size_ = vocab_size;
  return source;
}

absl::StatusOr<PromptSource> PromptSource::Corpus(std::vector<int32_t> ids) {
  if (ids.empty()) return absl::InvalidArgumentError("the prompt text has no tokens");
  PromptSource source;
  source.corpus_ = std::move(ids);
  return source;
}

std::vector<int32_t> PromptSource::Make(uint64_t index, int64_t length,
                                        std::mt19937_64& rng) const {
  std::vector<int32_t> ids(static_cast<size_t>(std::max<int64_t>(length, 0)));
  if (is_random()) {
    std::uniform_int_distribution<int32_t> id(1, static_cast<int32_t>(vocab_size_ - 1));
    for (int32_t& x : ids) x = id(rng);
    return ids;
  }
  const size_t size = corpus_.size();
  size_t at = static_cast<size_t>((index % size) * (static_cast<uint64_t>(length) % size) % size);
  for (int32_t& x : ids) {
    x = corpus_[at];
    if (++at == size) at = 0;
  }
  return ids;
}

std::vector<absl::string_view> SplitText(absl::string_view text, size_t max_bytes) {
  std::vector<absl::string_view> pieces;
  max_bytes = std::max<size_t>(max_bytes, 4);  // room for one whole UTF-8 character
  while (text.size() > max_bytes) {
    size_t cut = max_bytes;
    // A byte 10xxxxxx continues a character: move the cut back to the character's start.
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    const size_t space = text.substr(0, cut).find_last_of("\n ");
    if (space != absl::string_view::npos && space + 1 >= cut / 2) cut = space + 1;
    pieces.push_back(text.substr(0, cut));
    text.remove_prefix(cut);
  }
  if (!text.empty()) pieces.push_back(text);
  return pieces;
}

uint64_t RequestSeed(uint64_t run_seed, uint64_t index) {
  // splitmix64 of the pair: neighbouring indices get unrelated streams.
  uint64_t z = run_seed * 0x9E3779B97F4A7C15ull + index + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace tandem::bench
