// OpenAI request bodies -> GenerateRequest: every accepted field lands where the worker reads
// it, defaults are OpenAI's, and each bad input is INVALID_ARGUMENT naming its field.
#include "tandem/gateway/openai_request.h"

#include <gtest/gtest.h>

#include <cctype>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "tandem/gateway/api_error.h"

namespace tandem::gateway {
namespace {

TEST(GatewayCompletionRequest, MapsEveryFieldToTheGenerateRequest) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(R"({
    "model": "stories", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.5,
    "top_p": 0.9, "stop": ["\n", "The end"], "seed": 7, "n": 1, "user": "u1",
    "stream": true, "stream_options": {"include_usage": true}, "logprobs": 3,
    "mode": "hybrid", "beta": 0.5, "window": 64, "sink": 4, "selection": "pages",
    "select_tokens": 128, "dense_layers": 1, "session_id": "s-1", "ignore_eos": true,
    "top_k": -1, "return_progress": true, "some_future_field": {"x": 1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->endpoint, Endpoint::kCompletions);
  EXPECT_EQ(r->model, "stories");
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_TRUE(r->return_progress);
  EXPECT_EQ(r->max_tokens, 32);
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 3);
  const v1::GenerateRequest& g = r->generate;
  EXPECT_EQ(g.prompt_text(), "Once upon a time");
  EXPECT_FLOAT_EQ(g.temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.top_p(), 0.9f);
  ASSERT_EQ(g.stop_size(), 2);
  EXPECT_EQ(g.stop(0), "\n");
  EXPECT_EQ(g.stop(1), "The end");
  EXPECT_EQ(g.seed(), 7u);
  EXPECT_EQ(g.mode(), "hybrid");
  EXPECT_FLOAT_EQ(g.beta(), 0.5f);
  EXPECT_EQ(g.window(), 64);
  EXPECT_EQ(g.sink(), 4);
  EXPECT_EQ(g.selection(), "pages");
  EXPECT_EQ(g.select_tokens(), 128);
  EXPECT_EQ(g.dense_layers(), 1);
  EXPECT_EQ(g.session_id(), "s-1");
  EXPECT_TRUE(g.ignore_eos());
  EXPECT_EQ(g.top_k(), 0);  // -1 = no limit, as vLLM
  EXPECT_TRUE(g.logprobs());
  EXPECT_EQ(g.top_logprobs(), 3);
  EXPECT_EQ(g.max_tokens(), 0);  // filled by the handler (it knows the context)
  EXPECT_EQ(r->ignored_fields, std::vector<std::string>{"some_future_field"});
}

TEST(GatewayCompletionRequest, DefaultsAreOpenAis) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(R"({"prompt": "Hi", "stop": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->max_tokens.has_value());
  EXPECT_FLOAT_EQ(r->generate.temperature(), 1.0f);  // OpenAI samples at 1 by default
  EXPECT_FALSE(r->generate.has_seed());
  EXPECT_FALSE(r->generate.has_beta());
  EXPECT_FALSE(r->generate.logprobs());
  EXPECT_EQ(r->generate.stop_size(), 0);
  EXPECT_EQ(r->generate.mode(), "");
}

TEST(GatewayCompletionRequest, PromptAsTokenIdsAndOneElementLists) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(R"({"prompt": [1, 403, 407]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->generate.has_prompt_ids());
  EXPECT_EQ(r->generate.prompt_ids().ids_size(), 3);
  EXPECT_EQ(r->generate.prompt_ids().ids(1), 403);

  r = ParseCompletionRequest(R"({"prompt": ["one prompt"]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.prompt_text(), "one prompt");

  r = ParseCompletionRequest(R"({"prompt": [[5, 6]], "max_tokens": 16.0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.prompt_ids().ids_size(), 2);
  EXPECT_EQ(r->max_tokens, 16);
}

// Each bad body: INVALID_ARGUMENT whose param names the field, with a message that says what
// is wrong.
struct BadBody {
  const char* body;
  const char* param;
  const char* message_part;
};

void PrintTo(const BadBody& b, std::ostream* os) { *os << b.body; }

// top_p 0 keeps only the most probable token (OpenAI), not "unset"; any integer seed is taken;
// vLLM's extras at their neutral values are accepted.
TEST(GatewayCompletionRequest, TopPZeroSeedsAndNeutralExtras) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(
      R"({"prompt": "x", "top_p": 0, "seed": -5, "repetition_penalty": 1, "min_p": 0,
          "min_tokens": 0, "length_penalty": 1, "stop_token_ids": [], "use_beam_search": false,
          "guided_decoding_backend": "xgrammar"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->generate.top_p(), 0.0f);
  EXPECT_LT(r->generate.top_p(), 1e-20f);
  EXPECT_EQ(r->generate.seed(), static_cast<uint64_t>(int64_t{-5}));
  EXPECT_TRUE(r->ignored_fields.empty());
}

// The model's recommended sampling (generation_config.json, via ModelInfoResponse) fills what
// the request leaves out, and only that; without it OpenAI's defaults stay.
TEST(GatewayCompletionRequest, ModelDefaultsFillOnlyWhatTheRequestLeftOut) {
  v1::ModelInfoResponse info;
  info.set_default_temperature(0.6f);
  info.set_default_top_p(0.9f);
  info.set_default_top_k(20);
  absl::StatusOr<OpenAiRequest> bare = ParseCompletionRequest(R"({"prompt": "x"})");
  ASSERT_TRUE(bare.ok()) << bare.status();
  ApplyModelDefaults(info, &*bare);
  EXPECT_FLOAT_EQ(bare->generate.temperature(), 0.6f);
  EXPECT_FLOAT_EQ(bare->generate.top_p(), 0.9f);
  EXPECT_EQ(bare->generate.top_k(), 20);
  absl::StatusOr<OpenAiRequest> given = ParseCompletionRequest(
      R"({"prompt": "x", "temperature": 0, "top_p": 1, "top_k": -1})");
  ASSERT_TRUE(given.ok()) << given.status();
  ApplyModelDefaults(info, &*given);
  EXPECT_FLOAT_EQ(given->generate.temperature(), 0.0f);
  EXPECT_FLOAT_EQ(given->generate.top_p(), 1.0f);
  EXPECT_EQ(given->generate.top_k(), 0);
  absl::StatusOr<OpenAiRequest> plain = ParseCompletionRequest(R"({"prompt": "x"})");
  ASSERT_TRUE(plain.ok()) << plain.status();
  ApplyModelDefaults(v1::ModelInfoResponse(), &*plain);
  EXPECT_FLOAT_EQ(plain->generate.temperature(), 1.0f);
  EXPECT_FLOAT_EQ(plain->generate.top_p(), 0.0f);   // the proto's unset: no cut
  EXPECT_EQ(plain->generate.top_k(), 0);
}

class GatewayCompletionRequestErrors : public ::testing::TestWithParam<BadBody> {};

TEST_P(GatewayCompletionRequestErrors, NameTheField) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(GetParam().body);
  ASSERT_FALSE(r.ok()) << GetParam().body;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(r.status()), GetParam().param) << r.status();
  EXPECT_NE(r.status().message().find(GetParam().message_part), std::string::npos) << r.status();
}

