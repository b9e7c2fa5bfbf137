#include "tandem/gateway/chat_prompt.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tandem/common/grpc_status.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/api_error.h"

namespace tandem::gateway {

absl::StatusOr<RenderedPrompt> RenderChatPrompt(const chat_template::Template& chat_template,
                                                const OpenAiRequest& request,
                                                const v1::ModelInfoResponse& info) {
  chat_template::ChatOptions options;
  options.add_generation_prompt = request.add_generation_prompt;
  options.bos_token = info.bos_token();
  options.eos_token = info.eos_token();
  options.tools = request.tools;
  options.extra = request.template_kwargs;
  absl::StatusOr<std::string> text =
      chat_template::RenderChat(chat_template, request.messages, options);
  if (!text.ok()) {
    return WithParam(absl::Status(text.status().code(),
                                  absl::StrCat("chat template: ", text.status().message())),
                     "messages");
  }
  RenderedPrompt prompt;
  prompt.text = std::move(*text);
  if (!info.bos_token().empty() && absl::StartsWith(prompt.text, info.bos_token())) {
    prompt.bos_text_bytes = info.bos_token().size();
  }
  return prompt;
}

absl::Status SetChatPrompt(const RenderedPrompt& prompt, bool continued_session,
                           v1::Generation::Stub& stub, int timeout_ms,
                           v1::GenerateRequest* generate) {
  if (prompt.text.size() <= prompt.bos_text_bytes) {
    return InvalidField("messages", "the chat template rendered nothing");
  }
  if (prompt.bos_text_bytes > 0) {
    generate->set_prompt_text(continued_session ? prompt.text.substr(prompt.bos_text_bytes)
                                                : prompt.text);
    return absl::OkStatus();
  }
  v1::TokenizeRequest request;
  request.set_text(prompt.text);
  request.set_add_bos(false);
  v1::TokenizeResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  TANDEM_RETURN_IF_ERROR(FromGrpcStatus(stub.Tokenize(&ctx, request, &response)));
  if (response.token_ids().empty()) {
    return InvalidField("messages", "the chat template's rendering has no tokens");
  }
  *generate->mutable_prompt_ids()->mutable_ids() = response.token_ids();
  return absl::OkStatus();
}

absl::Status ChatTemplateSource::CheckOverride() {
  if (override_source_.empty()) return absl::OkStatus();
  v1::ModelInfoResponse none;
  return Get(none).status();
}

absl::StatusOr<std::shared_ptr<const chat_template::Template>> ChatTemplateSource::Get(
    const v1::ModelInfoResponse& info) {
  const std::string& source = override_source_.empty() ? info.chat_template() : override_source_;
  if (source.empty()) {
    return InvalidField("messages",
                        "the model has no chat template (tokenizer_config.json chat_template); "
                        "start tandem-gateway with --chat_template=FILE, or use /v1/completions");
  }
  std::lock_guard lock(mu_);
  if (parsed_ == nullptr || parsed_source_ != source) {
    absl::StatusOr<chat_template::Template> parsed = chat_template::Template::Parse(source);
    if (!parsed.ok()) {
      return WithParam(absl::Status(parsed.status().code(),
                                    absl::StrCat("chat template: ", parsed.status().message())),
                       "messages");
    }
    parsed_ = std::make_shared<const chat_template::Template>(std::move(*parsed));
    parsed_source_ = source;
  }
  return parsed_;
}

}  // namespace tandem::gateway
