#include "tandem/security/token_file.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::security {
namespace {

constexpr size_t kMinTokenChars = 16;
constexpr size_t kMaxTokenChars = 4096;
constexpr size_t kMaxTokens = 65536;
constexpr size_t kMaxFileBytes = 1 << 20;

bool PrincipalChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
         c == '@' || c == '/' || c == '-';
}

// Equal contents in time that depends on the lengths only.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot read the token file '", path, "'"));
  }
  std::string text(kMaxFileBytes + 1, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), file));
  std::fclose(file);
  if (text.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the token file '", path, "' is larger than 1 MiB"));
  }
  return Parse(text, path);
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source) {
  TokenTable table;
  std::set<std::string> seen;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat(source, ":", line_number);
    if (fields.size() > 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expected 'token' or 'token principal', got ", fields.size(), " fields"));
    }
    const absl::string_view token = fields[0];
    if (token.size() < kMinTokenChars || token.size() > kMaxTokenChars) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a token must have ", kMinTokenChars,
                                                     "..", kMaxTokenChars,
                                                     " characters, this one has ", token.size()));
    }
    for (char c : token) {
      if (c < 0x21 || c > 0x7e) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": a token must be printable ASCII"));
      }
    }
    std::string principal =
        fields.size() == 2 ? std::string(fields[1]) : absl::StrCat("token-", line_number);
    if (principal.size() > 128 || !std::all_of(principal.begin(), principal.end(), PrincipalChar)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": a principal must be 1..128 characters of [A-Za-z0-9._:@/-]"));
    }
    if (!seen.insert(std::string(token)).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": this token is listed twice"));
    }
    if (table.entries_.size() == kMaxTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": more than ", kMaxTokens, " tokens"));
    }
    table.entries_.emplace_back(std::string(token), std::move(principal));
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source,
                     ": no token (one per line: 'token' or 'token principal'); an empty file would "
                     "refuse every call"));
  }
  return table;
}

std::optional<std::string> TokenTable::Lookup(absl::string_view token) const {
  // Every entry is compared (no early exit), so the time tells nothing about which matched.
  const std::string* found = nullptr;
  for (const auto& [candidate, principal] : entries_) {
    if (ConstantTimeEquals(candidate, token)) found = &principal;
  }
  if (found == nullptr) return std::nullopt;
  return *found;
}

absl::StatusOr<std::string> ReadClientToken(const std::string& path) {
  absl::StatusOr<TokenTable> table = TokenTable::Load(path);
  if (!table.ok()) {
    return absl::Status(table.status().code(),
                        absl::StrCat("--token_file: ", table.status().message()));
  }
  return table->first_token();
}

}  // namespace tandem::security
