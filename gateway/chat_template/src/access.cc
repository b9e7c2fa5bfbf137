// Attribute, item and slice access, iteration, and the str/dict methods templates call.
#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "builtins.h"
#include "interpreter.h"
#include "text_util.h"

namespace tandem::chat_template::internal {
namespace {

// Jinja's object_type_repr: "None" or "dict object" (quoted in attribute messages, not in
// element messages, as jinja2.Undefined words them).
std::string TypeName(const Value& obj) {
  if (obj.is_none()) return "None";
  return absl::StrCat(obj.TypeName(), " object");
}
std::string TypeRepr(const Value& obj) { return absl::StrCat("'", TypeName(obj), "'"); }

Value MissingAttribute(const Value& obj, absl::string_view name) {
  return Value::Undefined(absl::StrCat(TypeRepr(obj), " has no attribute '", name, "'"));
}

absl::StatusOr<std::optional<std::string>> OptionalString(const std::optional<Value>& v,
                                                          absl::string_view what) {
  if (!v || v->is_none()) return std::optional<std::string>();
  if (!v->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " arg must be None or str"));
  }
  return std::optional<std::string>(v->str());
}

// Prefixes for startswith/endswith: a str or a tuple (list) of str.
absl::StatusOr<std::vector<std::string>> Affixes(const Value& v, absl::string_view method) {
  std::vector<std::string> out;
  if (v.is_string()) {
    out.push_back(v.str());
    return out;
  }
  if (v.is_list()) {
    for (const Value& item : v.list()) {
      if (!item.is_string()) break;
      out.push_back(item.str());
    }
    if (out.size() == v.list().size()) return out;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(method, " first arg must be str or a tuple of str, not ", v.TypeName()));
}

absl::StatusOr<Value> CallStrMethod(Interpreter& in, const std::string& self,
                                    const std::string& name, CallArgs& args) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto bound = BindArgs(name, args, {"chars"}, 0);
    if (!bound.ok()) return bound.status();
    auto chars = OptionalString((*bound)[0], name);
    if (!chars.ok()) return chars.status();
    return Value::String(PyStrip(self, *chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    auto bound = BindArgs(name, args, {}, 0);
    if (!bound.ok()) return bound.status();
    if (name == "upper") return Value::String(PyUpper(self));
    if (name == "lower") return Value::String(PyLower(self));
    if (name == "title") return Value::String(PyTitle(self));
    return Value::String(PyCapitalize(self));
  }
  if (name == "startswith" || name == "endswith") {
    auto bound = BindArgs(name, args, {"prefix"}, 1);
    if (!bound.ok()) return bound.status();
    auto affixes = Affixes(*(*bound)[0], name);
    if (!affixes.ok()) return affixes.status();
    for (const std::string& a : *affixes) {
      if (name == "startswith" ? absl::StartsWith(self, a) : absl::EndsWith(self, a)) {
        return Value::Bool(true);
      }
    }
    return Value::Bool(false);
  }
  if (name == "split") {
    auto bound = BindArgs(name, args, {"sep", "maxsplit"}, 0);
    if (!bound.ok()) return bound.status();
    auto sep = OptionalString((*bound)[0], "split");
    if (!sep.ok()) return sep.status();
    if (*sep && (*sep)->empty()) return absl::InvalidArgumentError("empty separator");
    int64_t maxsplit = -1;
    if ((*bound)[1]) {
      auto m = ToIndex(*(*bound)[1], "maxsplit");
      if (!m.ok()) return m.status();
      maxsplit = *m;
    }
    List parts;
    for (std::string& p : PySplit(self, *sep, maxsplit))
      parts.push_back(Value::String(std::move(p)));
    return Value::MakeList(std::move(parts));
  }
  if (name == "replace") {
    auto bound = BindArgs(name, args, {"old", "new", "count"}, 2);
    if (!bound.ok()) return bound.status();
    if (!(*bound)[0]->is_string() || !(*bound)[1]->is_string()) {
      return absl::InvalidArgumentError("replace() arguments must be str");
    }
    int64_t count = -1;
    if ((*bound)[2]) {
      auto c = ToIndex(*(*bound)[2], "count");
      if (!c.ok()) return c.status();
      count = *c;
    }
    const std::string& old_text = (*bound)[0]->str();
    const std::string& new_text = (*bound)[1]->str();
    auto status = in.CheckSize(PyReplaceSize(self, old_text, new_text, count));
    if (!status.ok()) return status;
    return Value::String(PyReplace(self, old_text, new_text, count));
  }
  if (name == "find" || name == "count") {
    auto bound = BindArgs(name, args, {"sub"}, 1);
    if (!bound.ok()) return bound.status();
    if (!(*bound)[0]->is_string()) return absl::InvalidArgumentError("must be str");
    const std::string& sub = (*bound)[0]->str();
    if (name == "find") {
      size_t hit = self.find(sub);
      return Value::Int(hit == std::string::npos ? -1 : CodePointCount(self.substr(0, hit)));
    }
    if (sub.empty()) return Value::Int(CodePointCount(self) + 1);
    int64_t n = 0;
    for (size_t p = self.find(sub); p != std::string::npos; p = self.find(sub, p + sub.size())) ++n;
    return Value::Int(n);
  }
  if (name == "join") {
    auto bound = BindArgs(name, args, {"iterable"}, 1);
    if (!bound.ok()) return bound.status();
    auto items = Iterate(*(*bound)[0]);
    if (!items.ok()) return items.status();
    std::string out;
    for (size_t i = 0; i < items->size(); ++i) {
      if (!(*items)[i].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence item ", i, ": expected str instance, ", (*items)[i].TypeName(), " found"));
      }
      if (i > 0) out += self;
      out += (*items)[i].str();
      auto status = in.CheckSize(out.size());
      if (!status.ok()) return status;
    }
    return Value::String(std::move(out));
  }
  return absl::InvalidArgumentError(absl::StrCat("'str' object has no attribute '", name, "'"));
}

