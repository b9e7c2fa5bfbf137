// The Responses API's pure parts (issue 25 item 6): request bodies -> chat messages and options
// (responses_request.h), the response object and the streamed events (responses_answer.h), and
// the store behind previous_response_id (response_store.h).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "response_store.h"
#include "tandem/gateway/api_error.h"
#include "tandem/gateway/responses_answer.h"
#include "tandem/gateway/responses_request.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;

absl::StatusOr<ResponsesRequest> Parse(const Json& body) {
  return ParseResponsesRequest(body.dump());
}

// The param of a refused body.
std::string RefusedParam(const Json& body) {
  absl::StatusOr<ResponsesRequest> r = Parse(body);
  EXPECT_FALSE(r.ok()) << body.dump();
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  return ParamOf(r.status());
}

TEST(ResponsesRequest, AStringInputIsOneUserMessage) {
  absl::StatusOr<ResponsesRequest> r =
      Parse({{"model", "m"}, {"input", "Hello"}, {"max_output_tokens", 32},
             {"instructions", "Be brief."}, {"temperature", 0.5}, {"stream", true}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->input, Json::array({{{"role", "user"}, {"content", "Hello"}}}));
  EXPECT_EQ(r->instructions, "Be brief.");
  EXPECT_EQ(r->chat.endpoint, Endpoint::kResponses);
  EXPECT_EQ(r->chat.max_tokens, 32);
  EXPECT_TRUE(r->chat.stream);
  EXPECT_FLOAT_EQ(r->chat.generate.temperature(), 0.5f);
  EXPECT_TRUE(r->store);
  EXPECT_TRUE(r->previous_response_id.empty());
  EXPECT_TRUE(r->chat.ignored_fields.empty());
}

TEST(ResponsesRequest, ItemsBecomeChatMessagesWithTheirTextParts) {
  // As the Vercel AI SDK sends a conversation: developer/system text, user input_text parts,
  // the assistant's output_text.
  const Json input = Json::array(
      {{{"role", "developer"}, {"content", "You answer."}},
       {{"role", "user"},
        {"content", Json::array({{{"type", "input_text"}, {"text", "Once "}},
                                 {{"type", "input_text"}, {"text", "upon"}}})}},
       {{"type", "message"},
        {"role", "assistant"},
        {"content", Json::array({{{"type", "output_text"}, {"text", "a time"}}})}}});
  absl::StatusOr<ResponsesRequest> r =
      Parse({{"input", input}, {"previous_response_id", "resp_1"}, {"store", false},
             {"metadata", {{"k", "v"}}}, {"include", Json::array()}, {"user", "u"},
             {"tools", Json::array()}, {"tool_choice", "auto"}, {"truncation", "disabled"},
             {"text", {{"format", {{"type", "text"}}}}}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->input, Json::array({{{"role", "system"}, {"content", "You answer."}},
                                   {{"role", "user"}, {"content", "Once upon"}},
                                   {{"role", "assistant"}, {"content", "a time"}}}));
  EXPECT_EQ(r->previous_response_id, "resp_1");
  EXPECT_FALSE(r->store);
  EXPECT_EQ(r->metadata, Json({{"k", "v"}}));
  EXPECT_TRUE(r->chat.ignored_fields.empty());
}

TEST(ResponsesRequest, WhatTandemCannotHonourIsRefusedNamingTheField) {
  EXPECT_EQ(RefusedParam({{"model", "m"}}), "input");
  EXPECT_EQ(RefusedParam({{"input", Json::array()}}), "input");
  EXPECT_EQ(RefusedParam({{"input", 3}}), "input");
  EXPECT_EQ(RefusedParam({{"input", Json::array({{{"type", "function_call_output"},
                                                   {"call_id", "c"}, {"output", "x"}}})}}),
            "input[0].type");
  EXPECT_EQ(RefusedParam({{"input", Json::array({{{"role", "tool"}, {"content", "x"}}})}}),
            "input[0].role");
  EXPECT_EQ(RefusedParam({{"input", Json::array({{{"role", "user"},
                                                   {"content", Json::array({{{"type",
                                                                              "input_image"},
                                                                             {"image_url",
                                                                              "u"}}})}}})}}),
            "input[0].content[0].type");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"tools", Json::array({{{"type", "function"}}})}}),
            "tools");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"background", true}}), "background");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"conversation", "c"}}), "conversation");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"max_output_tokens", 0}}), "max_output_tokens");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}}}}}}),
            "text.format");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"top_logprobs", 3}}), "top_logprobs");
  Json metadata = Json::object();
  for (int i = 0; i < 17; ++i) metadata[std::to_string(i)] = "v";
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"metadata", metadata}}), "metadata");
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"metadata", {{"k", 1}}}}), "metadata");
  // The fields shared with chat completions keep their checks.
  EXPECT_EQ(RefusedParam({{"input", "x"}, {"temperature", -1}}), "temperature");
}

