// Jinja2's filters and tests that chat templates use, with transformers' tojson
// (json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)).
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "builtins.h"
#include "errors.h"
#include "interpreter.h"
#include "json_dump.h"
#include "tandem/common/status_macros.h"
#include "text_util.h"

namespace tandem::chat_template::internal {
namespace {

absl::StatusOr<int64_t> Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return CodePointCount(v.str());
    case Value::Kind::kList:
      return static_cast<int64_t>(v.list().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict().size());
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
  }
}

absl::StatusOr<std::string> RequireString(const std::optional<Value>& v, absl::string_view what) {
  if (!v->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be a string, not ", v->TypeName()));
  }
  return v->str();
}

absl::StatusOr<Value> ToJson(Interpreter& in, const Value& subject, CallArgs& args) {
  auto bound = BindArgs("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"}, 0);
  if (!bound.ok()) return bound.status();
  JsonDumpOptions options;
  if ((*bound)[0]) options.ensure_ascii = Truthy(*(*bound)[0]);
  if ((*bound)[1] && !(*bound)[1]->is_none()) {
    if ((*bound)[1]->is_string()) {
      return absl::InvalidArgumentError("tojson: a string indent is not supported");
    }
    auto indent = ToIndex(*(*bound)[1], "indent");
    if (!indent.ok()) return indent.status();
    options.indent = static_cast<int>(std::clamp<int64_t>(*indent, 0, 64));
  }
  if ((*bound)[2] && !(*bound)[2]->is_none()) {
    const Value& seps = *(*bound)[2];
    if (!seps.is_list() || seps.list().size() != 2 || !seps.list()[0].is_string() ||
        !seps.list()[1].is_string()) {
      return absl::InvalidArgumentError("tojson: separators must be a pair of strings");
    }
    options.item_separator = seps.list()[0].str();
    options.key_separator = seps.list()[1].str();
    options.separators_set = true;
    if (options.item_separator.empty()) options.item_separator = "";
  }
  if ((*bound)[3]) options.sort_keys = Truthy(*(*bound)[3]);
  auto text = DumpJson(subject, options, in.limits().max_output_bytes);
  if (!text.ok()) {
    if (absl::IsResourceExhausted(text.status())) return LimitError(text.status().message());
    return text.status();
  }
  return Value::String(std::move(*text));
}

absl::StatusOr<Value> ToInt(const Value& v, const std::optional<Value>& fallback) {
  if (v.is_undefined()) return UndefinedError(v);  // jinja2.Undefined.__int__ raises
  Value dflt = fallback ? *fallback : Value::Int(0);
  if (v.is_int() || v.is_bool()) return Value::Int(v.int_value());
  if (v.is_float()) {
    double f = v.float_value();
    if (!std::isfinite(f) || std::fabs(f) >= 9.2e18) return dflt;
    return Value::Int(static_cast<int64_t>(f));
  }
  if (v.is_string()) {
    std::string s(absl::StripAsciiWhitespace(v.str()));
    std::string digits;
    for (char c : s) {
      if (c != '_') digits.push_back(c);
    }
    int64_t i = 0;
    if (absl::SimpleAtoi(digits, &i)) return Value::Int(i);
    double f = 0;
    if (absl::SimpleAtod(s, &f) && std::isfinite(f) && std::fabs(f) < 9.2e18) {
      return Value::Int(static_cast<int64_t>(f));
    }
  }
  return dflt;
}

absl::StatusOr<Value> ToFloat(const Value& v, const std::optional<Value>& fallback) {
  if (v.is_undefined()) return UndefinedError(v);
  Value dflt = fallback ? *fallback : Value::Float(0.0);
  if (v.is_number()) return Value::Float(v.float_value());
  if (v.is_string()) {
    double f = 0;
    if (absl::SimpleAtod(absl::StripAsciiWhitespace(v.str()), &f)) return Value::Float(f);
  }
  return dflt;
}

absl::StatusOr<Value> Indent(Interpreter& in, const Value& subject, CallArgs& args) {
  auto bound = BindArgs("indent", args, {"width", "first", "blank"}, 0);
  if (!bound.ok()) return bound.status();
  std::string pad = "    ";
  if ((*bound)[0]) {
    if ((*bound)[0]->is_string()) {
      pad = (*bound)[0]->str();
    } else {
      auto width = ToIndex(*(*bound)[0], "width");
      if (!width.ok()) return width.status();
      pad.assign(static_cast<size_t>(std::clamp<int64_t>(*width, 0, 1024)), ' ');
    }
  }
  bool first = (*bound)[1] && Truthy(*(*bound)[1]);
  bool blank = (*bound)[2] && Truthy(*(*bound)[2]);
  std::string s = ToPyString(subject);
  std::vector<std::string> lines = absl::StrSplit(s, '\n');
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n";
    bool indent =
        (i > 0 || first) && (blank || !PyStrip(lines[i], std::nullopt, true, true).empty());
    if (indent) out += pad;
    out += lines[i];
    auto status = in.CheckSize(out.size());
    if (!status.ok()) return status;
  }
  return Value::String(std::move(out));
}

}  // namespace

