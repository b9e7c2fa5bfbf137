// KvCacheManager over a SessionTable: eviction is least recently used and explicit (parked while
// the host pool has room, the oldest parked closed to make room, closed when parking is off,
// parked ones kept through a device shortage they cannot cure),
// a parked session comes back whole, the session limit closes cached sessions only, and a
// session in use is never a hit.
#include "tandem/gpu_worker/kv_cache_manager.h"

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/tier_factory.h"

namespace tandem::gpu_worker {
namespace {

constexpr size_t kPage = ParkingPool::kDefaultPageBytes;   // each session parks in one page
const WindowGeometry kGeometry{2, 2, 8, DType::kF32};

class KvCacheManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing::MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
  }

  // 2 layers, 2 kv heads of 8, blocks of 8, at most 64 positions.
  absl::StatusOr<WindowCache> MakeWindow(int64_t window) {
    WindowOptions o;
    o.window = window;
    o.sink = 0;
    o.block = 8;
    o.max_chunk = 32;
    o.max_context = 64;
    return WindowCache::Create(*backend_, kGeometry, o);
  }

  // A gpu-mode session `id` holding `tokens` positions (ids 1..tokens).
  void Open(SessionTable& table, const std::string& id, int64_t tokens) {
    auto window = MakeWindow(WindowOptions::kUnlimited);
    ASSERT_TRUE(window.ok()) << window.status();
    ASSERT_TRUE(window->Append(tokens).ok());
    auto seq = std::make_unique<Sequence>(id, AttentionMode::kGpu, std::move(*window));
    for (int32_t t = 1; t <= tokens; ++t) seq->tokens.push_back(t);
    table.Add(std::move(seq));
  }

