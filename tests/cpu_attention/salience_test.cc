// ComputeSalience over real Shards against a double-precision reference: a[i] = mean over the
// T*G query rows of softmax_i(scale * q·k_i) over every held entry. Tolerance: max |a - ref|
// <= 1e-6 + 1e-4 * ref per entry, and sum(a) = 1 within 1e-5.
#include "tandem/cpu_attention/salience.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "tandem/common/bf16.h"
#include "tandem/kv_store/block_pool.h"
#include "tandem/kv_store/memory_budget.h"
#include "tandem/kv_store/shard.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::BlockFormat;
using kv_store::BlockPool;
using kv_store::KvDType;
using kv_store::MemoryBudget;
using kv_store::SelectRule;
using kv_store::Shard;

std::vector<double> ReferenceSalience(const std::vector<float>& q, size_t rows,
                                      const std::vector<float>& k, size_t n, size_t D,
                                      double scale) {
  std::vector<double> a(n, 0.0), s(n);
  for (size_t r = 0; r < rows; ++r) {
    double m = -INFINITY;
    for (size_t i = 0; i < n; ++i) {
      double dot = 0.0;
      for (size_t d = 0; d < D; ++d) dot += double{q[r * D + d]} * k[i * D + d];
      s[i] = scale * dot;
      m = std::max(m, s[i]);
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += std::exp(s[i] - m);
    for (size_t i = 0; i < n; ++i) a[i] += std::exp(s[i] - m) / sum / static_cast<double>(rows);
  }
  return a;
}

struct ShardFixture {
  std::unique_ptr<MemoryBudget> budget = std::make_unique<MemoryBudget>(uint64_t{1} << 30);
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<Shard> shard;
  std::vector<float> k_f32;  // [n, D] exact values held

  ShardFixture(uint32_t block_tokens, uint32_t D, KvDType dtype, size_t n, uint32_t seed,
               float k_scale = 1.0f) {
    BlockFormat fmt;
    fmt.block_tokens = block_tokens;
    fmt.head_dim = D;
    fmt.dtype = dtype;
    auto p = BlockPool::Create(fmt, 1024, budget.get());
    EXPECT_TRUE(p.ok()) << p.status();
    pool = std::move(*p);
    shard = std::make_unique<Shard>(pool.get(), budget.get());
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t es = kv_store::DTypeBytes(dtype);
    // Append in a few uneven batches so block boundaries fall mid-batch.
    size_t done = 0;
    while (done < n) {
      const size_t batch = std::min<size_t>(n - done, 1 + (done * 7 + 13) % 150);
      std::vector<std::byte> kr(batch * D * es), vr(batch * D * es);
      std::vector<float> maw(batch, 0.5f);
      for (size_t i = 0; i < batch * D; ++i) {
        float kv = k_scale * normal(rng), vv = normal(rng);
        if (dtype == KvDType::kBf16) {
          const bf16_t kb = FloatToBf16(kv), vb = FloatToBf16(vv);
          std::memcpy(kr.data() + 2 * i, &kb, 2);
          std::memcpy(vr.data() + 2 * i, &vb, 2);
          kv = Bf16ToFloat(kb);
        } else {
          std::memcpy(kr.data() + 4 * i, &kv, 4);
          std::memcpy(vr.data() + 4 * i, &vv, 4);
        }
        k_f32.push_back(kv);
      }
      auto appended = shard->Append(kr.data(), vr.data(), maw.data(), batch, SelectRule{});
      EXPECT_TRUE(appended.ok()) << appended.status();
      done += batch;
    }
  }
};

struct Case {
  uint32_t block_tokens, D, G, T;
  KvDType dtype;
  size_t n;
};

class SalienceTest : public ::testing::TestWithParam<Case> {};

TEST_P(SalienceTest, MatchesReferenceAndSumsToOne) {
  const Case c = GetParam();
  ShardFixture fx(c.block_tokens, c.D, c.dtype, c.n, c.n + c.D);
  ASSERT_EQ(fx.shard->held(), c.n);
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // q laid out [T, H_q, D] with 2 kv heads' worth of query heads: q_token_stride > G * D.
  const size_t q_stride = 2 * size_t{c.G} * c.D;
  std::vector<float> q(c.T * q_stride);
  for (float& x : q) x = 2.0f * normal(rng);
  std::vector<float> q_rows;  // [T*G, D] for the reference
  for (uint32_t t = 0; t < c.T; ++t) {
    q_rows.insert(q_rows.end(), q.begin() + t * q_stride, q.begin() + t * q_stride + c.G * c.D);
  }

  AttentionParams p;
  p.dtype = c.dtype;
  p.head_dim = c.D;
  p.group = c.G;
  p.num_tokens = c.T;
  p.q_token_stride = q_stride;
  std::vector<float> a(c.n, -1.0f);
  ASSERT_TRUE(ComputeSalience(p, *fx.shard, q.data(), a).ok());
  const auto ref = ReferenceSalience(q_rows, size_t{c.T} * c.G, fx.k_f32, c.n, c.D,
                                     1.0 / std::sqrt(static_cast<double>(c.D)));
  double sum = 0.0, worst = 0.0;
  for (size_t i = 0; i < c.n; ++i) {
    ASSERT_NEAR(a[i], ref[i], 1e-6 + 1e-4 * ref[i]) << "entry " << i;
    worst = std::max(worst, std::abs(a[i] - ref[i]));
    sum += a[i];
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  std::printf("  n=%zu: worst abs err %.3g, sum - 1 = %.3g\n", c.n, worst, sum - 1.0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SalienceTest,
                         ::testing::Values(Case{16, 64, 1, 1, KvDType::kBf16, 1},
                                           Case{16, 64, 4, 1, KvDType::kBf16, 17},
                                           Case{64, 128, 8, 1, KvDType::kBf16, 1000},
                                           Case{64, 128, 4, 3, KvDType::kF32, 777},
                                           Case{256, 64, 2, 2, KvDType::kBf16, 3000},
                                           Case{32, 128, 1, 1, KvDType::kF32, 64}));

TEST(Salience, EmptyShardAndBadArguments) {
  ShardFixture empty(64, 64, KvDType::kBf16, 0, 1);
  AttentionParams p;
  p.dtype = KvDType::kBf16;
  p.head_dim = 64;
  std::vector<float> q(64, 1.0f);
  EXPECT_TRUE(ComputeSalience(p, *empty.shard, q.data(), {}).ok());

  ShardFixture fx(64, 64, KvDType::kBf16, 10, 2);
  std::vector<float> a(10);
  EXPECT_EQ(ComputeSalience(p, *fx.shard, q.data(), std::span<float>(a.data(), 9)).code(),
            absl::StatusCode::kInvalidArgument);
  AttentionParams wrong = p;
  wrong.head_dim = 128;
  EXPECT_EQ(ComputeSalience(wrong, *fx.shard, q.data(), a).code(),
            absl::StatusCode::kInvalidArgument);
  wrong = p;
  wrong.dtype = KvDType::kF32;
  EXPECT_EQ(ComputeSalience(wrong, *fx.shard, q.data(), a).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSalience(p, *fx.shard, nullptr, a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::cpu_attention
