// MakeCompletionsWriter (answer_writer.h): chat completions and completions answers.
#include <optional>

#include "absl/strings/str_cat.h"
#include "answer_writer.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {
namespace {

class CompletionsWriter final : public AnswerWriter {
 public:
  CompletionsWriter(ResponseMeta meta, const OpenAiRequest& r,
                    std::optional<ReasoningMode> reasoning)
      : builder_(std::move(meta), r.logprobs, r.top_logprobs, r.include_usage, reasoning),
        include_usage_(r.include_usage),
        return_progress_(r.return_progress),
        logprobs_(r.logprobs) {}

  std::string StreamStart() override {
    // Chat's first chunk carries the role.
    if (builder_.meta().endpoint != Endpoint::kChatCompletions) return "";
    return SseData(builder_.RoleChunk());
  }
  std::string StreamProgress(const v1::PrefillProgress& progress) override {
    return return_progress_ ? SseData(builder_.ProgressChunk(progress)) : "";
  }
  std::string StreamToken(const v1::TokenDelta& delta, const TokenPiece& sampled) override {
    std::optional<nlohmann::json> chunk = builder_.TokenChunk(delta, sampled);
    return chunk.has_value() ? SseData(*chunk) : "";
  }
  std::string StreamFinish(const v1::GenerateFinal& final) override {
    std::optional<nlohmann::json> held_back = builder_.HeldBackChunk();
    return absl::StrCat(held_back.has_value() ? SseData(*held_back) : "",
                        SseData(builder_.FinishChunk(final)),
                        include_usage_ ? SseData(builder_.UsageChunk(final)) : "", SseDone());
  }
  std::string StreamError(const ApiError& error) override {
    // As vLLM: the error as an event, then the stream ends.
    return absl::StrCat(SseData(ErrorJson(error)), SseDone());
  }
  void Append(const v1::TokenDelta& delta, const TokenPiece& sampled) override {
    builder_.Append(delta, sampled);
  }
  std::string Whole(const v1::GenerateFinal& final) override {
    return DumpJson(builder_.Aggregate(final));
  }
  bool wants_pieces() const override { return logprobs_; }

 private:
  ResponseBuilder builder_;
  const bool include_usage_;
  const bool return_progress_;
  const bool logprobs_;
};

}  // namespace

std::unique_ptr<AnswerWriter> MakeCompletionsWriter(ResponseMeta meta, const OpenAiRequest& r,
                                                    std::optional<ReasoningMode> reasoning) {
  return std::make_unique<CompletionsWriter>(std::move(meta), r, reasoning);
}

}  // namespace tandem::gateway
