// The estimator's faces, run for real: `tandem-gpu-worker --plan` (exit 0 fits, 1 not, 2 bad
// input; the table and the JSON; a Llama-3-8B preset planned without weights, its numbers
// against the sizing functions), the start-up refusal of a --kv_cache_bytes the device cannot
// hold, and GetCapacity on a running worker through `tandem capacity` and a gRPC stub.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../../common/child_process.h"
#include "../engine/engine_test_util.h"
#include "absl/strings/str_cat.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/gpu_worker/window_cache.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gpu_worker {
namespace {

using test_process::ChildProcess;
using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;

uint64_t ItemBytes(const nlohmann::json& tier, const std::string& name) {
  for (const nlohmann::json& item : tier["items"]) {
    if (item["name"] == name) return item["bytes"].get<uint64_t>();
  }
  ADD_FAILURE() << "no item " << name << " in " << tier.dump();
  return 0;
}

std::string Gutenberg() { return testing::ModelDir("gutenberg-14m").string(); }

TEST(PlanE2eTest, PlanPrintsAndExitsByTheVerdict) {
  TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
  const std::vector<std::string> base = {TANDEM_GPU_WORKER_BIN, "--plan", "--model=" + Gutenberg(),
                                         "--backend=cpu", "--log_level=warn"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunCommand(argv);
  };
  absl::StatusOr<CommandResult> r = with({"--plan_context=4096", "--plan_mode=gpu"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("kv (all on the device)"));
  EXPECT_THAT(r->out, HasSubstr("largest context that fits (batch 1, mode gpu): 8192"));

  // JSON: the items add up; 64 gpu-mode sequences of 8192 do not fit 16 MiB of device.
  r = with({"--plan_context=8192", "--plan_batch=64", "--plan_mode=gpu", "--plan_json",
            "--plan_device_bytes=16MiB"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->err;
  const nlohmann::json j = nlohmann::json::parse(r->out);
  uint64_t sum = 0;
  for (const nlohmann::json& item : j["device"]["items"]) sum += item["bytes"].get<uint64_t>();
  EXPECT_EQ(sum, j["device"]["total_bytes"].get<uint64_t>());
  EXPECT_FALSE(j["fits"].get<bool>());
  EXPECT_FALSE(j["device"]["fits"].get<bool>());
  EXPECT_THAT(j["device"]["why"].get<std::string>(), HasSubstr("needs"));
  EXPECT_EQ(j["largest_context"].get<int64_t>(), 0);  // the weights alone are more than 16 MiB
  EXPECT_EQ(j["batch"].get<int64_t>(), 64);

  // Hybrid on two planned 1 MiB nodes: the nodes do not fit; the worker's embedded node does.
  r = with({"--plan_context=8192", "--plan_mode=hybrid", "--plan_node_bytes=1MiB,1MiB"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->err;
  EXPECT_THAT(r->out, HasSubstr("CPU node planned-0 would need"));
  r = with({"--plan_context=8192", "--plan_mode=hybrid"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("node in-process"));

  // Bad input: exit 2 with the field named.
  r = with({"--plan_mode=fast"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->err, HasSubstr("--plan_mode"));
  r = with({"--plan_context=9000"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->err, HasSubstr("context must be in 1..8192"));
}

// Llama-3-8B from the preset, no weights anywhere: the gpu-mode KV of 128K tokens is
// WindowCache::BytesFor's (16 GiB of bf16 K/V + f32 MAW), the weights 15 GiB, and int8 node KV
// takes the node block format's bytes (head_dim + 4 per row: 51.6% of bf16 at 128).
TEST(PlanE2eTest, Llama3PresetWithoutWeights) {
  const std::vector<std::string> base = {
      TANDEM_GPU_WORKER_BIN,       "--plan",      "--preset=llama3-8b", "--backend=cpu",
      "--plan_device_bytes=80GiB", "--plan_json", "--log_level=warn"};
  std::vector<std::string> argv = base;
  argv.insert(argv.end(), {"--plan_context=131072", "--plan_mode=gpu"});
  absl::StatusOr<CommandResult> r = RunCommand(argv);
  ASSERT_TRUE(r.ok()) << r.status();
  // (The verdict depends on the host: a cpu backend's device memory is its RAM.)
  ASSERT_TRUE(r->exit_code == 0 || r->exit_code == 1) << r->err;
  nlohmann::json j = nlohmann::json::parse(r->out);
  absl::StatusOr<ModelConfig> config = GeometryPreset("llama3-8b");
  ASSERT_TRUE(config.ok());
  WindowOptions wo;
  wo.window = WindowOptions::kUnlimited;
  wo.sink = 0;
  wo.block = 16;
  wo.max_chunk = 512;
  wo.max_context = 131072;
  EXPECT_EQ(ItemBytes(j["device"], "kv (all on the device)"),
            WindowCache::BytesFor({32, 8, 128, DType::kBF16}, wo));
  EXPECT_EQ(ItemBytes(j["device"], "weights"), 16060522496u);  // 8.03 B bf16 parameters
  EXPECT_TRUE(j["device"]["fits"].get<bool>());

  // 128K hybrid on two 64 GiB nodes: bf16 vs int8 node blocks.
  auto node_blocks = [&](const std::string& dtype) {
    std::vector<std::string> a = base;
    a.insert(a.end(), {"--plan_context=131072", "--plan_mode=hybrid",
                       "--plan_node_bytes=64GiB,64GiB", "--node_kv_dtype=" + dtype});
    absl::StatusOr<CommandResult> run = RunCommand(a);
    EXPECT_TRUE(run.ok());
    const nlohmann::json plan = nlohmann::json::parse(run->out);
    EXPECT_TRUE(plan["nodes"]["fits"].get<bool>()) << run->out;
    return ItemBytes(plan["nodes"], "node KV blocks");
  };
  const uint64_t bf16 = node_blocks("bf16"), int8 = node_blocks("int8");
  const uint64_t shards = 32 * 8, blocks = (131072 - 1024 - 4 + 15) / 16;
  const kv_store::BlockFormat bf16_format{16, 128, kv_store::KvDType::kBf16};
  const kv_store::BlockFormat int8_format{16, 128, kv_store::KvDType::kInt8};
  EXPECT_EQ(bf16, shards * blocks * bf16_format.block_bytes());
  EXPECT_EQ(int8, shards * blocks * int8_format.block_bytes());
  EXPECT_LT(static_cast<double>(int8), 0.56 * static_cast<double>(bf16));
}

// --quantization: fp8 plans the preset's FP8 weights; another value is a usage error (exit 2).
TEST(PlanE2eTest, QuantizationFlag) {
  const std::vector<std::string> base = {
      TANDEM_GPU_WORKER_BIN,       "--plan",      "--preset=llama3-8b", "--backend=cpu",
      "--plan_device_bytes=80GiB", "--plan_json", "--log_level=warn"};
  std::vector<std::string> argv = base;
  argv.push_back("--quantization=fp8");
  absl::StatusOr<CommandResult> r = RunCommand(argv);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->exit_code == 0 || r->exit_code == 1) << r->err;
  absl::StatusOr<ModelConfig> config = GeometryPreset("llama3-8b");
  ASSERT_TRUE(config.ok());
  config->quantization = "fp8";
  absl::StatusOr<size_t> fp8_bytes = DeviceModel::WeightBytes(*config);
  ASSERT_TRUE(fp8_bytes.ok()) << fp8_bytes.status();
  EXPECT_EQ(ItemBytes(nlohmann::json::parse(r->out)["device"], "weights"), *fp8_bytes);

  argv = base;
  argv.push_back("--quantization=int8");
  r = RunCommand(argv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 2);
  EXPECT_THAT(r->err, HasSubstr("--quantization \"int8\" is not supported"));
}

// Two real CPU nodes, one storing int8 rows and one bf16: --plan asks their Stats and sizes
// each node in the dtype it reported, whatever --node_kv_dtype says; planned nodes (nobody to
// ask) take --node_kv_dtype. The tiny preset: no model files needed.
TEST(PlanE2eTest, PlanSizesEachNodeInItsReportedKvStorage) {
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  std::vector<std::string> addresses;
  for (const char* dtype : {"int8", "bf16"}) {
    auto child = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                      "--pool_bytes=64MiB", "--threads=1",
                                      absl::StrCat("--node_kv_dtype=", dtype), "--log_level=warn"});
    ASSERT_TRUE(child.ok()) << child.status();
    absl::StatusOr<int> port = (*child)->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    nodes.push_back(std::move(*child));
    addresses.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  const std::vector<std::string> base = {
      TANDEM_GPU_WORKER_BIN, "--plan", "--preset=tiny", "--preset_set=layers=16",
      "--backend=cpu", "--plan_mode=hybrid", "--plan_context=4096", "--window=512",
      "--plan_json", "--log_level=warn"};
  auto plan = [&](std::vector<std::string> extra) -> nlohmann::json {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    absl::StatusOr<CommandResult> r = RunCommand(argv);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    EXPECT_EQ(r->exit_code, 0) << r->out << r->err;
    return nlohmann::json::parse(r->out, nullptr, /*allow_exceptions=*/false);
  };
  for (const char* flag : {"bf16", "int8"}) {
    SCOPED_TRACE(flag);
    const nlohmann::json j = plan({"--cpu_nodes=" + addresses[0] + "," + addresses[1],
                                   absl::StrCat("--node_kv_dtype=", flag)});
    ASSERT_TRUE(j.is_object());
    // The pool lists the nodes in its own order.
    std::map<std::string, std::string> storage;
    ASSERT_EQ(j["node_addresses"].size(), 2u);
    ASSERT_EQ(j["node_kv_storage"].size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      storage[j["node_addresses"][i].get<std::string>()] = j["node_kv_storage"][i];
      EXPECT_GT(j["node_bytes"][i].get<uint64_t>(), 0u);
    }
    EXPECT_EQ(storage[addresses[0]], "int8 (reported)");
    EXPECT_EQ(storage[addresses[1]], "bf16 (reported)");
    for (const nlohmann::json& item : j["nodes"]["items"]) {
      if (item["name"] != "node KV blocks") continue;
      const std::string detail = item["detail"].get<std::string>();
      EXPECT_THAT(detail, HasSubstr("int8 entries"));
      EXPECT_THAT(detail, HasSubstr("bf16 entries"));
    }
  }
  // Planned nodes: the flag's dtype, said as such.
  const nlohmann::json planned =
      plan({"--plan_node_bytes=64MiB,64MiB", "--node_kv_dtype=int8"});
  ASSERT_TRUE(planned.is_object());
  EXPECT_EQ(planned["node_kv_storage"],
            nlohmann::json({"int8 (--node_kv_dtype; not seen yet)",
                            "int8 (--node_kv_dtype; not seen yet)"}));
  for (auto& node : nodes) {
    absl::StatusOr<int> code = node->Terminate();
    ASSERT_TRUE(code.ok()) << code.status();
  }
}

TEST(PlanE2eTest, WorkerRefusesAKvBudgetTheDeviceCannotHold) {
  TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
  absl::StatusOr<CommandResult> r =
      RunCommand({TANDEM_GPU_WORKER_BIN, "--model=" + Gutenberg(), "--backend=cpu",
                  "--address=127.0.0.1:0", "--kv_cache_bytes=64TiB", "--log_level=warn"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("the worker needs"));
  EXPECT_THAT(r->err, HasSubstr("--kv_cache_bytes 64.0 TiB"));
}

TEST(PlanE2eTest, GetCapacityOfARunningWorker) {
  TANDEM_SKIP_WITHOUT_MODEL("gutenberg-14m");
  auto worker = ChildProcess::Start({TANDEM_GPU_WORKER_BIN, "--model=" + Gutenberg(),
                                     "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2",
                                     "--embedded_pool_bytes=64MiB", "--log_level=warn"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> port = (*worker)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string address = absl::StrCat("127.0.0.1:", *port);

  absl::StatusOr<CommandResult> r = RunCommand(
      {TANDEM_CLI_BIN, "capacity", "--server=" + address, "--context=4096", "--mode=hybrid"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("node in-process"));
  EXPECT_THAT(r->out, HasSubstr("mode hybrid (pages)"));

  auto stub =
      v1::Generation::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto call = [&](v1::GetCapacityRequest request, v1::GetCapacityResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub->GetCapacity(&ctx, request, response);
  };
  // The 64 MiB embedded pool holds 4096 tokens of hybrid KV but not 8192 x 8 sequences; the
  // largest context for batch 8 is where the node pool runs out.
  v1::GetCapacityRequest request;
  request.set_mode("hybrid");
  request.set_batch(8);
  v1::GetCapacityResponse response;
  grpc::Status s = call(request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.context(), 8192);
  EXPECT_FALSE(response.fits());
  EXPECT_FALSE(response.nodes().fits());
  EXPECT_TRUE(response.device().fits());
  EXPECT_GT(response.largest_context(), 1024);
  EXPECT_LT(response.largest_context(), 8192);
  ASSERT_EQ(response.node_addresses_size(), 1);
  EXPECT_GT(response.node_bytes(0), uint64_t{64} << 20);
  // The node's KV storage, machine-readable, as the table says it.
  ASSERT_EQ(response.node_kv_storage_size(), 1);
  EXPECT_THAT(response.node_kv_storage(0), ::testing::MatchesRegex("(int8|bf16|f32) \\(.*\\)"));
  EXPECT_THAT(response.text(), HasSubstr(response.node_kv_storage(0)));
  // One more token than the largest does not fit, the largest does.
  v1::GetCapacityRequest edge = request;
  edge.set_context(response.largest_context());
  v1::GetCapacityResponse at;
  ASSERT_TRUE(call(edge, &at).ok());
  EXPECT_TRUE(at.fits()) << at.text();
  edge.set_context(response.largest_context() + 1);
  ASSERT_TRUE(call(edge, &at).ok());
  EXPECT_FALSE(at.fits()) << at.text();
  // `tandem capacity` exits 1 for a plan that does not fit.
  r = RunCommand({TANDEM_CLI_BIN, "capacity", "--server=" + address, "--mode=hybrid", "--batch=8"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1) << r->err;
  EXPECT_THAT(r->out, HasSubstr("DOES NOT FIT"));

  // Bad fields: INVALID_ARGUMENT naming them.
  request.set_mode("fast");
  s = call(request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("mode"));
  request.set_mode("");
  request.set_context(100000);
  s = call(request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("context must be in 1..8192"));
}

}  // namespace
}  // namespace tandem::gpu_worker
