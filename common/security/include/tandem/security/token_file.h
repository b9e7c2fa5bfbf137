// Bearer tokens a server accepts, from a file: one token per line, optionally followed by
// whitespace and the principal it stands for ("s3cr3t alice"). Blank lines and lines starting
// with '#' are skipped. A token without a principal stands for "token-<line number>".
//
// Tokens are 16..4096 printable ASCII characters without spaces (shorter ones are guessable and
// refused at load); principals 1..128 characters of [A-Za-z0-9._:@/-]. A token listed twice is
// INVALID_ARGUMENT (which principal it means would be ambiguous).
//
// Lookup compares against every token in constant time per token (the time does not tell how
// many leading characters matched). Immutable after Load: thread-safe.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::security {

class TokenTable {
 public:
  // Reads `path` (at most 1 MiB, at most 65536 tokens). Errors name the file and the line.
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  // Parses the file's text; `source` names it in messages.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);

  // The principal of `token`, or nullopt.
  std::optional<std::string> Lookup(absl::string_view token) const;
  size_t size() const { return entries_.size(); }
  // The file's first token (a loaded table holds at least one).
  const std::string& first_token() const { return entries_.front().first; }

 private:
  std::vector<std::pair<std::string, std::string>> entries_;  // (token, principal)
};

// The first token of a client's token file (the CLI's --token_file): the first field of the
// first line that is neither blank nor a comment.
absl::StatusOr<std::string> ReadClientToken(const std::string& path);

}  // namespace tandem::security
