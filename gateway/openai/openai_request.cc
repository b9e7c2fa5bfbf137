#include "tandem/gateway/openai_request.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "request_fields.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/api_error.h"

namespace tandem::gateway {
namespace {

using internal::CheckListSize;
using internal::Fields;
using internal::kMaxTokensLimit;
using internal::ParseBody;
using internal::ReadCommon;
using internal::Unsupported;
using Json = nlohmann::ordered_json;

// A JSON integer that is a token id (0..int32 max); the worker checks it against its vocabulary.
bool IsTokenId(const Json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 &&
         v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
}

absl::Status ReadPrompt(Fields& f, v1::GenerateRequest* g) {
  const Json* prompt = f.Find("prompt");
  if (prompt == nullptr) return InvalidField("prompt", "'prompt' is required");
  const Json* one = prompt;
  // A list of prompts: one element is that prompt; several are refused (one choice per request).
  if (prompt->is_array() && !prompt->empty() &&
      ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
    if (prompt->size() != 1) {
      return InvalidField("prompt", absl::StrCat("'prompt' holds ", prompt->size(),
                                                 " prompts; tandem takes one prompt per request"));
    }
    one = &(*prompt)[0];
  }
  if (one->is_string()) {
    if (one->get_ref<const std::string&>().empty()) {
      return InvalidField("prompt", "'prompt' must not be empty");
    }
    g->set_prompt_text(one->get<std::string>());
    return absl::OkStatus();
  }
  if (one->is_array()) {
    if (one->empty()) return InvalidField("prompt", "'prompt' must not be empty");
    v1::TokenIds* ids = g->mutable_prompt_ids();
    ids->mutable_ids()->Reserve(static_cast<int>(one->size()));
    for (const Json& id : *one) {
      if (!IsTokenId(id)) {
        return InvalidField("prompt", "'prompt' token ids must be integers in 0..2147483647");
      }
      ids->add_ids(static_cast<int32_t>(id.get<int64_t>()));
    }
    return absl::OkStatus();
  }
  return InvalidField("prompt", "'prompt' must be a string or a list of token ids");
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseCompletionRequest(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  OpenAiRequest r;
  r.endpoint = Endpoint::kCompletions;
  Fields f(j);
  TANDEM_RETURN_IF_ERROR(ReadCommon(f, &r));
  TANDEM_RETURN_IF_ERROR(ReadPrompt(f, &r.generate));
  if (const Json* lp = f.Find("logprobs"); lp != nullptr) {
    if (!lp->is_number_integer() || lp->get<int64_t>() < 0 || lp->get<int64_t>() > 5) {
      return InvalidField("logprobs", "'logprobs' must be an integer in 0..5 for completions");
    }
    r.logprobs = true;
    r.top_logprobs = static_cast<int>(lp->get<int64_t>());
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> echo, f.Bool("echo"));
  if (echo.value_or(false)) return Unsupported("echo", "true");
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> suffix, f.String("suffix"));
  if (suffix.has_value() && !suffix->empty()) return Unsupported("suffix", "(insertion)");
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> best_of, f.Int("best_of"));
  if (best_of.has_value() && *best_of != 1) return Unsupported("best_of", "other than 1");
  r.generate.set_logprobs(r.logprobs);
  r.generate.set_top_logprobs(r.top_logprobs);
  r.ignored_fields = f.Unread();
  return r;
}

absl::StatusOr<OpenAiRequest> ParseChatRequest(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  OpenAiRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  Fields f(j);
  TANDEM_RETURN_IF_ERROR(ReadCommon(f, &r));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> max_completion, f.Int("max_completion_tokens"));
  if (max_completion.has_value()) {
    if (*max_completion < 1 || *max_completion > kMaxTokensLimit) {
      return InvalidField("max_completion_tokens",
                          absl::StrCat("'max_completion_tokens' must be in 1..", kMaxTokensLimit));
    }
    r.max_tokens = *max_completion;
  }
  const Json* messages = f.Find("messages");
  if (messages == nullptr) return InvalidField("messages", "'messages' is required");
  if (!messages->is_array() || messages->empty()) {
    return InvalidField("messages", "'messages' must be a non-empty list of messages");
  }
  TANDEM_RETURN_IF_ERROR(CheckListSize("messages", messages->size(), kMaxMessages));
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return InvalidField(where, absl::StrCat("'", where, "' must be an object"));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return InvalidField(where + ".role", absl::StrCat("'", where, ".role' must be a string"));
    }
    auto content = m.find("content");
    if (content != m.end() && !content->is_string() && !content->is_array() &&
        !content->is_null()) {
      return InvalidField(where + ".content", absl::StrCat("'", where,
                                                           ".content' must be a string, a list "
                                                           "of parts or null"));
    }
  }
  r.messages = *messages;
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> logprobs, f.Bool("logprobs"));
  r.logprobs = logprobs.value_or(false);
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> top, f.Int("top_logprobs"));
  if (top.has_value()) {
    if (*top < 0 || *top > 20)
      return InvalidField("top_logprobs", "'top_logprobs' must be in 0..20");
    if (*top > 0 && !r.logprobs) {
      return InvalidField("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    r.top_logprobs = static_cast<int>(*top);
  }
  if (const Json* tools = f.Find("tools"); tools != nullptr) {
    if (!tools->is_array()) return InvalidField("tools", "'tools' must be a list");
    TANDEM_RETURN_IF_ERROR(CheckListSize("tools", tools->size(), kMaxTools));
    if (!tools->empty()) r.tools = *tools;
  }
  const Json* choice = f.Find("tool_choice");
  if (choice != nullptr && (!choice->is_string() || (*choice != "none" && *choice != "auto"))) {
    return Unsupported("tool_choice", "other than \"none\" or \"auto\"");
  }
  // With tools, OpenAI's default choice is "auto": the model may call one, and the client waits
  // for `tool_calls`. tandem renders the tools into the prompt but does not parse calls out of
  // the model's text, so it takes tools only with tool_choice "none" (as vLLM without
  // --enable-auto-tool-choice).
  if (!r.tools.is_null() && (choice == nullptr || *choice == "auto")) {
    return InvalidField("tool_choice",
                        "'tools' with tool_choice \"auto\" (the default) is not supported by "
                        "tandem: it does not parse tool calls from the model's output; send "
                        "\"tool_choice\": \"none\" to have the tools rendered into the prompt only");
  }
  f.Find("parallel_tool_calls");
  if (const Json* format = f.Find("response_format"); format != nullptr) {
    if (!format->is_object() || !format->contains("type") || (*format)["type"] != "text") {
      return Unsupported("response_format", "other than {\"type\": \"text\"}");
    }
  }
  if (const Json* kwargs = f.Find("chat_template_kwargs"); kwargs != nullptr) {
    if (!kwargs->is_object()) {
      return InvalidField("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    }
    r.template_kwargs = *kwargs;
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> add_prompt, f.Bool("add_generation_prompt"));
  r.add_generation_prompt = add_prompt.value_or(true);
  r.generate.set_logprobs(r.logprobs);
  r.generate.set_top_logprobs(r.top_logprobs);
  r.ignored_fields = f.Unread();
  return r;
}

void ApplyModelDefaults(const v1::ModelInfoResponse& info, OpenAiRequest* r) {
  v1::GenerateRequest& g = r->generate;
  if (!r->temperature_given && info.has_default_temperature()) {
    g.set_temperature(info.default_temperature());
  }
  if (!r->top_p_given && info.has_default_top_p()) g.set_top_p(info.default_top_p());
  if (!r->top_k_given && info.has_default_top_k()) g.set_top_k(info.default_top_k());
}

}  // namespace tandem::gateway
