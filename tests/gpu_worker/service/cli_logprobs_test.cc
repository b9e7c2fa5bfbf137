// The `tandem` CLI's --logprobs table and its local tokenizer's handling of special-token text,
// with an in-process engine on stories260k.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gpu_worker {
namespace {

using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;

class CliLogprobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::LoadGolden(&golden_)) {
      GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
    }
    model_ = testing::Stories260kDir().string();
  }

  testing::Golden golden_;
  std::string model_;
};

TEST_F(CliLogprobsTest, GenerateListsEachTokensLogprobAndTopTokens) {
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_CLI_BIN, "generate", "--model", model_, "--backend=cpu", "--mode=gpu",
                  "--prompt", golden_.prompt_text, "--max-tokens=4", "--logprobs=3"});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->exit_code, 0) << r->err;
  // The text first, as without the flag, then the table, then the summary.
  const size_t table = r->out.find("\n[logprobs] index token_id logprob | top tokens\n");
  ASSERT_NE(table, std::string::npos) << r->out;
  EXPECT_GT(r->out.find("[tandem] 4 tokens"), table) << r->out;
  std::vector<std::string> rows;
  for (absl::string_view line : absl::StrSplit(r->out.substr(table + 1), '\n')) {
    if (line.find(" | ") != std::string::npos && !absl::StartsWith(line, "[")) {
      rows.emplace_back(line);
    }
  }
  ASSERT_EQ(rows.size(), 4u) << r->out;
  for (size_t i = 0; i < rows.size(); ++i) {
    // "    i      id   logprob | "a" lp "b" lp "c" lp": greedy, so the first candidate's value is
    // the token's own.
    std::vector<std::string> head =
        absl::StrSplit(rows[i].substr(0, rows[i].find(" |")), ' ', absl::SkipEmpty());
    ASSERT_EQ(head.size(), 3u) << rows[i];
    EXPECT_EQ(head[0], std::to_string(i));
    EXPECT_EQ(head[1], std::to_string(golden_.greedy_ids[5 + i]));
    double logprob = 0;
    ASSERT_TRUE(absl::SimpleAtod(head[2], &logprob)) << rows[i];
    EXPECT_LE(logprob, 0.0);
    const std::string tail = rows[i].substr(rows[i].find(" |") + 2);
    EXPECT_EQ(std::count(tail.begin(), tail.end(), '"'), 6) << rows[i];
  }

  r = RunCommand({TANDEM_CLI_BIN, "generate", "--model", model_, "--backend=cpu", "--prompt=x",
                  "--logprobs=21"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("INVALID_ARGUMENT: top_logprobs must be in 0..20"));
}

// The CLI's local tokenizer agrees with the worker's: "<s>" written in the text is the BOS token,
// and --add-bos does not add a second one.
TEST_F(CliLogprobsTest, TokenizeParsesSpecialTokenText) {
  absl::StatusOr<CommandResult> r = RunCommand({TANDEM_CLI_BIN, "tokenize", "--model=" + model_,
                                                "--text=<s>" + golden_.prompt_text, "--add-bos"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_EQ(r->out, "1 403 407 261 378\n5 tokens\n");
}

}  // namespace
}  // namespace tandem::gpu_worker
