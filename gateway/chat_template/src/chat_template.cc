#include "tandem/chat_template/chat_template.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ast.h"
#include "interpreter.h"
#include "parser.h"
#include "value.h"

namespace tandem::chat_template {

namespace {
constexpr size_t kMaxSourceBytes = 1 << 20;
}  // namespace

Template::Template(std::shared_ptr<const internal::Program> program)
    : program_(std::move(program)) {}

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  if (source.size() > kMaxSourceBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chat template of ", source.size(), " bytes exceeds the limit of ", kMaxSourceBytes));
  }
  auto program = internal::ParseProgram(absl::string_view(source.data(), source.size()));
  if (!program.ok()) return program.status();
  return Template(std::shared_ptr<const internal::Program>(std::move(*program)));
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context,
                                             const RenderLimits& limits) const {
  if (!context.is_object() && !context.is_null()) {
    return absl::InvalidArgumentError("chat template context must be a JSON object");
  }
  auto values = internal::Value::FromJson(context);
  if (!values.ok()) return values.status();
  internal::Interpreter interpreter(limits);
  return interpreter.Render(*program_, *values);
}

namespace {

// One OpenAI message -> the shape templates expect (see RenderChat's contract).
absl::StatusOr<nlohmann::ordered_json> NormalizeMessage(const nlohmann::ordered_json& message,
                                                        size_t index) {
  if (!message.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("messages[", index, "] is not an object"));
  }
  auto role = message.find("role");
  if (role == message.end() || !role->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("messages[", index, "] has no string 'role'"));
  }
  nlohmann::ordered_json out = message;
  auto content = message.find("content");
  if (content != message.end() && content->is_array()) {
    std::string text;
    bool first = true;
    for (const auto& part : *content) {
      auto type = part.is_object() ? part.find("type") : part.end();
      auto part_text = part.is_object() ? part.find("text") : part.end();
      if (!part.is_object() || type == part.end() || *type != "text" || part_text == part.end() ||
          !part_text->is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat("messages[", index,
                         "].content: only text parts ({\"type\": \"text\", \"text\": ...}) "
                         "are supported"));
      }
      if (!first) text += "\n";
      first = false;
      text += part_text->get<std::string>();
    }
    out["content"] = text;
  } else if (content != message.end() && !content->is_string() && !content->is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat("messages[", index, "].content must be a string, null or a list of parts"));
  }
  auto tool_calls = out.find("tool_calls");
  if (*role == "assistant" && tool_calls != out.end() && tool_calls->is_array()) {
    for (auto& call : *tool_calls) {
      if (!call.is_object()) continue;
      auto function = call.find("function");
      if (function == call.end() || !function->is_object()) continue;
      auto arguments = function->find("arguments");
      if (arguments == function->end() || arguments->is_null() ||
          (arguments->is_string() && arguments->get<std::string>().empty())) {
        (*function)["arguments"] = nlohmann::ordered_json::object();
      } else if (arguments->is_string()) {
        auto parsed = nlohmann::ordered_json::parse(arguments->get<std::string>(), nullptr,
                                                    /*allow_exceptions=*/false);
        if (parsed.is_discarded()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "messages[", index, "].tool_calls: function.arguments is not valid JSON"));
        }
        *arguments = std::move(parsed);
      }
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> RenderChat(const Template& chat_template,
                                       const nlohmann::ordered_json& messages,
                                       const ChatOptions& options) {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be an array");
  nlohmann::ordered_json normalized = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    auto message = NormalizeMessage(messages[i], i);
    if (!message.ok()) return message.status();
    normalized.push_back(std::move(*message));
  }
  if (!options.tools.is_null() && !options.tools.is_array()) {
    return absl::InvalidArgumentError("tools must be an array");
  }
  if (!options.extra.is_null() && !options.extra.is_object()) {
    return absl::InvalidArgumentError("extra template variables must be a JSON object");
  }
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = std::move(normalized);
  context["tools"] = options.tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = options.add_generation_prompt;
  context["bos_token"] = options.bos_token;
  context["eos_token"] = options.eos_token;
  if (options.extra.is_object()) {
    for (const auto& [key, value] : options.extra.items()) context[key] = value;
  }
  return chat_template.Render(context, options.limits);
}

}  // namespace tandem::chat_template
