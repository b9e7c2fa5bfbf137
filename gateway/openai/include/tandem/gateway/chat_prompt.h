// Chat messages -> the prompt a worker is sent. The messages are rendered with the chat template
// (--chat_template's file, else the worker's tokenizer_config.json chat_template) as
// transformers' apply_chat_template does, then sent so that the sequence has exactly the BOS the
// template wrote:
// - the rendering starts with the tokenizer's bos_token text (Llama-3, Mistral): that text is
//   cut and the rest goes as prompt_text, so the worker puts the real BOS id in front on a new
//   session's first turn (its tokenizer may not map the literal "<s>" text to the BOS id, and
//   a continued session must not get a BOS in the middle);
// - otherwise (ChatML/Qwen2-style templates that write no BOS): the text is tokenized with
//   add_bos = false on the same worker and sent as prompt_ids, so the worker adds none (it
//   would add one to a prompt_text), as vLLM and HF do with add_special_tokens=False.
// With a session_id, `messages` are the new turn's messages: earlier turns are in the
// session's KV on the worker.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "tandem/chat_template/chat_template.h"
#include "tandem/gateway/openai_request.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gateway {

// How a rendered chat prompt is sent (see the header).
struct RenderedPrompt {
  std::string text;  // the rendering, the BOS text cut when it led
  bool bos_stripped = false;
};

// Renders `request` (chat) with `chat_template` and the worker's special tokens. INVALID_ARGUMENT
// (param "messages") for messages the template refuses.
absl::StatusOr<RenderedPrompt> RenderChatPrompt(const chat_template::Template& chat_template,
                                                const OpenAiRequest& request,
                                                const v1::ModelInfoResponse& info);

// Sets `generate`'s prompt from `prompt`: prompt_text when the BOS was cut, else prompt_ids from
// Tokenize(add_bos = false) through `stub` (its errors pass through).
absl::Status SetChatPrompt(const RenderedPrompt& prompt, v1::Generation::Stub& stub, int timeout_ms,
                           v1::GenerateRequest* generate);

// The chat template in use: parsed once (the flag's source, or the first worker's).
// Thread-safe.
class ChatTemplateSource {
 public:
  // `override_source`: --chat_template's file contents ("" = use the worker's).
  explicit ChatTemplateSource(std::string override_source)
      : override_source_(std::move(override_source)) {}

  // Parses the override source now (startup check); OK without one.
  absl::Status CheckOverride();

  // The template: INVALID_ARGUMENT (param "messages") when neither --chat_template nor the
  // worker's model has one, or when its source does not parse.
  absl::StatusOr<std::shared_ptr<const chat_template::Template>> Get(
      const v1::ModelInfoResponse& info);

 private:
  const std::string override_source_;
  std::mutex mu_;
  std::string parsed_source_;                              // guarded by mu_
  std::shared_ptr<const chat_template::Template> parsed_;  // guarded by mu_
};

}  // namespace tandem::gateway
