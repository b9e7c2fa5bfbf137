// Token files and PEM reading: the accepted shapes, every refusal with its line, and the
// credential combinations that are refused before a server starts.
#include "tandem/security/token_file.h"

#include <gtest/gtest.h>

#include "tandem/security/authenticator.h"
#include "tandem/security/credentials.h"

namespace tandem::security {
namespace {

TEST(TokenTableTest, ParsesTokensWithAndWithoutPrincipals) {
  absl::StatusOr<TokenTable> t = TokenTable::Parse(
      "# comment\n\n  0123456789abcdef-alice alice\n0123456789abcdef-anon\n", "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->Lookup("0123456789abcdef-alice"), "alice");
  EXPECT_EQ(t->Lookup("0123456789abcdef-anon"), "token-4");
  EXPECT_EQ(t->Lookup("0123456789abcdef-alic"), std::nullopt);
  EXPECT_EQ(t->Lookup(""), std::nullopt);
  EXPECT_EQ(t->first_token(), "0123456789abcdef-alice");
}

TEST(TokenTableTest, RefusesWeakDuplicateOrMalformedEntries) {
  struct Case {
    const char* text;
    const char* message;
  };
  for (const Case& c : {
           Case{"short alice\n", "tokens:1: a token must have 16..4096 characters"},
           Case{"0123456789abcdef a b\n", "tokens:1: expected 'token' or 'token principal'"},
           Case{"0123456789abcdef al!ce\n", "tokens:1: a principal must be"},
           Case{"0123456789abcdef a\n0123456789abcdef b\n", "tokens:2: this token is listed"},
           Case{"# nothing\n", "tokens: no token"},
       }) {
    absl::StatusOr<TokenTable> t = TokenTable::Parse(c.text, "tokens");
    ASSERT_FALSE(t.ok()) << c.text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status();
  }
}

TEST(CredentialsTest, RefusesHalfGivenFilesAndTokensWithoutTls) {
  auto server = ServerCredentialsFromFiles({"cert.pem", "", ""});
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("--tls_cert and --tls_key go together"),
            std::string::npos);
  auto ca_only = ServerCredentialsFromFiles({"", "", "ca.pem"});
  EXPECT_FALSE(ca_only.ok());
  auto token = ChannelCredentialsFromFiles({}, "0123456789abcdef");
  ASSERT_FALSE(token.ok());
  EXPECT_NE(token.status().message().find("needs TLS"), std::string::npos);
  auto missing = ServerCredentialsFromFiles({"/nonexistent/cert.pem", "/nonexistent/key.pem", ""});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("--tls_cert: cannot read '/nonexistent/cert.pem'"),
            std::string::npos)
      << missing.status();
  EXPECT_TRUE(ServerCredentialsFromFiles({}).ok());  // plaintext
  EXPECT_TRUE(ChannelCredentialsFromFiles({}).ok());
}

TEST(AuthenticatorTest, ParsesPeerLists) {
  EXPECT_EQ(ParsePeerList(" a , b,,c "), (std::set<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(ParsePeerList("").empty());
}

}  // namespace
}  // namespace tandem::security
