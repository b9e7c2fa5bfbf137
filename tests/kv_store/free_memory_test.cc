// Giving free KV memory back to the kernel: BlockPool::ReleaseFreeBlocks releases exactly the
// pages of blocks free since before the cut (checked with mincore, which reports the kernel's
// page residency of the pool's mapping), keeps blocks in use intact, and never makes an
// Allocate fail while a release is in flight; KvStore and FreeMemoryReleaser bring a store's
// resident block bytes to 0 after its sessions close.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kv_test_util.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/free_memory_releaser.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::kv_store {
namespace {

using Clock = std::chrono::steady_clock;

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

BlockFormat Format() { return BlockFormat{16, 64, KvDType::kF32}; }   // 8 KiB + MAW per block

// Residency of the pages wholly inside block `id`, and of those the block only partly covers.
struct Residency {
  size_t whole_pages = 0, whole_resident = 0;
};
Residency PagesOf(const BlockPool& pool, BlockId id) {
  const auto begin = reinterpret_cast<uintptr_t>(pool.data(id));
  const auto end = begin + pool.format().block_bytes();
  const uintptr_t first = (begin + kPage - 1) / kPage * kPage, last = end / kPage * kPage;
  Residency r;
  if (last <= first) return r;
  std::vector<unsigned char> vec((last - first) / kPage);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(first), last - first, vec.data()), 0);
  r.whole_pages = vec.size();
  for (unsigned char v : vec) r.whole_resident += v & 1;
  return r;
}

TEST(ReleaseFreeBlocksTest, ReleasesOnlyBlocksFreeBeforeTheCut) {
  const BlockFormat f = Format();
  const size_t bb = f.block_bytes();
  ASSERT_GE(bb, 2 * kPage) << "each block must cover whole pages for this test";
  MemoryBudget budget(1 << 30);
  auto created = BlockPool::Create(f, 64, &budget);
  ASSERT_TRUE(created.ok()) << created.status();
  BlockPool& p = **created;
  for (int i = 0; i < 32; ++i) {
    auto id = p.Allocate();
    ASSERT_TRUE(id.ok());
    ASSERT_EQ(*id, static_cast<BlockId>(i));
    std::memset(p.data(*id), 0x5a, bb);
  }
  for (BlockId id = 0; id < 32; ++id) {
    const Residency r = PagesOf(p, id);
    EXPECT_EQ(r.whole_resident, r.whole_pages) << id;
  }
  for (BlockId id = 0; id < 16; ++id) p.Unref(id);            // long free
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const Clock::time_point cut = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  for (BlockId id = 16; id < 24; ++id) p.Unref(id);           // freed after the cut
  EXPECT_EQ(p.blocks_resident(), 32u);
  const uint64_t used = budget.used();

  // Blocks 0..15 are one run starting page-aligned at the mapping's base.
  const uint64_t released = p.ReleaseFreeBlocks(cut);
  EXPECT_EQ(released, 16 * bb / kPage * kPage);
  EXPECT_EQ(p.blocks_resident(), 16u);
  EXPECT_EQ(budget.used(), used);   // the budget counts blocks in use, not pages
  for (BlockId id = 0; id < 32; ++id) {
    const Residency r = PagesOf(p, id);
    if (id < 16) {
      EXPECT_EQ(r.whole_resident, 0u) << "long-free block " << id << " kept its pages";
    } else {
      EXPECT_EQ(r.whole_resident, r.whole_pages) << "block " << id << " lost pages";
    }
  }
  for (BlockId id = 24; id < 32; ++id) {   // in use: contents intact, edge bytes included
    EXPECT_EQ(static_cast<unsigned>(p.data(id)[0]), 0x5au) << id;
    EXPECT_EQ(static_cast<unsigned>(p.data(id)[bb - 1]), 0x5au) << id;
  }
  EXPECT_EQ(p.ReleaseFreeBlocks(cut), 0u);   // nothing else was free before the cut

  // Reuse: the recently freed (resident) blocks first, newest first; then released ones,
  // whose whole pages read as zeros; the bump index last.
  for (BlockId want = 23; want >= 16; --want) {
    auto id = p.Allocate();
    ASSERT_TRUE(id.ok());
    EXPECT_EQ(*id, want);
  }
  auto reused = p.Allocate();
  ASSERT_TRUE(reused.ok());
  EXPECT_LT(*reused, 16u);
  EXPECT_EQ(static_cast<unsigned>(p.data(*reused)[bb / 2]), 0u);
  EXPECT_EQ(p.blocks_touched(), 32u);
  EXPECT_EQ(p.blocks_resident(), 17u);   // 16..31 and the reused one

  // Everything free now and released with a cut in the future: only pages of blocks in use
  // (and the pages they share with neighbours) stay.
  for (BlockId id = 16; id < 32; ++id) p.Unref(id);
  p.Unref(*reused);
  EXPECT_GT(p.ReleaseFreeBlocks(Clock::now() + std::chrono::hours(1)), 0u);
  EXPECT_EQ(p.blocks_resident(), 0u);
  for (BlockId id = 0; id < 32; ++id) EXPECT_EQ(PagesOf(p, id).whole_resident, 0u) << id;
  EXPECT_EQ(budget.used(), 0u);
}

