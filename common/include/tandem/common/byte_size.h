// A byte count for flags: "1073741824", "64M", "8GiB", "1.5G" (K/M/G/T are powers of 1024;
// an optional "B" or "iB" suffix is accepted). Usable as an absl flag type. FormatBytes writes a
// count for people: "64.0 GiB".
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tandem {

struct ByteSize {
  uint64_t bytes = 0;
};

// False (with *error set) for anything but a finite non-negative number with a known suffix,
// or a value past 2^62.
inline bool ParseByteSize(absl::string_view text, uint64_t* bytes, std::string* error) {
  std::string s(absl::StripAsciiWhitespace(text));
  double multiplier = 1;
  auto ends_with = [&](absl::string_view suffix) {
    if (s.size() > suffix.size() &&
        absl::EqualsIgnoreCase(absl::string_view(s).substr(s.size() - suffix.size()), suffix)) {
      s.resize(s.size() - suffix.size());
      return true;
    }
    return false;
  };
  if (!ends_with("iB")) ends_with("B");
  const char units[] = {'K', 'M', 'G', 'T'};
  for (int i = 0; i < 4; ++i) {
    if (ends_with(std::string(1, units[i]))) multiplier = std::pow(1024.0, i + 1);
  }
  double value = 0;
  if (!absl::SimpleAtod(s, &value) || !std::isfinite(value) || value < 0 ||
      value * multiplier > 4.6e18) {
    *error = absl::StrCat("'", text, "' is not a byte size like 1073741824, 512M or 8GiB");
    return false;
  }
  *bytes = static_cast<uint64_t>(value * multiplier);
  return true;
}

// A byte count for logs and messages: "512 B" below 1 KiB, else one decimal of the largest
// binary unit it reaches: "1.5 KiB", "64.0 GiB", "2.0 TiB" (up to EiB). Rounded to the nearest
// tenth, so the exact count belongs beside it where a program reads the output.
inline std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  // Move up when the value would print as "1024.0" in this unit.
  while (unit + 1 < 6 && value >= 1023.95) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f %s", value, kUnits[unit]);
  return text;
}

inline bool AbslParseFlag(absl::string_view text, ByteSize* size, std::string* error) {
  return ParseByteSize(text, &size->bytes, error);
}

inline std::string AbslUnparseFlag(ByteSize size) { return absl::StrCat(size.bytes); }

}  // namespace tandem
