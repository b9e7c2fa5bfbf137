// json.dumps for template values, as transformers' tojson filter calls it:
// json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "value.h"

namespace tandem::chat_template::internal {

// Options of json.dumps as transformers' tojson passes them (ensure_ascii defaults to False).
struct JsonDumpOptions {
  int indent = -1;             // -1: none (one line)
  std::string item_separator;  // empty: ", " without indent, "," with it
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
  bool separators_set = false;
};

// json.dumps(value, ...). Undefined, namespaces and callables are not serializable (error, as
// Python's TypeError). Output above max_bytes is an error (RESOURCE_EXHAUSTED).
absl::StatusOr<std::string> DumpJson(const Value& value, const JsonDumpOptions& options,
                                     int64_t max_bytes);

}  // namespace tandem::chat_template::internal
