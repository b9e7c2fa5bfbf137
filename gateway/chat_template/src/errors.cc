#include "errors.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace tandem::chat_template::internal {
namespace {
constexpr char kFinalPayload[] = "tandem.chat_template/final";
}  // namespace

absl::Status MarkFinal(absl::Status status) {
  status.SetPayload(kFinalPayload, absl::Cord("1"));
  return status;
}

bool IsFinal(const absl::Status& status) { return status.GetPayload(kFinalPayload).has_value(); }

absl::Status RaisedError(absl::string_view message) {
  return MarkFinal(absl::InvalidArgumentError(message));
}

absl::Status LimitError(absl::string_view message) {
  return MarkFinal(absl::ResourceExhaustedError(message));
}

absl::Status AtLine(int line, const absl::Status& status) {
  if (status.ok() || IsFinal(status)) return status;
  return MarkFinal(absl::Status(
      status.code(), absl::StrCat("chat template error at line ", line, ": ", status.message())));
}

}  // namespace tandem::chat_template::internal
