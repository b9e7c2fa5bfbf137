// ParseBoundedJson: the same document as nlohmann's own parser within bounds, refusals past
// them (a body nested 100000 deep, which overflowed the gateway's stack before), duplicate keys
// as Python's json takes them.
#include "tandem/gateway/bounded_json.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;

TEST(BoundedJson, BuildsWhatNlohmannBuilds) {
  const std::string text =
      R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],)"
      R"("z":1,"a":[1,-2,3.5,true,null,"s",{"k":[[]]}],"big":18446744073709551615,"e":{}})";
  absl::StatusOr<Json> parsed = ParseBoundedJson(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, Json::parse(text));
  EXPECT_EQ(parsed->dump(), Json::parse(text).dump());  // key order kept
  EXPECT_TRUE((*parsed)["big"].is_number_unsigned());
  ASSERT_TRUE(ParseBoundedJson("[1,2]").ok());
  EXPECT_TRUE(ParseBoundedJson("\"s\"")->is_string());
}

TEST(BoundedJson, ARepeatedKeyKeepsItsPlaceAndTakesTheLastValue) {
  absl::StatusOr<Json> parsed = ParseBoundedJson(R"({"a":1,"b":2,"a":{"x":3}})");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->dump(), R"({"a":{"x":3},"b":2})");
}

TEST(BoundedJson, DeepNestingIsRefusedNamingTheBound) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  absl::StatusOr<Json> parsed = ParseBoundedJson(deep);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("nested deeper than 128"), std::string::npos);
  // Within the bound it parses; one more level does not.
  JsonLimits limits;
  limits.max_depth = 3;
  EXPECT_TRUE(ParseBoundedJson(R"({"a":[{"b":1}]})", limits).ok());
  EXPECT_FALSE(ParseBoundedJson(R"({"a":[{"b":[1]}]})", limits).ok());
}

TEST(BoundedJson, KeysPerObjectAreBounded) {
  std::string text = "{";
  for (int i = 0; i < 20000; ++i) absl::StrAppend(&text, i > 0 ? "," : "", "\"", i, "\":1");
  text += "}";
  absl::StatusOr<Json> parsed = ParseBoundedJson(text);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("more than 16384 keys"), std::string::npos);
  JsonLimits limits;
  limits.max_object_keys = 20000;
  parsed = ParseBoundedJson(text, limits);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->size(), 20000u);
  EXPECT_EQ((*parsed)["19999"], 1);
}

TEST(BoundedJson, SyntaxErrorsSayWhere) {
  for (const char* bad : {"", "{", "{\"a\":}", "[1,]", "{\"a\":1}x", "nul"}) {
    absl::StatusOr<Json> parsed = ParseBoundedJson(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("not valid JSON"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace tandem::gateway
