// The answer shapes: streamed chunks and aggregates of both endpoints as OpenAI sends them,
// logprobs in the chat and legacy shapes, finish_reason mapping, usage, SSE framing, and the
// error object and HTTP status of each gRPC code.
#include "tandem/gateway/openai_response.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tandem/gateway/api_error.h"
#include "tandem/gateway/sse.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::json;

ResponseMeta Meta(Endpoint endpoint) {
  return ResponseMeta{endpoint, "id-1", 1700000000, "stories260k"};
}

v1::TokenDelta Delta(int32_t id, const std::string& text, int64_t index) {
  v1::TokenDelta d;
  d.set_token_id(id);
  d.set_text(text);
  d.set_index(index);
  return d;
}

v1::TokenLogprob Candidate(int32_t id, const std::string& text, float logprob) {
  v1::TokenLogprob t;
  t.set_token_id(id);
  t.set_text(text);
  t.set_raw(text);
  t.set_logprob(logprob);
  return t;
}

v1::GenerateFinal Final(v1::FinishReason reason, int64_t prompt, int64_t completion) {
  v1::GenerateFinal f;
  f.set_finish_reason(reason);
  f.mutable_usage()->set_prompt_tokens(prompt);
  f.mutable_usage()->set_completion_tokens(completion);
  f.mutable_usage()->set_total_tokens(prompt + completion);
  return f;
}

TEST(GatewayResponseIds, PrefixAndLength) {
  const std::string chat = NewResponseId(Endpoint::kChatCompletions);
  EXPECT_EQ(chat.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(chat.size(), 9u + 24u);
  const std::string completion = NewResponseId(Endpoint::kCompletions);
  EXPECT_EQ(completion.rfind("cmpl-", 0), 0u);
  EXPECT_NE(NewResponseId(Endpoint::kCompletions), completion);
}

TEST(GatewayFinishReason, MapsToOpenAisNames) {
  EXPECT_EQ(FinishReasonName(v1::FINISH_REASON_LENGTH), "length");
  EXPECT_EQ(FinishReasonName(v1::FINISH_REASON_CONTEXT), "length");
  EXPECT_EQ(FinishReasonName(v1::FINISH_REASON_STOP), "stop");
  EXPECT_EQ(FinishReasonName(v1::FINISH_REASON_EOS), "stop");
  EXPECT_EQ(FinishReasonName(v1::FINISH_REASON_CANCELLED), "");
}

TEST(GatewayChatChunks, RoleTokensFinishAndUsage) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), false, 0, true);
  const Json role = b.RoleChunk();
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["id"], "id-1");
  EXPECT_EQ(role["created"], 1700000000);
  EXPECT_EQ(role["model"], "stories260k");
  EXPECT_TRUE(role["usage"].is_null());  // include_usage: null on every chunk but the last
  EXPECT_EQ(role["choices"][0]["delta"], Json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(role["choices"][0]["finish_reason"].is_null());

  std::optional<Json> chunk = b.TokenChunk(Delta(5, "Once", 0), {});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["delta"], Json({{"content", "Once"}}));
  EXPECT_TRUE((*chunk)["choices"][0]["logprobs"].is_null());
  // An empty delta (text held back) sends nothing without logprobs.
  EXPECT_FALSE(b.TokenChunk(Delta(6, "", 1), {}).has_value());

  v1::GenerateFinal final = Final(v1::FINISH_REASON_EOS, 7, 2);
  final.mutable_usage()->set_cached_tokens(5);  // the prefix cache served 5 of the 7
  final.set_mode("hybrid");
  const Json finish = b.FinishChunk(final);
  EXPECT_EQ(finish["choices"][0]["delta"], Json::object());
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(finish["tandem"],
            Json({{"degraded", false}, {"degraded_steps", 0}, {"mode", "hybrid"}}));

  const Json last = b.UsageChunk(final);
  EXPECT_EQ(last["choices"], Json::array());
  EXPECT_EQ(last["usage"], Json({{"prompt_tokens", 7},
                                 {"completion_tokens", 2},
                                 {"total_tokens", 9},
                                 {"prompt_tokens_details", {{"cached_tokens", 5}}},
                                 {"degraded_steps", 0}}));
}

