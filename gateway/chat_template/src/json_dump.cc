// json.dumps as transformers' tojson filter calls it.
#include "json_dump.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "text_util.h"

namespace tandem::chat_template::internal {

namespace {

void AppendJsonString(const std::string& s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        *out += "\\\"";
        ++i;
        continue;
      case '\\':
        *out += "\\\\";
        ++i;
        continue;
      case '\n':
        *out += "\\n";
        ++i;
        continue;
      case '\r':
        *out += "\\r";
        ++i;
        continue;
      case '\t':
        *out += "\\t";
        ++i;
        continue;
      case '\b':
        *out += "\\b";
        ++i;
        continue;
      case '\f':
        *out += "\\f";
        ++i;
        continue;
      default:
        break;
    }
    char buf[16];
    if (c < 0x20) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      *out += buf;
      ++i;
      continue;
    }
    if (c < 0x80 || !ensure_ascii) {
      out->push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // ensure_ascii: \uXXXX, with surrogate pairs above the BMP.
    size_t len = 0;
    uint32_t cp = DecodeCodePoint(s, i, &len);
    if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
    } else {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
    }
    *out += buf;
    i += len;
  }
  out->push_back('"');
}

absl::Status DumpJsonInto(const Value& value, const JsonDumpOptions& options, int depth,
                          int64_t max_bytes, std::string* out) {
  if (static_cast<int64_t>(out->size()) > max_bytes) {
    return absl::ResourceExhaustedError("chat template output exceeds the size limit (tojson)");
  }
  if (depth > 512) return absl::InvalidArgumentError("tojson: value nested too deeply");
  const std::string item_sep = !options.item_separator.empty() ? options.item_separator
                               : options.indent >= 0           ? ","
                                                               : ", ";
  auto newline = [&](int level) {
    if (options.indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(options.indent) * level, ' ');
  };
  switch (value.kind()) {
    case Value::Kind::kNone:
      *out += "null";
      return absl::OkStatus();
    case Value::Kind::kBool:
      *out += value.bool_value() ? "true" : "false";
      return absl::OkStatus();
    case Value::Kind::kInt:
      *out += absl::StrCat(value.int_value());
      return absl::OkStatus();
    case Value::Kind::kFloat: {
      double f = value.float_value();
      if (std::isnan(f))
        *out += "NaN";
      else if (std::isinf(f))
        *out += f > 0 ? "Infinity" : "-Infinity";
      else
        *out += PyFloatRepr(f);
      return absl::OkStatus();
    }
    case Value::Kind::kString:
      AppendJsonString(value.str(), options.ensure_ascii, out);
      return absl::OkStatus();
    case Value::Kind::kList: {
      if (value.list().empty()) {
        *out += "[]";
        return absl::OkStatus();
      }
      out->push_back('[');
      bool first = true;
      for (const Value& item : value.list()) {
        if (!first) *out += item_sep;
        first = false;
        newline(depth + 1);
        auto status = DumpJsonInto(item, options, depth + 1, max_bytes, out);
        if (!status.ok()) return status;
      }
      newline(depth);
      out->push_back(']');
      return absl::OkStatus();
    }
    case Value::Kind::kDict: {
      if (value.dict().size() == 0) {
        *out += "{}";
        return absl::OkStatus();
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : value.dict().entries()) entries.push_back(&entry);
      if (options.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out->push_back('{');
      bool first = true;
      for (const auto* entry : entries) {
        if (!first) *out += item_sep;
        first = false;
        newline(depth + 1);
        AppendJsonString(entry->first, options.ensure_ascii, out);
        *out += options.key_separator;
        auto status = DumpJsonInto(entry->second, options, depth + 1, max_bytes, out);
        if (!status.ok()) return status;
      }
      newline(depth);
      out->push_back('}');
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("Object of type ", value.TypeName(), " is not JSON serializable"));
  }
}

}  // namespace

absl::StatusOr<std::string> DumpJson(const Value& value, const JsonDumpOptions& options,
                                     int64_t max_bytes) {
  std::string out;
  auto status = DumpJsonInto(value, options, 0, max_bytes, &out);
  if (!status.ok()) return status;
  if (static_cast<int64_t>(out.size()) > max_bytes) {
    return absl::ResourceExhaustedError("chat template output exceeds the size limit (tojson)");
  }
  return out;
}

}  // namespace tandem::chat_template::internal
