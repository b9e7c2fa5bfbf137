// LoadChatConfig: chat_template.jinja / tokenizer_config.json of a model directory.
#include "tandem/gpu_worker/chat_config.h"

#include <optional>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "special_tokens.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using nlohmann::json;
using tokenizer_internal::ReadFileBytes;
using tokenizer_internal::ReadOptionalJsonObject;
using tokenizer_internal::TokenText;

absl::Status TemplateError(const std::filesystem::path& file, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat(file.string(), ": \"chat_template\" ", what));
}

// tokenizer_config.json's chat_template: a string, or a list of named templates (transformers'
// multi-template form) of which the one named "default" is used; "" when absent, null or no
// entry is named "default" (such a model has only task templates, e.g. "tool_use").
absl::StatusOr<std::string> ChatTemplateField(const json& config,
                                              const std::filesystem::path& file) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) {
    return TemplateError(file, "is neither a string, a list of {name, template} nor null");
  }
  for (const json& entry : *it) {
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto source = entry.is_object() ? entry.find("template") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string() || source == entry.end() ||
        !source->is_string()) {
      return TemplateError(file,
                           "has an entry that is not {\"name\": string, \"template\": string}");
    }
    if (name->get<std::string>() == "default") return source->get<std::string>();
  }
  return std::string();
}

}  // namespace

absl::StatusOr<ChatConfig> LoadChatConfig(const std::filesystem::path& model_dir) {
  ChatConfig chat;
  const std::filesystem::path config_path = model_dir / "tokenizer_config.json";
  TANDEM_ASSIGN_OR_RETURN(const std::optional<json> config, ReadOptionalJsonObject(config_path));
  if (config.has_value()) {
    TANDEM_ASSIGN_OR_RETURN(chat.chat_template, ChatTemplateField(*config, config_path));
    TANDEM_ASSIGN_OR_RETURN(const std::optional<std::string> bos,
                            TokenText(*config, "bos_token", config_path));
    TANDEM_ASSIGN_OR_RETURN(const std::optional<std::string> eos,
                            TokenText(*config, "eos_token", config_path));
    chat.bos_token = bos.value_or("");
    chat.eos_token = eos.value_or("");
  }
  // transformers >= 4.47 saves the template beside the config and prefers it when loading.
  const std::filesystem::path jinja_path = model_dir / "chat_template.jinja";
  std::error_code ec;
  if (std::filesystem::exists(jinja_path, ec)) {
    TANDEM_ASSIGN_OR_RETURN(chat.chat_template, ReadFileBytes(jinja_path));
  }
  return chat;
}

}  // namespace tandem::gpu_worker