// A generation that ran some steps without a CPU node's answer says so where every client
// looks: the aggregate's and the finish chunk's "tandem" object and usage.degraded_steps.
TEST(GatewayDegradedAnswer, MarkedInTheAggregateTheFinishChunkAndUsage) {
  v1::GenerateFinal final = Final(v1::FINISH_REASON_LENGTH, 4, 3);
  final.set_degraded(true);
  final.set_degraded_steps(2);
  final.set_mode("hybrid");
  ResponseBuilder aggregate(Meta(Endpoint::kChatCompletions), false, 0, false);
  const Json j = aggregate.Aggregate(final);
  EXPECT_EQ(j["tandem"], Json({{"degraded", true}, {"degraded_steps", 2}, {"mode", "hybrid"}}));
  EXPECT_EQ(j["usage"]["degraded_steps"], 2);
  ResponseBuilder stream(Meta(Endpoint::kCompletions), false, 0, true);
  EXPECT_EQ(stream.FinishChunk(final)["tandem"]["degraded"], true);
  EXPECT_EQ(stream.UsageChunk(final)["usage"]["degraded_steps"], 2);
}

TEST(GatewayChatAggregate, MessageUsageAndFinish) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), false, 0, false);
  b.Append(Delta(5, "Once", 0), {});
  b.Append(Delta(6, " upon", 1), {});
  b.Append(Delta(6, " a", 1), {});  // held-back text of token 1, sent with a repeated index
  const Json j = b.Aggregate(Final(v1::FINISH_REASON_CONTEXT, 3, 2));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_FALSE(j.contains("usage") && j["usage"].is_null());
  EXPECT_EQ(j["choices"][0]["message"], Json({{"role", "assistant"}, {"content", "Once upon a"}}));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
}

constexpr ReasoningMode kQwen3{ReasoningSyntax::kQwen3, PromptThinking::kNone};

// With a reasoning parser, streamed deltas carry reasoning_content or content, a token that is
// (part of) a tag sends nothing, and what was held back at the end goes before the finish chunk.
TEST(GatewayChatReasoning, StreamedDeltasSplitAtTheTags) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), false, 0, false, kQwen3);
  EXPECT_EQ(b.RoleChunk()["choices"][0]["delta"], Json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_FALSE(b.TokenChunk(Delta(1, "<think>", 0), {}).has_value());
  std::optional<Json> chunk = b.TokenChunk(Delta(2, "\nHm", 1), {});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["delta"], Json({{"reasoning_content", "\nHm"}}));
  EXPECT_EQ((*chunk)["object"], "chat.completion.chunk");
  EXPECT_TRUE((*chunk)["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(b.TokenChunk(Delta(3, "</th", 2), {}).has_value());  // may be a tag: waits
  chunk = b.TokenChunk(Delta(4, "ink>\n\nYes", 3), {});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["delta"], Json({{"content", "Yes"}}));
  EXPECT_FALSE(b.HeldBackChunk().has_value());

  // One delta across the end of the block carries both parts.
  ResponseBuilder both(Meta(Endpoint::kChatCompletions), false, 0, false, kQwen3);
  chunk = both.TokenChunk(Delta(1, "<think>a</think>b", 0), {});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["delta"], Json({{"reasoning_content", "a"}, {"content", "b"}}));

  // A truncated answer that ends in a partial tag: the text is sent before the finish chunk.
  ResponseBuilder cut(Meta(Endpoint::kChatCompletions), false, 0, false, kQwen3);
  ASSERT_TRUE(cut.TokenChunk(Delta(1, "<think>x</thi", 0), {}).has_value());
  std::optional<Json> held = cut.HeldBackChunk();
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ((*held)["choices"][0]["delta"], Json({{"reasoning_content", "</thi"}}));
  EXPECT_TRUE((*held)["choices"][0]["finish_reason"].is_null());
}

