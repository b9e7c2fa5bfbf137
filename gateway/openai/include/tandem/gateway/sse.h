// Server-sent events as OpenAI streams them: each event is one "data: <compact JSON>" line and a
// blank line; the stream ends with "data: [DONE]". Comments (": text") carry tandem's prefill
// progress; SSE clients ignore them. JSON is dumped with invalid UTF-8 replaced (U+FFFD), so a
// stray byte from a worker can never make the dump throw.
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

// Compact JSON, invalid UTF-8 replaced by U+FFFD (never throws).
inline std::string DumpJson(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline std::string SseData(const nlohmann::json& event) {
  return absl::StrCat("data: ", DumpJson(event), "\n\n");
}

// A comment line; `text` must not contain a newline.
inline std::string SseComment(absl::string_view text) { return absl::StrCat(": ", text, "\n\n"); }

inline std::string SseDone() { return "data: [DONE]\n\n"; }

}  // namespace tandem::gateway
