// A compiled PCRE2 regex for pre-tokenizer patterns (Hugging Face writes them for Oniguruma:
// `(?i:...)`, `\p{L}`, `\p{N}`, lookahead; PCRE2 understands the same syntax). Compiled with
// PCRE2_UTF | PCRE2_UCP (so \s, \w and \d are Unicode-aware, as in Oniguruma) and
// PCRE2_MATCH_INVALID_UTF (ill-formed UTF-8 in a subject never matches instead of failing the
// match), and JIT-compiled when the platform allows.
//
// Thread safety: a Regex is immutable after Compile and may be shared; each thread matches with
// its own MatchData.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::gpu_worker::tokenizer_internal {

class Regex {
 public:
  // Scratch space of one matching thread (pcre2_match_data).
  class MatchData {
   public:
    MatchData() = default;  // holds nothing; for steps without a regex
    explicit MatchData(const Regex& regex);

   private:
    friend class Regex;
    struct Free {
      void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
    };
    std::unique_ptr<pcre2_match_data, Free> data_;
  };

  // A piece of a subject: [begin, end) byte offsets, and whether the regex matched it.
  struct Span {
    size_t begin;
    size_t end;
    bool is_match;
  };

  // INVALID_ARGUMENT naming the pattern and PCRE2's message when it does not compile. `literal`:
  // the pattern is a plain string, not a regex.
  static absl::StatusOr<Regex> Compile(std::string_view pattern, bool literal);

  // Cuts `subject` into consecutive non-empty spans, matches and the gaps between them, left to
  // right, together covering it exactly (empty matches are skipped). Appends them to `out`.
  // INTERNAL when PCRE2 gives up (a resource limit), naming the error.
  absl::Status Segment(std::string_view subject, MatchData& match_data,
                       std::vector<Span>* out) const;

 private:
  struct Free {
    void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  };
  explicit Regex(pcre2_code* code) : code_(code) {}

  std::unique_ptr<pcre2_code, Free> code_;
};

}  // namespace tandem::gpu_worker::tokenizer_internal
