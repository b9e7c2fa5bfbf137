// Renders every case of fixtures.json (made by make_fixtures.py with python3-jinja2, as
// transformers' apply_chat_template renders) through RenderChat and requires the same bytes, or
// an error carrying jinja2's message for conversations the template refuses.
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/chat_template/chat_template.h"

namespace tandem::chat_template {
namespace {

using Json = nlohmann::ordered_json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TestDir() { return TANDEM_CHAT_TEMPLATE_TEST_DIR; }

TEST(ChatTemplateFixtures, EveryCaseMatchesJinja2) {
  std::string text = ReadFile(TestDir() + "/fixtures.json");
  ASSERT_FALSE(text.empty()) << "missing " << TestDir() << "/fixtures.json";
  Json fixtures = Json::parse(text);

  std::map<std::string, Template> templates;
  for (const auto& [name, info] : fixtures["templates"].items()) {
    std::string source = ReadFile(TestDir() + "/" + info["file"].get<std::string>());
    ASSERT_FALSE(source.empty()) << name;
    auto parsed = Template::Parse(source);
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    templates.emplace(name, *parsed);
  }

  int rendered = 0, refused = 0;
  for (const Json& c : fixtures["cases"]) {
    const std::string label = c["template"].get<std::string>() + " " + c["name"].get<std::string>();
    ChatOptions options;
    options.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    options.bos_token = c["bos_token"].get<std::string>();
    options.eos_token = c["eos_token"].get<std::string>();
    options.tools = c["tools"];
    options.extra = c["extra"];
    auto out = RenderChat(templates.at(c["template"].get<std::string>()), c["messages"], options);
    if (c.contains("expected")) {
      ASSERT_TRUE(out.ok()) << label << ": " << out.status();
      EXPECT_EQ(*out, c["expected"].get<std::string>()) << label;
      ++rendered;
    } else {
      ASSERT_FALSE(out.ok()) << label << " rendered where jinja2 refused: " << *out;
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << label;
      EXPECT_NE(std::string(out.status().message()).find(c["error"].get<std::string>()),
                std::string::npos)
          << label << ": " << out.status() << " lacks jinja2's \"" << c["error"] << "\"";
      ++refused;
    }
  }
  // The fixture set is not allowed to shrink silently.
  EXPECT_GE(rendered, 150);
  EXPECT_GE(refused, 15);
}

// Engine snippets (whitespace control, loops, scoping, filters, tests, methods, Python
// formatting of values, errors) rendered directly with Template::Render.
TEST(ChatTemplateFixtures, EverySnippetMatchesJinja2) {
  Json fixtures = Json::parse(ReadFile(TestDir() + "/fixtures.json"));
  int checked = 0;
  for (const Json& s : fixtures["snippets"]) {
    const std::string name = s["name"].get<std::string>();
    auto parsed = Template::Parse(s["template"].get<std::string>());
    if (s.contains("error") && s["syntax_error"].get<bool>()) {
      ASSERT_FALSE(parsed.ok()) << name << " parsed where jinja2 reports: " << s["error"];
      EXPECT_NE(std::string(parsed.status().message()).find("syntax error at line"),
                std::string::npos)
          << name << ": " << parsed.status();
      ++checked;
      continue;
    }
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status();
    auto out = parsed->Render(s["context"]);
    if (s.contains("expected")) {
      ASSERT_TRUE(out.ok()) << name << ": " << out.status();
      EXPECT_EQ(*out, s["expected"].get<std::string>()) << name;
    } else {
      ASSERT_FALSE(out.ok()) << name << " rendered where jinja2 raised: " << *out;
      EXPECT_NE(std::string(out.status().message()).find(s["error"].get<std::string>()),
                std::string::npos)
          << name << ": " << out.status() << " lacks jinja2's \"" << s["error"] << "\"";
    }
    ++checked;
  }
  EXPECT_GE(checked, 35);
}

}  // namespace
}  // namespace tandem::chat_template
