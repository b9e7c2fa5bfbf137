#include "tandem/gpu_worker/page_selection.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker {

absl::StatusOr<SelectionRule> ParseSelectionRule(std::string_view name) {
  // Debian's absl has its own string_view: go through std::string.
  const std::string lower = absl::AsciiStrToLower(std::string(name));
  if (lower == "maw") return SelectionRule::kMaw;
  if (lower == "pages") return SelectionRule::kPages;
  return absl::InvalidArgumentError(
      absl::StrCat("selection '", std::string(name), "' is not one of: maw, pages"));
}

std::string_view SelectionRuleName(SelectionRule rule) {
  switch (rule) {
    case SelectionRule::kMaw:
      return "maw";
    case SelectionRule::kPages:
      return "pages";
  }
  return "unknown";
}

}  // namespace tandem::gpu_worker
