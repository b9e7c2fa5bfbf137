// The values a chat template computes with: Python's None/bool/int/float/str/list/dict as Jinja2
// sees them, plus jinja2.Undefined, namespace() objects and callables (globals, macros, bound
// methods such as "abc".strip). Lists and dicts are immutable and shared (copying a Value is
// O(1)); a namespace is the only mutable object and has reference semantics, as in Python.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::chat_template::internal {

class Value;
class Interpreter;

using List = std::vector<Value>;

// Nesting bounds. Every algorithm over values (printing, ==, <, tojson, destruction) recurses
// over their nesting, so the interpreter refuses values nested deeper than kMaxValueDepth (from
// the context or built by the template). Namespaces are the only mutable values: they may not
// hold a namespace (so no reference cycle can form) nor values deeper than
// kMaxNamespaceValueDepth, and count as that deep plus one wherever they are held.
inline constexpr uint32_t kMaxValueDepth = 512;
inline constexpr uint32_t kMaxNamespaceValueDepth = 256;

// A Python dict with string keys, in insertion order (json.dumps and iteration show that order).
class Dict {
 public:
  const Value* Find(absl::string_view key) const;
  void Set(std::string key, Value value);  // replaces an existing key in place, else appends
  // Out of line: Value is incomplete here, and clang's libstdc++ instantiation of
  // vector<pair<string, Value>>::size() needs it complete.
  size_t size() const;
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<std::string, Value>> entries_;
  absl::flat_hash_map<std::string, size_t> index_;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A callable value. Errors it returns are reported at the calling node's line.
struct Callable {
  std::string name;
  std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> fn;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };

  Value() : kind_(Kind::kNone) {}
  static Value Undefined(std::string message);  // message: why, e.g. "'x' is undefined"
  static Value None() { return Value(); }
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  static Value String(std::string s);
  static Value MakeList(List items);
  static Value MakeTuple(List items);  // a list that prints as (a, b) and is never == a list
  static Value MakeDict(Dict dict);
  static Value MakeNamespace(Dict attributes);
  static Value MakeCallable(std::string name,
                            std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> fn);
  // nlohmann JSON -> Value (objects keep their key order). INVALID_ARGUMENT when the JSON is
  // nested deeper than kMaxValueDepth.
  static absl::StatusOr<Value> FromJson(const nlohmann::ordered_json& json);

  // 0 for scalars, 1 + the deepest element for lists and dicts (see kMaxValueDepth).
  uint32_t depth() const { return depth_; }
  // Whether a namespace is this value or inside it.
  bool holds_namespace() const { return holds_namespace_; }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || is_float(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }  // lists and tuples
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool bool_value() const { return int_; }
  int64_t int_value() const { return int_; }  // also for bool (Python: True == 1)
  double float_value() const { return is_float() ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return *str_; }  // string, or an undefined's message
  const List& list() const { return *list_; }
  const Dict& dict() const { return *dict_; }  // dict or namespace attributes
  Dict& namespace_attributes() const { return *dict_; }
  const Callable& callable() const { return *callable_; }

  // Python's type name as used in error messages: "str", "int", "dict", "NoneType", ...
  absl::string_view TypeName() const;

 private:
  Kind kind_;
  bool tuple_ = false;
  bool holds_namespace_ = false;
  uint32_t depth_ = 0;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> str_;
  std::shared_ptr<const List> list_;
  std::shared_ptr<Dict> dict_;  // shared but never changed once built, except a namespace's
  std::shared_ptr<const Callable> callable_;
};

// bool(value): empty str/list/dict, 0, None and undefined are false.
bool Truthy(const Value& value);

// Python str(value), as {{ value }} prints it: undefined -> "", None -> "None", True -> "True",
// floats as repr (1.0, 1e-05), lists and dicts as their repr with single-quoted strings.
std::string ToPyString(const Value& value);

// Python repr(value) (strings quoted).
std::string ToPyRepr(const Value& value);

// Python ==: numbers compare by value across bool/int/float, lists elementwise, dicts as maps,
// undefined equals only undefined, namespaces and callables by identity.
bool PyEquals(const Value& a, const Value& b);

// repr of a float as Python prints it: shortest round-trip digits, "1.0", "1e+16", "1e-05".
std::string PyFloatRepr(double f);

}  // namespace tandem::chat_template::internal