INSTANTIATE_TEST_SUITE_P(
    Bodies, GatewayCompletionRequestErrors,
    ::testing::Values(
        BadBody{R"({"prompt": "x", "n": 2})", "n", "'n' must be 1"},
        BadBody{R"({"prompt": "x", "max_tokens": "16"})", "max_tokens", "must be an integer"},
        BadBody{R"({"prompt": "x", "max_tokens": 0})", "max_tokens", "must be in 1.."},
        BadBody{R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens", "must be an integer"},
        BadBody{R"({"prompt": "x", "temperature": "hot"})", "temperature", "must be a number"},
        BadBody{R"({"prompt": "x", "stream": "yes"})", "stream", "must be a boolean"},
        BadBody{R"({"prompt": "x", "stop": 3})", "stop", "string or a list"},
        BadBody{R"({"prompt": "x", "stop": ["a", 1]})", "stop", "string or a list"},
        BadBody{R"({"prompt": "x", "temperature": -1})", "temperature", "0..100"},
        BadBody{R"({"prompt": "x", "top_p": 1.5})", "top_p", "0..1"},
        BadBody{R"({"prompt": "x", "top_p": -0.1})", "top_p", "0..1"},
        BadBody{R"({"prompt": "x", "guided_json": {"type": "object"}})", "guided_json",
                "not supported"},
        BadBody{R"({"prompt": "x", "guided_choice": ["a", "b"]})", "guided_choice",
                "not supported"},
        BadBody{R"({"prompt": "x", "structured_outputs": {"regex": "a+"}})", "structured_outputs",
                "not supported"},
        BadBody{R"({"prompt": "x", "repetition_penalty": 1.3})", "repetition_penalty",
                "other than 1"},
        BadBody{R"({"prompt": "x", "min_p": 0.1})", "min_p", "other than 0"},
        BadBody{R"({"prompt": "x", "min_tokens": 5})", "min_tokens", "other than 0"},
        BadBody{R"({"prompt": "x", "stop_token_ids": [5]})", "stop_token_ids", "not supported"},
        BadBody{R"({"prompt": "x", "use_beam_search": true})", "use_beam_search",
                "not supported"},
        BadBody{R"({"prompt": "x", "echo": true})", "echo", "not supported"},
        BadBody{R"({"prompt": "x", "logprobs": 6})", "logprobs", "0..5"},
        BadBody{R"({"prompt": "x", "logprobs": true})", "logprobs", "0..5"},
        BadBody{R"({"prompt": "x", "best_of": 2})", "best_of", "not supported"},
        BadBody{R"({"prompt": "x", "presence_penalty": 0.5})", "presence_penalty", "not supported"},
        BadBody{R"({"prompt": "x", "logit_bias": {"1": 5}})", "logit_bias", "not supported"},
        BadBody{R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options",
                "only allowed with stream"},
        BadBody{R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})",
                "stream_options.include_usage", "boolean"},
        BadBody{R"({"prompt": "x", "window": "big"})", "window", "must be an integer"},
        BadBody{R"({"prompt": "x", "mode": 1})", "mode", "must be a string"},
        BadBody{R"({"prompt": "x", "top_k": -2})", "top_k", "-1"},
        BadBody{R"({"max_tokens": 4})", "prompt", "'prompt' is required"},
        BadBody{R"({"prompt": ""})", "prompt", "must not be empty"},
        BadBody{R"({"prompt": ["a", "b"]})", "prompt", "one prompt per request"},
        BadBody{R"({"prompt": [1, -2]})", "prompt", "token ids"},
        BadBody{R"({"prompt": {"text": "x"}})", "prompt", "a string or a list"}),
    [](const ::testing::TestParamInfo<BadBody>& info) {
      std::string name = std::string(info.param.param) + "_" + std::to_string(info.index);
      for (char& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

TEST(GatewayCompletionRequest, BadJsonAndNonObjects) {
  for (const char* body : {"", "{", "[1, 2]", "\"text\"", "{\"prompt\": \"x\",}"}) {
    absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
  }
  EXPECT_NE(ParseCompletionRequest("{").status().message().find("not valid JSON"),
            std::string::npos);
}

TEST(GatewayChatRequest, MapsMessagesLogprobsAndMaxCompletionTokens) {
  absl::StatusOr<OpenAiRequest> r = ParseChatRequest(R"({
    "model": "m", "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    "max_tokens": 100, "max_completion_tokens": 20, "logprobs": true, "top_logprobs": 2,
    "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
    "chat_template_kwargs": {"enable_thinking": false}, "temperature": 0})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->endpoint, Endpoint::kChatCompletions);
  EXPECT_EQ(r->max_tokens, 20);  // max_completion_tokens wins
  ASSERT_EQ(r->messages.size(), 2u);
  EXPECT_EQ(r->messages[0]["content"], "Be brief.");
  // Key order is kept (templates print messages with tojson).
  EXPECT_EQ(r->messages[0].begin().key(), "role");
  EXPECT_TRUE(r->tools.is_null());  // an empty list is no tools
  EXPECT_EQ(r->template_kwargs["enable_thinking"], false);
  EXPECT_TRUE(r->add_generation_prompt);
  EXPECT_TRUE(r->generate.logprobs());
  EXPECT_EQ(r->generate.top_logprobs(), 2);
  EXPECT_FLOAT_EQ(r->generate.temperature(), 0.0f);
  EXPECT_FALSE(r->generate.has_prompt_ids());
  EXPECT_TRUE(r->generate.prompt_text().empty());  // rendered later with the template
}