// logprobs are per token, whatever the parser tells: a tag token's chunk carries its entry and
// an empty content.
TEST(GatewayChatReasoning, TagTokensKeepTheirLogprobs) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), true, 0, false, kQwen3);
  v1::TokenDelta tag = Delta(151667, "<think>", 0);
  tag.set_logprob(-0.5f);
  std::optional<Json> chunk = b.TokenChunk(tag, TokenPiece{"<think>", "<think>"});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["delta"], Json({{"content", ""}}));
  ASSERT_EQ((*chunk)["choices"][0]["logprobs"]["content"].size(), 1u);
  EXPECT_EQ((*chunk)["choices"][0]["logprobs"]["content"][0]["token"], "<think>");
}

TEST(GatewayChatReasoning, AggregateMessage) {
  auto message = [](ReasoningMode mode, const std::vector<std::string>& texts) {
    ResponseBuilder b(Meta(Endpoint::kChatCompletions), false, 0, false, mode);
    for (size_t i = 0; i < texts.size(); ++i) {
      b.Append(Delta(static_cast<int32_t>(i), texts[i], static_cast<int64_t>(i)), {});
    }
    return b.Aggregate(Final(v1::FINISH_REASON_EOS, 3,
                             static_cast<int64_t>(texts.size())))["choices"][0]["message"];
  };
  EXPECT_EQ(
      message(kQwen3, {"<think>", "\nWhy.\n", "</th", "ink>", "\n\n", "Because."}),
      Json({{"role", "assistant"}, {"content", "Because."}, {"reasoning_content", "\nWhy.\n"}}));
  // Thinking disabled: no reasoning (null), the content as it came.
  EXPECT_EQ(
      message(kQwen3, {"Just ", "this."}),
      Json({{"role", "assistant"}, {"content", "Just this."}, {"reasoning_content", nullptr}}));
  // Truncated thinking: no content (null, as vLLM).
  EXPECT_EQ(message(kQwen3, {"<think>", "Still"}),
            Json({{"role", "assistant"}, {"content", nullptr}, {"reasoning_content", "Still"}}));
  // A prompt that opened the block: the answer starts in it.
  EXPECT_EQ(message({ReasoningSyntax::kQwen3, PromptThinking::kOpen}, {"Plan", "</think>", "Go"}),
            Json({{"role", "assistant"}, {"content", "Go"}, {"reasoning_content", "Plan"}}));
  // Nothing generated: content "" as without a parser.
  EXPECT_EQ(message(kQwen3, {}),
            Json({{"role", "assistant"}, {"content", ""}, {"reasoning_content", nullptr}}));
}

// The legacy completions endpoint never splits: its text is the raw generation.
TEST(GatewayChatReasoning, CompletionsIgnoreTheParser) {
  ResponseBuilder b(Meta(Endpoint::kCompletions), false, 0, false, kQwen3);
  std::optional<Json> chunk = b.TokenChunk(Delta(1, "<think>a</think>b", 0), {});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_EQ((*chunk)["choices"][0]["text"], "<think>a</think>b");
  EXPECT_FALSE(b.HeldBackChunk().has_value());
  ResponseBuilder whole(Meta(Endpoint::kCompletions), false, 0, false, kQwen3);
  whole.Append(Delta(1, "<think>a</think>b", 0), {});
  EXPECT_EQ(whole.Aggregate(Final(v1::FINISH_REASON_EOS, 1, 1))["choices"][0]["text"],
            "<think>a</think>b");
}