v1::TokenDelta Delta(const std::string& text, int64_t index) {
  v1::TokenDelta d;
  d.set_text(text);
  d.set_index(index);
  return d;
}

v1::GenerateFinal Final(v1::FinishReason reason) {
  v1::GenerateFinal f;
  f.set_finish_reason(reason);
  f.mutable_usage()->set_prompt_tokens(7);
  f.mutable_usage()->set_completion_tokens(3);
  f.mutable_usage()->set_total_tokens(10);
  f.mutable_usage()->set_cached_tokens(4);
  f.set_mode("gpu");
  return f;
}

ResponsesEcho Echo() {
  ResponsesEcho echo;
  echo.instructions = "Be brief.";
  echo.max_output_tokens = 3;
  echo.temperature = 0;
  echo.previous_response_id = "resp_prev";
  return echo;
}

TEST(ResponsesAnswer, TheResponseObject) {
  ResponsesAnswer answer("stories260k", 1700000000, Echo());
  EXPECT_EQ(answer.id().rfind("resp_", 0), 0u);
  EXPECT_EQ(answer.id().size(), 5u + 48u);
  answer.Append(Delta("Once", 0));
  answer.Append(Delta(" upon", 1));
  answer.Append(Delta(" a", 1));   // held-back text of token 1
  const Json done = answer.Response(Final(v1::FINISH_REASON_EOS));
  EXPECT_EQ(done["object"], "response");
  EXPECT_EQ(done["status"], "completed");
  EXPECT_EQ(done["model"], "stories260k");
  EXPECT_EQ(done["created_at"], 1700000000);
  EXPECT_EQ(done["instructions"], "Be brief.");
  EXPECT_EQ(done["previous_response_id"], "resp_prev");
  EXPECT_EQ(done["max_output_tokens"], 3);
  EXPECT_TRUE(done["incomplete_details"].is_null());
  ASSERT_EQ(done["output"].size(), 1u);
  const Json& message = done["output"][0];
  EXPECT_EQ(message["type"], "message");
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["status"], "completed");
  EXPECT_EQ(message["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(message["content"][0]["type"], "output_text");
  EXPECT_EQ(message["content"][0]["text"], "Once upon a");
  EXPECT_EQ(message["content"][0]["annotations"], Json::array());
  EXPECT_EQ(done["usage"], Json({{"input_tokens", 7},
                                 {"input_tokens_details", {{"cached_tokens", 4}}},
                                 {"output_tokens", 3},
                                 {"output_tokens_details", {{"reasoning_tokens", 0}}},
                                 {"total_tokens", 10},
                                 {"degraded_steps", 0}}));
  EXPECT_EQ(done["tandem"]["mode"], "gpu");
  // max_output_tokens reached: incomplete, as OpenAI says it.
  const Json cut = answer.Response(Final(v1::FINISH_REASON_LENGTH));
  EXPECT_EQ(cut["status"], "incomplete");
  EXPECT_EQ(cut["incomplete_details"], Json({{"reason", "max_output_tokens"}}));
  EXPECT_EQ(cut["output"][0]["status"], "incomplete");
}

// The SSE text as (event name, data) pairs, checking that each event's name is its type.
std::vector<Json> EventsOf(const std::string& sse) {
  std::vector<Json> events;
  for (absl::string_view block : absl::StrSplit(sse, "\n\n", absl::SkipEmpty())) {
    std::vector<std::string> lines = absl::StrSplit(block, '\n');
    EXPECT_EQ(lines.size(), 2u) << block;
    if (lines.size() != 2) continue;
    EXPECT_EQ(lines[0].rfind("event: ", 0), 0u);
    EXPECT_EQ(lines[1].rfind("data: ", 0), 0u);
    Json data = Json::parse(lines[1].substr(6));
    EXPECT_EQ(data["type"], lines[0].substr(7));
    events.push_back(std::move(data));
  }
  return events;
}

TEST(ResponsesAnswer, TheStreamedEventsInOrder) {
  ResponsesAnswer answer("stories260k", 1700000000, Echo());
  std::string sse = answer.StreamStart();
  sse += answer.StreamToken(Delta("Once", 0));
  EXPECT_EQ(answer.StreamToken(Delta("", 1)), "");   // no text, no event
  sse += answer.StreamToken(Delta(" upon", 2));
  sse += answer.StreamFinish(Final(v1::FINISH_REASON_STOP));
  const std::vector<Json> events = EventsOf(sse);
  std::vector<std::string> types;
  for (size_t i = 0; i < events.size(); ++i) {
    types.push_back(events[i]["type"]);
    EXPECT_EQ(events[i]["sequence_number"], i);
  }
  EXPECT_EQ(types, (std::vector<std::string>{
                       "response.created", "response.in_progress", "response.output_item.added",
                       "response.content_part.added", "response.output_text.delta",
                       "response.output_text.delta", "response.output_text.done",
                       "response.content_part.done", "response.output_item.done",
                       "response.completed"}));
  EXPECT_EQ(events[0]["response"]["status"], "in_progress");
  EXPECT_EQ(events[0]["response"]["id"], answer.id());
  const std::string item = events[2]["item"]["id"];
  EXPECT_EQ(events[4]["item_id"], item);
  EXPECT_EQ(events[4]["delta"], "Once");
  EXPECT_EQ(events[5]["delta"], " upon");
  EXPECT_EQ(events[6]["text"], "Once upon");
  EXPECT_EQ(events[9]["response"]["output"][0]["content"][0]["text"], "Once upon");
  EXPECT_EQ(events[9]["response"]["usage"]["output_tokens"], 3);

  const std::vector<Json> error =
      EventsOf(answer.StreamError(ApiError{503, "no worker", "service_unavailable_error", "", ""}));
  ASSERT_EQ(error.size(), 1u);
  EXPECT_EQ(error[0]["type"], "error");
  EXPECT_EQ(error[0]["message"], "no worker");
  EXPECT_EQ(error[0]["code"], "service_unavailable_error");
}

ResponseStore::Entry Entry(const std::string& principal, const std::string& text) {
  return {principal, Json::array({{{"role", "user"}, {"content", text}}}),
          Json{{"id", "x"}}};
}

TEST(ResponseStore, EntriesBelongToTheirPrincipal) {
  ResponseStore store(10, 1 << 20);
  ASSERT_TRUE(store.Put("resp_a", Entry("alice", "hi")));
  absl::StatusOr<std::shared_ptr<const ResponseStore::Entry>> got = store.Get("resp_a", "alice");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)->conversation[0]["content"], "hi");
  // Another principal: exactly the answer for an unknown id.
  const absl::Status other = store.Get("resp_a", "mallory").status();
  const absl::Status unknown = store.Get("resp_zz", "alice").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other.message(), "Response with id 'resp_a' not found.");
  EXPECT_EQ(unknown.message(), "Response with id 'resp_zz' not found.");
  EXPECT_EQ(store.Delete("resp_a", "mallory").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.Delete("resp_a", "alice").ok());
  EXPECT_EQ(store.Get("resp_a", "alice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.entries(), 0u);
  EXPECT_EQ(store.bytes(), 0u);
}

TEST(ResponseStore, LeastRecentlyUsedGoFirstPastEitherBound) {
  ResponseStore by_count(2, 1 << 20);
  ASSERT_TRUE(by_count.Put("a", Entry("p", "1")));
  ASSERT_TRUE(by_count.Put("b", Entry("p", "2")));
  ASSERT_TRUE(by_count.Get("a", "p").ok());   // a is now the most recent
  ASSERT_TRUE(by_count.Put("c", Entry("p", "3")));
  EXPECT_TRUE(by_count.Get("a", "p").ok());
  EXPECT_FALSE(by_count.Get("b", "p").ok());
  EXPECT_TRUE(by_count.Get("c", "p").ok());

  const size_t one = [] {
    ResponseStore probe(10, 1 << 20);
    probe.Put("a", Entry("p", std::string(1000, 'x')));
    return probe.bytes();
  }();
  ResponseStore by_bytes(100, 2 * one + one / 2);
  ASSERT_TRUE(by_bytes.Put("a", Entry("p", std::string(1000, 'x'))));
  ASSERT_TRUE(by_bytes.Put("b", Entry("p", std::string(1000, 'y'))));
  ASSERT_TRUE(by_bytes.Put("c", Entry("p", std::string(1000, 'z'))));
  EXPECT_EQ(by_bytes.entries(), 2u);
  EXPECT_FALSE(by_bytes.Get("a", "p").ok());
  EXPECT_LE(by_bytes.bytes(), 2 * one + one / 2);
  // One entry larger than the whole budget is not stored, and evicts nothing.
  EXPECT_FALSE(by_bytes.Put("huge", Entry("p", std::string(10 * one, 'h'))));
  EXPECT_EQ(by_bytes.entries(), 2u);
}

}  // namespace
}  // namespace tandem::gateway