absl::StatusOr<Value> CallDictMethod(const Value& self, const std::string& name, CallArgs& args) {
  if (name == "get") {
    auto bound = BindArgs(name, args, {"key", "default"}, 1);
    if (!bound.ok()) return bound.status();
    if ((*bound)[0]->is_string()) {
      const Value* found = self.dict().Find((*bound)[0]->str());
      if (found != nullptr) return *found;
    }
    return (*bound)[1] ? *(*bound)[1] : Value::None();
  }
  auto bound = BindArgs(name, args, {}, 0);
  if (!bound.ok()) return bound.status();
  List out;
  for (const auto& [key, item] : self.dict().entries()) {
    if (name == "keys")
      out.push_back(Value::String(key));
    else if (name == "values")
      out.push_back(item);
    else
      out.push_back(Value::MakeTuple({Value::String(key), item}));
  }
  return Value::MakeList(std::move(out));
}

bool IsStrMethod(absl::string_view name) {
  static const char* kNames[] = {"strip",   "lstrip",     "rstrip",     "upper",    "lower",
                                 "title",   "capitalize", "startswith", "endswith", "split",
                                 "replace", "find",       "count",      "join"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

bool IsDictMethod(absl::string_view name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

}  // namespace

absl::Status UndefinedError(const Value& undefined) {
  return absl::InvalidArgumentError(undefined.str());
}

absl::StatusOr<Value> GetAttribute(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.is_string() && IsStrMethod(name)) {
    std::string self = obj.str();
    return Value::MakeCallable("str." + name, [self, name](Interpreter& in, CallArgs& args) {
      return CallStrMethod(in, self, name, args);
    });
  }
  if (obj.is_dict() && IsDictMethod(name)) {
    return Value::MakeCallable("dict." + name, [obj, name](Interpreter&, CallArgs& args) {
      return CallDictMethod(obj, name, args);
    });
  }
  if (obj.is_dict() || obj.is_namespace()) {
    const Value* found = obj.dict().Find(name);
    if (found != nullptr) return *found;
  }
  return MissingAttribute(obj, name);
}

absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t index = key.int_value();
    if (obj.is_list()) {
      int64_t n = static_cast<int64_t>(obj.list().size());
      if (index < 0) index += n;
      if (index >= 0 && index < n) return obj.list()[static_cast<size_t>(index)];
    } else {
      std::vector<size_t> offsets = CodePointOffsets(obj.str());
      int64_t n = static_cast<int64_t>(offsets.size()) - 1;
      if (index < 0) index += n;
      if (index >= 0 && index < n) {
        size_t i = static_cast<size_t>(index);
        return Value::String(obj.str().substr(offsets[i], offsets[i + 1] - offsets[i]));
      }
    }
    return Value::Undefined(absl::StrCat(TypeName(obj), " has no element ", key.int_value()));
  }
  if ((obj.is_dict() || obj.is_namespace()) && key.is_string()) {
    const Value* found = obj.dict().Find(key.str());
    if (found != nullptr) return *found;
  }
  if (key.is_string()) return GetAttribute(obj, key.str());
  return Value::Undefined(absl::StrCat(TypeName(obj), " has no element ", ToPyRepr(key)));
}

