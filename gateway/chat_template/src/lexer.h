// Jinja2 lexer with the whitespace rules transformers uses: trim_blocks (the first newline after
// a block or comment tag is dropped), lstrip_blocks (spaces and tabs before a block or comment
// tag at the start of a line are dropped, unless "{%+"), "-" on either side of a tag strips all
// whitespace on that side, newlines are normalised to "\n" and one trailing newline of the source
// is dropped (keep_trailing_newline=False). Comments are removed here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::chat_template::internal {

struct Token {
  enum class Type {
    kText,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInt,
    kFloat,
    kOp,
    kEof
  };
  Token() = default;
  explicit Token(Type t) : type(t) {}

  Type type = Type::kEof;
  std::string text;  // text data, name, decoded string literal, operator
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;  // 1-based
  int column = 1;
};

// Errors: INVALID_ARGUMENT "chat template syntax error at line L, column C: ...".
absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source);

absl::Status SyntaxError(int line, int column, absl::string_view message);

}  // namespace tandem::chat_template::internal
