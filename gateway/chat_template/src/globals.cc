// The template globals (raise_exception, strftime_now as transformers adds them; namespace,
// range, dict as Jinja2 has them) and Python-style argument binding.
#include <ctime>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "builtins.h"
#include "errors.h"
#include "interpreter.h"
#include "tandem/common/status_macros.h"

namespace tandem::chat_template::internal {

absl::StatusOr<std::vector<std::optional<Value>>> BindArgs(
    absl::string_view function, const CallArgs& args, const std::vector<absl::string_view>& names,
    size_t required) {
  std::vector<std::optional<Value>> out(names.size());
  if (args.positional.size() > names.size()) {
    return absl::InvalidArgumentError(absl::StrCat(function, "() takes at most ", names.size(),
                                                   " argument(s) (", args.positional.size(),
                                                   " given)"));
  }
  for (size_t i = 0; i < args.positional.size(); ++i) out[i] = args.positional[i];
  for (const auto& [key, value] : args.keyword) {
    size_t i = 0;
    while (i < names.size() && names[i] != key) ++i;
    if (i == names.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(function, "() got an unexpected keyword argument '", key, "'"));
    }
    if (out[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(function, "() got multiple values for argument '", key, "'"));
    }
    out[i] = value;
  }
  for (size_t i = 0; i < required; ++i) {
    if (!out[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(function, "() missing required argument '", names[i], "'"));
    }
  }
  return out;
}

absl::StatusOr<int64_t> ToIndex(const Value& v, absl::string_view what) {
  if (v.is_undefined()) return UndefinedError(v);
  if (v.is_int() || v.is_bool()) return v.int_value();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be an integer, not '", v.TypeName(), "'"));
}

absl::Status CheckNamespaceValue(const Value& value) {
  if (value.holds_namespace()) {
    return absl::InvalidArgumentError("a namespace attribute cannot hold a namespace");
  }
  if (value.depth() > kMaxNamespaceValueDepth) {
    return LimitError(absl::StrCat("a namespace attribute cannot hold a value nested deeper than ",
                                   kMaxNamespaceValueDepth, " levels"));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<Value> RaiseException(Interpreter&, CallArgs& args) {
  auto bound = BindArgs("raise_exception", args, {"message"}, 1);
  if (!bound.ok()) return bound.status();
  return RaisedError(ToPyString(*(*bound)[0]));
}

// datetime.now().strftime(fmt): local time, C locale names ("%b" -> "Jul").
absl::StatusOr<Value> StrftimeNow(Interpreter&, CallArgs& args) {
  auto bound = BindArgs("strftime_now", args, {"format"}, 1);
  if (!bound.ok()) return bound.status();
  if (!(*bound)[0]->is_string())
    return absl::InvalidArgumentError("strftime_now: format must be a string");
  const std::string& format = (*bound)[0]->str();
  if (format.empty()) return Value::String("");
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  // strftime returns 0 both for "buffer too small" and for an empty result: grow, bounded.
  for (size_t size = 64 + format.size() * 4; size <= (1u << 16); size *= 4) {
    std::string buf(size, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &local);
    if (n > 0) {
      buf.resize(n);
      return Value::String(std::move(buf));
    }
  }
  return Value::String("");  // the format expands to nothing (or to more than 256 KiB)
}

absl::StatusOr<Value> Namespace(Interpreter&, CallArgs& args) {
  Dict attributes;
  if (args.positional.size() > 1)
    return absl::InvalidArgumentError("namespace() takes at most 1 positional argument");
  if (!args.positional.empty()) {
    const Value& init = args.positional[0];
    if (init.is_dict()) {
      for (const auto& [key, value] : init.dict().entries()) attributes.Set(key, value);
    } else if (init.is_list()) {
      for (const Value& pair : init.list()) {
        if (!pair.is_list() || pair.list().size() != 2 || !pair.list()[0].is_string()) {
          return absl::InvalidArgumentError("namespace(): expected (name, value) pairs");
        }
        attributes.Set(pair.list()[0].str(), pair.list()[1]);
      }
    } else {
      return absl::InvalidArgumentError("namespace(): the positional argument must be a mapping");
    }
  }
  for (const auto& [key, value] : args.keyword) attributes.Set(key, value);
  for (const auto& entry : attributes.entries()) {
    TANDEM_RETURN_IF_ERROR(CheckNamespaceValue(entry.second));
  }
  return Value::MakeNamespace(std::move(attributes));
}

absl::StatusOr<Value> Range(Interpreter& in, CallArgs& args) {
  if (!args.keyword.empty() || args.positional.empty() || args.positional.size() > 3) {
    return absl::InvalidArgumentError("range() takes 1 to 3 positional integer arguments");
  }
  int64_t values[3] = {0, 0, 1};
  for (size_t i = 0; i < args.positional.size(); ++i) {
    auto v = ToIndex(args.positional[i], "range() argument");
    if (!v.ok()) return v.status();
    values[args.positional.size() == 1 ? 1 : i] = *v;
  }
  int64_t start = values[0], stop = values[1], step = values[2];
  if (step == 0) return absl::InvalidArgumentError("range() arg 3 must not be zero");
  // The count is bounded before anything is allocated.
  __int128 span =
      step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
  __int128 count =
      span <= 0 ? 0 : (span + (step > 0 ? step : -step) - 1) / (step > 0 ? step : -step);
  if (count > in.limits().max_loop_iterations) {
    return LimitError(absl::StrCat("range() of ", static_cast<int64_t>(count),
                                   " items exceeds the loop iteration limit of ",
                                   in.limits().max_loop_iterations));
  }
  List out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0, x = start; i < static_cast<int64_t>(count); ++i, x += step) {
    out.push_back(Value::Int(x));
  }
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> MakeDictGlobal(Interpreter&, CallArgs& args) {
  Dict out;
  if (args.positional.size() > 1)
    return absl::InvalidArgumentError("dict() takes at most 1 positional argument");
  if (!args.positional.empty()) {
    if (!args.positional[0].is_dict())
      return absl::InvalidArgumentError("dict(): argument must be a mapping");
    for (const auto& [key, value] : args.positional[0].dict().entries()) out.Set(key, value);
  }
  for (const auto& [key, value] : args.keyword) out.Set(key, value);
  return Value::MakeDict(std::move(out));
}

}  // namespace

Dict MakeGlobals() {
  Dict globals;
  globals.Set("raise_exception", Value::MakeCallable("raise_exception", RaiseException));
  globals.Set("strftime_now", Value::MakeCallable("strftime_now", StrftimeNow));
  globals.Set("namespace", Value::MakeCallable("namespace", Namespace));
  globals.Set("range", Value::MakeCallable("range", Range));
  globals.Set("dict", Value::MakeCallable("dict", MakeDictGlobal));
  return globals;
}

}  // namespace tandem::chat_template::internal
