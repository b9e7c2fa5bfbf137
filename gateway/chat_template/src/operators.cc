// Python's arithmetic, concatenation, comparison and membership on template values.
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "builtins.h"
#include "interpreter.h"
#include "tandem/common/status_macros.h"

namespace tandem::chat_template::internal {
namespace {

absl::Status Unsupported(absl::string_view op, const Value& a, const Value& b) {
  // Python: a str/list/tuple times a non-int names the other operand's type.
  bool a_seq = a.is_string() || a.is_list(), b_seq = b.is_string() || b.is_list();
  if (op == "*" && (a_seq || b_seq)) {
    return absl::InvalidArgumentError(absl::StrCat("can't multiply sequence by non-int of type '",
                                                   (a_seq ? b : a).TypeName(), "'"));
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported operand type(s) for ",
                                                 op == "**" ? "** or pow()" : op, ": '",
                                                 a.TypeName(), "' and '", b.TypeName(), "'"));
}

absl::Status Overflow() { return absl::InvalidArgumentError("integer overflow"); }

bool IsIntLike(const Value& v) { return v.is_int() || v.is_bool(); }

absl::StatusOr<Value> Repeat(Interpreter& in, const Value& seq, int64_t times) {
  if (times <= 0) return seq.is_string() ? Value::String("") : Value::MakeList({});
  if (seq.is_string()) {
    auto status =
        in.CheckSize(static_cast<uint64_t>(seq.str().size()) * static_cast<uint64_t>(times));
    if (!status.ok()) return status;
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.str();
    return Value::String(std::move(out));
  }
  auto status = in.CountIterations(static_cast<int64_t>(seq.list().size()) * times);
  if (!status.ok()) return status;
  List out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.list().begin(), seq.list().end());
  return Value::MakeList(std::move(out));
}

// Python's printf-style str % args for the conversions templates use: %s %r %d %i %%, with a
// tuple of arguments or a single one.
absl::StatusOr<Value> FormatPercent(Interpreter& in, const std::string& format, const Value& args) {
  List values = args.is_tuple() ? args.list() : List{args};
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out.push_back(format[i]);
      continue;
    }
    if (i + 1 >= format.size()) return absl::InvalidArgumentError("incomplete format");
    char spec = format[++i];
    if (spec == '%') {
      out.push_back('%');
      continue;
    }
    if (spec != 's' && spec != 'r' && spec != 'd' && spec != 'i') {
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported format character '", std::string(1, spec), "'"));
    }
    if (next >= values.size()) {
      return absl::InvalidArgumentError("not enough arguments for format string");
    }
    const Value& v = values[next++];
    if (spec == 's') {
      out += ToPyString(v);
    } else if (spec == 'r') {
      out += ToPyRepr(v);
    } else if (v.is_number()) {
      out += absl::StrCat(v.is_float() ? static_cast<int64_t>(v.float_value()) : v.int_value());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "%", std::string(1, spec), " format: a real number is required, not ", v.TypeName()));
    }
    TANDEM_RETURN_IF_ERROR(in.CheckSize(out.size()));
  }
  // Python leaves an unused non-tuple argument alone when it supports [] (a list or dict).
  bool mapping_like = !args.is_tuple() && (args.is_list() || args.is_dict());
  if (next < values.size() && !mapping_like) {
    return absl::InvalidArgumentError("not all arguments converted during string formatting");
  }
  return Value::String(std::move(out));
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
      }
      return absl::StrContains(container.str(), item.str());
    case Value::Kind::kList:
      for (const Value& x : container.list()) {
        if (PyEquals(x, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      if (item.is_list() || item.is_dict()) {  // Python hashes the key first
        return absl::InvalidArgumentError(absl::StrCat("unhashable type: '", item.TypeName(), "'"));
      }
      return item.is_string() && container.dict().Find(item.str()) != nullptr;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("argument of type '", container.TypeName(), "' is not iterable"));
  }
}

}  // namespace

