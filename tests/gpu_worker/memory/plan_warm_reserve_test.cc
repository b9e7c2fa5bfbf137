// The memory plan shows the embedded node's warm reserve (free KV blocks it keeps faulted in
// while sessions hold blocks, kv_store::BlockWarmer) as a host line: --node_warm_reserve, or
// what the node's pool has left beyond the sessions' KV when that is less; no line without a
// reserve or without an embedded node.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "plan_test_util.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

using testing::FindItem;

constexpr const char* kReserve = "embedded node warm reserve";

class PlanWarmReserveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
    ASSERT_TRUE(config.ok()) << config.status();
    setup_.config = *config;
    setup_.kv_dtype = DType::kBF16;
    setup_.backend = "cuda";
    setup_.engine.block_tokens = 16;
    setup_.engine.page_tokens = 16;
    setup_.max_context = 8192;
    SetPool(uint64_t{1} << 30);
  }
  void SetPool(uint64_t bytes) {
    setup_.engine.nodes.embedded.pool_bytes = bytes;
    setup_.embedded_node = true;
    setup_.nodes = {{"in-process", bytes, bytes, std::nullopt}};
  }
  MemoryPlan Plan() {
    MemoryPlanRequest r = MemoryPlanRequest::Defaults(setup_.engine);
    r.mode = AttentionMode::kHybrid;
    r.selection = SelectionRule::kPages;
    r.context = 4096;
    r.window = 128;
    r.sink = 4;
    r.batch = 1;
    absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup_, r);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : MemoryPlan{};
  }
  MemoryPlanSetup setup_;
};

TEST_F(PlanWarmReserveTest, TheReserveIsAHostLineBesideTheNodeKv) {
  setup_.engine.nodes.embedded.warm_reserve_bytes = uint64_t{512} << 20;
  const MemoryPlan with = Plan();
  ASSERT_GT(with.nodes.total_bytes, 0u);
  const MemoryItem* reserve = FindItem(with.host, kReserve);
  ASSERT_NE(reserve, nullptr);
  EXPECT_EQ(reserve->bytes, uint64_t{512} << 20);

  setup_.engine.nodes.embedded.warm_reserve_bytes = 0;
  const MemoryPlan without = Plan();
  EXPECT_EQ(FindItem(without.host, kReserve), nullptr);
  EXPECT_EQ(with.host.total_bytes - without.host.total_bytes, uint64_t{512} << 20);
}

TEST_F(PlanWarmReserveTest, AtMostWhatThePoolHasLeftBeyondTheKv) {
  setup_.engine.nodes.embedded.warm_reserve_bytes = uint64_t{512} << 20;
  const uint64_t kv = Plan().nodes.total_bytes;
  ASSERT_GT(kv, 0u);
  SetPool(kv + (uint64_t{3} << 20));
  const MemoryItem* reserve = FindItem(Plan().host, kReserve);
  ASSERT_NE(reserve, nullptr);
  EXPECT_EQ(reserve->bytes, uint64_t{3} << 20);
  SetPool(kv);   // full: nothing left to keep warm
  EXPECT_EQ(FindItem(Plan().host, kReserve), nullptr);
}

TEST_F(PlanWarmReserveTest, NoLineForRemoteNodes) {
  setup_.engine.nodes.embedded.warm_reserve_bytes = uint64_t{512} << 20;
  setup_.embedded_node = false;
  setup_.nodes = {{"10.0.0.1:50061", uint64_t{1} << 30, uint64_t{1} << 30, std::nullopt}};
  EXPECT_EQ(FindItem(Plan().host, kReserve), nullptr);
}

}  // namespace
}  // namespace tandem::gpu_worker