TEST(GatewayChatLogprobs, ContentEntriesWithTopCandidatesAndBytes) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), true, 2, false);
  v1::TokenDelta d = Delta(7, "Hi", 0);
  d.set_logprob(-0.25f);
  *d.add_top_logprobs() = Candidate(7, "Hi", -0.25f);
  *d.add_top_logprobs() = Candidate(9, "Yo", -1.5f);
  *d.add_top_logprobs() = Candidate(11, "No", -3.0f);  // more than asked: cut to 2
  std::optional<Json> chunk = b.TokenChunk(d, TokenPiece{"Hi", "Hi"});
  ASSERT_TRUE(chunk.has_value());
  const Json& entry = (*chunk)["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(entry["token"], "Hi");
  EXPECT_DOUBLE_EQ(entry["logprob"].get<double>(), -0.25);
  EXPECT_EQ(entry["bytes"], Json({72, 105}));
  ASSERT_EQ(entry["top_logprobs"].size(), 2u);
  EXPECT_EQ(entry["top_logprobs"][1]["token"], "Yo");
  EXPECT_DOUBLE_EQ(entry["top_logprobs"][1]["logprob"].get<double>(), -1.5);

  // With logprobs, an empty-text token still gets its chunk (its entry), and -inf is floored.
  v1::TokenDelta empty = Delta(8, "", 1);
  empty.set_logprob(-std::numeric_limits<float>::infinity());
  chunk = b.TokenChunk(empty, TokenPiece{"\xEF\xBF\xBD", "\xE2"});
  ASSERT_TRUE(chunk.has_value());
  const Json& e2 = (*chunk)["choices"][0]["logprobs"]["content"][0];
  EXPECT_DOUBLE_EQ(e2["logprob"].get<double>(), -9999.0);
  EXPECT_EQ(e2["bytes"], Json({0xE2}));
  // A repeated index adds text only.
  chunk = b.TokenChunk(Delta(8, "\xE2\x82\xAC", 1), TokenPiece{});
  ASSERT_TRUE(chunk.has_value());
  EXPECT_TRUE((*chunk)["choices"][0]["logprobs"].is_null());
}

TEST(GatewayCompletionChunks, TextAndLegacyLogprobs) {
  ResponseBuilder b(Meta(Endpoint::kCompletions), true, 1, false);
  v1::TokenDelta d0 = Delta(5, "Once", 0);
  d0.set_logprob(-0.5f);
  *d0.add_top_logprobs() = Candidate(5, "Once", -0.5f);
  v1::TokenDelta d1 = Delta(6, " upon", 1);
  d1.set_logprob(-2.0f);
  *d1.add_top_logprobs() = Candidate(9, " on", -1.0f);
  std::optional<Json> c0 = b.TokenChunk(d0, TokenPiece{"Once", "Once"});
  std::optional<Json> c1 = b.TokenChunk(d1, TokenPiece{" upon", " upon"});
  ASSERT_TRUE(c0.has_value() && c1.has_value());
  EXPECT_EQ((*c0)["object"], "text_completion");
  EXPECT_EQ((*c0)["choices"][0]["text"], "Once");
  const Json& lp = (*c1)["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], Json({" upon"}));
  EXPECT_EQ(lp["token_logprobs"], Json({-2.0}));
  // The sampled token is always among them (OpenAI: up to logprobs + 1 entries).
  EXPECT_EQ(lp["top_logprobs"], Json::array({{{" on", -1.0}, {" upon", -2.0}}}));
  EXPECT_EQ(lp["text_offset"], Json({4}));  // after "Once"
  EXPECT_FALSE(b.FinishChunk(Final(v1::FINISH_REASON_LENGTH, 1, 2)).contains("usage"));
  EXPECT_EQ(b.FinishChunk(Final(v1::FINISH_REASON_LENGTH, 1, 2))["choices"][0]["text"], "");
}

TEST(GatewayCompletionAggregate, TextLogprobsAndUsage) {
  ResponseBuilder b(Meta(Endpoint::kCompletions), true, 0, false);
  v1::TokenDelta d0 = Delta(5, "Once", 0);
  d0.set_logprob(-0.5f);
  v1::TokenDelta d1 = Delta(6, " upon", 1);
  d1.set_logprob(-0.75f);
  b.Append(d0, TokenPiece{"Once", "Once"});
  b.Append(d1, TokenPiece{" upon", " upon"});
  const Json j = b.Aggregate(Final(v1::FINISH_REASON_STOP, 4, 2));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "Once upon");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  const Json& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], Json({"Once", " upon"}));
  EXPECT_EQ(lp["token_logprobs"], Json({-0.5, -0.75}));
  EXPECT_EQ(lp["top_logprobs"], Json::array({Json::object(), Json::object()}));
  EXPECT_EQ(lp["text_offset"], Json({0, 4}));
  EXPECT_EQ(j["usage"], Json({{"prompt_tokens", 4},
                              {"completion_tokens", 2},
                              {"total_tokens", 6},
                              {"prompt_tokens_details", {{"cached_tokens", 0}}},
                              {"degraded_steps", 0}}));
}

