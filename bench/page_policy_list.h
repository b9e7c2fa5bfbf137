// Parses the --pages flag of the accuracy benchmarks (tandem-ppl-bench, tandem-needle-bench):
// a comma-separated list of page-selection budgets, each TOKENS followed by any of :dN (N dense
// first layers), :cF (PagePolicy::centroid_share F in [0, 1]; unset: the default) and :m (the
// second score is q·mean even where low-rank keys are kept: PagePolicy::low_rank = false), e.g.
// "512,512:c0,2048:d1:c0.5,2048:m".
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
  std::string label;   // "pages 512", "pages 512 d1", "pages 512 c0"
  gpu_worker::PagePolicy policy;
};

// INVALID_ARGUMENT naming the item for anything but TOKENS (>= 1) with :dN (N >= 0), :cF
// (0 <= F <= 1) and :m suffixes.
inline absl::StatusOr<std::vector<LabelledPagePolicy>> ParsePagePolicies(const std::string& spec) {
  std::vector<LabelledPagePolicy> out;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(item, ':');
    gpu_worker::PagePolicy p;
    std::string label = "pages " + parts[0];
    bool ok = absl::SimpleAtoi(parts[0], &p.select_tokens) && p.select_tokens > 0;
    for (size_t i = 1; ok && i < parts.size(); ++i) {
      const std::string& part = parts[i];
      ok = part.size() > 1 || part == "m";
      if (part == "m") {
        p.low_rank = false;
      } else if (ok && part[0] == 'd') {
        ok = absl::SimpleAtoi(part.substr(1), &p.dense_layers) && p.dense_layers >= 0;
      } else if (ok && part[0] == 'c') {
        ok = absl::SimpleAtod(part.substr(1), &p.centroid_share) && p.centroid_share >= 0.0 &&
             p.centroid_share <= 1.0;
      } else {
        ok = false;
      }
      absl::StrAppend(&label, " ", part);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad --pages item '", item, "' (expected TOKENS with any of :dN, :cF, :m)"));
    }
    out.push_back({label, p});
  }
  return out;
}

}  // namespace tandem::bench
