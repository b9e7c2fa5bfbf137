// Python str semantics over UTF-8 bytes: lengths, indices and slices count code points, strip
// and split use Python's whitespace set, case changes cover ASCII, Latin-1, Latin Extended-A,
// Greek and Cyrillic (not Python's final-sigma and dotted-I special cases, nor other scripts).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::chat_template::internal {

// Code point at byte `pos`; *len = its byte length. An invalid byte is one code point (its value).
uint32_t DecodeCodePoint(std::string_view s, size_t pos, size_t* len);
void AppendCodePoint(uint32_t cp, std::string* out);

// Byte offset of every code point, plus s.size() at the end (so size() - 1 code points).
std::vector<size_t> CodePointOffsets(std::string_view s);
int64_t CodePointCount(std::string_view s);

bool IsPyWhitespace(uint32_t cp);

// str.strip/lstrip/rstrip: `chars` absent = Python whitespace, else any of its code points.
std::string PyStrip(std::string_view s, const std::optional<std::string>& chars, bool left,
                    bool right);
// str.split(sep=None, maxsplit=-1). sep must not be empty (the caller reports the error).
std::vector<std::string> PySplit(std::string_view s, const std::optional<std::string>& sep,
                                 int64_t maxsplit);
// str.replace(old, new, count=-1), including Python's rule for an empty `old`.
std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text,
                      int64_t count);
// Byte size PyReplace's result will have (to bound it before building it).
size_t PyReplaceSize(std::string_view s, std::string_view old_text, std::string_view new_text,
                     int64_t count);

std::string PyUpper(std::string_view s);       // str.upper / the upper filter
std::string PyLower(std::string_view s);       // str.lower / the lower filter
bool PyIsLower(std::string_view s);            // str.islower(): cased, and no upper case
bool PyIsUpper(std::string_view s);            // str.isupper()
std::string PyCapitalize(std::string_view s);  // str.capitalize / the capitalize filter
std::string PyTitle(std::string_view s);       // str.title()
std::string JinjaTitle(std::string_view s);    // the title filter (words split at [-\s({\[<])

}  // namespace tandem::chat_template::internal
