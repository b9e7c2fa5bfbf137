// mode=exact over gRPC with the real binaries: tandem-gpu-worker started with --mode=exact and a
// forced half split (--exact_fetch_share=0.5; the planned split of a toy model is all-fetch),
// and the `tandem generate` CLI against it: the greedy continuation equals golden.json's (gpu
// mode's), the summary names the mode and the split, and a request that sets beta with exact
// is INVALID_ARGUMENT (the worker keeps serving).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "service_test_util.h"

namespace tandem::gpu_worker {
namespace {

using test_process::ChildProcess;
using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(ExactCli, WorkerServesExactModeOverGrpc) {
  testing::Golden golden;
  if (!testing::LoadGolden(&golden)) {
    GTEST_SKIP() << "stories260k not found under " << testing::Stories260kDir();
  }
  auto worker = ChildProcess::Start(
      {TANDEM_GPU_WORKER_BIN, "--model=" + testing::Stories260kDir().string(),
       "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2", "--embedded_pool_bytes=64MiB",
       "--mode=exact", "--window=32", "--sink=4", "--exact_fetch_share=0.5", "--log_level=warn"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> port = (*worker)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string server = absl::StrCat("--server=127.0.0.1:", *port);

  absl::StatusOr<CommandResult> r = RunCommand(
      {TANDEM_CLI_BIN, "generate", server, "--prompt", golden.prompt_text, "--max-tokens=56"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  const std::string text = golden.greedy_text.substr(golden.prompt_text.size());
  EXPECT_THAT(r->out, StartsWith(text + "\n[tandem] 56 tokens | TTFT "));
  // 60 positions: 4 sink + up to 32 + a block on the device, the rest split half and half.
  EXPECT_THAT(r->out, HasSubstr("| mode exact\n"));
  EXPECT_THAT(r->out, HasSubstr("[tandem] exact split: fetch 50.0% ("));
  EXPECT_THAT(r->out, HasSubstr("nodes 50.0% ("));
  EXPECT_THAT(r->out, ::testing::Not(HasSubstr(" 0 on CPU nodes")));

  r = RunCommand({TANDEM_CLI_BIN, "generate", server, "--prompt=x", "--mode=exact", "--beta=0"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, StartsWith("tandem: INVALID_ARGUMENT: mode exact"));

  r = RunCommand(
      {TANDEM_CLI_BIN, "generate", server, "--prompt", golden.prompt_text, "--max-tokens=8"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;

  absl::StatusOr<int> code = (*worker)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace tandem::gpu_worker