TEST(ReleaseFreeBlocksTest, AllocateNeverFailsWhileAReleaseIsInFlight) {
  // 16 blocks, 4 threads holding at most 4 each: demand never exceeds the pool, so every
  // Allocate must succeed even while free blocks sit in a release.
  const BlockFormat f = Format();
  MemoryBudget budget(1 << 30);
  auto created = BlockPool::Create(f, 16, &budget);
  ASSERT_TRUE(created.ok());
  BlockPool& p = **created;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> failures{0}, allocations{0}, released{0};
  std::thread releaser([&] {
    while (!stop.load()) released.fetch_add(p.ReleaseFreeBlocks(Clock::now()));
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<BlockId> mine;
      for (int i = 0; i < 3000; ++i) {
        if (mine.size() < 4) {
          auto id = p.Allocate();
          if (!id.ok()) {
            failures.fetch_add(1);
            continue;
          }
          allocations.fetch_add(1);
          std::memset(p.data(*id), t + 1, f.block_bytes());
          mine.push_back(*id);
        }
        if (i % 2 == 1) {
          const BlockId id = mine.front();
          // Nobody else wrote this block while we held it, and no release zeroed it.
          EXPECT_EQ(static_cast<int>(p.data(id)[f.block_bytes() / 2]), t + 1);
          mine.erase(mine.begin());
          p.Unref(id);
        }
      }
      for (BlockId id : mine) p.Unref(id);
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  releaser.join();
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_GT(allocations.load(), 0u);
  std::printf("[release race] %llu allocations, %llu bytes released meanwhile\n",
              static_cast<unsigned long long>(allocations.load()),
              static_cast<unsigned long long>(released.load()));
  // Every block is accounted for exactly once.
  EXPECT_EQ(p.blocks_in_use(), 0u);
  std::vector<char> seen(16, 0);
  for (int i = 0; i < 16; ++i) {
    auto id = p.Allocate();
    ASSERT_TRUE(id.ok()) << i;
    ASSERT_LT(*id, 16u);
    EXPECT_FALSE(seen[*id]) << "block " << *id << " handed out twice";
    seen[*id] = 1;
  }
  EXPECT_EQ(p.Allocate().status().code(), absl::StatusCode::kResourceExhausted);
}

// A store with one session of 2 layers x 2 kv heads x 64 entries (8 blocks of 16 entries).
class StoreMemoryTest : public ::testing::Test {
 protected:
  void Fill(KvStore& store, const std::string& id) {
    SessionOptions o;
    o.geometry = Geometry{2, 8, 2, 64};
    o.block_tokens = 16;
    o.dtype = KvDType::kF32;
    auto session = store.OpenSession(id, o);
    ASSERT_TRUE(session.ok()) << session.status();
    const BlockFormat f = (*session)->format();
    constexpr uint32_t kN = 64;
    std::vector<std::byte> k, v;
    for (uint32_t h = 0; h < 2; ++h) {
      auto rows = testing::MakeRows(f.dtype, kN, f.head_dim, h);
      k.insert(k.end(), rows.begin(), rows.end());
      v.insert(v.end(), rows.begin(), rows.end());
    }
    const std::vector<float> maw(2 * kN, 1.0f);
    const std::vector<uint32_t> heads = {0, 1};
    for (uint32_t layer = 0; layer < 2; ++layer) {
      auto appended =
          store.Append(**session, layer, heads, k.data(), v.data(), maw.data(), kN, 64);
      ASSERT_TRUE(appended.ok()) << appended.status();
    }
  }
};

TEST_F(StoreMemoryTest, ReleaseFreeMemoryAfterCloseLeavesNothingResident) {
  KvStore store(KvStore::Options{64ull << 20, 16, 16});
  Fill(store, "a");
  const StoreStats open = store.Stats();
  EXPECT_EQ(open.blocks_in_use, 16u);
  EXPECT_EQ(open.resident_block_bytes, open.block_bytes_in_use);
  EXPECT_EQ(store.ReleaseFreeMemory(Clock::now()), 0u);   // nothing is free
  ASSERT_TRUE(store.CloseSession("a").ok());
  EXPECT_EQ(store.Stats().resident_block_bytes, open.block_bytes_in_use);   // kept for reuse
  EXPECT_GT(store.ReleaseFreeMemory(Clock::now() + std::chrono::seconds(1)), 0u);
  EXPECT_EQ(store.Stats().resident_block_bytes, 0u);
  // The released blocks serve the next session.
  Fill(store, "b");
  EXPECT_EQ(store.Stats().blocks_in_use, 16u);
  EXPECT_EQ(store.Stats().resident_block_bytes, open.block_bytes_in_use);
}

// With a warm reserve, the store's warmer faults in that many free blocks after an append,
// and the next session's appends take them instead of new pages.
TEST_F(StoreMemoryTest, WarmerKeepsTheReserveBesideAppends) {
  KvStore::Options options{64ull << 20, 16, 16};
  options.warm_reserve_bytes = 1ull << 20;
  KvStore store(options);
  Fill(store, "a");
  const StoreStats loaded = store.Stats();
  const uint64_t block_bytes = loaded.block_bytes_in_use / loaded.blocks_in_use;
  const uint64_t reserve = (1ull << 20) / block_bytes;
  // Waits until the resident blocks are `bytes` and the warmer has counted `warmed` blocks (it
  // has caught up; its count follows the blocks by a moment), or 10 s passed.
  auto wait_for = [&](uint64_t bytes, uint64_t warmed) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while ((store.Stats().resident_block_bytes != bytes || store.warmed_blocks() < warmed) &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  wait_for(loaded.block_bytes_in_use + reserve * block_bytes, reserve);
  EXPECT_EQ(store.Stats().resident_block_bytes, loaded.block_bytes_in_use + reserve * block_bytes);
  // While "a" was filled the warmer may have warmed blocks its later appends then took.
  EXPECT_GE(store.warmed_blocks(), reserve);
  // The second session's 16 blocks come from the reserve: the warmer makes up exactly those,
  // and no more memory is touched.
  const uint64_t warmed = store.warmed_blocks();
  Fill(store, "b");
  EXPECT_EQ(store.Stats().blocks_in_use, 2 * loaded.blocks_in_use);
  wait_for(2 * loaded.block_bytes_in_use + reserve * block_bytes, warmed + loaded.blocks_in_use);
  EXPECT_EQ(store.Stats().resident_block_bytes,
            2 * loaded.block_bytes_in_use + reserve * block_bytes);
  EXPECT_EQ(store.warmed_blocks() - warmed, loaded.blocks_in_use);
}

TEST_F(StoreMemoryTest, ReleaserWaitsForTheDelayThenReleases) {
  KvStore store(KvStore::Options{64ull << 20, 16, 16});
  Fill(store, "a");
  const uint64_t resident = store.Stats().resident_block_bytes;
  ASSERT_GT(resident, 0u);
  {
    FreeMemoryReleaser slow(store, std::chrono::hours(1), std::chrono::milliseconds(5));
    ASSERT_TRUE(store.CloseSession("a").ok());
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
    while (slow.passes() < 3 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_GE(slow.passes(), 3u);
    EXPECT_EQ(store.Stats().resident_block_bytes, resident) << "released before the delay";
    EXPECT_EQ(slow.released_bytes(), 0u);
  }
  FreeMemoryReleaser fast(store, std::chrono::milliseconds(20));
  EXPECT_EQ(fast.period(), std::chrono::milliseconds(10));   // after / 2, at least 10 ms
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  while (fast.released_bytes() == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(fast.released_bytes(), 0u);
  EXPECT_EQ(store.Stats().resident_block_bytes, 0u);
  EXPECT_EQ(FreeMemoryReleaser(store, std::chrono::hours(1)).period(),
            std::chrono::milliseconds(1000));
}

}  // namespace
}  // namespace tandem::kv_store
