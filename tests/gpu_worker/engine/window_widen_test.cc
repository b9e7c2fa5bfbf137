// WindowCache::Widen / Narrow (device prefill): a widened window keeps every token of a long
// prompt on the device; Narrow() turns the tokens beyond the configured window into evictions,
// oldest first, and their Release shrinks the ring back to the configured bytes. At each stage
// every slot holds the K, V and MAW of its position, and the positions on the device are
// exactly the sink and the recent ones.
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

constexpr int64_t kLayers = 2, kHeads = 3, kDim = 8;

// Values that identify (position, layer, head); compared after rounding to the cache dtype.
float KOf(int64_t p, int64_t l, int64_t h) { return static_cast<float>(p) + 0.5f * (l * 4 + h); }
float MawOf(int64_t p, int64_t l, int64_t h) { return 1.0f / (1 + p + 7 * l + 3 * h); }

float Rounded(float x, DType dtype) {
  return dtype == DType::kF32 ? x : Bf16ToFloat(FloatToBf16(x));
}

float Load(const std::vector<char>& bytes, size_t i, DType dtype) {
  return dtype == DType::kF32 ? reinterpret_cast<const float*>(bytes.data())[i]
                              : Bf16ToFloat(reinterpret_cast<const uint16_t*>(bytes.data())[i]);
}

class WindowWidenTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing::MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
    options_.sink = 4;
    options_.window = 32;
    options_.block = 8;
    options_.max_chunk = 20;
    options_.max_context = 1000;
  }

  // Appends n tokens and writes K = KOf, V = -KOf and MAW = MawOf into their slots.
  void Feed(WindowCache& cache, int64_t n) {
    const int64_t first = cache.next_position();
    auto slots = cache.Append(n);
    ASSERT_TRUE(slots.ok()) << slots.status();
    std::vector<float> rows(n * 2 * kHeads * kDim);   // [n, (k heads | v heads), D]
    auto dev_rows = backend_->Allocate(rows.size() * 4);
    auto dev_slots = backend_->Allocate(n * 4);
    ASSERT_TRUE(dev_rows.ok() && dev_slots.ok());
    ASSERT_TRUE(backend_->CopyToDevice(dev_slots->data(), (*slots)->data(), n * 4).ok());
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kDim; ++d) {
            rows[(t * 2 * kHeads + h) * kDim + d] = KOf(first + t, l, h);
            rows[(t * 2 * kHeads + kHeads + h) * kDim + d] = -KOf(first + t, l, h);
          }
          const float maw = MawOf(first + t, l, h);
          ASSERT_TRUE(backend_
                          ->CopyToDevice(cache.maw(l) + h * cache.capacity() + (**slots)[t],
                                         &maw, 4)
                          .ok());
        }
      }
      ASSERT_TRUE(backend_->CopyToDevice(dev_rows->data(), rows.data(), rows.size() * 4).ok());
      WriteKvParams w;
      w.k = dev_rows->as<float>();
      w.v = dev_rows->as<float>() + kHeads * kDim;
      w.row_stride = 2 * kHeads * kDim;
      w.slots = dev_slots->as<int32_t>();
      w.k_cache = cache.k(l);
      w.v_cache = cache.v(l);
      w.cache_dtype = GetParam();
      w.num_tokens = n;
      w.num_kv_heads = kHeads;
      w.capacity = cache.capacity();
      w.head_dim = kDim;
      { absl::Status st = backend_->WriteKv(w); ASSERT_TRUE(st.ok()) << st; }
    }
  }

  // Every slot's position is one the cache should hold, each such position has one slot, and
  // its K, V and MAW are those Feed wrote; slots past scan_slots() are empty.
  void ExpectContents(const WindowCache& cache) {
    const int64_t cap = cache.capacity();
    std::vector<int32_t> slot_pos(cap);
    ASSERT_TRUE(backend_->CopyToHost(slot_pos.data(), cache.slot_pos(), cap * 4).ok());
    const int64_t sink = cache.options().sink;
    std::vector<int64_t> expected;
    for (int64_t p = 0; p < std::min(sink, cache.next_position()); ++p) expected.push_back(p);
    for (int64_t p = sink + cache.evicted_tokens(); p < cache.next_position(); ++p) {
      expected.push_back(p);
    }
    std::vector<int64_t> held;
    const size_t elem = DTypeBytes(GetParam());
    for (int64_t l = 0; l < kLayers; ++l) {
      std::vector<char> k(kHeads * cap * kDim * elem), v(k.size());
      std::vector<float> maw(kHeads * cap);
      ASSERT_TRUE(backend_->CopyToHost(k.data(), cache.k(l), k.size()).ok());
      ASSERT_TRUE(backend_->CopyToHost(v.data(), cache.v(l), v.size()).ok());
      ASSERT_TRUE(backend_->CopyToHost(maw.data(), cache.maw(l), maw.size() * 4).ok());
      for (int64_t s = 0; s < cap; ++s) {
        const int32_t p = slot_pos[s];
        if (p < 0) continue;
        ASSERT_LT(s, cache.scan_slots()) << "slot " << s << " holds position " << p;
        if (l == 0) held.push_back(p);
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kDim; ++d) {
            const size_t i = (h * cap + s) * kDim + d;
            ASSERT_EQ(Load(k, i, GetParam()), Rounded(KOf(p, l, h), GetParam()))
                << "slot " << s << " pos " << p;
            ASSERT_EQ(Load(v, i, GetParam()), Rounded(-KOf(p, l, h), GetParam()))
                << "slot " << s << " pos " << p;
          }
          ASSERT_EQ(maw[h * cap + s], MawOf(p, l, h)) << "MAW of slot " << s << " pos " << p;
        }
      }
    }
    std::sort(held.begin(), held.end());
    EXPECT_EQ(held, expected);
    EXPECT_EQ(cache.entries(), static_cast<int64_t>(expected.size()));
  }

  std::unique_ptr<Backend> backend_;
  WindowOptions options_;
  const WindowGeometry geometry_{kLayers, kHeads, kDim, GetParam()};
};

