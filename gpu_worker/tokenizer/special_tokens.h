// Files of a Hugging Face model directory that the tokenizers read besides the tokenizer itself:
// BOS/EOS and add_bos_token from tokenizer_config.json, config.json and generation_config.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::gpu_worker::tokenizer_internal {

// Largest tokenizer or config file read (Llama-3's tokenizer.json is 9 MB, Gemma's 34 MB).
inline constexpr size_t kMaxTokenizerFileBytes = size_t{512} << 20;

// The bytes of `path`. NOT_FOUND when it does not exist, INVALID_ARGUMENT when it is larger than
// kMaxTokenizerFileBytes or not a regular file, INTERNAL when reading fails.
absl::StatusOr<std::string> ReadFileBytes(const std::filesystem::path& path);

// `path` parsed as JSON; NOT_FOUND as ReadFileBytes, INVALID_ARGUMENT (naming the file) when it
// is not JSON.
absl::StatusOr<nlohmann::json> ReadJsonFile(const std::filesystem::path& path);

// A token written as a string or as an AddedToken object {"content": ...} in field `field` of
// `object`; nullopt for null or absent. INVALID_ARGUMENT naming `file` and the field otherwise.
absl::StatusOr<std::optional<std::string>> TokenText(const nlohmann::json& object,
                                                     const char* field,
                                                     const std::filesystem::path& file);

// `path` parsed as a JSON object, or nullopt when it does not exist. INVALID_ARGUMENT naming the
// file when it is not JSON or not an object.
absl::StatusOr<std::optional<nlohmann::json>> ReadOptionalJsonObject(
    const std::filesystem::path& path);

// What the model directory's JSON files say about special tokens, before resolution.
struct SpecialTokenConfig {
  std::optional<bool> add_bos_token;     // tokenizer_config.json
  std::optional<std::string> bos_token;  // tokenizer_config.json, a token text
  std::vector<std::string> eos_tokens;   // tokenizer_config.json, a token text
  std::optional<int64_t> bos_token_id;   // generation_config.json, else config.json
  std::vector<int64_t> eos_token_ids;    // generation_config.json, then config.json
};

// Reads tokenizer_config.json, config.json and generation_config.json of `model_dir`; a file that
// is absent contributes nothing. INVALID_ARGUMENT (naming file and field) for malformed files or
// mistyped fields.
absl::StatusOr<SpecialTokenConfig> ReadSpecialTokenConfig(const std::filesystem::path& model_dir);

struct SpecialTokens {
  int32_t bos_id = -1;
  std::vector<int32_t> eos_ids;
  std::optional<bool> add_bos_token;
};

// Resolves `config` against a vocabulary of `vocab_size` ids (`token_to_id` gives -1 for unknown
// texts), following the precedence documented at LoadTokenizer. `model_bos` / `model_eos`: the
// tokenizer model's own (-1: none), used when the files name none. INVALID_ARGUMENT when a token
// text is not in the vocab or an id is outside [0, vocab_size).
absl::StatusOr<SpecialTokens> ResolveSpecialTokens(
    const SpecialTokenConfig& config, const std::function<int32_t(std::string_view)>& token_to_id,
    int32_t vocab_size, int32_t model_bos, int32_t model_eos);

}  // namespace tandem::gpu_worker::tokenizer_internal
