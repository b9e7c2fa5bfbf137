// One formula for a shard's memory on a CPU node (kv_store::BlockFormat::ShardBytes), which the
// worker's placement (RemoteKv::ShardBytes) and memory plan (EstimateMemory's node items) call,
// against what kv_store actually charges a shard's budget: real BlockPool + Shard appends, bf16
// and int8 rows, with and without a selected copy (MAW selection), in one append and in many.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/model_geometry.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/memory_budget.h"
#include "tandem/kv_store/shard.h"

namespace tandem::gpu_worker {
namespace {

using kv_store::BlockFormat;
using kv_store::KvDType;

// Budget bytes kv_store charges a fresh shard of `format` for `entries` entries appended in
// appends of `step` entries, every entry selected when `select_all`, none otherwise.
uint64_t ChargedBytes(const BlockFormat& format, uint64_t entries, uint64_t step,
                      bool select_all) {
  kv_store::MemoryBudget budget(uint64_t{1} << 30);
  auto pool = kv_store::BlockPool::Create(format, /*max_blocks=*/4096, &budget);
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return 0;
  kv_store::Shard shard(pool->get(), &budget);
  const std::vector<std::byte> k(step * format.row_bytes(), std::byte{1});
  const std::vector<std::byte> v(step * format.row_bytes(), std::byte{2});
  const std::vector<float> maw(step, select_all ? 1.0f : 0.0f);
  // select_all = false: threshold 2 selects no entry (every MAW is 0).
  const kv_store::SelectRule rule{select_all, 2.0f};
  for (uint64_t done = 0; done < entries;) {
    const uint64_t n = std::min(step, entries - done);
    absl::StatusOr<uint64_t> appended = shard.Append(k.data(), v.data(), maw.data(), n, rule);
    EXPECT_TRUE(appended.ok()) << appended.status();
    if (!appended.ok()) return 0;
    done += n;
  }
  return budget.used();
}

struct FormatCase {
  KvDType dtype;
  uint32_t block_tokens;
  uint32_t head_dim;
};

const FormatCase kFormats[] = {
    {KvDType::kBf16, 16, 128}, {KvDType::kInt8, 16, 128}, {KvDType::kBf16, 64, 64},
    {KvDType::kInt8, 64, 64},  {KvDType::kInt8, 32, 40},  {KvDType::kF32, 16, 32},
};

TEST(NodeShardBytes, BlockFormatFormulaIsWhatKvStoreCharges) {
  for (const FormatCase& f : kFormats) {
    const BlockFormat format{f.block_tokens, f.head_dim, f.dtype};
    SCOPED_TRACE(std::string(kv_store::KvDTypeName(f.dtype)) + " block " +
                 std::to_string(f.block_tokens) + " head_dim " + std::to_string(f.head_dim));
    for (uint64_t entries : {1ull, 15ull, 64ull, 1000ull, 4097ull}) {
      SCOPED_TRACE(entries);
      // No selected copy (pages selection, exact mode): whole blocks only, exactly.
      EXPECT_EQ(format.ShardBytes(entries, 0), ChargedBytes(format, entries, entries, false));
      // Every entry selected in one append: one reservation of the selected copy, exactly.
      EXPECT_EQ(format.ShardBytes(entries, entries), ChargedBytes(format, entries, entries, true));
      // In appends of 7: the selected buffers grow geometrically, between the 1x and 2x forms.
      const uint64_t grown = ChargedBytes(format, entries, 7, true);
      EXPECT_GE(grown, format.ShardBytes(entries, entries, 1));
      EXPECT_LE(grown, format.ShardBytes(entries, entries, 2));
    }
  }
  // The int8 row: head_dim bytes and an f32 scale (132 B at head_dim 128, bf16: 256 B).
  EXPECT_EQ((BlockFormat{16, 128, KvDType::kInt8}.row_bytes()), 132u);
  EXPECT_EQ((BlockFormat{16, 128, KvDType::kBf16}.row_bytes()), 256u);
}

// The memory plan's node items for a hybrid request on one node: "node KV blocks" is the
// shards' blocks as kv_store charges them for the offloaded entries, and with MAW selection at
// beta 0 (every entry selected) "node selected copies" is the 2x bound of the selected buffers
// kv_store charges for one reservation.
TEST(NodeShardBytes, MemoryPlanNodeItemsAreKvStoreCharges) {
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  for (KvDType dtype : {KvDType::kBf16, KvDType::kInt8}) {
    for (SelectionRule selection : {SelectionRule::kPages, SelectionRule::kMaw}) {
      SCOPED_TRACE(std::string(kv_store::KvDTypeName(dtype)) + " " +
                   std::string(SelectionRuleName(selection)));
      MemoryPlanSetup setup;
      setup.config = *config;
      setup.kv_dtype = DType::kBF16;
      setup.node_kv_dtype = dtype;
      setup.engine.block_tokens = 16;
      setup.engine.page_tokens = 16;
      setup.max_context = 8192;
      setup.nodes.push_back({"node-a", uint64_t{64} << 30, uint64_t{64} << 30, std::nullopt});
      MemoryPlanRequest request = MemoryPlanRequest::Defaults(setup.engine);
      request.mode = AttentionMode::kHybrid;
      request.selection = selection;
      request.beta = 0.0f;
      request.context = 5000;
      request.window = 1024;
      request.sink = 4;
      request.batch = 2;
      absl::StatusOr<MemoryPlan> plan = EstimateMemory(setup, request);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const uint64_t offloaded = 5000 - 1024 - 4;
      const uint64_t shards = uint64_t(config->num_layers) * config->num_kv_heads * 2;
      const BlockFormat format{16, static_cast<uint32_t>(config->head_dim), dtype};
      const uint64_t blocks = ChargedBytes(format, offloaded, offloaded, false);
      const uint64_t with_copy = ChargedBytes(format, offloaded, offloaded, true);
      bool saw_blocks = false, saw_copies = false;
      for (const MemoryItem& item : plan->nodes.items) {
        if (item.name == "node KV blocks") {
          saw_blocks = true;
          EXPECT_EQ(item.bytes, shards * blocks) << item.detail;
        } else if (item.name == "node selected copies") {
          saw_copies = true;
          EXPECT_EQ(item.bytes, shards * 2 * (with_copy - blocks)) << item.detail;
        }
      }
      EXPECT_TRUE(saw_blocks);
      EXPECT_EQ(saw_copies, selection == SelectionRule::kMaw);
    }
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