TEST_P(WindowWidenTest, WidenHoldsThePromptNarrowEvictsAndShrinks) {
  auto cache = WindowCache::Create(*backend_, geometry_, options_);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const size_t configured_bytes = WindowCache::BytesFor(geometry_, options_);
  // A first turn past the window: the ring has wrapped and evicted before the widening.
  for (int i = 0; i < 4; ++i) {
    Feed(*cache, 17);
    const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
    ASSERT_TRUE(cache->Release(blocks).ok());
  }
  ASSERT_GT(cache->evicted_tokens(), 0);
  const int64_t evicted_before = cache->evicted_tokens();
  ExpectContents(*cache);

  // Room for 150 more recent tokens: the prompt of the next turn stays whole on the device.
  const int64_t recent = cache->entries() - options_.sink;
  ASSERT_TRUE(cache->Widen(recent + 150).ok());
  EXPECT_TRUE(cache->widened());
  EXPECT_EQ(cache->configured_window(), 32);
  WindowOptions wide = options_;
  wide.window = (recent + 150 + 7) / 8 * 8;
  EXPECT_EQ(cache->options().window, wide.window);
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor(geometry_, wide));
  EXPECT_GT(cache->device_bytes(), configured_bytes);
  ExpectContents(*cache);
  for (int64_t fed = 0; fed < 150; fed += 20) {
    Feed(*cache, std::min<int64_t>(20, 150 - fed));
    EXPECT_TRUE(cache->PendingEvictions().empty()) << "after " << fed << " tokens";
  }
  EXPECT_EQ(cache->evicted_tokens(), evicted_before);
  ExpectContents(*cache);

  // Back to the configured window: the oldest blocks leave, judged by the configured n_gpu.
  ASSERT_TRUE(cache->Narrow().ok());
  EXPECT_FALSE(cache->widened());
  EXPECT_TRUE(cache->relaid());
  EXPECT_EQ(cache->eviction_entries(), options_.sink + 32);
  const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
  ASSERT_FALSE(blocks.empty());
  int64_t total = 0;
  for (const EvictedBlock& b : blocks) {
    EXPECT_EQ(b.first_pos, options_.sink + evicted_before + total);
    total += b.count;
  }
  const size_t elem = DTypeBytes(GetParam());
  std::vector<char> k(kHeads * total * kDim * elem), v(k.size());
  std::vector<float> maw(kHeads * total);
  ASSERT_TRUE(cache->ReadBlocks(1, blocks, k.data(), v.data(), maw.data()).ok());
  for (int64_t h = 0; h < kHeads; ++h) {
    for (int64_t t = 0; t < total; ++t) {
      const int64_t p = options_.sink + evicted_before + t;
      ASSERT_EQ(Load(k, (h * total + t) * kDim, GetParam()), Rounded(KOf(p, 1, h), GetParam()))
          << "t " << t;
      ASSERT_EQ(Load(v, (h * total + t) * kDim + 3, GetParam()),
                Rounded(-KOf(p, 1, h), GetParam()));
      ASSERT_EQ(maw[h * total + t], MawOf(p, 1, h));
    }
  }
  ASSERT_TRUE(cache->Release(blocks).ok());
  EXPECT_FALSE(cache->relaid());
  EXPECT_EQ(cache->device_bytes(), configured_bytes);
  EXPECT_LE(cache->entries() - options_.sink, 32);
  EXPECT_GT(cache->entries() - options_.sink, 32 - 8);
  ExpectContents(*cache);

  // The configured ring works on: decode and a chunk, with the usual evictions.
  for (int64_t n : {1, 1, 20, 5}) {
    Feed(*cache, n);
    const std::vector<EvictedBlock> more = cache->PendingEvictions();
    ASSERT_TRUE(cache->Release(more).ok());
    ExpectContents(*cache);
  }
}