absl::StatusOr<Value> GetSlice(Interpreter& in, const Value& obj, const Value& start,
                               const Value& stop, const Value& step) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (!obj.is_list() && !obj.is_string()) {
    return Value::Undefined(absl::StrCat(TypeRepr(obj), " cannot be sliced"));
  }
  std::vector<size_t> offsets;
  int64_t n;
  if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list().size());
  } else {
    offsets = CodePointOffsets(obj.str());
    n = static_cast<int64_t>(offsets.size()) - 1;
  }
  // Python's PySlice_AdjustIndices.
  int64_t st = 1;
  if (!step.is_none()) {
    auto s = ToIndex(step, "slice step");
    if (!s.ok()) return s.status();
    st = *s;
    if (st == 0) return absl::InvalidArgumentError("slice step cannot be zero");
  }
  auto bound = [&](const Value& v, int64_t dflt) -> absl::StatusOr<int64_t> {
    if (v.is_none()) return dflt;
    auto i = ToIndex(v, "slice indices");
    if (!i.ok()) return i.status();
    int64_t x = *i;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  auto lo = bound(start, st < 0 ? n - 1 : 0);
  if (!lo.ok()) return lo.status();
  auto hi = bound(stop, st < 0 ? -1 : n);
  if (!hi.ok()) return hi.status();
  std::vector<int64_t> picks;
  for (int64_t i = *lo; st > 0 ? i < *hi : i > *hi; i += st) picks.push_back(i);
  auto counted = in.CountIterations(static_cast<int64_t>(picks.size()));
  if (!counted.ok()) return counted;
  if (obj.is_list()) {
    List out;
    out.reserve(picks.size());
    for (int64_t i : picks) out.push_back(obj.list()[static_cast<size_t>(i)]);
    return obj.is_tuple() ? Value::MakeTuple(std::move(out)) : Value::MakeList(std::move(out));
  }
  std::string out;
  for (int64_t i : picks) {
    size_t k = static_cast<size_t>(i);
    out += obj.str().substr(offsets[k], offsets[k + 1] - offsets[k]);
  }
  return Value::String(std::move(out));
}

absl::StatusOr<List> Iterate(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return List();
    case Value::Kind::kList:
      return value.list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& entry : value.dict().entries()) keys.push_back(Value::String(entry.first));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      std::vector<size_t> offsets = CodePointOffsets(value.str());
      for (size_t i = 0; i + 1 < offsets.size(); ++i) {
        chars.push_back(Value::String(value.str().substr(offsets[i], offsets[i + 1] - offsets[i])));
      }
      return chars;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("'", value.TypeName(), "' object is not iterable"));
  }
}

}  // namespace tandem::chat_template::internal
