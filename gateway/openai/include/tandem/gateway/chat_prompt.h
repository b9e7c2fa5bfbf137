// Chat messages -> the prompt a worker is sent. The messages are rendered with the chat template
// (--chat_template's file, else the worker's tokenizer_config.json chat_template) as
// transformers' apply_chat_template does, then sent so that the sequence holds exactly the BOS
// that Hugging Face's apply_chat_template(tokenize=True) gives (the rendering tokenized with
// add_special_tokens=False, as vLLM does too), and never one in the middle of a session:
// - the rendering starts with the tokenizer's bos_token text (Llama-3, Mistral, Gemma):
//   - a one-shot request or a session's first turn: the text goes as prompt_text as rendered;
//     the worker turns the BOS text into the BOS id and adds no other (it adds none to a text
//     that starts with BOS);
//   - a later turn of a session (WorkerPool::Lease::continued_session): the BOS text is cut and
//     the rest goes as prompt_text (the worker adds no BOS to a continued session), so no BOS
//     lands mid-sequence;
// - otherwise (ChatML/Qwen2-style templates that write no BOS): the text is tokenized with
//   add_bos = false on the same worker and sent as prompt_ids, so no BOS is added (the worker
//   would add one to a prompt_text when its tokenizer adds one).
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

struct RenderedPrompt {
  std::string text;           // the rendering
  size_t bos_text_bytes = 0;  // > 0: `text` starts with the bos_token text, this long
};

// Renders `request` (chat) with `chat_template` and the worker's special tokens. INVALID_ARGUMENT
// (param "messages") for messages the template refuses.
absl::StatusOr<RenderedPrompt> RenderChatPrompt(const chat_template::Template& chat_template,
                                                const OpenAiRequest& request,
                                                const v1::ModelInfoResponse& info);

// Sets `generate`'s prompt from `prompt` as the header says; `continued_session`: a later turn
// of a session. Tokenize goes through `stub` (its errors pass through).
absl::Status SetChatPrompt(const RenderedPrompt& prompt, bool continued_session,
                           v1::Generation::Stub& stub, int timeout_ms,
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
