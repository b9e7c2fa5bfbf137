// MergeStates / MergeStateInPlace: merging attention over two disjoint key sets equals attention
// over their union (vs the double reference: O relative error <= 1e-5 with f32 KV, LSE absolute
// error <= 1e-5); the empty state (-inf LSE) is a bit-exact identity; two empties give O = 0,
// LSE = -inf, never NaN.
#include "tandem/cpu_attention/merge_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/thread_pool.h"

namespace tandem::cpu_attention {
namespace {


constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Attention of `rows` contiguous query rows (T = 1, G = rows) over k/v [n, D] (f32 KV).
void Attend(const std::vector<float>& q, const float* k, const float* v, size_t n, uint32_t rows,
            uint32_t D, ThreadPool& pool, std::vector<float>* o, std::vector<float>* lse) {
  o->assign(size_t{rows} * D, -1.0f);
  lse->assign(rows, -1.0f);
  AttentionParams p;
  p.dtype = kv_store::KvDType::kF32;
  p.head_dim = D;
  p.group = rows;
  p.num_tokens = 1;
  HeadProblem h;
  h.k = reinterpret_cast<const std::byte*>(k);
  h.v = reinterpret_cast<const std::byte*>(v);
  h.n = n;
  h.q = q.data();
  h.o = o->data();
  h.lse = lse->data();
  ASSERT_TRUE(SparseAttention(p, {&h, 1}, pool).ok());
}

TEST(MergeStates, TwoHalvesEqualTheWhole) {
  constexpr uint32_t D = 64, rows = 4;
  ThreadPool pool(2);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {2u, 9u, 300u, 4001u}) {
    std::vector<float> q(rows * D), k(n * D), v(n * D);
    for (float& x : q) x = 2.0f * normal(rng);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    const size_t half = n / 3;  // unequal halves
    std::vector<float> o_a, lse_a, o_b, lse_b;
    Attend(q, k.data(), v.data(), half, rows, D, pool, &o_a, &lse_a);
    Attend(q, k.data() + half * D, v.data() + half * D, n - half, rows, D, pool, &o_b, &lse_b);

    std::vector<double> ref_o, ref_lse;
    ReferenceAttention(q.data(), k.data(), v.data(), n, 1, rows, D, 1.0 / std::sqrt(double{D}),
                       &ref_o, &ref_lse);
    std::vector<float> o(rows * D), lse(rows);
    MergeStates(o_a.data(), lse_a.data(), o_b.data(), lse_b.data(), o.data(), lse.data(), rows, D);
    EXPECT_LE(RelativeError(o, ref_o), 1e-5) << "n=" << n;
    for (uint32_t r = 0; r < rows; ++r) EXPECT_NEAR(lse[r], ref_lse[r], 1e-5);

    // In place (out aliases a), and the one-row form, give the same bits.
    std::vector<float> o_in = o_a, lse_in = lse_a;
    MergeStates(o_in.data(), lse_in.data(), o_b.data(), lse_b.data(), o_in.data(), lse_in.data(),
                rows, D);
    EXPECT_EQ(0, std::memcmp(o_in.data(), o.data(), o.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(lse_in.data(), lse.data(), lse.size() * sizeof(float)));
    std::vector<float> o_row = o_a, lse_row = lse_a;
    for (uint32_t r = 0; r < rows; ++r) {
      MergeStateInPlace(&o_row[r * D], &lse_row[r], &o_b[r * D], lse_b[r], D);
    }
    EXPECT_EQ(0, std::memcmp(o_row.data(), o.data(), o.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(lse_row.data(), lse.data(), lse.size() * sizeof(float)));
  }
}

TEST(MergeStates, EmptySideIsBitExactIdentity) {
  constexpr size_t D = 128;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> o(D), empty_o(D, 0.0f);
  for (float& x : o) x = normal(rng);
  const float lse = 3.75f;

  std::vector<float> out(D);
  float out_lse;
  MergeStates(o.data(), &lse, empty_o.data(), &kNegInf, out.data(), &out_lse, 1, D);
  EXPECT_EQ(0, std::memcmp(out.data(), o.data(), D * sizeof(float)));
  EXPECT_EQ(out_lse, lse);
  MergeStates(empty_o.data(), &kNegInf, o.data(), &lse, out.data(), &out_lse, 1, D);
  EXPECT_EQ(0, std::memcmp(out.data(), o.data(), D * sizeof(float)));
  EXPECT_EQ(out_lse, lse);

  // In place, both directions.
  std::vector<float> dst = o;
  float dst_lse = lse;
  MergeStateInPlace(dst.data(), &dst_lse, empty_o.data(), kNegInf, D);
  EXPECT_EQ(0, std::memcmp(dst.data(), o.data(), D * sizeof(float)));
  EXPECT_EQ(dst_lse, lse);
  std::vector<float> dst2(D, 0.0f);
  float dst2_lse = kNegInf;
  MergeStateInPlace(dst2.data(), &dst2_lse, o.data(), lse, D);
  EXPECT_EQ(0, std::memcmp(dst2.data(), o.data(), D * sizeof(float)));
  EXPECT_EQ(dst2_lse, lse);
}

TEST(MergeStates, TwoEmptiesGiveZeroAndNegInfNeverNaN) {
  constexpr size_t D = 64, rows = 3;
  // Garbage (even NaN) in the O of empty states must not leak.
  std::vector<float> o_a(rows * D, std::numeric_limits<float>::quiet_NaN());
  std::vector<float> o_b(rows * D, 5.0f);
  std::vector<float> lse_a(rows, kNegInf), lse_b(rows, kNegInf);
  std::vector<float> out(rows * D, 7.0f), out_lse(rows, 7.0f);
  MergeStates(o_a.data(), lse_a.data(), o_b.data(), lse_b.data(), out.data(), out_lse.data(), rows,
              D);
  for (float x : out) ASSERT_EQ(x, 0.0f);
  for (float x : out_lse) ASSERT_EQ(x, kNegInf);

  std::vector<float> dst(D, 1.0f);
  float dst_lse = kNegInf;
  MergeStateInPlace(dst.data(), &dst_lse, o_b.data(), kNegInf, D);
  for (float x : dst) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(dst_lse, kNegInf);
}

TEST(MergeStates, FarApartLsesStayFinite) {
  constexpr size_t D = 16;
  std::vector<float> o_a(D, 1.0f), o_b(D, -1.0f), out(D);
  const float lse_a = 200.0f, lse_b = -200.0f;  // exp() of either alone overflows/underflows
  float out_lse;
  MergeStates(o_a.data(), &lse_a, o_b.data(), &lse_b, out.data(), &out_lse, 1, D);
  for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f);
  EXPECT_FLOAT_EQ(out_lse, 200.0f);
  const float lse_c = 200.0f;
  MergeStates(o_a.data(), &lse_a, o_b.data(), &lse_c, out.data(), &out_lse, 1, D);
  for (float x : out) EXPECT_FLOAT_EQ(x + 1.0f, 1.0f);  // equal weights: mean of 1 and -1
  EXPECT_NEAR(out_lse, 200.0f + std::log(2.0f), 1e-5);
}

}  // namespace
}  // namespace tandem::cpu_attention
