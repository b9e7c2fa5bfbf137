#include "tandem/gateway/responses_request.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "request_fields.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/api_error.h"

namespace tandem::gateway {
namespace {

using internal::CheckListSize;
using internal::Fields;
using internal::Unsupported;
using Json = nlohmann::ordered_json;

// The text of one message's content: a string, or the text of its text parts in order.
absl::StatusOr<std::string> ContentText(const Json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return InvalidField(where, absl::StrCat("'", where, "' must be a string or a list of parts"));
  }
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& part = content[i];
    const std::string at = absl::StrCat(where, "[", i, "]");
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      return InvalidField(at, absl::StrCat("'", at, "' must be an object with a 'type'"));
    }
    const std::string type = part["type"].get<std::string>();
    if (type != "input_text" && type != "output_text" && type != "text") {
      return Unsupported(at + ".type", absl::StrCat("\"", type, "\" (this model reads text only)"));
    }
    if (!part.contains("text") || !part["text"].is_string()) {
      return InvalidField(at + ".text", absl::StrCat("'", at, ".text' must be a string"));
    }
    text += part["text"].get<std::string>();
  }
  return text;
}

// `input` as chat messages.
absl::StatusOr<Json> InputMessages(const Json& input) {
  if (input.is_string()) {
    return Json::array({Json{{"role", "user"}, {"content", input.get<std::string>()}}});
  }
  if (!input.is_array() || input.empty()) {
    return InvalidField("input", "'input' must be a string or a non-empty list of items");
  }
  TANDEM_RETURN_IF_ERROR(CheckListSize("input", input.size(), kMaxMessages));
  Json messages = Json::array();
  for (size_t i = 0; i < input.size(); ++i) {
    const Json& item = input[i];
    const std::string where = absl::StrCat("input[", i, "]");
    if (!item.is_object()) return InvalidField(where, absl::StrCat("'", where, "' must be an object"));
    if (auto type = item.find("type"); type != item.end() && !type->is_null() &&
                                       (!type->is_string() || *type != "message")) {
      return Unsupported(where + ".type",
                         absl::StrCat(type->dump(), " (tandem takes message items only)"));
    }
    auto role = item.find("role");
    if (role == item.end() || !role->is_string()) {
      return InvalidField(where + ".role", absl::StrCat("'", where, ".role' must be a string"));
    }
    std::string name = role->get<std::string>();
    if (name != "user" && name != "assistant" && name != "system" && name != "developer") {
      return InvalidField(where + ".role",
                          absl::StrCat("'", where, ".role' must be user, assistant, system or "
                                       "developer, got \"", name, "\""));
    }
    if (name == "developer") name = "system";   // what chat templates know
    auto content = item.find("content");
    if (content == item.end()) {
      return InvalidField(where + ".content", absl::StrCat("'", where, ".content' is required"));
    }
    TANDEM_ASSIGN_OR_RETURN(std::string text, ContentText(*content, where + ".content"));
    messages.push_back(Json{{"role", name}, {"content", std::move(text)}});
  }
  return messages;
}

absl::Status ReadMetadata(const Json& metadata, Json* out) {
  if (!metadata.is_object()) return InvalidField("metadata", "'metadata' must be an object");
  TANDEM_RETURN_IF_ERROR(CheckListSize("metadata", metadata.size(), kMaxMetadataPairs));
  for (auto it = metadata.begin(); it != metadata.end(); ++it) {
    if (it.key().size() > kMaxMetadataKeyBytes || !it.value().is_string() ||
        it.value().get_ref<const std::string&>().size() > kMaxMetadataValueBytes) {
      return InvalidField("metadata", absl::StrCat("'metadata' holds strings of at most ",
                                                   kMaxMetadataValueBytes, " bytes under keys "
                                                   "of at most ", kMaxMetadataKeyBytes));
    }
  }
  *out = metadata;
  return absl::OkStatus();
}

// The Responses API's options tandem takes only in their neutral form.
absl::Status ReadOptions(Fields& f) {
  if (const Json* tools = f.Find("tools"); tools != nullptr) {
    if (!tools->is_array()) return InvalidField("tools", "'tools' must be a list");
    if (!tools->empty()) {
      return Unsupported("tools", "with entries (tandem does not parse tool calls)");
    }
  }
  if (const Json* choice = f.Find("tool_choice");
      choice != nullptr && (!choice->is_string() || (*choice != "none" && *choice != "auto"))) {
    return Unsupported("tool_choice", "other than \"none\" or \"auto\"");
  }
  if (const Json* text = f.Find("text"); text != nullptr) {
    if (!text->is_object()) return InvalidField("text", "'text' must be an object");
    if (auto format = text->find("format"); format != text->end() && !format->is_null()) {
      if (!format->is_object() || !format->contains("type") || (*format)["type"] != "text") {
        return Unsupported("text.format", "other than {\"type\": \"text\"}");
      }
    }
  }
  if (const Json* truncation = f.Find("truncation");
      truncation != nullptr && *truncation != "disabled" && *truncation != "auto") {
    return InvalidField("truncation", "'truncation' must be \"disabled\" or \"auto\"");
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> background, f.Bool("background"));
  if (background.value_or(false)) return Unsupported("background", "true");
  if (f.Find("conversation") != nullptr) {
    return Unsupported("conversation", "(continue with previous_response_id)");
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> top_logprobs, f.Int("top_logprobs"));
  if (top_logprobs.value_or(0) != 0) return Unsupported("top_logprobs", "above 0");
  for (const char* ignored : {"include", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                              "safety_identifier", "reasoning", "max_tool_calls"}) {
    f.Find(ignored);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResponsesRequest> ParseResponsesRequest(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, internal::ParseBody(body));
  ResponsesRequest out;
  OpenAiRequest& r = out.chat;
  r.endpoint = Endpoint::kResponses;
  Fields f(j);
  TANDEM_RETURN_IF_ERROR(internal::ReadCommon(f, &r));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> max_output, f.Int("max_output_tokens"));
  if (max_output.has_value()) {
    if (*max_output < 1 || *max_output > internal::kMaxTokensLimit) {
      return InvalidField("max_output_tokens",
                          absl::StrCat("'max_output_tokens' must be in 1..",
                                       internal::kMaxTokensLimit, ", got ", *max_output));
    }
    r.max_tokens = *max_output;
  }
  const Json* input = f.Find("input");
  if (input == nullptr) return InvalidField("input", "'input' is required");
  TANDEM_ASSIGN_OR_RETURN(out.input, InputMessages(*input));
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> instructions, f.String("instructions"));
  out.instructions = instructions.value_or("");
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> previous, f.String("previous_response_id"));
  out.previous_response_id = previous.value_or("");
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> store, f.Bool("store"));
  out.store = store.value_or(true);
  if (const Json* metadata = f.Find("metadata"); metadata != nullptr) {
    TANDEM_RETURN_IF_ERROR(ReadMetadata(*metadata, &out.metadata));
  }
  TANDEM_RETURN_IF_ERROR(ReadOptions(f));
  r.ignored_fields = f.Unread();
  return out;
}

}  // namespace tandem::gateway
