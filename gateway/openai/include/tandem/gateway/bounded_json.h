// JSON request bodies parsed within bounds: the document is built from nlohmann's SAX events
// (its parser keeps its own stack, so nothing here recurses with the input's depth), nesting
// deeper than max_depth stops the parse at the first bracket past it, and keys are inserted in
// O(1) (a hash index per open object), so a body of N bytes costs O(N) whatever its shape.
// Key order is kept (ordered_json: chat templates print tools and messages with tojson); a
// repeated key keeps its first position and takes its last value, as Python's json does.
//
// Errors: INVALID_ARGUMENT "the request body is not valid JSON: ..." for a syntax error, and
// "... nested deeper than N ..." / "... more than N keys ..." for a bound.
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

struct JsonLimits {
  // Arrays and objects inside one another; the outermost object is depth 1. OpenAI's requests
  // need ~6 (a tool's JSON schema adds its own); deep nesting only costs the renderers' stacks.
  int max_depth = 128;
  // Keys of one object (logit_bias, a schema's properties, chat_template_kwargs).
  size_t max_object_keys = 16384;
};

absl::StatusOr<nlohmann::ordered_json> ParseBoundedJson(std::string_view text,
                                                        const JsonLimits& limits = {});

}  // namespace tandem::gateway