TEST(GatewayProgress, LlamaCppShape) {
  ResponseBuilder b(Meta(Endpoint::kChatCompletions), false, 0, false);
  v1::PrefillProgress p;
  p.set_total(2048);
  p.set_processed(512);
  p.set_elapsed_seconds(0.25);
  const Json j = b.ProgressChunk(p);
  EXPECT_EQ(j["choices"], Json::array());
  EXPECT_EQ(j["prompt_progress"],
            Json({{"total", 2048}, {"cache", 0}, {"processed", 512}, {"time_ms", 250}}));
}

TEST(GatewaySse, Framing) {
  EXPECT_EQ(SseData(Json({{"a", 1}})), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseComment("prefill 512/2048"), ": prefill 512/2048\n\n");
  EXPECT_EQ(SseDone(), "data: [DONE]\n\n");
  // Invalid UTF-8 from a worker is replaced, never thrown.
  EXPECT_EQ(SseData(Json({{"t", std::string("a\xFF")}})), "data: {\"t\":\"a\xEF\xBF\xBD\"}\n\n");
}

TEST(GatewayErrors, HttpStatusAndShapePerCode) {
  struct Case {
    absl::Status status;
    int http;
    const char* type;
  };
  const Case cases[] = {
      {absl::InvalidArgumentError("bad"), 400, "invalid_request_error"},
      {absl::OutOfRangeError("far"), 400, "invalid_request_error"},
      {absl::NotFoundError("none"), 404, "not_found_error"},
      {absl::ResourceExhaustedError("full"), 429, "rate_limit_error"},
      {absl::UnavailableError("down"), 503, "service_unavailable_error"},
      {absl::DeadlineExceededError("slow"), 504, "timeout_error"},
      {absl::InternalError("bug"), 500, "internal_server_error"},
      {absl::UnknownError("?"), 500, "internal_server_error"},
  };
  for (const Case& c : cases) {
    const ApiError e = FromStatus(c.status);
    EXPECT_EQ(e.http_status, c.http) << c.status;
    EXPECT_EQ(e.type, c.type) << c.status;
    EXPECT_EQ(e.message, c.status.message());
  }
  const Json j = ErrorJson(FromStatus(InvalidField("n", "'n' must be 1")));
  EXPECT_EQ(j, Json({{"error",
                      {{"message", "'n' must be 1"},
                       {"type", "invalid_request_error"},
                       {"param", "n"},
                       {"code", nullptr}}}}));
  EXPECT_EQ(ErrorJson(FromStatus(absl::UnavailableError("x")))["error"]["param"], nullptr);
  EXPECT_EQ(ErrorJson(FromStatus(absl::UnavailableError("x")))["error"]["code"], "unavailable");
}

}  // namespace
}  // namespace tandem::gateway
