// What a model directory says about chat formatting, for clients that render prompts themselves
// (the OpenAI gateway renders `chat_template` with its Jinja subset): the template source and
// the BOS / EOS token texts that templates refer to as `bos_token` / `eos_token`.
//
// Sources, as transformers reads them: model_dir/chat_template.jinja when it exists (newer
// checkpoints save the template there), else tokenizer_config.json's `chat_template`, which is a
// string or a list of {"name", "template"} (the one named "default" is used). bos_token /
// eos_token: tokenizer_config.json's, each a string or an AddedToken object {"content": ...}.
//
// Errors: INVALID_ARGUMENT naming the file (and field) for malformed JSON or a mistyped field;
// INTERNAL when a file exists but cannot be read. Absent files or fields give "". Nothing throws.
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::gpu_worker {

struct ChatConfig {
  std::string chat_template;  // Jinja source; "" when the model has none
  std::string bos_token;      // token text, e.g. "<|begin_of_text|>"; "" when absent
  std::string eos_token;      // token text, e.g. "<|eot_id|>"; "" when absent
};

absl::StatusOr<ChatConfig> LoadChatConfig(const std::filesystem::path& model_dir);

}  // namespace tandem::gpu_worker
