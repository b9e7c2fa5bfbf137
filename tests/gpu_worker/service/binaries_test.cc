// The real binaries: tandem-gpu-worker started by the test (LISTENING handshake, SIGTERM
// drain, exit statuses for bad command lines) and the `tandem generate|tokenize` CLI against
// it and in-process, checked against golden.json.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gpu_worker {
namespace {

using test_process::ChildProcess;
using test_process::CommandResult;
using testing::Golden;
using ::testing::HasSubstr;
using test_process::RunCommand;
using ::testing::StartsWith;

// Lines of the CLI's stdout that start with "[tandem]".
std::vector<std::string> SummaryLines(const std::string& out) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "[tandem]")) lines.emplace_back(line);
  }
  return lines;
}

class BinariesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::LoadGolden(&golden_)) {
      GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
    }
    model_ = testing::Stories260kDir().string();
  }

  // The text after "Once upon a time" up to (not including) `end`.
  std::string ContinuationUpTo(const std::string& end) const {
    const std::string all = golden_.greedy_text.substr(golden_.prompt_text.size());
    return all.substr(0, all.find(end));
  }

  Golden golden_;
  std::string model_;
};

TEST_F(BinariesTest, WorkerServesTheCliAndDrainsOnSigterm) {
  auto worker = ChildProcess::Start(
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--address=127.0.0.1:0", "--backend=cpu",
       "--cpu_threads=2", "--embedded_pool_bytes=64MiB", "--mode=gpu", "--log_level=warn"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> port = (*worker)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string server = absl::StrCat("--server=127.0.0.1:", *port);

  // Hyphenated flags, greedy, the worker's default mode (gpu).
  absl::StatusOr<CommandResult> r = RunCommand(
      {TANDEM_CLI_BIN, "generate", server, "--prompt", golden_.prompt_text, "--max-tokens", "56"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  const std::string text = golden_.greedy_text.substr(golden_.prompt_text.size());
  EXPECT_THAT(r->out, StartsWith(text + "\n[tandem] 56 tokens | TTFT "));
  ASSERT_EQ(SummaryLines(r->out).size(), 1u) << r->out;
  EXPECT_THAT(SummaryLines(r->out)[0],
              HasSubstr("| KV: 60 on device, 0 on CPU nodes | degraded steps: 0 | finish: "
                        "length | mode gpu"));

  // Stop strings: repeated and comma-listed, both spellings; the text ends before "Lily".
  r = RunCommand({TANDEM_CLI_BIN, "generate", server, "--prompt=" + golden_.prompt_text,
                  "--max_tokens=56", "--stop=zzz,Lily", "--stop", "qqq"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_THAT(r->out, StartsWith(ContinuationUpTo("Lily") + "\n[tandem] "));
  EXPECT_THAT(r->out, HasSubstr("| finish: stop |"));

  r = RunCommand({TANDEM_CLI_BIN, "tokenize", server, "--text", golden_.prompt_text, "--add-bos"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_EQ(r->out, "1 403 407 261 378\n5 tokens\n");

  // A request the service rejects: status on stderr, exit 1.
  r = RunCommand({TANDEM_CLI_BIN, "generate", server, "--prompt=x", "--mode=fast"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, StartsWith("tandem: INVALID_ARGUMENT: mode"));

  absl::StatusOr<int> code = (*worker)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << "tandem-gpu-worker exit status after SIGTERM";
}

TEST_F(BinariesTest, CliRunsAnInProcessEngine) {
  // Hybrid with the embedded node; 2-token chunks make the 5-token prompt "long" (> 2 chunks),
  // so the progress bar is drawn on stderr.
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_CLI_BIN, "generate", "--model", model_, "--backend=cpu", "--prompt",
                  golden_.prompt_text, "--max-tokens=56", "--mode=hybrid", "--beta=0",
                  "--window=32", "--sink=4", "--prefill-chunk=2"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  const std::string text = golden_.greedy_text.substr(golden_.prompt_text.size());
  EXPECT_THAT(r->out, StartsWith(text + "\n[tandem] 56 tokens | TTFT "));
  EXPECT_THAT(r->out, HasSubstr("| finish: length | mode hybrid\n"));
  EXPECT_THAT(r->out, ::testing::Not(HasSubstr(" 0 on CPU nodes")));
  EXPECT_THAT(r->err, HasSubstr("[prefill]"));
  EXPECT_THAT(r->err, HasSubstr("5/5 tokens"));

  r = RunCommand(
      {TANDEM_CLI_BIN, "tokenize", "--model=" + model_, "--text=" + golden_.prompt_text});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_EQ(r->out, "403 407 261 378\n4 tokens\n");

  // A failing in-process engine: exit 1 with the status.
  r = RunCommand({TANDEM_CLI_BIN, "generate", "--model=/nonexistent/model", "--prompt=x"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, StartsWith("tandem: "));
}

// `tandem attend` against a node too small for its KV: the AppendKv stream fails with
// RESOURCE_EXHAUSTED, the CLI exits 1 and closes the session it opened, so the node holds
// nothing afterwards.
TEST_F(BinariesTest, AttendThatFailsClosesItsSessionOnTheNode) {
  auto node = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                   "--pool_bytes=8MiB", "--threads=1", "--log_level=warn"});
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<int> port = (*node)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string server = absl::StrCat("--server=127.0.0.1:", *port);
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_CLI_BIN, "attend", server, "--layers=2", "--kv_heads=2", "--q_heads=4",
                  "--head_dim=64", "--tokens=65536", "--decode_steps=1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->out;
  EXPECT_THAT(r->err, HasSubstr("RESOURCE_EXHAUSTED"));
  EXPECT_THAT(r->err, HasSubstr("after the error: ok"));
  r = RunCommand({TANDEM_CLI_BIN, "stats", server});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_THAT(r->out, ::testing::Not(HasSubstr("sessions:")))
      << "the node still holds a session:\n" << r->out;
  EXPECT_THAT(r->out, ::testing::Not(HasSubstr("blocks_in_use:")));
}

TEST_F(BinariesTest, BadCommandLinesExitWithTwo) {
  const std::vector<std::vector<std::string>> bad = {
      {TANDEM_GPU_WORKER_BIN, "--no_such_flag=1"},
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--cpu_threads=many"},
      {TANDEM_GPU_WORKER_BIN},  // no --model
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--backend=tpu"},
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--mode=fast"},
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--prefill_attention=f32"},
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--beta=-1"},
      {TANDEM_GPU_WORKER_BIN, "--model=" + model_, "--max_message_bytes=12XB"},
      {TANDEM_CPU_ATTENTION_BIN, "--release_free_after_s=nan"},
      {TANDEM_CPU_ATTENTION_BIN, "--release_free_after_s=1e9"},
      {TANDEM_CPU_ATTENTION_BIN, "--release_free_after_s=soon"},
      {TANDEM_CPU_ATTENTION_BIN, "--no_such_flag=1"},
      {TANDEM_CPU_ATTENTION_BIN, "--max_message_bytes=2GiB"},
      {TANDEM_CPU_ATTENTION_BIN, "stray"},
      {TANDEM_CLI_BIN, "generate", "--max-tokens=abc"},
      {TANDEM_CLI_BIN, "frobnicate"},
  };
  for (const auto& argv : bad) {
    SCOPED_TRACE(absl::StrJoin(argv, " "));
    absl::StatusOr<CommandResult> r = RunCommand(argv);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 2) << r->err;
    EXPECT_FALSE(r->err.empty());
  }
  // Flag names take hyphens as well as underscores: this one parses (and fails only later, on the
  // model, with 1).
  absl::StatusOr<CommandResult> hyphens = RunCommand(
      {TANDEM_GPU_WORKER_BIN, "--model=/nonexistent/model", "--max-batch=8", "--kv-cache-bytes",
       "1GiB", "--address=127.0.0.1:0"});
  ASSERT_TRUE(hyphens.ok()) << hyphens.status();
  EXPECT_EQ(hyphens->exit_code, 1) << hyphens->err;
  // A command line that parses but names a model that cannot load: exit 1.
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_GPU_WORKER_BIN, "--model=/nonexistent/model", "--address=127.0.0.1:0"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->err;
}

// --help lists each binary's own flags on stdout and exits 0.
TEST_F(BinariesTest, HelpListsTheFlagsAndExitsZero) {
  const std::vector<std::pair<std::string, std::string>> binaries = {
      {TANDEM_GPU_WORKER_BIN, "--max_batch"},
      {TANDEM_CPU_ATTENTION_BIN, "--pool_bytes"},
      {TANDEM_CLI_BIN, "--server"},
  };
  for (const auto& [binary, flag] : binaries) {
    SCOPED_TRACE(binary);
    absl::StatusOr<CommandResult> r = RunCommand({binary, "--help"});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 0) << r->err;
    EXPECT_THAT(r->out + r->err, HasSubstr(flag));
    EXPECT_THAT(r->out + r->err, ::testing::Not(HasSubstr("No flags matched")));
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
