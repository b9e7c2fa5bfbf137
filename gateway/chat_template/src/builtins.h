// What Jinja2 (with transformers' overrides) provides to templates: attribute/item/slice access
// with Python's lookup rules, the operators, the filters and tests, str/dict methods, and the
// globals. Errors are plain INVALID_ARGUMENT with Python's or Jinja's message; the interpreter
// adds the line (see errors.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "value.h"

namespace tandem::chat_template::internal {

class Interpreter;

// ---- access (access.cc) ----
// obj.name: a method of str/dict ("strip", "items", ...) first, then a dict key / namespace
// attribute; else an undefined value naming what is missing. Access on an undefined value is
// its UndefinedError.
absl::StatusOr<Value> GetAttribute(const Value& obj, const std::string& name);
// obj[key]: list/str index (negative from the end), dict key, else as GetAttribute for a string
// key. Out of range or missing: an undefined value.
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key);
// obj[start:stop:step] on a list or str (null values = omitted).
absl::StatusOr<Value> GetSlice(Interpreter& in, const Value& obj, const Value& start,
                               const Value& stop, const Value& step);
// The items a for-loop visits: list items, dict keys, str code points; undefined: none.
absl::StatusOr<List> Iterate(const Value& value);
// The error an undefined value raises when used (its message).
absl::Status UndefinedError(const Value& undefined);

// ---- operators (operators.cc) ----
// op in + - * / // % ** ~ == != < <= > >= in notin.
absl::StatusOr<Value> BinaryOp(Interpreter& in, absl::string_view op, const Value& a,
                               const Value& b);
absl::StatusOr<Value> Negate(const Value& v);
// Python a < b for numbers, strings and lists (TypeError otherwise).
absl::StatusOr<bool> LessThan(const Value& a, const Value& b);

// ---- filters and tests (filters.cc) ----
absl::StatusOr<Value> ApplyFilter(Interpreter& in, const std::string& name, const Value& subject,
                                  CallArgs& args);
// The sequence filters (sequence_filters.cc); an empty optional when `name` is not one of them.
absl::StatusOr<std::optional<Value>> ApplySequenceFilter(Interpreter& in, const std::string& name,
                                                         const Value& subject, CallArgs& args);
absl::StatusOr<bool> ApplyTest(Interpreter& in, const std::string& name, const Value& subject,
                               CallArgs& args);

// ---- globals (globals.cc) ----
// raise_exception, strftime_now, namespace, range, dict.
Dict MakeGlobals();

// ---- argument binding (globals.cc) ----
// Binds Python-style: positional in order, then keywords by name. Unknown keywords, too many
// arguments and missing required ones (the first `required` names) are errors naming `function`.
absl::StatusOr<std::vector<std::optional<Value>>> BindArgs(
    absl::string_view function, const CallArgs& args, const std::vector<absl::string_view>& names,
    size_t required);

// What a namespace attribute may hold: no namespace (so no reference cycle can form) and
// nothing deeper than kMaxNamespaceValueDepth.
absl::Status CheckNamespaceValue(const Value& value);

// Python int(x) where x must be an int or bool (indices, counts); TypeError otherwise.
absl::StatusOr<int64_t> ToIndex(const Value& v, absl::string_view what);

}  // namespace tandem::chat_template::internal
