#include "special_tokens.h"

#include <algorithm>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

using nlohmann::json;

absl::Status FieldError(const std::filesystem::path& file, const char* field,
                        std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(file.string(), ": \"", field, "\" ", std::string(what)));
}

// An id or a list of ids; empty for null or absent.
absl::StatusOr<std::vector<int64_t>> TokenIds(const json& object, const char* field,
                                              const std::filesystem::path& file) {
  std::vector<int64_t> ids;
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return ids;
  if (it->is_number_integer()) {
    ids.push_back(it->get<int64_t>());
    return ids;
  }
  if (it->is_array()) {
    for (const json& id : *it) {
      if (!id.is_number_integer())
        return FieldError(file, field, "has an entry that is not an int");
      ids.push_back(id.get<int64_t>());
    }
    return ids;
  }
  return FieldError(file, field, "is neither an int, a list of ints nor null");
}

void AppendUnique(int32_t id, std::vector<int32_t>* ids) {
  if (std::find(ids->begin(), ids->end(), id) == ids->end()) ids->push_back(id);
}

}  // namespace

absl::StatusOr<std::optional<std::string>> TokenText(const json& object, const char* field,
                                                     const std::filesystem::path& file) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return FieldError(file, field, "is neither a string, an object with \"content\" nor null");
}

absl::StatusOr<std::optional<json>> ReadOptionalJsonObject(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  TANDEM_ASSIGN_OR_RETURN(json parsed, ReadJsonFile(path));
  if (!parsed.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not a JSON object"));
  }
  return parsed;
}

absl::StatusOr<std::string> ReadFileBytes(const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrCat(path.string(), " does not exist"));
  }
  if (!std::filesystem::is_regular_file(status)) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not a regular file"));
  }
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec)
    return absl::InternalError(absl::StrCat("cannot stat ", path.string(), ": ", ec.message()));
  if (size > kMaxTokenizerFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), " is ", size, " bytes, more than the limit of ", kMaxTokenizerFileBytes));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::InternalError(absl::StrCat("cannot open ", path.string()));
  std::string bytes(static_cast<size_t>(size), '\0');
  file.read(bytes.data(), static_cast<std::streamsize>(size));
  if (file.gcount() != static_cast<std::streamsize>(size)) {
    return absl::InternalError(absl::StrCat("short read of ", path.string()));
  }
  return bytes;
}

absl::StatusOr<json> ReadJsonFile(const std::filesystem::path& path) {
  TANDEM_ASSIGN_OR_RETURN(const std::string text, ReadFileBytes(path));
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not valid JSON"));
  }
  return parsed;
}

absl::StatusOr<SpecialTokenConfig> ReadSpecialTokenConfig(const std::filesystem::path& model_dir) {
  SpecialTokenConfig config;

  const std::filesystem::path tokenizer_config_path = model_dir / "tokenizer_config.json";
  TANDEM_ASSIGN_OR_RETURN(const std::optional<json> tokenizer_config,
                          ReadOptionalJsonObject(tokenizer_config_path));
  if (tokenizer_config.has_value()) {
    const auto add_bos = tokenizer_config->find("add_bos_token");
    if (add_bos != tokenizer_config->end() && !add_bos->is_null()) {
      if (!add_bos->is_boolean()) {
        return FieldError(tokenizer_config_path, "add_bos_token", "is not a boolean");
      }
      config.add_bos_token = add_bos->get<bool>();
    }
    TANDEM_ASSIGN_OR_RETURN(config.bos_token,
                            TokenText(*tokenizer_config, "bos_token", tokenizer_config_path));
    TANDEM_ASSIGN_OR_RETURN(const std::optional<std::string> eos,
                            TokenText(*tokenizer_config, "eos_token", tokenizer_config_path));
    if (eos.has_value()) config.eos_tokens.push_back(*eos);
  }

  // generation_config.json first: it is what generation uses, and may list several EOS ids.
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::filesystem::path path = model_dir / name;
    TANDEM_ASSIGN_OR_RETURN(const std::optional<json> file, ReadOptionalJsonObject(path));
    if (!file.has_value()) continue;
    TANDEM_ASSIGN_OR_RETURN(const std::vector<int64_t> bos, TokenIds(*file, "bos_token_id", path));
    if (bos.size() > 1) return FieldError(path, "bos_token_id", "lists more than one id");
    if (!bos.empty() && !config.bos_token_id.has_value()) config.bos_token_id = bos[0];
    TANDEM_ASSIGN_OR_RETURN(const std::vector<int64_t> eos, TokenIds(*file, "eos_token_id", path));
    config.eos_token_ids.insert(config.eos_token_ids.end(), eos.begin(), eos.end());
  }
  return config;
}

absl::StatusOr<SpecialTokens> ResolveSpecialTokens(
    const SpecialTokenConfig& config, const std::function<int32_t(std::string_view)>& token_to_id,
    int32_t vocab_size, int32_t model_bos, int32_t model_eos) {
  const auto check_id = [&](int64_t id, const char* what) -> absl::StatusOr<int32_t> {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    return static_cast<int32_t>(id);
  };
  const auto resolve_text = [&](const std::string& text,
                                const char* what) -> absl::StatusOr<int32_t> {
    const int32_t id = token_to_id(text);
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json ", what, " \"", text,
                                                     "\" is not a token of the vocabulary"));
    }
    return id;
  };

  SpecialTokens tokens;
  tokens.add_bos_token = config.add_bos_token;
  if (config.bos_token.has_value()) {
    TANDEM_ASSIGN_OR_RETURN(tokens.bos_id, resolve_text(*config.bos_token, "bos_token"));
  } else if (config.bos_token_id.has_value()) {
    TANDEM_ASSIGN_OR_RETURN(tokens.bos_id, check_id(*config.bos_token_id, "bos_token_id"));
  } else if (model_bos >= 0) {
    TANDEM_ASSIGN_OR_RETURN(tokens.bos_id, check_id(model_bos, "the model's BOS id"));
  }

  for (const int64_t id : config.eos_token_ids) {
    TANDEM_ASSIGN_OR_RETURN(const int32_t checked, check_id(id, "eos_token_id"));
    AppendUnique(checked, &tokens.eos_ids);
  }
  for (const std::string& text : config.eos_tokens) {
    TANDEM_ASSIGN_OR_RETURN(const int32_t id, resolve_text(text, "eos_token"));
    AppendUnique(id, &tokens.eos_ids);
  }
  if (tokens.eos_ids.empty() && model_eos >= 0) {
    TANDEM_ASSIGN_OR_RETURN(const int32_t id, check_id(model_eos, "the model's EOS id"));
    tokens.eos_ids.push_back(id);
  }
  return tokens;
}

}  // namespace tandem::gpu_worker::tokenizer_internal
