#include "tandem/gateway/openai_response.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::json;

constexpr double kLogprobFloor = -9999.0;

double Floor(float logprob) {
  return std::isfinite(logprob) ? std::max<double>(logprob, kLogprobFloor) : kLogprobFloor;
}

Json ByteList(const std::string& bytes) {
  Json list = Json::array();
  for (unsigned char c : bytes) list.push_back(static_cast<int>(c));
  return list;
}

// A chat delta of split text: its non-empty parts, or {"content": ""} when both are empty (a
// chunk sent for its logprobs alone, as without a parser).
Json SplitDelta(const ReasoningSplit& split) {
  Json delta = Json::object();
  if (!split.reasoning.empty()) delta["reasoning_content"] = split.reasoning;
  if (!split.content.empty() || split.reasoning.empty()) delta["content"] = split.content;
  return delta;
}

}  // namespace

std::string RandomHex(int digits) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (int i = 0; i < digits; ++i) hex.push_back(kHex[rng() & 15]);
  return hex;
}

std::string NewResponseId(Endpoint endpoint) {
  return (endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-") + RandomHex(24);
}

std::string FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
    case v1::FINISH_REASON_CONTEXT:
      return "length";
    case v1::FINISH_REASON_STOP:
    case v1::FINISH_REASON_EOS:
      return "stop";
    default:
      return "";
  }
}

Json UsageJson(const v1::GenerateFinal& final) {
  const v1::Usage& usage = final.usage();
  // prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served (OpenAI's
  // and vLLM's field); degraded_steps: tandem's count of steps without a node's answer.
  return {{"prompt_tokens", usage.prompt_tokens()},
          {"completion_tokens", usage.completion_tokens()},
          {"total_tokens", usage.total_tokens()},
          {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens()}}},
          {"degraded_steps", final.degraded_steps()}};
}

Json TandemJson(const v1::GenerateFinal& final) {
  return {{"degraded", final.degraded()},
          {"degraded_steps", final.degraded_steps()},
          {"mode", final.mode()}};
}

ResponseBuilder::ResponseBuilder(ResponseMeta meta, bool logprobs, int top_logprobs,
                                 bool include_usage, std::optional<ReasoningMode> reasoning)
    : meta_(std::move(meta)),
      logprobs_(logprobs),
      top_logprobs_(top_logprobs),
      include_usage_(include_usage) {
  if (reasoning.has_value() && meta_.endpoint == Endpoint::kChatCompletions) {
    reasoning_.emplace(*reasoning);
  }
}

