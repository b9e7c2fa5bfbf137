// Parses the --pages flag of the accuracy benchmarks (tandem-ppl-bench, tandem-needle-bench):
// a comma-separated list of page-selection budgets, each TOKENS or TOKENS:dN (N dense first
// layers), e.g. "256,512,512:d1".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "tandem/gpu_worker/page_selection.h"

namespace tandem::bench {

struct LabelledPagePolicy {
  std::string label;   // "pages 512" or "pages 512 d1"
  gpu_worker::PagePolicy policy;
};

// INVALID_ARGUMENT naming the item for anything but TOKENS (>= 1) or TOKENS:dN (N >= 0).
inline absl::StatusOr<std::vector<LabelledPagePolicy>> ParsePagePolicies(const std::string& spec) {
  std::vector<LabelledPagePolicy> out;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(item, ':');
    gpu_worker::PagePolicy p;
    bool ok = parts.size() <= 2 && absl::SimpleAtoi(parts[0], &p.select_tokens) &&
              p.select_tokens > 0;
    if (ok && parts.size() == 2) {
      ok = parts[1].size() > 1 && parts[1][0] == 'd' &&
           absl::SimpleAtoi(parts[1].substr(1), &p.dense_layers) && p.dense_layers >= 0;
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --pages item '", item, "' (expected TOKENS or TOKENS:dN)"));
    }
    out.push_back({absl::StrFormat("pages %d%s", p.select_tokens,
                                   p.dense_layers ? absl::StrFormat(" d%d", p.dense_layers)
                                                  : std::string()),
                   p});
  }
  return out;
}

}  // namespace tandem::bench