absl::StatusOr<bool> LessThan(const Value& a, const Value& b) {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.float_value() < b.float_value();
    return a.int_value() < b.int_value();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 order = code points
  if (a.is_list() && b.is_list()) {
    const List& x = a.list();
    const List& y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (PyEquals(x[i], y[i])) continue;
      return LessThan(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  return absl::InvalidArgumentError(absl::StrCat("'<' not supported between instances of '",
                                                 a.TypeName(), "' and '", b.TypeName(), "'"));
}

absl::StatusOr<Value> Negate(const Value& v) {
  if (v.is_undefined()) return UndefinedError(v);
  if (v.is_float()) return Value::Float(-v.float_value());
  if (IsIntLike(v)) {
    if (v.int_value() == INT64_MIN) return Overflow();
    return Value::Int(-v.int_value());
  }
  return absl::InvalidArgumentError(
      absl::StrCat("bad operand type for unary -: '", v.TypeName(), "'"));
}

absl::StatusOr<Value> BinaryOp(Interpreter& in, absl::string_view op, const Value& a,
                               const Value& b) {
  if (op == "==") return Value::Bool(PyEquals(a, b));
  if (op == "!=") return Value::Bool(!PyEquals(a, b));
  if (op == "in" || op == "notin") {
    auto hit = Contains(b, a);
    if (!hit.ok()) return hit.status();
    return Value::Bool(op == "in" ? *hit : !*hit);
  }
  if (op == "~") {
    std::string out = ToPyString(a);
    out += ToPyString(b);
    auto status = in.CheckSize(out.size());
    if (!status.ok()) return status;
    return Value::String(std::move(out));
  }
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    if (a.is_undefined()) return UndefinedError(a);
    if (b.is_undefined()) return UndefinedError(b);
    bool swap = op == ">" || op == "<=";
    auto less = swap ? LessThan(b, a) : LessThan(a, b);
    if (!less.ok()) {
      if (a.is_list() && b.is_list()) return less.status();  // an element pair was incomparable
      return absl::InvalidArgumentError(absl::StrCat("'", op,
                                                     "' not supported between instances of '",
                                                     a.TypeName(), "' and '", b.TypeName(), "'"));
    }
    bool result = (op == "<" || op == ">") ? *less : !*less;
    return Value::Bool(result);
  }
  // Arithmetic: an undefined operand raises its UndefinedError.
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      auto status = in.CheckSize(a.str().size() + b.str().size());
      if (!status.ok()) return status;
      return Value::String(a.str() + b.str());
    }
    if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
      auto status = in.CountIterations(static_cast<int64_t>(a.list().size() + b.list().size()));
      if (!status.ok()) return status;
      List out = a.list();
      out.insert(out.end(), b.list().begin(), b.list().end());
      return a.is_tuple() ? Value::MakeTuple(std::move(out)) : Value::MakeList(std::move(out));
    }
    if (a.is_string() && !b.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("can only concatenate str (not \"", b.TypeName(), "\") to str"));
    }
    if (a.is_list() && b.TypeName() != a.TypeName()) {
      return absl::InvalidArgumentError(absl::StrCat("can only concatenate ", a.TypeName(),
                                                     " (not \"", b.TypeName(), "\") to ",
                                                     a.TypeName()));
    }
  }
  if (op == "%" && a.is_string()) return FormatPercent(in, a.str(), b);
  if (op == "*") {
    if ((a.is_string() || a.is_list()) && IsIntLike(b)) return Repeat(in, a, b.int_value());
    if (IsIntLike(a) && (b.is_string() || b.is_list())) return Repeat(in, b, a.int_value());
  }
  if (!a.is_number() || !b.is_number()) return Unsupported(op, a, b);
  bool as_float = a.is_float() || b.is_float() || op == "/";
  if (as_float) {
    double x = a.float_value(), y = b.float_value();
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if (op == "**") {
      double r = std::pow(x, y);
      if (std::isinf(r) && std::isfinite(x) && std::isfinite(y)) {
        return absl::InvalidArgumentError("(34, 'Numerical result out of range')");
      }
      return Value::Float(r);
    }
    if (y == 0) {
      // Python's wording: int / int says "division by zero", a float operand names its operation.
      bool ints = !a.is_float() && !b.is_float();
      return absl::InvalidArgumentError(op == "/"
                                            ? (ints ? "division by zero" : "float division by zero")
                                        : op == "//" ? "float floor division by zero"
                                                     : "float modulo");
    }
    if (op == "/") return Value::Float(x / y);
    if (op == "//" || op == "%") {
      // CPython's float_divmod, so 2 // 0.1 is 19.0 as in Python.
      double mod = std::fmod(x, y);
      double div = (x - mod) / y;
      if (mod != 0) {
        if ((y < 0) != (mod < 0)) {
          mod += y;
          div -= 1.0;
        }
      } else {
        mod = std::copysign(0.0, y);
      }
      double floordiv = 0;
      if (div != 0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      } else {
        floordiv = std::copysign(0.0, x / y);
      }
      return Value::Float(op == "//" ? floordiv : mod);
    }
    return Unsupported(op, a, b);
  }
  int64_t x = a.int_value(), y = b.int_value(), r = 0;
  if (op == "+") {
    if (__builtin_add_overflow(x, y, &r)) return Overflow();
    return Value::Int(r);
  }
  if (op == "-") {
    if (__builtin_sub_overflow(x, y, &r)) return Overflow();
    return Value::Int(r);
  }
  if (op == "*") {
    if (__builtin_mul_overflow(x, y, &r)) return Overflow();
    return Value::Int(r);
  }
  if (op == "**") {
    if (y < 0) return Value::Float(std::pow(static_cast<double>(x), static_cast<double>(y)));
    if (x == 0) return Value::Int(y == 0 ? 1 : 0);
    if (x == 1) return Value::Int(1);
    if (x == -1) return Value::Int(y % 2 == 1 ? -1 : 1);
    r = 1;  // |x| >= 2 overflows within 63 steps
    for (int64_t i = 0; i < y; ++i) {
      if (__builtin_mul_overflow(r, x, &r)) return Overflow();
    }
    return Value::Int(r);
  }
  if (y == 0) {
    return absl::InvalidArgumentError(op == "%" ? "integer modulo by zero"
                                                : "integer division or modulo by zero");
  }
  if (x == INT64_MIN && y == -1) return Overflow();
  int64_t q = x / y, m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors toward negative infinity
    q -= 1;
    m += y;
  }
  if (op == "//") return Value::Int(q);
  if (op == "%") return Value::Int(m);
  return Unsupported(op, a, b);
}

}  // namespace tandem::chat_template::internal