// A prompt longer than the widened window: blocks leave during the prefill (at the widened
// size) and Narrow() evicts the rest down to the configured window.
TEST_P(WindowWidenTest, PartlyWidenedEvictsDuringThePrefill) {
  auto cache = WindowCache::Create(*backend_, geometry_, options_);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Widen(64).ok());
  int64_t evicted = 0;
  for (int i = 0; i < 8; ++i) {
    Feed(*cache, 20);
    const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
    for (const EvictedBlock& b : blocks) evicted += b.count;
    ASSERT_TRUE(cache->Release(blocks).ok());
    EXPECT_LE(cache->entries() - options_.sink, 64);
    EXPECT_EQ(cache->eviction_entries(), std::min(cache->entries(), options_.sink + 32));
  }
  EXPECT_GT(evicted, 0);
  EXPECT_TRUE(cache->widened());
  ExpectContents(*cache);
  ASSERT_TRUE(cache->Narrow().ok());
  ASSERT_TRUE(cache->Release(cache->PendingEvictions()).ok());
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor(geometry_, options_));
  ExpectContents(*cache);
}

// A short prompt: Narrow() with nothing to evict shrinks at once; Widen refuses what it cannot
// do (unlimited windows, pending evictions) and ignores a smaller request.
TEST_P(WindowWidenTest, NarrowWithoutEvictionsAndRefusals) {
  auto cache = WindowCache::Create(*backend_, geometry_, options_);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Widen(16).ok());   // not wider than the configured 32
  EXPECT_FALSE(cache->relaid());
  ASSERT_TRUE(cache->Widen(200).ok());
  Feed(*cache, 20);
  ASSERT_TRUE(cache->Narrow().ok());
  EXPECT_FALSE(cache->relaid());
  EXPECT_TRUE(cache->PendingEvictions().empty());
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor(geometry_, options_));
  ExpectContents(*cache);
  Feed(*cache, 20);
  ASSERT_FALSE(cache->PendingEvictions().empty());
  EXPECT_EQ(cache->Widen(200).code(), absl::StatusCode::kFailedPrecondition);

  WindowOptions unlimited = options_;
  unlimited.window = WindowOptions::kUnlimited;
  unlimited.sink = 0;
  auto gpu = WindowCache::Create(*backend_, geometry_, unlimited);
  ASSERT_TRUE(gpu.ok());
  EXPECT_EQ(gpu->Widen(100).code(), absl::StatusCode::kFailedPrecondition);
}

