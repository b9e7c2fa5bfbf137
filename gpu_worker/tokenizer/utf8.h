// UTF-8 helpers shared by the tokenizers and the stream decoder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::gpu_worker::tokenizer_internal {

// Appends the UTF-8 encoding of code point `cp` (<= 0x10FFFF) to `dst`.
void AppendUtf8(uint32_t cp, std::string* dst);

// Decodes the well-formed UTF-8 character at `src[pos]`: sets *cp and returns its length in
// bytes, or returns 0 when the bytes there are not a complete well-formed character.
size_t DecodeUtf8(std::string_view src, size_t pos, uint32_t* cp);

// Appends `src` to `dst` as valid UTF-8: each maximal ill-formed subpart becomes U+FFFD (the
// Unicode "best practice", as Python's errors="replace" and Rust's from_utf8_lossy do). When
// `final` is false, a well-formed but unfinished sequence at the very end of `src` is not written.
// Returns the number of bytes of `src` consumed (src.size() when final).
size_t AppendValidUtf8(std::string_view src, bool final, std::string* dst);

// `src` with invalid sequences replaced by U+FFFD.
std::string ToValidUtf8(std::string_view src);

// True when `src` is entirely well-formed UTF-8.
bool IsValidUtf8(std::string_view src);

}  // namespace tandem::gpu_worker::tokenizer_internal
