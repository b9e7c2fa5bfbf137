// How render errors are shaped. Jinja's own errors (type errors, undefined values, bad filter
// arguments) become INVALID_ARGUMENT "chat template error at line L: <message>"; the message of
// raise_exception(msg) is passed through unchanged, as transformers surfaces it. A status marked
// final (raised, already located, or a bound hit) is never re-wrapped by an enclosing node.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tandem::chat_template::internal {

absl::Status MarkFinal(absl::Status status);
bool IsFinal(const absl::Status& status);

// raise_exception(msg): INVALID_ARGUMENT with exactly msg.
absl::Status RaisedError(absl::string_view message);
// A limit of RenderLimits was reached.
absl::Status LimitError(absl::string_view message);
// Locates a non-final error at `line`.
absl::Status AtLine(int line, const absl::Status& status);

}  // namespace tandem::chat_template::internal