// Fork (a cached prefix continued by another request): the fork holds the parent's positions
// before the cut at their slots, with their K, V and MAW, and the parent is unchanged. A
// settling parent's pending blocks come along pending, and leave the fork as they leave the
// parent; a cut among evicted positions, or in a widened window, is refused.
TEST_P(WindowWidenTest, ForkCopiesThePrefixAndSettlesItsPendingBlocks) {
  auto parent = WindowCache::Create(*backend_, geometry_, options_);
  ASSERT_TRUE(parent.ok()) << parent.status();
  for (int i = 0; i < 4; ++i) {   // wrapped and evicted before
    Feed(*parent, 17);
    ASSERT_TRUE(parent->Release(parent->PendingEvictions()).ok());
  }
  const int64_t recent = parent->entries() - options_.sink;
  ASSERT_TRUE(parent->Widen(recent + 120).ok());
  for (int64_t fed = 0; fed < 120; fed += 20) Feed(*parent, 20);
  EXPECT_FALSE(parent->Fork(parent->next_position(), 1000).ok()) << "widened: a prefill";
  ASSERT_TRUE(parent->Narrow().ok());
  ASSERT_TRUE(parent->settling());
  const int64_t end = parent->next_position();
  const int64_t first_on_device = options_.sink + parent->evicted_tokens();

  // Cut among the evicted positions: refused (their KV is the tier's, before the cut).
  auto refused = parent->Fork(first_on_device - 1, 1000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(parent->Fork(end + 1, 1000).status().code(), absl::StatusCode::kInvalidArgument);

  for (const int64_t cut : {end - 10, first_on_device + 40, first_on_device}) {
    SCOPED_TRACE(cut);
    auto fork = parent->Fork(cut, 2000);
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ(fork->next_position(), cut);
    EXPECT_EQ(fork->evicted_tokens(), parent->evicted_tokens());
    EXPECT_EQ(fork->options().max_context, 2000);
    EXPECT_EQ(fork->configured_window(), 32);
    EXPECT_EQ(fork->device_bytes(), *parent->ForkBytes(cut, 2000));
    ExpectContents(*fork);
    // Pending blocks leave it oldest first, as the parent's would; then it works on.
    EXPECT_EQ(fork->settling(), cut - first_on_device > 32);
    while (!fork->PendingEvictions().empty()) {
      ASSERT_TRUE(fork->Release(fork->PendingEvictions()).ok());
    }
    EXPECT_FALSE(fork->relaid());
    EXPECT_EQ(fork->device_bytes(), WindowCache::BytesFor(geometry_, [&] {
                WindowOptions o = options_;
                o.max_context = 2000;
                return o;
              }()));
    Feed(*fork, 20);
    ASSERT_TRUE(fork->Release(fork->PendingEvictions()).ok());
    ExpectContents(*fork);
  }
  EXPECT_EQ(parent->next_position(), end);
  ExpectContents(*parent);
}

// A parked window holds no device memory and its K, V, MAW and slots in host memory; back on
// the device every position is where it was, and it goes on (appends wrap the ring, evictions
// leave oldest first). A widened or settling window is not parked.
TEST_P(WindowWidenTest, ParkMovesTheWindowToTheHostAndUnparkRestoresIt) {
  for (const int64_t window : {int64_t{32}, WindowOptions::kUnlimited}) {
    SCOPED_TRACE(window == WindowOptions::kUnlimited ? "unlimited" : "bounded");
    WindowOptions o = options_;
    o.window = window;
    o.max_context = 200;
    auto cache = WindowCache::Create(*backend_, geometry_, o);
    ASSERT_TRUE(cache.ok()) << cache.status();
    for (int i = 0; i < 5; ++i) {   // a bounded ring wraps and evicts
      Feed(*cache, 13);
      ASSERT_TRUE(cache->Release(cache->PendingEvictions()).ok());
    }
    const size_t resident = cache->device_bytes();
    EXPECT_EQ(cache->resident_bytes(), resident);
    const size_t park_bytes = cache->ParkBytes();
    EXPECT_EQ(park_bytes, static_cast<size_t>(kLayers * kHeads * cache->scan_slots()) *
                              (2 * kDim * DTypeBytes(GetParam()) + 4));
    const int64_t next = cache->next_position(), evicted = cache->evicted_tokens();

    ParkingPool pool(*backend_, size_t{1} << 30, 4096);
    ASSERT_TRUE(cache->Park(pool).ok());
    EXPECT_TRUE(cache->parked());
    EXPECT_EQ(cache->device_bytes(), 0u);
    EXPECT_EQ(cache->parked_bytes(), pool.PagesFor(park_bytes) * 4096);
    EXPECT_EQ(pool.in_use_bytes(), cache->parked_bytes());
    EXPECT_EQ(cache->resident_bytes(), resident);
    EXPECT_EQ(cache->Park(pool).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(cache->Append(1).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(cache->Truncate(next - 1).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(cache->Fork(next, 200).status().code(), absl::StatusCode::kFailedPrecondition);

    ASSERT_TRUE(cache->Unpark().ok());
    EXPECT_FALSE(cache->parked());
    EXPECT_EQ(cache->parked_bytes(), 0u);
    EXPECT_EQ(pool.in_use_bytes(), 0u);
    EXPECT_EQ(cache->device_bytes(), resident);
    EXPECT_EQ(cache->next_position(), next);
    EXPECT_EQ(cache->evicted_tokens(), evicted);
    EXPECT_EQ(cache->Unpark().code(), absl::StatusCode::kFailedPrecondition);
    ExpectContents(*cache);
    Feed(*cache, 19);
    ASSERT_TRUE(cache->Release(cache->PendingEvictions()).ok());
    ExpectContents(*cache);
  }
  // Its slots are about to move: a widened window (a prefill) and a settling one stay.
  auto widened = WindowCache::Create(*backend_, geometry_, options_);
  ASSERT_TRUE(widened.ok());
  ASSERT_TRUE(widened->Widen(100).ok());
  Feed(*widened, 20);
  Feed(*widened, 20);
  Feed(*widened, 20);
  ParkingPool pool(*backend_, size_t{1} << 30);
  EXPECT_EQ(widened->Park(pool).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(widened->Narrow().ok());
  ASSERT_TRUE(widened->settling());
  EXPECT_EQ(widened->Park(pool).code(), absl::StatusCode::kFailedPrecondition);
  // A pool too small: refused, the window unchanged.
  while (!widened->PendingEvictions().empty()) {
    ASSERT_TRUE(widened->Release(widened->PendingEvictions()).ok());
  }
  ParkingPool tiny(*backend_, 64, 64);
  EXPECT_EQ(widened->Park(tiny).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(widened->parked());
  EXPECT_GT(widened->device_bytes(), 0u);
  EXPECT_FALSE(widened->parked());
}

INSTANTIATE_TEST_SUITE_P(DTypes, WindowWidenTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace tandem::gpu_worker