Json ResponseBuilder::Envelope(bool chunk) const {
  const bool chat = meta_.endpoint == Endpoint::kChatCompletions;
  Json j = {
      {"id", meta_.id},
      {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
      {"created", meta_.created},
      {"model", meta_.model},
      {"system_fingerprint", nullptr}};
  if (chunk && include_usage_) j["usage"] = nullptr;
  return j;
}

void ResponseBuilder::AddLogprobs(const v1::TokenDelta& delta, const TokenPiece& sampled,
                                  Json* logprobs) const {
  const double logprob = Floor(delta.has_logprob() ? delta.logprob() : 0.0f);
  if (meta_.endpoint == Endpoint::kChatCompletions) {
    if (logprobs->is_null()) *logprobs = {{"content", Json::array()}};
    Json top = Json::array();
    for (const v1::TokenLogprob& t : delta.top_logprobs()) {
      if (static_cast<int>(top.size()) >= top_logprobs_) break;
      top.push_back(
          {{"token", t.text()}, {"logprob", Floor(t.logprob())}, {"bytes", ByteList(t.raw())}});
    }
    (*logprobs)["content"].push_back({{"token", sampled.text},
                                      {"logprob", logprob},
                                      {"bytes", ByteList(sampled.bytes)},
                                      {"top_logprobs", std::move(top)}});
    return;
  }
  if (logprobs->is_null()) {
    *logprobs = {{"tokens", Json::array()},
                 {"token_logprobs", Json::array()},
                 {"top_logprobs", Json::array()},
                 {"text_offset", Json::array()}};
  }
  Json top = Json::object();
  for (const v1::TokenLogprob& t : delta.top_logprobs()) {
    if (static_cast<int>(top.size()) >= top_logprobs_) break;
    if (!top.contains(t.text())) top[t.text()] = Floor(t.logprob());
  }
  // "The API will always return the logprob of the sampled token, so there may be up to
  // logprobs+1 elements" (OpenAI's legacy completions; vLLM does the same).
  if (top_logprobs_ > 0 && !top.contains(sampled.text)) top[sampled.text] = logprob;
  (*logprobs)["tokens"].push_back(sampled.text);
  (*logprobs)["token_logprobs"].push_back(logprob);
  (*logprobs)["top_logprobs"].push_back(std::move(top));
  (*logprobs)["text_offset"].push_back(text_offset_);
}

Json ResponseBuilder::ChatChunk(Json delta) const {
  Json j = Envelope(true);
  j["choices"] = Json::array({{{"index", 0},
                               {"delta", std::move(delta)},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return j;
}

Json ResponseBuilder::RoleChunk() const {
  return ChatChunk({{"role", "assistant"}, {"content", ""}});
}

std::optional<Json> ResponseBuilder::TokenChunk(const v1::TokenDelta& delta,
                                                const TokenPiece& sampled) {
  // A repeated index adds held-back text to a token already sent: no logprobs entry again.
  const bool new_token = delta.index() > last_index_;
  last_index_ = std::max(last_index_, delta.index());
  Json choice = {{"index", 0}};
  bool nothing_told = delta.text().empty();
  if (meta_.endpoint != Endpoint::kChatCompletions) {
    choice["text"] = delta.text();
  } else if (reasoning_.has_value()) {
    const ReasoningSplit split = reasoning_->Feed(delta.text());
    nothing_told = split.reasoning.empty() && split.content.empty();
    choice["delta"] = SplitDelta(split);
  } else {
    choice["delta"] = {{"content", delta.text()}};
  }
  if (nothing_told && !(logprobs_ && new_token)) return std::nullopt;
  Json logprobs;
  if (logprobs_ && new_token) AddLogprobs(delta, sampled, &logprobs);
  text_offset_ += static_cast<int64_t>(delta.text().size());
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = nullptr;
  Json j = Envelope(true);
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

std::optional<Json> ResponseBuilder::HeldBackChunk() {
  if (!reasoning_.has_value()) return std::nullopt;
  const ReasoningSplit split = reasoning_->Finish();
  if (split.reasoning.empty() && split.content.empty()) return std::nullopt;
  return ChatChunk(SplitDelta(split));
}

Json ResponseBuilder::FinishChunk(const v1::GenerateFinal& final) const {
  const v1::FinishReason reason = final.finish_reason();
  Json choice = {{"index", 0}};
  if (meta_.endpoint == Endpoint::kChatCompletions) {
    choice["delta"] = Json::object();
  } else {
    choice["text"] = "";
  }
  choice["logprobs"] = nullptr;
  const std::string name = FinishReasonName(reason);
  choice["finish_reason"] = name.empty() ? Json(nullptr) : Json(name);
  Json j = Envelope(true);
  j["choices"] = Json::array({std::move(choice)});
  j["tandem"] = TandemJson(final);
  return j;
}

Json ResponseBuilder::UsageChunk(const v1::GenerateFinal& final) const {
  Json j = Envelope(true);
  j["choices"] = Json::array();
  j["usage"] = UsageJson(final);
  return j;
}

Json ResponseBuilder::ProgressChunk(const v1::PrefillProgress& progress) const {
  Json j = Envelope(true);
  j["choices"] = Json::array();
  j["prompt_progress"] = {{"total", progress.total()},
                          {"cache", 0},
                          {"processed", progress.processed()},
                          {"time_ms", static_cast<int64_t>(progress.elapsed_seconds() * 1000.0)}};
  return j;
}

void ResponseBuilder::Append(const v1::TokenDelta& delta, const TokenPiece& sampled) {
  const bool new_token = delta.index() > last_index_;
  last_index_ = std::max(last_index_, delta.index());
  if (logprobs_ && new_token) AddLogprobs(delta, sampled, &aggregate_logprobs_);
  text_offset_ += static_cast<int64_t>(delta.text().size());
  text_ += delta.text();
}

Json ResponseBuilder::Aggregate(const v1::GenerateFinal& final) const {
  Json choice = {{"index", 0}};
  if (meta_.endpoint == Endpoint::kChatCompletions && reasoning_.has_value()) {
    // Split whole, as a stream of any deltas would be (reasoning_ itself is the stream's).
    ReasoningSplit split = SplitReasoning(reasoning_->mode(), text_);
    Json content =
        split.content.empty() && !split.reasoning.empty() ? Json(nullptr) : Json(split.content);
    Json reasoning = split.reasoning.empty() ? Json(nullptr) : Json(split.reasoning);
    choice["message"] = {{"role", "assistant"},
                         {"content", std::move(content)},
                         {"reasoning_content", std::move(reasoning)}};
  } else if (meta_.endpoint == Endpoint::kChatCompletions) {
    choice["message"] = {{"role", "assistant"}, {"content", text_}};
  } else {
    choice["text"] = text_;
  }
  choice["logprobs"] = aggregate_logprobs_;
  const std::string name = FinishReasonName(final.finish_reason());
  choice["finish_reason"] = name.empty() ? Json(nullptr) : Json(name);
  Json j = Envelope(false);
  j["choices"] = Json::array({std::move(choice)});
  j["usage"] = UsageJson(final);
  j["tandem"] = TandemJson(final);
  return j;
}

}  // namespace tandem::gateway
