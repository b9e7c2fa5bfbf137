// KvStore::Append of an int8 session quantises a large append in slices and fills its heads'
// shards through Options::parallel_for (the CPU node's attention ThreadPool): the stored rows
// are the same bytes as QuantizeRowsInt8 of the whole input in one thread, and the MAW and the
// selection the same, with and without the pool; a one-block append stays in the calling
// thread.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/int8_rows.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::kv_store {
namespace {

constexpr uint32_t kHeads = 8, kD = 128, kBlock = 64;

// Random bf16 rows [kHeads, n, kD], with a per-row magnitude so the scales differ.
std::vector<std::byte> RandomRows(uint32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16_t> rows(size_t{kHeads} * n * kD);
  for (size_t r = 0; r < size_t{kHeads} * n; ++r) {
    const float magnitude = 0.1f + static_cast<float>(r % 13);
    for (uint32_t d = 0; d < kD; ++d) rows[r * kD + d] = FloatToBf16(magnitude * normal(rng));
  }
  std::vector<std::byte> bytes(rows.size() * sizeof(bf16_t));
  std::memcpy(bytes.data(), rows.data(), bytes.size());
  return bytes;
}

struct Store {
  explicit Store(KvStore::Options options) : store(std::move(options)) {
    SessionOptions o;
    o.geometry = {1, kHeads * 4, kHeads, kD};
    o.block_tokens = kBlock;
    o.dtype = KvDType::kBf16;
    o.int8_storage = true;
    o.beta = 1.0f;  // selects maw > 1 / 4096
    auto opened = store.OpenSession("s", o);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (opened.ok()) session = *opened;
  }
  // MAW alternates 0 and 1: every other entry passes the selection threshold (beta / 4096).
  absl::StatusOr<AppendStats> Append(const std::vector<std::byte>& k,
                                     const std::vector<std::byte>& v, uint32_t n) {
    std::vector<uint32_t> heads(kHeads);
    for (uint32_t h = 0; h < kHeads; ++h) heads[h] = h;
    std::vector<float> maw(size_t{kHeads} * n);
    for (size_t i = 0; i < maw.size(); ++i) maw[i] = static_cast<float>(i % 2);
    return store.Append(*session, 0, heads, k.data(), v.data(), maw.data(), n, 4096);
  }
  KvStore store;
  std::shared_ptr<Session> session;
};

// Entry i of `head`'s shard (K or V) against the reference rows [kHeads, n] of int8 rows.
void ExpectStored(const Session& session, const std::vector<std::byte>& reference, uint32_t n,
                  bool values, const char* what) {
  const size_t row = BlockFormat{kBlock, kD, KvDType::kInt8}.row_bytes();
  int mismatches = 0;
  for (uint32_t h = 0; h < kHeads; ++h) {
    const Shard* shard = session.shard(0, h);
    ASSERT_NE(shard, nullptr);
    ASSERT_EQ(shard->held(), n);
    for (uint32_t i = 0; i < n; ++i) {
      const BlockId block = shard->blocks()[i / kBlock];
      const std::byte* stored =
          (values ? shard->pool()->v(block) : shard->pool()->k(block)) + (i % kBlock) * row;
      mismatches += std::memcmp(stored, reference.data() + (size_t{h} * n + i) * row, row) != 0;
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

TEST(Int8ParallelAppend, PoolSlicesStoreTheSameBytesAsOneThread) {
  constexpr uint32_t kN = 4096;  // 32768 rows of K and of V: 32 slices each
  const std::vector<std::byte> k = RandomRows(kN, 1), v = RandomRows(kN, 2);
  const size_t row = BlockFormat{kBlock, kD, KvDType::kInt8}.row_bytes();
  std::vector<std::byte> k_ref(size_t{kHeads} * kN * row), v_ref(k_ref.size());
  QuantizeRowsInt8(k.data(), KvDType::kBf16, size_t{kHeads} * kN, kD, k_ref.data());
  QuantizeRowsInt8(v.data(), KvDType::kBf16, size_t{kHeads} * kN, kD, v_ref.data());

  cpu_attention::ThreadPool pool(4);
  std::atomic<int> calls{0};
  std::atomic<size_t> tasks{0};
  KvStore::Options parallel;
  parallel.capacity_bytes = 256ull << 20;
  parallel.parallel_for = [&](size_t n, const std::function<void(size_t)>& fn) {
    calls.fetch_add(1);
    tasks.fetch_add(n);
    pool.ParallelFor(n, fn);
  };
  Store with_pool(parallel);
  KvStore::Options serial;
  serial.capacity_bytes = 256ull << 20;
  Store inline_only(serial);
  ASSERT_NE(with_pool.session, nullptr);
  ASSERT_NE(inline_only.session, nullptr);

  absl::StatusOr<AppendStats> pooled = with_pool.Append(k, v, kN);
  absl::StatusOr<AppendStats> serial_stats = inline_only.Append(k, v, kN);
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  ASSERT_TRUE(serial_stats.ok()) << serial_stats.status();
  EXPECT_EQ(pooled->entries_appended, serial_stats->entries_appended);
  EXPECT_EQ(pooled->entries_selected, serial_stats->entries_selected);
  EXPECT_EQ(pooled->entries_selected, uint64_t{kHeads} * kN / 2);
  // Quantisation (K and V in 1024-row slices), then the heads' shards.
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(tasks.load(), 2u * kHeads * kN / 1024 + kHeads);
  for (uint32_t h = 0; h < kHeads; ++h) {
    const Shard* a = with_pool.session->shard(0, h);
    const Shard* b = inline_only.session->shard(0, h);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(a->selected_count(), b->selected_count()) << "head " << h;
    int maw_mismatches = 0;
    for (uint32_t i = 0; i < kN; ++i) {
      maw_mismatches += a->pool()->maw(a->blocks()[i / kBlock])[i % kBlock] !=
                        b->pool()->maw(b->blocks()[i / kBlock])[i % kBlock];
    }
    EXPECT_EQ(maw_mismatches, 0) << "head " << h;
  }
  ExpectStored(*with_pool.session, k_ref, kN, false, "K, pool");
  ExpectStored(*with_pool.session, v_ref, kN, true, "V, pool");
  ExpectStored(*inline_only.session, k_ref, kN, false, "K, one thread");
  ExpectStored(*inline_only.session, v_ref, kN, true, "V, one thread");
}

TEST(Int8ParallelAppend, OneBlockStaysInTheCallingThread) {
  constexpr uint32_t kN = 64;  // 512 rows of K and of V: one slice each
  const std::vector<std::byte> k = RandomRows(kN, 3), v = RandomRows(kN, 4);
  int calls = 0;
  KvStore::Options options;
  options.capacity_bytes = 64ull << 20;
  options.parallel_for = [&](size_t n, const std::function<void(size_t)>& fn) {
    ++calls;
    for (size_t i = 0; i < n; ++i) fn(i);
  };
  Store store(options);
  ASSERT_NE(store.session, nullptr);
  ASSERT_TRUE(store.Append(k, v, kN).ok());
  EXPECT_EQ(calls, 0);
  const size_t row = BlockFormat{kBlock, kD, KvDType::kInt8}.row_bytes();
  std::vector<std::byte> k_ref(size_t{kHeads} * kN * row);
  QuantizeRowsInt8(k.data(), KvDType::kBf16, size_t{kHeads} * kN, kD, k_ref.data());
  ExpectStored(*store.session, k_ref, kN, false, "K");
}

}  // namespace
}  // namespace tandem::kv_store
