// The memory plan shows the prefix cache's parking budget in the host tier (ParkingBudgetBytes:
// the one rule the engine resolves --prefix_cache_host_bytes with), and counts it in the host
// total; without the prefix cache, or with no budget (the cpu backend's default), no line.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <string>

#include "plan_test_util.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

using testing::FindItem;

class PlanParkingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
    ASSERT_TRUE(config.ok()) << config.status();
    setup_.config = *config;
    setup_.kv_dtype = DType::kBF16;
    setup_.engine.block_tokens = 16;
    setup_.engine.page_tokens = 16;
    setup_.max_context = 8192;
  }
  MemoryPlan Plan() {
    MemoryPlanRequest r = MemoryPlanRequest::Defaults(setup_.engine);
    r.mode = AttentionMode::kGpu;
    r.context = 4096;
    r.batch = 1;
    absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup_, r);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : MemoryPlan{};
  }
  MemoryPlanSetup setup_;
};

TEST_F(PlanParkingTest, TheBudgetIsAHostLine) {
  setup_.engine.prefix_cache = true;
  setup_.engine.prefix_cache_host_bytes = size_t{3} << 30;
  setup_.backend = "cuda";
  const MemoryPlan with = Plan();
  const MemoryItem* parked = FindItem(with.host, "parked cached sessions");
  ASSERT_NE(parked, nullptr);
  EXPECT_EQ(parked->bytes, uint64_t{3} << 30);

  setup_.engine.prefix_cache = false;
  const MemoryPlan without = Plan();
  EXPECT_EQ(FindItem(without.host, "parked cached sessions"), nullptr);
  EXPECT_EQ(with.host.total_bytes - without.host.total_bytes, uint64_t{3} << 30);
}

TEST_F(PlanParkingTest, AutoIsAQuarterOfPhysicalMemoryOnCudaAndNoneOnCpu) {
  setup_.engine.prefix_cache = true;
  const size_t physical =
      static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(ParkingBudgetBytes(setup_.engine, "cuda"), physical / 4);
  EXPECT_EQ(ParkingBudgetBytes(setup_.engine, "cpu"), 0u);
  setup_.backend = "cpu";
  EXPECT_EQ(FindItem(Plan().host, "parked cached sessions"), nullptr);
  setup_.backend = "cuda";
  const MemoryItem* parked = FindItem(Plan().host, "parked cached sessions");
  ASSERT_NE(parked, nullptr);
  EXPECT_EQ(parked->bytes, physical / 4);
}

}  // namespace
}  // namespace tandem::gpu_worker
