#include "pcre2_regex.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

std::string Pcre2Message(int error_code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  if (n < 0) return absl::StrCat("PCRE2 error ", error_code);
  return std::string(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

// Length of the character at subject[pos], 1 for a byte that does not start one.
size_t CharLength(std::string_view subject, size_t pos) {
  size_t len = 1;
  while (pos + len < subject.size() && (static_cast<uint8_t>(subject[pos + len]) & 0xC0) == 0x80 &&
         len < 4) {
    ++len;
  }
  return len;
}

}  // namespace

Regex::MatchData::MatchData(const Regex& regex)
    : data_(pcre2_match_data_create_from_pattern(regex.code_.get(), nullptr)) {}

absl::StatusOr<Regex> Regex::Compile(std::string_view pattern, bool literal) {
  // PCRE2_LITERAL refuses PCRE2_UCP (meaningless without classes).
  const uint32_t options =
      PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("pre-tokenizer regex \"", std::string(pattern),
                                                   "\" does not compile at offset ", error_offset,
                                                   ": ", Pcre2Message(error_code)));
  }
  Regex regex(code);
  // Without JIT support PCRE2 falls back to its interpreter: slower, same results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return regex;
}

absl::Status Regex::Segment(std::string_view subject, MatchData& match_data,
                            std::vector<Span>* out) const {
  pcre2_match_data* md = match_data.data_.get();
  if (md == nullptr) return absl::ResourceExhaustedError("cannot allocate PCRE2 match data");
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t gap_begin = 0;  // end of the previous match
  size_t start = 0;      // where the next search starts
  while (start < subject.size()) {
    const int rc = pcre2_match(code_.get(), data, subject.size(), start, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return absl::InternalError(
          absl::StrCat("pre-tokenizer regex match failed: ", Pcre2Message(rc)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (end <= begin) {  // empty match: not a piece; search again one character later
      start = begin + (begin < subject.size() ? CharLength(subject, begin) : 1);
      continue;
    }
    if (begin > gap_begin) out->push_back({gap_begin, begin, false});
    out->push_back({begin, end, true});
    gap_begin = end;
    start = end;
  }
  if (gap_begin < subject.size()) out->push_back({gap_begin, subject.size(), false});
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::tokenizer_internal
