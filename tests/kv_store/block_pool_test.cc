// BlockPool, MemoryBudget, BudgetedBuffer and BlockFormat.
#include "tandem/kv_store/block_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/memory_budget.h"
#include "tandem/kv_store/shard.h"

namespace tandem::kv_store {
namespace {

BlockFormat Format(uint32_t block_tokens = 16, uint32_t head_dim = 64,
                   KvDType dtype = KvDType::kF32) {
  return BlockFormat{block_tokens, head_dim, dtype};
}

TEST(BlockFormatTest, LayoutAndSizes) {
  // bf16, head_dim 128: rows of 256 bytes, entries of 2 * 256 + 4 = 516 bytes.
  const BlockFormat f = Format(64, 128, KvDType::kBf16);
  EXPECT_EQ(f.row_bytes(), 256u);
  EXPECT_EQ(f.entry_bytes(), 516u);
  EXPECT_EQ(f.k_offset(), 0u);
  EXPECT_EQ(f.v_offset(), 64u * 256u);
  EXPECT_EQ(f.maw_offset(), 2u * 64u * 256u);
  EXPECT_EQ(f.block_bytes(), 64u * 516u);  // 33024 is already a multiple of 64
  for (uint32_t bt : {16u, 17u, 31u, 64u, 100u, 256u}) {
    for (uint32_t hd : {16u, 24u, 64u, 128u, 256u}) {
      for (KvDType dt : {KvDType::kF32, KvDType::kBf16}) {
        const BlockFormat g = Format(bt, hd, dt);
        EXPECT_EQ(g.block_bytes() % 64, 0u);
        EXPECT_GE(g.block_bytes(), bt * g.entry_bytes());
        EXPECT_LT(g.block_bytes(), bt * g.entry_bytes() + 64);
      }
    }
  }
}

TEST(BlockFormatTest, ValidateNamesTheField) {
  EXPECT_TRUE(Format(16, 16).Validate().ok());
  EXPECT_TRUE(Format(256, 256, KvDType::kBf16).Validate().ok());
  absl::Status s = Format(15, 64).Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block_tokens"), std::string::npos) << s;
  EXPECT_NE(s.message().find("15"), std::string::npos) << s;
  EXPECT_EQ(Format(257, 64).Validate().code(), absl::StatusCode::kInvalidArgument);
  s = Format(64, 100).Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim"), std::string::npos) << s;
  EXPECT_EQ(Format(64, 4).Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Format(64, 8).Validate().ok());  // stories260k has head_dim 8
  EXPECT_EQ(Format(64, 264).Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Format(64, 64, static_cast<KvDType>(7)).Validate().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MemoryBudgetTest, ChargeNeverExceedsCapacity) {
  MemoryBudget budget(100);
  EXPECT_TRUE(budget.Charge(60).ok());
  EXPECT_TRUE(budget.Charge(40).ok());
  EXPECT_EQ(budget.used(), 100u);
  EXPECT_EQ(budget.free(), 0u);
  absl::Status s = budget.Charge(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("100 B of 100 B"), std::string::npos) << s;
  EXPECT_EQ(budget.used(), 100u);
  budget.Release(30);
  EXPECT_EQ(budget.used(), 70u);
  EXPECT_EQ(budget.Charge(31).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(budget.Charge(30).ok());
  // A huge charge must not wrap around.
  budget.Release(100);
  EXPECT_EQ(budget.Charge(~uint64_t{0}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(MemoryBudgetTest, ConcurrentChargesStopExactlyAtCapacity) {
  constexpr uint64_t kCapacity = 25000;
  MemoryBudget budget(kCapacity);
  std::atomic<uint64_t> granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        if (budget.Charge(1).ok()) granted.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(granted.load(), kCapacity);
  EXPECT_EQ(budget.used(), kCapacity);
}

TEST(BudgetedBufferTest, GrowsGeometricallyKeepsContentsAndCharges) {
  MemoryBudget budget(1 << 20);
  {
    BudgetedBuffer buf(&budget);
    EXPECT_EQ(buf.capacity(), 0u);
    ASSERT_TRUE(buf.Reserve(100).ok());
    EXPECT_EQ(buf.capacity(), 128u);  // rounded up to 64
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 64, 0u);
    EXPECT_EQ(budget.used(), 128u);
    for (int i = 0; i < 128; ++i) buf.data()[i] = static_cast<std::byte>(i);
    ASSERT_TRUE(buf.Reserve(129).ok());
    EXPECT_EQ(buf.capacity(), 256u);  // doubled
    EXPECT_EQ(budget.used(), 256u);
    for (int i = 0; i < 128; ++i) ASSERT_EQ(buf.data()[i], static_cast<std::byte>(i));
    ASSERT_TRUE(buf.Reserve(200).ok());  // fits: no change
    EXPECT_EQ(buf.capacity(), 256u);
    ASSERT_TRUE(buf.Reserve(1000).ok());  // more than double: exactly the request
    EXPECT_EQ(buf.capacity(), 1024u);
    EXPECT_EQ(budget.used(), 1024u);
    buf.Clear();
    EXPECT_EQ(buf.capacity(), 0u);
    EXPECT_EQ(buf.data(), nullptr);
    EXPECT_EQ(budget.used(), 0u);
    ASSERT_TRUE(buf.Reserve(64).ok());
  }
  EXPECT_EQ(budget.used(), 0u);  // the destructor releases
}

TEST(BudgetedBufferTest, FallsBackToExactGrowthThenFailsUnchanged) {
  MemoryBudget budget(1500);
  BudgetedBuffer buf(&budget);
  ASSERT_TRUE(buf.Reserve(1024).ok());
  buf.data()[0] = std::byte{42};
  // Doubling to 2048 does not fit in 1500; exactly 1088 does.
  ASSERT_TRUE(buf.Reserve(1025).ok());
  EXPECT_EQ(buf.capacity(), 1088u);
  EXPECT_EQ(buf.data()[0], std::byte{42});
  const std::byte* data = buf.data();
  EXPECT_EQ(buf.Reserve(1600).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(buf.capacity(), 1088u);
  EXPECT_EQ(buf.data(), data);
  EXPECT_EQ(budget.used(), 1088u);
}

TEST(BlockPoolTest, CreateRejectsBadArguments) {
  MemoryBudget budget(1 << 20);
  EXPECT_EQ(BlockPool::Create(Format(), 0, &budget).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(Format(8), 4, &budget).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(Format(16, 100), 4, &budget).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(Format(), uint64_t{1} << 33, &budget).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(Format(), 4, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockPoolTest, AllocateUnrefReusesBlocksAndChargesBudget) {
  const BlockFormat f = Format();
  const uint64_t bb = f.block_bytes();
  MemoryBudget budget(1 << 20);
  auto pool = BlockPool::Create(f, 8, &budget);
  ASSERT_TRUE(pool.ok()) << pool.status();
  BlockPool& p = **pool;
  EXPECT_EQ(p.max_blocks(), 8u);
  EXPECT_EQ(p.blocks_in_use(), 0u);
  EXPECT_EQ(p.blocks_touched(), 0u);

  std::vector<BlockId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = p.Allocate();
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  EXPECT_EQ(ids, (std::vector<BlockId>{0, 1, 2}));  // bump index
  for (BlockId id : ids) EXPECT_EQ(p.refcount(id), 1u);
  EXPECT_EQ(p.blocks_in_use(), 3u);
  EXPECT_EQ(p.blocks_touched(), 3u);
  EXPECT_EQ(budget.used(), 3 * bb);
  // Blocks are bb bytes apart and 64-byte aligned.
  EXPECT_EQ(p.data(1) - p.data(0), static_cast<ptrdiff_t>(bb));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data(2)) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::byte*>(p.maw(1)), p.data(1) + f.maw_offset());

  p.Unref(1);
  EXPECT_EQ(p.refcount(1), 0u);
  EXPECT_EQ(p.blocks_in_use(), 2u);
  EXPECT_EQ(budget.used(), 2 * bb);
  auto reused = p.Allocate();
  ASSERT_TRUE(reused.ok());
  EXPECT_EQ(*reused, 1u);  // the free list comes before the bump index
  EXPECT_EQ(p.blocks_touched(), 3u);
  auto fresh = p.Allocate();
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(*fresh, 3u);
  EXPECT_EQ(p.blocks_touched(), 4u);

  for (BlockId id : {0u, 1u, 2u, 3u}) p.Unref(id);
  EXPECT_EQ(p.blocks_in_use(), 0u);
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_EQ(p.blocks_touched(), 4u);  // the high-water mark stays
}

TEST(BlockPoolTest, ReferencesKeepABlockAlive) {
  MemoryBudget budget(1 << 20);
  auto pool = BlockPool::Create(Format(), 4, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  auto id = p.Allocate();
  ASSERT_TRUE(id.ok());
  std::memset(p.k(*id), 0x5a, p.format().k_bytes());
  p.Ref(*id);
  p.Ref(*id);
  EXPECT_EQ(p.refcount(*id), 3u);
  p.Unref(*id);
  p.Unref(*id);
  EXPECT_EQ(p.refcount(*id), 1u);
  EXPECT_EQ(p.blocks_in_use(), 1u);
  EXPECT_EQ(static_cast<unsigned>(p.k(*id)[17]), 0x5au);
  p.Unref(*id);
  EXPECT_EQ(p.refcount(*id), 0u);
  EXPECT_EQ(p.blocks_in_use(), 0u);
  EXPECT_EQ(budget.used(), 0u);
}

TEST(BlockPoolTest, MaxBlocksExhaustedChangesNothing) {
  MemoryBudget budget(1 << 20);
  auto pool = BlockPool::Create(Format(), 4, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(p.Allocate().ok());
  const uint64_t used = budget.used();
  auto full = p.Allocate();
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("4 blocks"), std::string::npos) << full.status();
  EXPECT_EQ(p.blocks_in_use(), 4u);
  EXPECT_EQ(p.blocks_touched(), 4u);
  EXPECT_EQ(budget.used(), used);
  p.Unref(2);
  auto again = p.Allocate();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 2u);
}

TEST(BlockPoolTest, BudgetExhaustedChangesNothing) {
  const BlockFormat f = Format();
  MemoryBudget budget(2 * f.block_bytes() + f.block_bytes() / 2);
  auto pool = BlockPool::Create(f, 100, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  ASSERT_TRUE(p.Allocate().ok());
  ASSERT_TRUE(p.Allocate().ok());
  auto over = p.Allocate();
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("budget"), std::string::npos) << over.status();
  EXPECT_EQ(p.blocks_in_use(), 2u);
  EXPECT_EQ(p.blocks_touched(), 2u);
  EXPECT_EQ(budget.used(), 2 * f.block_bytes());
  p.Unref(0);
  auto again = p.Allocate();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 0u);
}

TEST(BlockPoolTest, LargeReservationCostsNothingUntilUsed) {
  // 2^24 blocks of 8 KiB reserve 128 GiB of address space; only touched blocks cost memory
  // and the bookkeeping grows with the bump index.
  const BlockFormat f = Format();
  MemoryBudget budget(uint64_t{1} << 40);
  auto pool = BlockPool::Create(f, uint64_t{1} << 24, &budget);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto id = (*pool)->Allocate();
  ASSERT_TRUE(id.ok());
  std::memset((*pool)->data(*id), 1, f.block_bytes());
  EXPECT_EQ((*pool)->blocks_touched(), 1u);
  EXPECT_EQ(budget.used(), f.block_bytes());
  (*pool)->Unref(*id);
}

TEST(BlockPoolTest, AllocateManyTakesFreedBlocksFirstAndAllOrNone) {
  const BlockFormat f = Format();
  MemoryBudget budget(1 << 20);
  auto pool = BlockPool::Create(f, 8, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  auto first = p.AllocateMany(5);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, (std::vector<BlockId>{0, 1, 2, 3, 4}));
  EXPECT_EQ(budget.used(), 5 * f.block_bytes());
  // 3 left: asking 4 takes nothing.
  auto over = p.AllocateMany(4);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("4 blocks"), std::string::npos) << over.status();
  EXPECT_NE(over.status().message().find("3 of 8 free"), std::string::npos) << over.status();
  EXPECT_EQ(p.blocks_in_use(), 5u);
  EXPECT_EQ(p.blocks_touched(), 5u);
  EXPECT_EQ(budget.used(), 5 * f.block_bytes());
  // Freed blocks (most recent first) come before never-used ones.
  p.Unref(1);
  p.Unref(3);
  auto second = p.AllocateMany(4);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, (std::vector<BlockId>{3, 1, 5, 6}));
  for (BlockId id : *second) EXPECT_EQ(p.refcount(id), 1u);
  EXPECT_EQ(p.blocks_in_use(), 7u);
  EXPECT_EQ(budget.used(), 7 * f.block_bytes());
  auto none = p.AllocateMany(0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(BlockPoolTest, AllocateManyOverBudgetChangesNothing) {
  const BlockFormat f = Format();
  MemoryBudget budget(3 * f.block_bytes());
  auto pool = BlockPool::Create(f, 100, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  ASSERT_TRUE(p.Allocate().ok());
  auto over = p.AllocateMany(3);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("budget"), std::string::npos) << over.status();
  EXPECT_EQ(p.blocks_in_use(), 1u);
  EXPECT_EQ(p.blocks_touched(), 1u);
  EXPECT_EQ(budget.used(), f.block_bytes());
  auto fits = p.AllocateMany(2);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(budget.used(), 3 * f.block_bytes());
}

// Resident pages of [p, p + bytes) by mincore, or -1 where mincore fails.
int64_t ResidentPages(const std::byte* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  std::vector<unsigned char> vec((end - begin) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()) != 0) return -1;
  return std::count_if(vec.begin(), vec.end(), [](unsigned char c) { return (c & 1) != 0; });
}

int64_t SpannedPages(const std::byte* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  return static_cast<int64_t>((end - begin) / page);
}

// AllocateMany hands out blocks whose pages are in memory, and faulting them in leaves the
// bytes of a neighbour in use (blocks of 8,256 bytes share pages) as they were.
TEST(BlockPoolTest, AllocateManyFaultsInFreshAndReleasedBlocks) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  {
    // Does this kernel populate (Linux >= 5.14)? Probe a mapping of our own.
    void* probe = mmap(nullptr, page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    ASSERT_NE(probe, MAP_FAILED);
    const bool populates = madvise(probe, page, 23 /* MADV_POPULATE_WRITE */) == 0;
    munmap(probe, page);
    if (!populates) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE";
  }
  const BlockFormat f = Format();   // f32, head_dim 64, 16 tokens: 8,256-byte blocks
  ASSERT_NE(f.block_bytes() % page, 0u);
  constexpr uint64_t kBlocks = 64;
  MemoryBudget budget(kBlocks * f.block_bytes());
  auto pool = BlockPool::Create(f, kBlocks, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  auto head = p.Allocate();
  ASSERT_TRUE(head.ok());
  std::memset(p.data(*head), 0x5a, f.block_bytes());
  auto many = p.AllocateMany(40);
  ASSERT_TRUE(many.ok()) << many.status();
  for (BlockId id : *many) {
    EXPECT_EQ(ResidentPages(p.data(id), f.block_bytes()), SpannedPages(p.data(id), f.block_bytes()))
        << "block " << id;
  }
  for (size_t i = 0; i < f.block_bytes(); ++i) {
    ASSERT_EQ(p.data(*head)[i], std::byte{0x5a}) << "byte " << i << " of the block in use";
  }
  // Released blocks lose their pages; taking them again faults them back in.
  for (BlockId id : *many) p.Unref(id);
  ASSERT_GT(p.ReleaseFreeBlocks(std::chrono::steady_clock::now() + std::chrono::seconds(1)), 0u);
  const std::byte* middle = p.data((*many)[20]);
  ASSERT_LT(ResidentPages(middle, f.block_bytes()), SpannedPages(middle, f.block_bytes()));
  auto again = p.AllocateMany(40);
  ASSERT_TRUE(again.ok()) << again.status();
  for (BlockId id : *again) {
    EXPECT_EQ(ResidentPages(p.data(id), f.block_bytes()), SpannedPages(p.data(id), f.block_bytes()))
        << "block " << id;
  }
  EXPECT_EQ(p.blocks_resident(), 41u);
  for (size_t i = 0; i < f.block_bytes(); ++i) {
    ASSERT_EQ(p.data(*head)[i], std::byte{0x5a}) << "byte " << i << " of the block in use";
  }
}

// The warm reserve: kept only while blocks are in use, never past what the budget could hand
// out, filled from released blocks before never-used ones, and left by ReleaseFreeBlocks.
TEST(BlockPoolTest, WarmReserveFollowsUseAndBudget) {
  const BlockFormat f = Format();
  MemoryBudget budget(20 * f.block_bytes());
  auto pool = BlockPool::Create(f, 100, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  p.SetWarmReserve(8);
  EXPECT_EQ(p.warm_reserve(), 8u);
  EXPECT_EQ(p.WarmFreeBlocks(100), 0u);   // idle: no reserve
  EXPECT_EQ(p.blocks_touched(), 0u);
  auto held = p.AllocateMany(10);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(p.WarmFreeBlocks(3), 3u);     // at most what is asked per call
  EXPECT_EQ(p.WarmFreeBlocks(100), 5u);   // then up to the reserve
  EXPECT_EQ(p.WarmFreeBlocks(100), 0u);
  EXPECT_EQ(p.blocks_touched(), 18u);
  EXPECT_EQ(p.blocks_resident(), 18u);
  EXPECT_EQ(budget.used(), 10 * f.block_bytes());   // free blocks are not charged
  // Allocations take the warm blocks (most recent first), not new ones.
  auto more = p.AllocateMany(4);
  ASSERT_TRUE(more.ok());
  for (BlockId id : *more) EXPECT_GE(id, 10u);
  EXPECT_EQ(p.blocks_touched(), 18u);
  // The budget has 6 blocks left and 4 are warm: only 2 more are warmed.
  EXPECT_EQ(p.WarmFreeBlocks(100), 2u);
  EXPECT_EQ(p.blocks_touched(), 20u);
  // ReleaseFreeBlocks leaves the reserve while blocks are in use...
  const auto later = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (BlockId id : *more) p.Unref(id);   // 10 free now
  EXPECT_EQ(p.ReleaseFreeBlocks(later) > 0, true);
  EXPECT_EQ(p.blocks_resident(), 10u + 8u);
  // ... and released blocks are warmed again before never-used ones: 3 warm are left, and the
  // budget's 5 free blocks allow 2 more.
  auto again = p.AllocateMany(5);
  ASSERT_TRUE(again.ok());
  const uint64_t touched = p.blocks_touched();
  EXPECT_EQ(p.WarmFreeBlocks(100), 2u);
  EXPECT_EQ(p.blocks_touched(), touched);
  EXPECT_EQ(p.blocks_resident(), 15u + 5u);
  // Idle: everything goes.
  for (BlockId id : *held) p.Unref(id);
  for (BlockId id : *again) p.Unref(id);
  EXPECT_EQ(p.WarmFreeBlocks(100), 0u);
  p.ReleaseFreeBlocks(later);
  EXPECT_EQ(p.blocks_resident(), 0u);
}

TEST(BlockPoolTest, ConcurrentAllocateAndUnrefBalance) {
  const BlockFormat f = Format();
  MemoryBudget budget(64 * f.block_bytes());
  auto pool = BlockPool::Create(f, 64, &budget);
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  std::vector<std::thread> threads;
  std::atomic<uint64_t> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      std::vector<BlockId> mine;
      for (int i = 0; i < 2000; ++i) {
        if (auto id = p.Allocate(); id.ok()) {
          mine.push_back(*id);
          ok.fetch_add(1);
        }
        if (mine.size() > 8 || (i % 3 == 0 && !mine.empty())) {
          p.Unref(mine.back());
          mine.pop_back();
        }
      }
      for (BlockId id : mine) p.Unref(id);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(ok.load(), 0u);
  EXPECT_EQ(p.blocks_in_use(), 0u);
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_LE(p.blocks_touched(), 64u);
}

}  // namespace
}  // namespace tandem::kv_store

namespace tandem::kv_store {
namespace {

// A pool on transparent huge pages (where the kernel has them) holds what is written like any
// other: every byte of many blocks round-trips, and freed blocks come back to the budget.
TEST(BlockPoolTest, HugePagePoolRoundTripsEveryBlock) {
  const BlockFormat format = Format(64, 128, KvDType::kBf16);
  constexpr uint64_t kBlocks = 200;   // > 2 MiB of blocks
  MemoryBudget budget(kBlocks * format.block_bytes());
  auto pool = BlockPool::Create(format, kBlocks, &budget, /*huge_pages=*/true);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<BlockId> ids;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    auto id = (*pool)->Allocate();
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    std::byte* data = (*pool)->data(*id);
    for (size_t b = 0; b < format.block_bytes(); b += 4093) data[b] = std::byte(i * 7 + b);
  }
  EXPECT_EQ((*pool)->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  for (uint64_t i = 0; i < kBlocks; ++i) {
    const std::byte* data = (*pool)->data(ids[i]);
    for (size_t b = 0; b < format.block_bytes(); b += 4093) {
      ASSERT_EQ(data[b], std::byte(i * 7 + b)) << "block " << i << " byte " << b;
    }
  }
  for (BlockId id : ids) (*pool)->Unref(id);
  EXPECT_EQ(budget.used(), 0u);
}

}  // namespace
}  // namespace tandem::kv_store