absl::StatusOr<Value> ApplyFilter(Interpreter& in, const std::string& name, const Value& subject,
                                  CallArgs& args) {
  auto sequence = ApplySequenceFilter(in, name, subject, args);
  if (!sequence.ok() || sequence->has_value()) {
    if (!sequence.ok()) return sequence.status();
    return **sequence;
  }
  if (name == "default" || name == "d") {
    auto bound = BindArgs(name, args, {"default_value", "boolean"}, 0);
    if (!bound.ok()) return bound.status();
    bool boolean = (*bound)[1] && Truthy(*(*bound)[1]);
    bool use_default = subject.is_undefined() || (boolean && !Truthy(subject));
    if (!use_default) return subject;
    return (*bound)[0] ? *(*bound)[0] : Value::String("");
  }
  if (name == "tojson") return ToJson(in, subject, args);
  if (name == "length" || name == "count") {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    auto n = Length(subject);
    if (!n.ok()) return n.status();
    return Value::Int(*n);
  }
  if (name == "trim") {
    auto bound = BindArgs(name, args, {"chars"}, 0);
    if (!bound.ok()) return bound.status();
    std::optional<std::string> chars;
    if ((*bound)[0] && !(*bound)[0]->is_none()) chars = ToPyString(*(*bound)[0]);
    return Value::String(PyStrip(ToPyString(subject), chars, true, true));
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title" ||
      name == "string" || name == "safe") {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    if (name == "safe") return subject;
    std::string s = ToPyString(subject);
    if (name == "upper") return Value::String(PyUpper(s));
    if (name == "lower") return Value::String(PyLower(s));
    if (name == "capitalize") return Value::String(PyCapitalize(s));
    if (name == "title") return Value::String(JinjaTitle(s));
    return Value::String(std::move(s));
  }
  if (name == "items") {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    if (subject.is_undefined()) return Value::MakeList({});
    if (!subject.is_dict())
      return absl::InvalidArgumentError("Can only get item pairs from a mapping.");
    List out;
    for (const auto& [key, item] : subject.dict().entries()) {
      out.push_back(Value::MakeTuple({Value::String(key), item}));
    }
    return Value::MakeList(std::move(out));
  }
  if (name == "first" || name == "last" || name == "list" || name == "reverse" ||
      name == "unique") {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    if (name == "reverse" && subject.is_string()) {
      std::vector<size_t> offsets = CodePointOffsets(subject.str());
      std::string out;
      for (size_t i = offsets.size() - 1; i > 0; --i) {
        out += subject.str().substr(offsets[i - 1], offsets[i] - offsets[i - 1]);
      }
      return Value::String(std::move(out));
    }
    auto items = Iterate(subject);
    if (!items.ok()) return items.status();
    if (name == "list") return Value::MakeList(std::move(*items));
    if (name == "reverse") {
      std::reverse(items->begin(), items->end());
      return Value::MakeList(std::move(*items));
    }
    if (name == "unique") {
      // Jinja's unique is case-insensitive for strings by default and keeps the first seen.
      List out;
      for (const Value& item : *items) {
        bool seen = false;
        for (const Value& kept : out) {
          seen = item.is_string() && kept.is_string() ? PyLower(item.str()) == PyLower(kept.str())
                                                      : PyEquals(item, kept);
          if (seen) break;
        }
        if (!seen) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (items->empty()) {
      return Value::Undefined(absl::StrCat("No ", name, " item, sequence was empty."));
    }
    return name == "first" ? items->front() : items->back();
  }
  if (name == "int" || name == "float") {
    auto bound = BindArgs(name, args, {"default"}, 0);
    if (!bound.ok()) return bound.status();
    return name == "int" ? ToInt(subject, (*bound)[0]) : ToFloat(subject, (*bound)[0]);
  }
  if (name == "abs") {
    if (subject.is_float()) return Value::Float(std::fabs(subject.float_value()));
    if (subject.is_int() || subject.is_bool()) {
      if (subject.int_value() == INT64_MIN) return absl::InvalidArgumentError("integer overflow");
      return Value::Int(std::llabs(subject.int_value()));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("bad operand type for abs(): '", subject.TypeName(), "'"));
  }
  if (name == "replace") {
    auto bound = BindArgs(name, args, {"old", "new", "count"}, 2);
    if (!bound.ok()) return bound.status();
    std::string s = ToPyString(subject);
    auto old_text = RequireString((*bound)[0], "replace: old");
    if (!old_text.ok()) return old_text.status();
    auto new_text = RequireString((*bound)[1], "replace: new");
    if (!new_text.ok()) return new_text.status();
    int64_t count = -1;
    if ((*bound)[2] && !(*bound)[2]->is_none()) {
      auto c = ToIndex(*(*bound)[2], "count");
      if (!c.ok()) return c.status();
      count = *c;
    }
    auto status = in.CheckSize(PyReplaceSize(s, *old_text, *new_text, count));
    if (!status.ok()) return status;
    return Value::String(PyReplace(s, *old_text, *new_text, count));
  }
  if (name == "indent") return Indent(in, subject, args);
  return absl::InvalidArgumentError(absl::StrCat("no filter named '", name, "'"));
}

absl::StatusOr<bool> ApplyTest(Interpreter& in, const std::string& name, const Value& subject,
                               CallArgs& args) {
  auto unary = [&](bool result) -> absl::StatusOr<bool> {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    return result;
  };
  const Value& v = subject;
  if (name == "defined") return unary(!v.is_undefined());
  if (name == "undefined") return unary(v.is_undefined());
  if (name == "none") return unary(v.is_none());
  if (name == "string") return unary(v.is_string());
  if (name == "number") return unary(v.is_number());
  if (name == "integer") return unary(v.is_int());
  if (name == "float") return unary(v.is_float());
  if (name == "boolean") return unary(v.is_bool());
  if (name == "true") return unary(v.is_bool() && v.bool_value());
  if (name == "false") return unary(v.is_bool() && !v.bool_value());
  if (name == "mapping") return unary(v.is_dict());
  // Python: str, list and dict have len() and [] (as has jinja2.Undefined).
  if (name == "sequence")
    return unary(v.is_string() || v.is_list() || v.is_dict() || v.is_undefined());
  if (name == "iterable")
    return unary(v.is_string() || v.is_list() || v.is_dict() || v.is_undefined());
  if (name == "callable") return unary(v.is_callable() || v.is_undefined());
  if (name == "lower" || name == "upper") {
    return unary(name == "lower" ? PyIsLower(ToPyString(v)) : PyIsUpper(ToPyString(v)));
  }
  if (name == "odd" || name == "even") {
    // Jinja: value % 2 == 1 (odd) / == 0 (even), with Python's % (floats too).
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    auto rest = BinaryOp(in, "%", v, Value::Int(2));
    if (!rest.ok()) return rest.status();
    return PyEquals(*rest, Value::Int(name == "odd" ? 1 : 0));
  }
  static const char* kBinaryTests[] = {
      "equalto", "eq", "==", "ne", "!=", "sameas", "in", "divisibleby", "lt",
      "<",       "le", "<=", "gt", ">",  "ge",     ">=", "lessthan",    "greaterthan"};
  if (std::find(std::begin(kBinaryTests), std::end(kBinaryTests), name) == std::end(kBinaryTests)) {
    return absl::InvalidArgumentError(absl::StrCat("no test named '", name, "'"));
  }
  auto bound = BindArgs(name, args, {"other"}, 1);
  if (!bound.ok()) return bound.status();
  const Value& other = *(*bound)[0];
  if (name == "equalto" || name == "eq" || name == "==") return PyEquals(v, other);
  if (name == "ne" || name == "!=") return !PyEquals(v, other);
  if (name == "sameas") return v.kind() == other.kind() && PyEquals(v, other);
  if (name == "in") {
    auto r = BinaryOp(in, "in", v, other);
    if (!r.ok()) return r.status();
    return r->bool_value();
  }
  if (name == "divisibleby") {
    auto rest = BinaryOp(in, "%", v, other);
    if (!rest.ok()) return rest.status();
    return PyEquals(*rest, Value::Int(0));
  }
  static const std::pair<const char*, const char*> kComparisons[] = {
      {"lt", "<"}, {"<", "<"},   {"le", "<="}, {"<=", "<="},      {"gt", ">"},
      {">", ">"},  {"ge", ">="}, {">=", ">="}, {"lessthan", "<"}, {"greaterthan", ">"}};
  for (const auto& [test, op] : kComparisons) {
    if (name == test) {
      auto r = BinaryOp(in, op, v, other);
      if (!r.ok()) return r.status();
      return r->bool_value();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("no test named '", name, "'"));
}

}  // namespace tandem::chat_template::internal
