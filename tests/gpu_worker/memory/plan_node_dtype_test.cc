// The memory plan sizes each CPU node's shards in the storage dtype that node reported in
// Stats (PlanNode::kv_dtype), and in the worker's --node_kv_dtype (MemoryPlanSetup::
// node_kv_dtype) only for nodes not seen yet; the plan says which it used per node. Sizes come
// from kv_store::BlockFormat::ShardBytes (node_shard_bytes_test checks it against kv_store).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tandem/cpu_attention/node_memory.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::gpu_worker {
namespace {

using kv_store::BlockFormat;
using kv_store::KvDType;

constexpr int64_t kContext = 6000, kWindow = 1024, kSink = 4;
constexpr uint64_t kOffloaded = kContext - kWindow - kSink;

MemoryPlanSetup MakeSetup(const ModelConfig& config, KvDType flag, std::vector<PlanNode> nodes) {
  MemoryPlanSetup setup;
  setup.config = config;
  setup.kv_dtype = DType::kBF16;
  setup.node_kv_dtype = flag;
  setup.engine.block_tokens = 16;
  setup.engine.page_tokens = 16;
  setup.max_context = 8192;
  setup.nodes = std::move(nodes);
  return setup;
}

MemoryPlanRequest Request(const MemoryPlanSetup& setup) {
  MemoryPlanRequest r = MemoryPlanRequest::Defaults(setup.engine);
  r.mode = AttentionMode::kHybrid;
  r.selection = SelectionRule::kPages;
  r.context = kContext;
  r.window = kWindow;
  r.sink = kSink;
  r.batch = 1;
  return r;
}

// Bytes of one shard of the plan's offloaded entries on a node storing `dtype`.
uint64_t Shard(const ModelConfig& c, KvDType dtype) {
  return BlockFormat{16, static_cast<uint32_t>(c.head_dim), dtype}.ShardBytes(kOffloaded, 0);
}

class PlanNodeDtypeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    config_.num_layers = 16;  // 32 shards a session: enough to see how they spread
    shards_ = static_cast<uint64_t>(config_.num_layers) * config_.num_kv_heads;
  }
  // The bytes a node holding `count` shards of one session in `dtype` is planned to need.
  uint64_t NodeBytes(uint64_t count, KvDType dtype) const {
    if (count == 0) return 0;
    return count * Shard(config_, dtype) +
           cpu_attention::SessionMetadataBytes(config_.num_layers, count);
  }
  ModelConfig config_;
  uint64_t shards_ = 0;
};

// One node: its reported dtype wins over the flag either way; without a report, the flag.
TEST_F(PlanNodeDtypeTest, OneNodeIsSizedInItsReportedDtypeElseTheFlags) {
  const uint64_t big = uint64_t{16} << 30;
  struct Case {
    KvDType flag;
    std::optional<KvDType> reported;
    KvDType used;
    const char* storage;
  };
  const Case cases[] = {
      {KvDType::kBf16, KvDType::kInt8, KvDType::kInt8, "int8 (reported)"},
      {KvDType::kInt8, KvDType::kBf16, KvDType::kBf16, "bf16 (reported)"},
      {KvDType::kInt8, std::nullopt, KvDType::kInt8, "int8 (--node_kv_dtype; not seen yet)"},
      {KvDType::kBf16, std::nullopt, KvDType::kBf16, "bf16 (--node_kv_dtype; not seen yet)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.storage);
    const MemoryPlanSetup setup = MakeSetup(config_, c.flag, {{"node-a", big, big, c.reported}});
    absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup, Request(setup));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->node_bytes.size(), 1u);
    EXPECT_EQ(plan->node_bytes[0], NodeBytes(shards_, c.used));
    ASSERT_EQ(plan->node_kv_storage.size(), 1u);
    EXPECT_EQ(plan->node_kv_storage[0], c.storage);
    EXPECT_NE(FormatMemoryPlan(*plan).find(std::string("KV ") + c.storage), std::string::npos)
        << FormatMemoryPlan(*plan);
  }
  // int8 rows at the tiny geometry's head_dim 16: 20 B against 32 B per K or V row.
  EXPECT_LT(Shard(config_, KvDType::kInt8), Shard(config_, KvDType::kBf16) * 7 / 10);
}

// A node whose pool holds the int8 shards but not the bf16 ones fits only when it reports int8
// (the flag alone says bf16); the refusal names int8 as a way out only for a bf16 node.
TEST_F(PlanNodeDtypeTest, ReportedInt8DecidesTheVerdict) {
  const uint64_t pool =
      (NodeBytes(shards_, KvDType::kInt8) + NodeBytes(shards_, KvDType::kBf16)) / 2;
  MemoryPlanSetup setup =
      MakeSetup(config_, KvDType::kBf16, {{"node-a", pool, pool, KvDType::kInt8}});
  absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup, Request(setup));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->nodes.fits) << plan->nodes.why;
  setup.nodes[0].kv_dtype.reset();
  plan = EstimateMemory(setup, Request(setup));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->nodes.fits);
  EXPECT_NE(plan->nodes.why.find("or int8 node KV"), std::string::npos) << plan->nodes.why;
}

// Mixed nodes of equal pools: int8 reported, bf16 reported, and one not seen yet under
// --node_kv_dtype=int8. Each node's bytes are a whole number of its own dtype's shards plus its
// session metadata; the shards add up to the session's; the int8 nodes take more of them (the
// plan fills the node with the most room left); the items list both dtypes and add up.
TEST_F(PlanNodeDtypeTest, MixedNodesAreEachSizedInTheirOwnDtype) {
  const uint64_t big = uint64_t{16} << 30;
  const MemoryPlanSetup setup = MakeSetup(
      config_, KvDType::kInt8,
      {{"node-int8", big, big, KvDType::kInt8}, {"node-bf16", big, big, KvDType::kBf16},
       {"node-new", big, big, std::nullopt}});
  const KvDType used[] = {KvDType::kInt8, KvDType::kBf16, KvDType::kInt8};
  absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup, Request(setup));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->node_bytes.size(), 3u);
  EXPECT_EQ(plan->node_kv_storage,
            (std::vector<std::string>{"int8 (reported)", "bf16 (reported)",
                                      "int8 (--node_kv_dtype; not seen yet)"}));
  std::vector<uint64_t> counts(3);
  for (size_t i = 0; i < 3; ++i) {
    bool found = false;
    for (uint64_t k = 0; k <= shards_ && !found; ++k) {
      if (NodeBytes(k, used[i]) == plan->node_bytes[i]) {
        counts[i] = k;
        found = true;
      }
    }
    EXPECT_TRUE(found) << "node " << i << ": " << plan->node_bytes[i]
                       << " B is no whole number of its dtype's shards";
  }
  EXPECT_EQ(counts[0] + counts[1] + counts[2], shards_);
  EXPECT_GT(counts[0], counts[1]);
  EXPECT_GT(counts[2], counts[1]);
  EXPECT_GT(counts[1], 0u);
  uint64_t sum = 0;
  for (uint64_t b : plan->node_bytes) sum += b;
  EXPECT_EQ(plan->nodes.total_bytes, sum);
  for (const MemoryItem& item : plan->nodes.items) {
    if (item.name != "node KV blocks") continue;
    EXPECT_NE(item.detail.find("int8 entries"), std::string::npos) << item.detail;
    EXPECT_NE(item.detail.find("bf16 entries"), std::string::npos) << item.detail;
    EXPECT_EQ(item.bytes, (counts[0] + counts[2]) * Shard(config_, KvDType::kInt8) +
                              counts[1] * Shard(config_, KvDType::kBf16));
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
