// Jinja2 statement and expression parser (the grammar and precedence of jinja2/parser.py for the
// constructs chat templates use): if/elif/else, for (tuple targets, "if" filter, else), set
// (names, tuples, namespace attributes, blocks), macro, break/continue, generation; expressions
// with conditional, or/and/not, comparisons and in/not in, + - ~ * / // % **, unary +/-,
// filters, tests, calls with keyword arguments, attribute/item/slice access, literals.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ast.h"

namespace tandem::chat_template::internal {

// Errors: INVALID_ARGUMENT "chat template syntax error at line L, column C: ...".
absl::StatusOr<std::unique_ptr<Program>> ParseProgram(absl::string_view source);

}  // namespace tandem::chat_template::internal
