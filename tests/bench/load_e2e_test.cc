// tandem-load against a real tandem-gpu-worker (cpu backend, stories260k, started by the test on
// a free port): a closed loop with random prompts, an open loop over a text file's tokens, a run
// the worker rejects, and an unreachable target. Skipped with a message when ../shared is absent.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "child_process.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {
namespace {

using test_process::ChildProcess;
using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;

// The last non-empty line of tandem-load's stdout: the JSON report.
nlohmann::json LastJsonLine(const std::string& out) {
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  if (lines.empty()) return nullptr;
  return nlohmann::json::parse(lines.back(), nullptr, /*allow_exceptions=*/false);
}

class LoadGeneratorE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path model =
        std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "stories260k";
    if (!std::filesystem::exists(model / "config.json")) {
      GTEST_SKIP() << "stories260k not found under " << model;
    }
    auto worker =
        ChildProcess::Start({TANDEM_GPU_WORKER_BIN, "--model=" + model.string(),
                             "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2",
                             "--embedded_pool_bytes=64MiB", "--mode=gpu", "--log_level=warn"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> port = worker_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    target_ = absl::StrCat("--target=127.0.0.1:", *port);
  }

  CommandResult Load(std::vector<std::string> args) {
    args.insert(args.begin(), {TANDEM_LOAD_BIN, target_, "--progress_s=0"});
    absl::StatusOr<CommandResult> r = RunCommand(args);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : CommandResult{};
  }

  std::unique_ptr<ChildProcess> worker_;
  std::string target_;
};

TEST_F(LoadGeneratorE2eTest, ClosedLoopRandomPrompts) {
  const std::string json_out = ::testing::TempDir() + "/tandem_load_closed.json";
  const CommandResult r =
      Load({"--concurrency=4", "--num_requests=12", "--warmup=2", "--prompt_tokens=16",
            "--output_tokens=16", "--json_out=" + json_out});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("Successful requests:                     12\n"));
  const nlohmann::json report = LastJsonLine(r.out);
  ASSERT_TRUE(report.is_object()) << r.out;
  EXPECT_EQ(report["completed"], 12);
  EXPECT_EQ(report["failed"], 0);
  // --ignore_eos (default): every request generates exactly its asked length.
  EXPECT_EQ(report["total_output_tokens"], 12 * 16);
  EXPECT_EQ(report["total_input_tokens"], 12 * 16);
  EXPECT_GT(report["duration"].get<double>(), 0);
  EXPECT_GT(report["request_throughput"].get<double>(), 0);
  EXPECT_NEAR(report["output_throughput"].get<double>(), 12 * 16 / report["duration"].get<double>(),
              1e-6);
  EXPECT_GT(report["mean_ttft_ms"].get<double>(), 0);
  EXPECT_LE(report["median_ttft_ms"].get<double>(), report["p99_ttft_ms"].get<double>());
  EXPECT_GT(report["mean_itl_ms"].get<double>(), 0);
  EXPECT_GE(report["mean_e2el_ms"].get<double>(), report["mean_ttft_ms"].get<double>());
  EXPECT_EQ(report["config"]["loop"], "closed");
  EXPECT_EQ(report["config"]["flags"]["concurrency"], "4");
  EXPECT_EQ(report["config"]["worker"]["backend"], "cpu");

  std::ifstream file(json_out);
  std::string line;
  ASSERT_TRUE(std::getline(file, line)) << json_out;
  EXPECT_EQ(nlohmann::json::parse(line), report);
}

TEST_F(LoadGeneratorE2eTest, OpenLoopOverTextPrompts) {
  const std::string text_path = ::testing::TempDir() + "/tandem_load_prompts.txt";
  {
    std::ofstream text(text_path);
    for (int i = 0; i < 50; ++i) text << "Once upon a time there was a little girl named Lily. ";
  }
  const CommandResult r =
      Load({"--request_rate=200", "--concurrency=4", "--num_requests=8",
            "--prompt_source=" + text_path, "--prompt_tokens=24", "--prompt_dist=uniform",
            "--prompt_spread=0.5", "--output_tokens=8", "--temperature=0.8", "--seed=3"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json report = LastJsonLine(r.out);
  ASSERT_TRUE(report.is_object()) << r.out;
  EXPECT_EQ(report["completed"], 8);
  EXPECT_EQ(report["total_output_tokens"], 8 * 8);
  EXPECT_GE(report["total_input_tokens"].get<int>(), 8 * 12);
  EXPECT_LE(report["total_input_tokens"].get<int>(), 8 * 36);
  EXPECT_EQ(report["config"]["loop"], "open");
  EXPECT_THAT(r.out, HasSubstr(text_path));
}

TEST_F(LoadGeneratorE2eTest, RejectedRequestsAreCountedByCode) {
  const CommandResult r = Load({"--num_requests=3", "--mode=fast"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;  // no request succeeded
  const nlohmann::json report = LastJsonLine(r.out);
  ASSERT_TRUE(report.is_object()) << r.out;
  EXPECT_EQ(report["completed"], 0);
  EXPECT_EQ(report["failed"], 3);
  EXPECT_EQ(report["errors"]["INVALID_ARGUMENT"], 3);
  EXPECT_THAT(r.err, HasSubstr("no request succeeded"));
}

TEST_F(LoadGeneratorE2eTest, BadFlagsAndUnreachableWorker) {
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_LOAD_BIN, "--target=127.0.0.1:1", "--connect_timeout_s=1"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("cannot reach the worker at 127.0.0.1:1"));

  r = RunCommand({TANDEM_LOAD_BIN, target_, "--concurrency=5000"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->err, HasSubstr("--concurrency must be in 1..4096"));

  // Longer than stories260k's 512-token context.
  r = RunCommand({TANDEM_LOAD_BIN, target_, "--prompt_tokens=500", "--output_tokens=100"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->err, HasSubstr("exceed the model's context (512)"));
}

}  // namespace
}  // namespace tandem::bench
