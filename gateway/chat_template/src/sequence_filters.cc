// The filters over sequences: select/reject/selectattr/rejectattr, map, join, sort, dictsort,
// min, max, sum (Jinja2's semantics, including its case-insensitive ordering of strings).
#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "builtins.h"
#include "interpreter.h"
#include "tandem/common/status_macros.h"
#include "text_util.h"

namespace tandem::chat_template::internal {
namespace {

// Jinja's attribute getter for selectattr/map/join: "a.b.0" looks up each part in turn.
absl::StatusOr<Value> GetPath(const Value& item, const std::string& path) {
  Value current = item;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    int64_t index = 0;
    auto next = absl::SimpleAtoi(part, &index) ? GetItem(current, Value::Int(index))
                                               : GetItem(current, Value::String(std::string(part)));
    if (!next.ok()) return next.status();
    current = std::move(*next);
  }
  return current;
}

// select/reject/selectattr/rejectattr: items for which the test (or truthiness) holds, or not.
absl::StatusOr<Value> Select(Interpreter& in, const std::string& filter, const Value& subject,
                             CallArgs& args) {
  bool by_attribute = filter == "selectattr" || filter == "rejectattr";
  bool keep_if = filter == "select" || filter == "selectattr";
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(filter, ": attribute name required"));
    }
    attribute = args.positional[0].str();
    next = 1;
  }
  std::optional<std::string> test;
  if (args.positional.size() > next) {
    if (!args.positional[next].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(filter, ": test name must be a string"));
    }
    test = args.positional[next].str();
    ++next;
  }
  CallArgs test_args;
  test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next),
                              args.positional.end());
  test_args.keyword = args.keyword;
  if (!Truthy(subject)) return Value::MakeList({});  // Jinja iterates only "if seq"
  auto items = Iterate(subject);
  if (!items.ok()) return items.status();
  auto counted = in.CountIterations(static_cast<int64_t>(items->size()));
  if (!counted.ok()) return counted;
  List out;
  for (const Value& item : *items) {
    Value probe = item;
    if (by_attribute) {
      auto got = GetPath(item, attribute);
      if (!got.ok()) return got.status();
      probe = std::move(*got);
    }
    bool holds = false;
    if (test) {
      CallArgs per_item = test_args;
      auto r = ApplyTest(in, *test, probe, per_item);
      if (!r.ok()) return r.status();
      holds = *r;
    } else {
      holds = Truthy(probe);
    }
    if (holds == keep_if) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> Map(Interpreter& in, const Value& subject, CallArgs& args) {
  if (!Truthy(subject)) return Value::MakeList({});  // Jinja maps only "if value"
  auto items = Iterate(subject);
  if (!items.ok()) return items.status();
  auto counted = in.CountIterations(static_cast<int64_t>(items->size()));
  if (!counted.ok()) return counted;
  List out;
  std::optional<std::string> attribute;
  std::optional<Value> fallback;
  for (const auto& [key, value] : args.keyword) {
    if (key == "attribute" && value.is_string())
      attribute = value.str();
    else if (key == "default")
      fallback = value;
    else if (!attribute)
      return absl::InvalidArgumentError(absl::StrCat("map: unexpected argument '", key, "'"));
  }
  if (attribute) {
    for (const Value& item : *items) {
      auto got = GetPath(item, *attribute);
      if (!got.ok()) return got.status();
      out.push_back(got->is_undefined() && fallback ? *fallback : *got);
    }
    return Value::MakeList(std::move(out));
  }
  if (args.positional.empty() || !args.positional[0].is_string()) {
    return absl::InvalidArgumentError("map: a filter name or attribute= is required");
  }
  std::string filter = args.positional[0].str();
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  for (const Value& item : *items) {
    CallArgs per_item = rest;
    auto mapped = ApplyFilter(in, filter, item, per_item);
    if (!mapped.ok()) return mapped.status();
    out.push_back(std::move(*mapped));
  }
  return Value::MakeList(std::move(out));
}

absl::StatusOr<Value> Join(Interpreter& in, const Value& subject, CallArgs& args) {
  auto bound = BindArgs("join", args, {"d", "attribute"}, 0);
  if (!bound.ok()) return bound.status();
  std::string sep = (*bound)[0] ? ToPyString(*(*bound)[0]) : "";
  auto items = Iterate(subject);
  if (!items.ok()) return items.status();
  std::string out;
  for (size_t i = 0; i < items->size(); ++i) {
    Value item = (*items)[i];
    if ((*bound)[1] && (*bound)[1]->is_string()) {
      auto got = GetPath(item, (*bound)[1]->str());
      if (!got.ok()) return got.status();
      item = std::move(*got);
    }
    if (i > 0) out += sep;
    out += ToPyString(item);
    auto status = in.CheckSize(out.size());
    if (!status.ok()) return status;
  }
  return Value::String(std::move(out));
}

// Jinja's ignore_case: strings compare lower-cased unless case_sensitive.
Value SortKey(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value::String(PyLower(v.str())) : v;
}

// A stable sort by Python's < on keys; the first comparison error is returned.
absl::Status StableSortBy(std::vector<std::pair<Value, Value>>* keyed, bool reverse) {
  absl::Status error;
  std::stable_sort(keyed->begin(), keyed->end(), [&](const auto& x, const auto& y) {
    if (!error.ok()) return false;
    auto less = reverse ? LessThan(y.first, x.first) : LessThan(x.first, y.first);
    if (!less.ok()) {
      error = less.status();
      return false;
    }
    return *less;
  });
  return error;
}

// sort(reverse=False, case_sensitive=False, attribute=None) and
// dictsort(case_sensitive=False, by='key', reverse=False).
absl::StatusOr<Value> Sort(Interpreter& in, const std::string& name, const Value& subject,
                           CallArgs& args) {
  bool dict_sort = name == "dictsort";
  auto bound = dict_sort ? BindArgs(name, args, {"case_sensitive", "by", "reverse"}, 0)
                         : BindArgs(name, args, {"reverse", "case_sensitive", "attribute"}, 0);
  if (!bound.ok()) return bound.status();
  bool reverse = (*bound)[dict_sort ? 2 : 0] && Truthy(*(*bound)[dict_sort ? 2 : 0]);
  bool case_sensitive = (*bound)[dict_sort ? 0 : 1] && Truthy(*(*bound)[dict_sort ? 0 : 1]);
  std::vector<std::pair<Value, Value>> keyed;  // (sort key, item)
  if (dict_sort) {
    if (!subject.is_dict())
      return absl::InvalidArgumentError("You can only sort by either key or value");
    bool by_value = (*bound)[1] && (*bound)[1]->is_string() && (*bound)[1]->str() == "value";
    if ((*bound)[1] && !((*bound)[1]->is_string() &&
                         ((*bound)[1]->str() == "key" || (*bound)[1]->str() == "value"))) {
      return absl::InvalidArgumentError("You can only sort by either 'key' or 'value'");
    }
    for (const auto& [key, item] : subject.dict().entries()) {
      Value pair = Value::MakeTuple({Value::String(key), item});
      keyed.emplace_back(SortKey(by_value ? item : Value::String(key), case_sensitive), pair);
    }
  } else {
    auto items = Iterate(subject);
    if (!items.ok()) return items.status();
    for (const Value& item : *items) {
      Value key = item;
      if ((*bound)[2] && (*bound)[2]->is_string()) {
        auto got = GetPath(item, (*bound)[2]->str());
        if (!got.ok()) return got.status();
        key = std::move(*got);
      }
      keyed.emplace_back(SortKey(key, case_sensitive), item);
    }
  }
  TANDEM_RETURN_IF_ERROR(in.CountIterations(static_cast<int64_t>(keyed.size())));
  TANDEM_RETURN_IF_ERROR(StableSortBy(&keyed, reverse));
  List out;
  for (auto& [key, item] : keyed) out.push_back(std::move(item));
  return Value::MakeList(std::move(out));
}

// min/max(case_sensitive=False, attribute=None): the first smallest / largest item.
absl::StatusOr<Value> MinMax(const std::string& name, const Value& subject, CallArgs& args) {
  auto bound = BindArgs(name, args, {"case_sensitive", "attribute"}, 0);
  if (!bound.ok()) return bound.status();
  bool case_sensitive = (*bound)[0] && Truthy(*(*bound)[0]);
  auto items = Iterate(subject);
  if (!items.ok()) return items.status();
  std::optional<std::pair<Value, Value>> best;
  for (const Value& item : *items) {
    Value key = item;
    if ((*bound)[1] && (*bound)[1]->is_string()) {
      auto got = GetPath(item, (*bound)[1]->str());
      if (!got.ok()) return got.status();
      key = std::move(*got);
    }
    key = SortKey(key, case_sensitive);
    if (!best) {
      best.emplace(key, item);
      continue;
    }
    auto better = name == "min" ? LessThan(key, best->first) : LessThan(best->first, key);
    if (!better.ok()) return better.status();
    if (*better) best.emplace(key, item);
  }
  if (!best) return Value::Undefined("No aggregated item, sequence was empty.");
  return best->second;
}

// sum(attribute=None, start=0).
absl::StatusOr<Value> Sum(Interpreter& in, const Value& subject, CallArgs& args) {
  auto bound = BindArgs("sum", args, {"attribute", "start"}, 0);
  if (!bound.ok()) return bound.status();
  Value total = (*bound)[1] ? *(*bound)[1] : Value::Int(0);
  auto items = Iterate(subject);
  if (!items.ok()) return items.status();
  for (const Value& item : *items) {
    Value term = item;
    if ((*bound)[0] && (*bound)[0]->is_string()) {
      auto got = GetPath(item, (*bound)[0]->str());
      if (!got.ok()) return got.status();
      term = std::move(*got);
    }
    auto next = BinaryOp(in, "+", total, term);
    if (!next.ok()) return next.status();
    total = std::move(*next);
  }
  return total;
}

}  // namespace

absl::StatusOr<std::optional<Value>> ApplySequenceFilter(Interpreter& in, const std::string& name,
                                                         const Value& subject, CallArgs& args) {
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    return Select(in, name, subject, args);
  }
  if (name == "map") return Map(in, subject, args);
  if (name == "join") return Join(in, subject, args);
  if (name == "sort" || name == "dictsort") return Sort(in, name, subject, args);
  if (name == "min" || name == "max") return MinMax(name, subject, args);
  if (name == "sum") return Sum(in, subject, args);
  return std::optional<Value>();
}

}  // namespace tandem::chat_template::internal
