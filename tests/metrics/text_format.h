// A small parser of the Prometheus text exposition format 0.0.4, written for the tests from the
// format's description (not prometheus-cpp's code): what a scrape says is read back and
// checked by value. Handles # HELP / # TYPE, samples with or without labels, label values with
// \\ \" \n escapes, +Inf/-Inf/NaN values and an optional timestamp; any other line is an error.
#pragma once

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace tandem::metrics_test {

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::map<std::string, std::string> help;  // by family name
  std::map<std::string, std::string> type;  // by family name
  std::vector<Sample> samples;

  // The samples named `name` whose labels include every pair of `labels`.
  std::vector<Sample> Find(const std::string& name,
                           const std::map<std::string, std::string>& labels = {}) const {
    std::vector<Sample> found;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool match = true;
      for (const auto& [k, v] : labels) {
        auto it = s.labels.find(k);
        if (it == s.labels.end() || it->second != v) match = false;
      }
      if (match) found.push_back(s);
    }
    return found;
  }
  // The value of the one sample that matches; nullopt when none or several do.
  std::optional<double> Value(const std::string& name,
                              const std::map<std::string, std::string>& labels = {}) const {
    std::vector<Sample> found = Find(name, labels);
    if (found.size() != 1) return std::nullopt;
    return found[0].value;
  }
};

inline bool IsNameChar(char c, bool first) {
  return absl::ascii_isalpha(c) || c == '_' || c == ':' || (!first && absl::ascii_isdigit(c));
}

inline absl::StatusOr<double> ParseValue(absl::string_view text) {
  if (text == "+Inf" || text == "Inf") return std::numeric_limits<double>::infinity();
  if (text == "-Inf") return -std::numeric_limits<double>::infinity();
  if (absl::AsciiStrToLower(text) == "nan") return std::numeric_limits<double>::quiet_NaN();
  double v = 0;
  if (!absl::SimpleAtod(text, &v))
    return absl::InvalidArgumentError(absl::StrCat("value '", text, "'"));
  return v;
}

inline absl::StatusOr<Sample> ParseSample(absl::string_view line) {
  Sample s;
  size_t i = 0;
  while (i < line.size() && IsNameChar(line[i], i == 0)) ++i;
  if (i == 0) return absl::InvalidArgumentError(absl::StrCat("no metric name: ", line));
  s.name = std::string(line.substr(0, i));
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      size_t start = i;
      while (i < line.size() && IsNameChar(line[i], i == start) && line[i] != ':') ++i;
      std::string key(line.substr(start, i - start));
      if (key.empty() || i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') {
        return absl::InvalidArgumentError(absl::StrCat("bad label in: ", line));
      }
      i += 2;
      std::string value;
      for (;; ++i) {
        if (i >= line.size()) return absl::InvalidArgumentError(absl::StrCat("open quote: ", line));
        if (line[i] == '"') break;
        if (line[i] == '\\') {
          if (++i >= line.size()) return absl::InvalidArgumentError("escape at end");
          if (line[i] == 'n') {
            value += '\n';
          } else if (line[i] == '\\' || line[i] == '"') {
            value += line[i];
          } else {
            return absl::InvalidArgumentError(absl::StrCat("bad escape in: ", line));
          }
        } else {
          value += line[i];
        }
      }
      ++i;  // the closing quote
      if (!s.labels.emplace(key, value).second) {
        return absl::InvalidArgumentError(absl::StrCat("label '", key, "' twice: ", line));
      }
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return absl::InvalidArgumentError(absl::StrCat("open brace: ", line));
    ++i;  // '}'
  }
  if (i >= line.size() || line[i] != ' ') {
    return absl::InvalidArgumentError(absl::StrCat("no value: ", line));
  }
  std::vector<absl::string_view> rest = absl::StrSplit(line.substr(i + 1), ' ', absl::SkipEmpty());
  if (rest.empty() || rest.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("value and timestamp: ", line));
  }
  absl::StatusOr<double> v = ParseValue(rest[0]);
  if (!v.ok()) return v.status();
  s.value = *v;
  int64_t timestamp = 0;
  if (rest.size() == 2 && !absl::SimpleAtoi(rest[1], &timestamp)) {
    return absl::InvalidArgumentError(absl::StrCat("timestamp: ", line));
  }
  return s;
}

inline absl::StatusOr<Exposition> ParseExposition(absl::string_view text) {
  Exposition e;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() >= 3 && parts[1] == "HELP") {
        e.help[std::string(parts[2])] = parts.size() == 4 ? std::string(parts[3]) : "";
      } else if (parts.size() == 4 && parts[1] == "TYPE") {
        static const char* kTypes[] = {"counter", "gauge", "histogram", "summary", "untyped"};
        bool known = false;
        for (const char* t : kTypes) known |= parts[3] == t;
        if (!known) return absl::InvalidArgumentError(absl::StrCat("type: ", line));
        e.type[std::string(parts[2])] = std::string(parts[3]);
      }
      continue;  // other comments are allowed
    }
    absl::StatusOr<Sample> s = ParseSample(line);
    if (!s.ok()) return s.status();
    e.samples.push_back(*std::move(s));
  }
  return e;
}

}  // namespace tandem::metrics_test
