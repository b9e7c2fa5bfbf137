#include "value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "text_util.h"

namespace tandem::chat_template::internal {

size_t Dict::size() const { return entries_.size(); }

const Value* Dict::Find(absl::string_view key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

void Dict::Set(std::string key, Value value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    entries_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, entries_.size());
  entries_.emplace_back(std::move(key), std::move(value));
}

Value Value::Undefined(std::string message) {
  Value v;
  v.kind_ = Kind::kUndefined;
  v.str_ = std::make_shared<const std::string>(std::move(message));
  return v;
}

Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.int_ = b ? 1 : 0;
  return v;
}

Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.int_ = i;
  return v;
}

Value Value::Float(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.float_ = f;
  return v;
}

Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.str_ = std::make_shared<const std::string>(std::move(s));
  return v;
}

Value Value::MakeList(List items) {
  Value v;
  v.kind_ = Kind::kList;
  for (const Value& item : items) {
    v.depth_ = std::max(v.depth_, item.depth_ + 1);
    v.holds_namespace_ = v.holds_namespace_ || item.holds_namespace_;
  }
  if (v.depth_ == 0) v.depth_ = 1;
  v.list_ = std::make_shared<const List>(std::move(items));
  return v;
}

Value Value::MakeTuple(List items) {
  Value v = MakeList(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.depth_ = 1;
  for (const auto& entry : dict.entries()) {
    v.depth_ = std::max(v.depth_, entry.second.depth_ + 1);
    v.holds_namespace_ = v.holds_namespace_ || entry.second.holds_namespace_;
  }
  v.dict_ = std::make_shared<Dict>(std::move(dict));
  return v;
}

Value Value::MakeNamespace(Dict attributes) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.depth_ = kMaxNamespaceValueDepth + 1;
  v.holds_namespace_ = true;
  v.dict_ = std::make_shared<Dict>(std::move(attributes));
  return v;
}

Value Value::MakeCallable(std::string name,
                          std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.callable_ = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

namespace {

// Recursion bounded by `depth` (checked against kMaxValueDepth before descending).
absl::StatusOr<Value> FromJsonAt(const nlohmann::ordered_json& json, uint32_t depth) {
  if (depth > kMaxValueDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template input is nested deeper than ", kMaxValueDepth, " levels"));
  }
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
    case nlohmann::ordered_json::value_t::discarded:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = json.get<uint64_t>();
      // Python ints are unbounded; beyond int64 the value is kept as a float (documented limit).
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::Float(static_cast<double>(u));
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::String(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(json.size());
      for (const auto& item : json) {
        auto value = FromJsonAt(item, depth + 1);
        if (!value.ok()) return value.status();
        items.push_back(std::move(*value));
      }
      return Value::MakeList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [key, item] : json.items()) {
        auto value = FromJsonAt(item, depth + 1);
        if (!value.ok()) return value.status();
        dict.Set(key, std::move(*value));
      }
      return Value::MakeDict(std::move(dict));
    }
    case nlohmann::ordered_json::value_t::binary:
      return Value::None();
  }
  return Value::None();
}

}  // namespace

absl::StatusOr<Value> Value::FromJson(const nlohmann::ordered_json& json) {
  return FromJsonAt(json, 0);
}

absl::string_view Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return tuple_ ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

bool Truthy(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
    case Value::Kind::kInt:
      return value.int_value() != 0;
    case Value::Kind::kFloat:
      return value.float_value() != 0.0;
    case Value::Kind::kString:
      return !value.str().empty();
    case Value::Kind::kList:
      return !value.list().empty();
    case Value::Kind::kDict:
      return value.dict().size() != 0;
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

std::string PyFloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  // Shortest round-trip digits in scientific form: "d.ddde[+-]X".
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, end);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  // Python's repr: positional notation when -4 <= exponent < 16, else scientific.
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    int point = exponent + 1;  // digits before the decimal point
    if (point <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-point), '0');
      out += digits;
    } else if (static_cast<size_t>(point) >= digits.size()) {
      out += digits;
      out.append(static_cast<size_t>(point) - digits.size(), '0');
      out += ".0";
    } else {
      out += digits.substr(0, point);
      out += ".";
      out += digits.substr(point);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) {
    out += ".";
    out += digits.substr(1);
  }
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  out += exp_buf;
  return out;
}

namespace {

std::string PyStringRepr(const std::string& s) {
  // Python prefers single quotes, and uses double quotes when the text has ' but no ".
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c == static_cast<unsigned char>(quote)) {
          out += '\\';
          out += static_cast<char>(c);
        } else if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\x%02x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string ToPyRepr(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kString:
      return PyStringRepr(value.str());
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kList: {
      std::string out = value.is_tuple() ? "(" : "[";
      bool first = true;
      for (const Value& item : value.list()) {
        if (!first) out += ", ";
        first = false;
        out += ToPyRepr(item);
      }
      if (value.is_tuple()) return out + (value.list().size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, item] : value.dict().entries()) {
        if (!first) out += ", ";
        first = false;
        out += PyStringRepr(key) + ": " + ToPyRepr(item);
      }
      return out + "}";
    }
    default:
      return ToPyString(value);
  }
}

std::string ToPyString(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return value.bool_value() ? "True" : "False";
    case Value::Kind::kInt:
      return absl::StrCat(value.int_value());
    case Value::Kind::kFloat:
      return PyFloatRepr(value.float_value());
    case Value::Kind::kString:
      return value.str();
    case Value::Kind::kList:
    case Value::Kind::kDict:
      return ToPyRepr(value);
    case Value::Kind::kNamespace: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [key, item] : value.dict().entries()) {
        if (!first) out += ", ";
        first = false;
        out += PyStringRepr(key) + ": " + ToPyRepr(item);
      }
      return out + "}>";
    }
    case Value::Kind::kCallable:
      return "<function " + value.callable().name + ">";
  }
  return "";
}

bool PyEquals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.float_value() == b.float_value();
    return a.int_value() == b.int_value();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.str() == b.str();
    case Value::Kind::kList: {
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!PyEquals(a.list()[i], b.list()[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [key, item] : a.dict().entries()) {
        const Value* other = b.dict().Find(key);
        if (other == nullptr || !PyEquals(item, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kNamespace:
      return &a.namespace_attributes() == &b.namespace_attributes();
    case Value::Kind::kCallable:
      return &a.callable() == &b.callable();
    default:
      return false;
  }
}

}  // namespace tandem::chat_template::internal
