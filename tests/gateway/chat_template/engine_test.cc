// Unit tests of the chat template engine's contracts that a jinja2 comparison cannot show:
// error positions and codes, the RenderLimits bounds, RenderChat's input checks, concurrency.
// (Rendering semantics are compared with python3-jinja2 in fixtures_test.cc.)
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/chat_template/chat_template.h"

namespace tandem::chat_template {
namespace {

using Json = nlohmann::ordered_json;

std::string Render(const std::string& source, const Json& context = Json::object(),
                   const RenderLimits& limits = {}) {
  auto t = Template::Parse(source);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return "";
  auto out = t->Render(context, limits);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

absl::Status RenderError(const std::string& source, const Json& context = Json::object(),
                         const RenderLimits& limits = {}) {
  auto t = Template::Parse(source);
  if (!t.ok()) return t.status();
  auto out = t->Render(context, limits);
  EXPECT_FALSE(out.ok()) << "rendered: " << *out;
  return out.ok() ? absl::OkStatus() : out.status();
}

TEST(ChatTemplateEngine, SyntaxErrorsNameLineAndColumn) {
  auto t = Template::Parse("line one\n{% if x %}\n  {{ a + }}\n{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(t.status().message()).find("line 3, column 10"), std::string::npos)
      << t.status();

  t = Template::Parse("{% for m in messages %}\n{{ m }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("'endfor'"), std::string::npos) << t.status();

  t = Template::Parse("ok\n  {% frob %}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("line 2, column 6: unknown tag 'frob'"),
            std::string::npos)
      << t.status();

  // As jinja2 (which fails compiling it): loop controls only inside a loop, not in a macro.
  t = Template::Parse("{% if true %}{% break %}{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("'break' outside loop"), std::string::npos);
  t = Template::Parse("{% for x in y %}{% macro m() %}{% continue %}{% endmacro %}{% endfor %}");
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(
      Template::Parse("{% for x in y %}{% if x %}{% continue %}{% endif %}{% endfor %}").ok());

  t = Template::Parse("{{ 'unterminated }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("unterminated string"), std::string::npos);
}

TEST(ChatTemplateEngine, RuntimeErrorsNameTheLine) {
  absl::Status s = RenderError("a\nb\n{{ 'x' + 1 }}");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "chat template error at line 3: can only concatenate str (not \"int\") to str");
}

TEST(ChatTemplateEngine, RaiseExceptionPassesTheMessageThrough) {
  absl::Status s =
      RenderError("{% for m in [1] %}\n{{ raise_exception('Roles must alternate') }}{% endfor %}");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "Roles must alternate");
}

TEST(ChatTemplateEngine, OutputBound) {
  RenderLimits limits;
  limits.max_output_bytes = 1000;
  EXPECT_EQ(Render("{% for i in range(10) %}0123456789{% endfor %}", Json::object(), limits).size(),
            100u);
  absl::Status s =
      RenderError("{% for i in range(200) %}0123456789{% endfor %}", Json::object(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // A single string built by an operator is bounded before it is allocated.
  s = RenderError("{{ 'ab' * 100000000000 }}", Json::object(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  s = RenderError("{% set s = 'x' * 600 %}{{ (s ~ s) | length }}", Json::object(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
}

TEST(ChatTemplateEngine, LoopBound) {
  RenderLimits limits;
  limits.max_loop_iterations = 1000;
  EXPECT_EQ(Render("{% for i in range(500) %}{% endfor %}ok", Json::object(), limits), "ok");
  // range() is refused before its list is built.
  absl::Status s =
      RenderError("{% for i in range(1000000000000) %}{% endfor %}", Json::object(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Nested loops count together.
  s = RenderError("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
                  Json::object(), limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
}

TEST(ChatTemplateEngine, DepthBound) {
  // Unbounded macro recursion ends with an error, not a stack overflow.
  absl::Status s = RenderError("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Deeply nested source is refused by the parser.
  std::string deep(5000, '(');
  deep = "{{ " + deep + "1" + std::string(5000, ')') + " }}";
  auto t = Template::Parse(deep);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("nested too deeply"), std::string::npos);
  // Deep JSON input renders (tojson nests fine within its own bound).
  Json v = Json::array();
  for (int i = 0; i < 100; ++i) v = Json::array({v});
  EXPECT_EQ(Render("{{ v | tojson | length }}", Json{{"v", v}}), "202");
}

TEST(ChatTemplateEngine, ValueNestingBound) {
  // A template cannot build a value so deep that printing, comparing or freeing it would
  // exhaust the stack.
  absl::Status s = RenderError(
      "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}"
      "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Nor a reference cycle through a namespace.
  s = RenderError("{% set ns = namespace(a=1) %}{% set ns.self = [ns] %}{{ ns }}");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("cannot hold a namespace"), std::string::npos) << s;
  // Input JSON deeper than the bound is refused before rendering.
  Json deep = Json::array();
  for (int i = 0; i < 600; ++i) deep = Json::array({deep});
  auto t = Template::Parse("{{ x | length }}");
  ASSERT_TRUE(t.ok());
  auto out = t->Render(Json{{"x", deep}});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  // A namespace may hold lists of namespaces' neighbours, and lists may hold namespaces.
  EXPECT_EQ(Render("{% set ns = namespace(l=[]) %}{% set ns.l = ns.l + [1] %}{{ [ns][0].l }}"),
            "[1]");
}

TEST(ChatTemplateEngine, SourceSizeBound) {
  auto t = Template::Parse(std::string((1 << 20) + 1, 'x'));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateEngine, StrftimeNow) {
  std::string year = Render("{{ strftime_now('%Y') }}");
  ASSERT_EQ(year.size(), 4u);
  EXPECT_GE(std::stoi(year), 2024);
  EXPECT_EQ(Render("{{ strftime_now('%d %b %Y') | length }}"), "11");
}

TEST(ChatTemplateEngine, ContextKeyOrderIsKept) {
  // tojson shows keys in the order the request gave them (ordered_json), as Python dicts do.
  Json tool = Json::parse(R"({"type": "function", "function": {"name": "f", "parameters": {}}})");
  EXPECT_EQ(Render("{{ t | tojson }}", Json{{"t", tool}}),
            R"({"type": "function", "function": {"name": "f", "parameters": {}}})");
}

TEST(ChatTemplateEngine, RenderChatNormalizesMessages) {
  auto t = Template::Parse(
      "{% for m in messages %}{{ m.role }}:{{ m.content }}"
      "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %};"
      "{% endfor %}{{ add_generation_prompt }}{{ bos_token }}{{ tools is none }}{{ extra_var }}");
  ASSERT_TRUE(t.ok()) << t.status();
  Json messages = Json::parse(R"([
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": null,
     "tool_calls": [{"id": "1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}
  ])");
  ChatOptions options;
  options.add_generation_prompt = false;
  options.bos_token = "<s>";
  options.extra = Json{{"extra_var", "!"}};
  auto out = RenderChat(*t, messages, options);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "user:a\nb;assistant:None{\"x\": 1};False<s>True!");
}

TEST(ChatTemplateEngine, RenderChatRefusesBadInput) {
  auto t = Template::Parse("{{ messages | length }}");
  ASSERT_TRUE(t.ok());
  ChatOptions options;
  EXPECT_EQ(RenderChat(*t, Json::object(), options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RenderChat(*t, Json::parse(R"([{"content": "no role"}])"), options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RenderChat(*t, Json::parse(R"([{"role": "user", "content": [{"type": "image_url"}]}])"),
                       options)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  Json bad_args = Json::parse(R"([{"role": "assistant", "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}])");
  EXPECT_EQ(RenderChat(*t, bad_args, options).status().code(), absl::StatusCode::kInvalidArgument);
  options.tools = Json::object();
  EXPECT_EQ(RenderChat(*t, Json::array(), options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateEngine, ConcurrentRendersOfOneTemplate) {
  auto t = Template::Parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m %}{% endfor %}"
      "{{ ns.n }}");
  ASSERT_TRUE(t.ok());
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 200; ++k) {
        Json messages = Json::array({i, i, i});
        auto out = t->Render(Json{{"messages", messages}});
        results[i] = out.ok() ? *out : out.status().ToString();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(results[i], std::to_string(3 * i));
}

}  // namespace
}  // namespace tandem::chat_template