  // An offload-mode session `id` whose host pages hold `offloaded` entries (window 16).
  void OpenOffloaded(SessionTable& table, const std::string& id, int64_t offloaded) {
    auto window = MakeWindow(16);
    ASSERT_TRUE(window.ok()) << window.status();
    auto seq = std::make_unique<Sequence>(id, AttentionMode::kOffload, std::move(*window));
    std::vector<float> zeros(2 * offloaded * 8, 0.0f);
    auto rows = backend_->Allocate(zeros.size() * sizeof(float));
    ASSERT_TRUE(rows.ok());
    ASSERT_TRUE(backend_->CopyToDevice(rows->data(), zeros.data(), zeros.size() * 4).ok());
    TierSpec spec;
    spec.mode = AttentionMode::kOffload;
    spec.geometry = kGeometry;
    spec.host_page_tokens = 8;
    spec.seed_host = [&](OffloadedKv& kv) -> absl::Status {
      for (int64_t l = 0; l < 2; ++l) {
        absl::Status s = kv.AppendFromDevice(l, rows->data(), rows->data(), offloaded);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    };
    auto tier = OpenOffloadTier(*backend_, nullptr, spec);
    ASSERT_TRUE(tier.ok()) << tier.status();
    seq->offload = std::move(*tier);
    ASSERT_GT(seq->offload->footprint().host, 0u);
    EXPECT_EQ(seq->offload->footprint().nodes, 0u);
    for (int32_t t = 1; t <= 24; ++t) seq->tokens.push_back(t);
    table.Add(std::move(seq));
  }

  // An attempt that fits once the device holds at most `max_bytes` of the table's sessions.
  static std::function<absl::Status()> FitsIn(const SessionTable& table, size_t max_bytes) {
    return [&table, max_bytes]() -> absl::Status {
      if (table.DeviceBytes() <= max_bytes) return absl::OkStatus();
      return absl::ResourceExhaustedError("device");
    };
  }

  std::unique_ptr<Backend> backend_;
};

KvCacheOptions Options(size_t host_bytes) {
  KvCacheOptions o;
  o.block_tokens = 8;
  o.min_tokens = 8;
  o.host_bytes = host_bytes;
  return o;
}

absl::Status AnyRoom(size_t) { return absl::OkStatus(); }

TEST_F(KvCacheManagerTest, EvictionParksTheOldestAndClosesParkedOnesForRoom) {
  SessionTable table(8);
  KvCacheManager cache(*backend_, table, Options(kPage), AnyRoom);
  for (const char* id : {"a", "b", "c"}) {
    Open(table, id, 24);
    cache.Insert(id, "scope", table.Find(id)->tokens);   // "a" is the least recently used
  }
  const size_t one = table.Find("c")->device_bytes();
  ASSERT_GT(one, 0u);
  ASSERT_LE(table.Find("a")->ParkBytes(), kPage);

  // Room for one session's bytes: "a" is parked, then "b" needs the pool: "a" is closed.
  ASSERT_TRUE(cache.WithEviction(FitsIn(table, one)).ok());
  EXPECT_FALSE(table.contains("a"));
  EXPECT_TRUE(table.Find("b")->parked());
  EXPECT_FALSE(table.Find("c")->parked());
  EXPECT_EQ(cache.parks(), 2u);
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(cache.parked_sessions(), 1u);
  EXPECT_EQ(cache.host_bytes(), kPage);
  EXPECT_EQ(cache.device_bytes(), one);
  EXPECT_EQ(cache.cached_sessions(), 2u);

  // A parked hit comes back whole and is the most recently used.
  ASSERT_TRUE(cache.Unpark("scope", "b"));
  EXPECT_FALSE(table.Find("b")->parked());
  EXPECT_EQ(table.Find("b")->device_bytes(), one);
  EXPECT_EQ(cache.unparks(), 1u);
  EXPECT_EQ(cache.host_bytes(), 0u);
  // The session limit closes the least recently used cached session ("c").
  ASSERT_TRUE(cache.MakeSessionRoom(2).ok());
  EXPECT_TRUE(table.contains("b"));
  EXPECT_FALSE(table.contains("c"));
  EXPECT_EQ(cache.evictions(), 2u);
}

// A parked session holds no device memory: a device shortage that parking cannot cure (the
// running requests hold the rest) leaves it cached for the next hit instead of emptying the cache.
TEST_F(KvCacheManagerTest, ADeviceShortageKeepsWhatIsParked) {
  SessionTable table(8);
  KvCacheManager cache(*backend_, table, Options(2 * kPage), AnyRoom);
  Open(table, "a", 24);
  Open(table, "b", 24);
  cache.Insert("a", "scope", table.Find("a")->tokens);
  cache.Insert("b", "scope", table.Find("b")->tokens);
  const absl::Status status = cache.WithEviction([] { return absl::ResourceExhaustedError("device"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.Find("a")->parked());
  EXPECT_TRUE(table.Find("b")->parked());
  EXPECT_EQ(cache.parks(), 2u);
  EXPECT_EQ(cache.evictions(), 0u);
  EXPECT_EQ(cache.cached_sessions(), 2u);
  EXPECT_EQ(cache.device_bytes(), 0u);
}

TEST_F(KvCacheManagerTest, WithoutAHostBudgetEvictionCloses) {
  SessionTable table(8);
  KvCacheManager cache(*backend_, table, Options(0), AnyRoom);
  Open(table, "a", 24);
  Open(table, "b", 24);
  cache.Insert("a", "scope", table.Find("a")->tokens);
  cache.Insert("b", "scope", table.Find("b")->tokens);
  ASSERT_TRUE(cache.WithEviction(FitsIn(table, table.Find("b")->device_bytes())).ok());
  EXPECT_FALSE(table.contains("a"));
  EXPECT_TRUE(table.contains("b"));
  EXPECT_EQ(cache.parks(), 0u);
  EXPECT_EQ(cache.evictions(), 1u);
  // Nothing cached is left to free: the attempt's own error comes back.
  ASSERT_TRUE(cache.WithEviction(FitsIn(table, 0)).ok());
  EXPECT_FALSE(table.contains("b"));
  EXPECT_EQ(cache.evictions(), 2u);
  EXPECT_EQ(cache.WithEviction([] { return absl::ResourceExhaustedError("device"); }).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.evictions(), 2u);
}

// Room short of host pages or CPU-node memory (memory_shortage.h) is made by closing the least
// recently used cached session holding that memory, never by parking (which frees device
// memory only) or by closing sessions that hold none of it.
TEST_F(KvCacheManagerTest, EvictionFreesTheMemoryTheAttemptWasShortOf) {
  SessionTable table(8);
  KvCacheManager cache(*backend_, table, Options(kPage), AnyRoom);
  Open(table, "old", 24);
  OpenOffloaded(table, "hosted", 16);
  Open(table, "new", 24);
  for (const char* id : {"old", "hosted", "new"}) {
    cache.Insert(id, "scope", table.Find(id)->tokens);
  }
  EXPECT_GT(cache.footprint().host, 0u);
  // Short of CPU-node memory: nothing cached holds any, nothing is evicted.
  absl::Status nodes = cache.WithEviction(
      [] { return MarkShortOf(MemoryKind::kNodes, absl::ResourceExhaustedError("nodes")); });
  EXPECT_EQ(ShortOf(nodes), MemoryKind::kNodes);
  EXPECT_EQ(cache.evictions(), 0u);
  EXPECT_EQ(cache.parks(), 0u);
  // Short of host pages until "hosted" is gone: it alone is closed, though "old" is older.
  ASSERT_TRUE(cache
                  .WithEviction([&]() -> absl::Status {
                    if (!table.contains("hosted")) return absl::OkStatus();
                    return MarkShortOf(MemoryKind::kHost, absl::ResourceExhaustedError("host"));
                  })
                  .ok());
  EXPECT_FALSE(table.contains("hosted"));
  EXPECT_TRUE(table.contains("old"));
  EXPECT_TRUE(table.contains("new"));
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(cache.parks(), 0u);
  EXPECT_EQ(cache.footprint().host, 0u);
  // Unmarked (the device): parked first.
  ASSERT_TRUE(cache
                  .WithEviction([&]() -> absl::Status {
                    if (table.Find("old")->parked()) return absl::OkStatus();
                    return absl::ResourceExhaustedError("device");
                  })
                  .ok());
  EXPECT_EQ(cache.parks(), 1u);
  EXPECT_EQ(cache.evictions(), 1u);
}

TEST_F(KvCacheManagerTest, SessionsInUseAndKeptOnesAreNeverEvicted) {
  SessionTable table(8);
  KvCacheManager cache(*backend_, table, Options(0), AnyRoom);
  Open(table, "cached", 24);
  Open(table, "running", 24);
  Open(table, "kept", 24);
  table.Keep("kept", "own");
  cache.Insert("cached", "scope", table.Find("cached")->tokens);
  std::vector<int32_t> prompt;
  for (int32_t t = 1; t <= 30; ++t) prompt.push_back(t);
  auto hit = cache.Match("scope", prompt);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->session_id, "cached");
  EXPECT_EQ(hit->common, 24);
  EXPECT_FALSE(cache.Match("other scope", prompt).has_value());
  // A cached session a request now runs is not a hit, and leaves the cache.
  table.SetRunning("cached", nullptr);
  EXPECT_FALSE(cache.Match("scope", prompt).has_value());
  EXPECT_FALSE(cache.contains("cached"));
  // Only cached sessions make room: three open, none cached.
  EXPECT_EQ(cache.MakeSessionRoom(3).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.WithEviction(FitsIn(table, 0)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(table.size(), 3u);
  EXPECT_EQ(cache.evictions(), 0u);
}

}  // namespace
}  // namespace tandem::gpu_worker
