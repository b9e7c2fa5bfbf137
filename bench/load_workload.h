// What tandem-load sends: request lengths drawn from a distribution, Poisson arrival times, and
// prompts of token ids (random ids, or slices of a tokenized text). Pure logic, no gRPC; every
// draw comes from a caller's std::mt19937_64, so a run is reproducible from its --load_seed.
//
// Thread safety: LengthSampler and PromptSource are immutable after construction and may be
// shared (their methods are const and take the generator); ArrivalSchedule is not thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::bench {

enum class LengthDist { kFixed, kUniform, kNormal };

// "fixed", "uniform" or "normal"; INVALID_ARGUMENT otherwise.
absl::StatusOr<LengthDist> ParseLengthDist(absl::string_view name);
const char* LengthDistName(LengthDist dist);

// A token-count distribution. `spread` is relative to the mean, as vLLM's range ratio:
// uniform draws integers in [mean * (1 - spread), mean * (1 + spread)], normal has standard
// deviation spread * mean. Every draw is clamped to [1, max] (max = the caller's limit).
struct LengthSpec {
  LengthDist dist = LengthDist::kFixed;
  int64_t mean = 0;
  double spread = 0;
};

class LengthSampler {
 public:
  // INVALID_ARGUMENT (naming `what`, e.g. "--prompt_tokens") for mean < 1, a negative or
  // non-finite spread, or uniform with spread > 1.
  static absl::StatusOr<LengthSampler> Create(const LengthSpec& spec, absl::string_view what);

  // One length in [1, max] (max >= 1).
  int64_t Sample(std::mt19937_64& rng, int64_t max) const;

  const LengthSpec& spec() const { return spec_; }

 private:
  explicit LengthSampler(const LengthSpec& spec) : spec_(spec) {}
  LengthSpec spec_;
};

// Arrival times of an open-loop run: a Poisson process of `rate` requests per second (gaps drawn
// from Exp(rate)); rate 0 = every request is due at once (a closed loop).
class ArrivalSchedule {
 public:
  ArrivalSchedule(double rate, uint64_t seed) : rate_(rate), rng_(seed) {}

  // The next request's arrival, seconds from the run's start; non-decreasing.
  double Next();

 private:
  double rate_;
  double now_s_ = 0;
  std::mt19937_64 rng_;
};

// Prompts as token ids: either uniform random ids in [1, vocab_size) (0 is left out: it is
// <unk> or padding in most vocabularies), or slices of a corpus of ids (a tokenized text) that
// wrap around its end.
class PromptSource {
 public:
  // INVALID_ARGUMENT for vocab_size < 2.
  static absl::StatusOr<PromptSource> Random(int64_t vocab_size);
  // INVALID_ARGUMENT for an empty corpus.
  static absl::StatusOr<PromptSource> Corpus(std::vector<int32_t> ids);

  // The prompt of request `index` (0-based), `length` ids. Random prompts draw from `rng`;
  // corpus prompts are the slice starting at (index * length) mod corpus size, so different
  // requests see different text until the corpus is used up.
  std::vector<int32_t> Make(uint64_t index, int64_t length, std::mt19937_64& rng) const;

  bool is_random() const { return corpus_.empty(); }
  size_t corpus_tokens() const { return corpus_.size(); }

 private:
  PromptSource() = default;
  int64_t vocab_size_ = 0;
  std::vector<int32_t> corpus_;
};

// Cuts `text` into pieces of at most `max_bytes` (> 0), each ending after a newline or a space
// when there is one in its second half, so a tokenizer sees whole words; the pieces concatenate
// to `text`. Never splits inside a UTF-8 character.
std::vector<absl::string_view> SplitText(absl::string_view text, size_t max_bytes);

// Seed of request `index`'s private generator, from the run's seed (so lengths and prompts do not
// depend on which thread sends the request).
uint64_t RequestSeed(uint64_t run_seed, uint64_t index);

}  // namespace tandem::bench