// Tools with tool_choice "none" are rendered into the prompt (the template gets them).
TEST(GatewayChatRequest, ToolsWithChoiceNoneAreTaken) {
  absl::StatusOr<OpenAiRequest> r = ParseChatRequest(
      R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
          "tools": [{"type": "function", "function": {"name": "f"}}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->tools.is_array());
  EXPECT_EQ(r->tools.size(), 1u);
}

TEST(GatewayChatRequest, Errors) {
  const BadBody cases[] = {
      {R"({"model": "m"})", "messages", "'messages' is required"},
      {R"({"messages": []})", "messages", "non-empty list"},
      {R"({"messages": ["hi"]})", "messages[0]", "must be an object"},
      {R"({"messages": [{"content": "hi"}]})", "messages[0].role", "must be a string"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content",
       "a string, a list of parts or null"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs",
       "needs 'logprobs': true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
           "top_logprobs": 21})",
       "top_logprobs", "0..20"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 3})", "n", "'n' must be 1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "tool_choice", "not supported"},
      // Tools with the default (auto) choice: calls would never be parsed out of the text.
      {R"({"messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}}]})",
       "tool_choice", "rendered into the prompt only"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
           "tools": [{"type": "function", "function": {"name": "f"}}]})",
       "tool_choice", "does not parse tool calls"},
      {R"({"messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_object"}})",
       "response_format", "not supported"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})",
       "max_completion_tokens", "1.."},
  };
  for (const BadBody& c : cases) {
    absl::StatusOr<OpenAiRequest> r = ParseChatRequest(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ParamOf(r.status()), c.param) << r.status();
    EXPECT_NE(r.status().message().find(c.message_part), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace tandem::gateway

namespace tandem::gateway {
namespace {

// A JSON list of `n` copies of `item`.
std::string ListOf(size_t n, const std::string& item) {
  std::string list = "[";
  for (size_t i = 0; i < n; ++i) list += (i > 0 ? "," : "") + item;
  return list + "]";
}

// Every list field is bounded: one entry past the bound is a 400 naming the field, the bound
// itself is taken (or refused for another reason, as logit_bias with entries is).
TEST(GatewayRequestBounds, ListFieldsOverTheirBoundAreRefusedNamingThem) {
  const std::string msg = R"({"role":"user","content":"x"})";
  const std::string one_msg = "[" + msg + "]";
  struct Case {
    std::string body;
    bool chat;
    const char* param;
  };
  std::string bias = "{";
  for (size_t i = 0; i <= kMaxLogitBiasEntries; ++i) {
    bias += (i > 0 ? "," : "") + ("\"" + std::to_string(i) + "\":1");
  }
  bias += "}";
  const Case cases[] = {
      {R"({"messages":)" + ListOf(kMaxMessages + 1, msg) + "}", true, "messages"},
      {R"({"messages":)" + one_msg + R"(,"tool_choice":"none","tools":)" +
           ListOf(kMaxTools + 1, R"({"type":"function","function":{"name":"f"}})") + "}",
       true, "tools"},
      {R"({"prompt":"x","stop":)" + ListOf(kMaxStopStrings + 1, R"("s")") + "}", false, "stop"},
      {R"({"prompt":"x","stop":")" + std::string(kMaxStopBytes + 1, 'a') + R"("})", false,
       "stop"},
      {R"({"prompt":"x","stop_token_ids":)" + ListOf(kMaxStopStrings + 1, "1") + "}", false,
       "stop_token_ids"},
      {R"({"prompt":"x","logit_bias":)" + bias + "}", false, "logit_bias"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<OpenAiRequest> r =
        c.chat ? ParseChatRequest(c.body) : ParseCompletionRequest(c.body);
    ASSERT_FALSE(r.ok()) << c.param;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.param;
    EXPECT_EQ(ParamOf(r.status()), c.param) << r.status();
    EXPECT_NE(r.status().message().find("at most"), std::string::npos) << r.status();
  }
  EXPECT_TRUE(ParseChatRequest(R"({"messages":)" + ListOf(kMaxMessages, msg) + "}").ok());
  EXPECT_TRUE(
      ParseCompletionRequest(R"({"prompt":"x","stop":)" + ListOf(kMaxStopStrings, R"("s")") + "}")
          .ok());
}

// The shapes that crashed or stalled the gateway: arrays nested 100000 deep in each field a
// request may nest, answered as a 400 without recursion.
TEST(GatewayRequestBounds, DeepNestingInAnyFieldIsA400) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& body :
       {R"({"prompt":)" + deep + "}", R"({"messages":)" + deep + "}",
        R"({"messages":[{"role":"user","content":)" + deep + "}]}",
        R"({"messages":[{"role":"user","content":"x"}],"tools":)" + deep + "}"}) {
    absl::StatusOr<OpenAiRequest> r = absl::StrContains(body, "messages")
                                          ? ParseChatRequest(body)
                                          : ParseCompletionRequest(body);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("nested deeper than"), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace tandem::gateway
