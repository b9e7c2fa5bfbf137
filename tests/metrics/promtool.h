// Runs `promtool check metrics` (Prometheus's own parser and lint) on an exposition, for the
// tests. promtool exits 1 when it cannot parse, 3 for lint problems. tandem's vLLM-style names
// carry a colon, which the lint reports as "metric names should not contain ':'" (the data model
// allows it; vLLM's names get the same); every other problem is returned.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::metrics_test {

inline bool PromtoolAvailable() { return std::system("command -v promtool >/dev/null 2>&1") == 0; }

struct PromtoolResult {
  int exit_code = 0;
  std::vector<std::string> colon_findings;  // the accepted lint lines
  std::vector<std::string> problems;        // everything else it printed
};

inline absl::StatusOr<PromtoolResult> RunPromtool(const std::string& exposition) {
  char path[] = "/tmp/tandem_metrics_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  close(fd);
  {
    std::ofstream out(path);
    out << exposition;
  }
  const std::string command = absl::StrCat("promtool check metrics < ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    std::remove(path);
    return absl::InternalError("popen failed");
  }
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  std::remove(path);
  PromtoolResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  for (absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    if (absl::EndsWith(line, "metric names should not contain ':'")) {
      result.colon_findings.emplace_back(line);
    } else {
      result.problems.emplace_back(line);
    }
  }
  return result;
}

}  // namespace tandem::metrics_test
