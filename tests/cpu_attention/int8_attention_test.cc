// 8-bit node KV (--node_kv_dtype=int8): the row codec and the MAW (SparseAttention), page
// (PagedAttention) and salience kernels over int8 rows, against references.
//
// Two references per kernel:
//  1. Exactness: the double-precision reference over the values the kernels compute with (the
//     dequantised rows q * scale as f32): the tolerances of the f32 kernel tests (O relative
//     1e-5, LSE 1e-4).
//  2. Quantisation cost: the reference over the ORIGINAL bf16 K/V, within a bound derived from
//     the quantisation step. Per element |k - k'| <= sk / 2 (sk = max|k row| / 127, the row's
//     step), so for query row r and key i the score moves by at most
//        eps_ri = scale * sum_d |q_rd| * sk_i / 2
//     hence |LSE' - LSE| <= max_i eps_ri (LSE is 1-Lipschitz in the max norm of the scores) and,
//     since every softmax weight moves by a factor within e^(+-2 eps),
//        |O' - O| <= (e^(2 max eps) - 1) * max|v| + max_i sv_i / 2,
//     each plus the kernels' own fp32 tolerance (1e-4). That worst case adds every element's
//     error with the same sign; the test also asserts the tighter typical bound that treats
//     the rounding errors as independent and uniform (variance step^2 / 12 per element): the
//     score error is then within 6 standard deviations,
//        eps6_ri = 6 * scale * ||q_r||_2 * sk_i / sqrt(12),
//     with the LSE and O bounds above evaluated at eps6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/paged_attention.h"
#include "scoped_cpu_isa.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/salience.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/int8_rows.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;

constexpr double kMawOTol = 1e-5;
constexpr double kPagedOTol = 1e-5;
constexpr double kLseTol = 1e-4;

size_t Int8Row(uint32_t D) { return D + kv_store::kInt8ScaleBytes; }

std::vector<std::byte> ToBf16Bytes(const std::vector<float>& x) {
  std::vector<std::byte> out(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const bf16_t b = FloatToBf16(x[i]);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// [n, D] bf16-exact floats -> n int8 rows.
std::vector<std::byte> Quantise(const std::vector<float>& x, uint32_t D) {
  const size_t n = x.size() / D;
  std::vector<std::byte> rows(n * Int8Row(D));
  const std::vector<std::byte> bf = ToBf16Bytes(x);
  kv_store::QuantizeRowsInt8(bf.data(), KvDType::kBf16, n, D, rows.data());
  return rows;
}

// int8 rows -> [n, D] floats: q * scale, optionally rounded to bf16 (what SparseAttention's
// tiles hold).
std::vector<float> Dequantise(const std::vector<std::byte>& rows, uint32_t D, bool bf16) {
  const size_t n = rows.size() / Int8Row(D);
  std::vector<float> out(n * D);
  kv_store::DequantizeRowsInt8(rows.data(), n, D, KvDType::kF32,
                               reinterpret_cast<std::byte*>(out.data()));
  if (bf16) {
    for (float& x : out) x = Bf16ToFloat(FloatToBf16(x));
  }
  return out;
}

// KV with a few outlier channels (as real keys have), bf16-exact.
std::vector<float> RandomKv(size_t n, uint32_t D, std::mt19937& rng, bool outliers) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n * D);
  for (size_t i = 0; i < x.size(); ++i) {
    const bool big = outliers && (i % D) % 17 == 3;
    x[i] = Bf16ToFloat(FloatToBf16(normal(rng) * (big ? 8.0f : 1.0f)));
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Row codec

TEST(Int8Rows, RoundTripWithinHalfAStep) {
  std::mt19937 rng(1);
  for (uint32_t D : {8u, 64u, 128u, 256u}) {
    for (KvDType src : {KvDType::kF32, KvDType::kBf16}) {
      const size_t n = 37;
      std::vector<float> x = RandomKv(n, D, rng, /*outliers=*/true);
      std::fill_n(x.begin() + 5 * D, D, 0.0f);  // an all-zero row
      std::vector<std::byte> in =
          src == KvDType::kF32
              ? std::vector<std::byte>(reinterpret_cast<const std::byte*>(x.data()),
                                       reinterpret_cast<const std::byte*>(x.data() + x.size()))
              : ToBf16Bytes(x);
      std::vector<std::byte> rows(n * Int8Row(D));
      kv_store::QuantizeRowsInt8(in.data(), src, n, D, rows.data());
      const std::vector<float> back = Dequantise(rows, D, /*bf16=*/false);
      for (size_t r = 0; r < n; ++r) {
        const std::byte* row = rows.data() + r * Int8Row(D);
        float amax = 0.0f;
        for (uint32_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(x[r * D + d]));
        const float scale = kv_store::Int8RowScale(row, D);
        ASSERT_EQ(scale, amax / 127.0f) << "row " << r;
        int max_code = 0;
        for (uint32_t d = 0; d < D; ++d) {
          const int code = static_cast<int8_t>(row[d]);
          max_code = std::max(max_code, std::abs(code));
          // Half a step, plus the f32 rounding of x * (127 / amax) and of q * scale.
          ASSERT_LE(std::abs(back[r * D + d] - x[r * D + d]), 0.5f * scale * (1 + 1e-5f) + 1e-30f)
              << "D " << D << " row " << r << " d " << d;
        }
        EXPECT_EQ(max_code, amax > 0 ? 127 : 0) << "row " << r;
      }
    }
  }
}

TEST(Int8Rows, NonFiniteValuesQuantiseToZeroWithAFiniteScale) {
  std::vector<float> x(16, 1.0f);
  x[0] = 4.0f;
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[7] = std::numeric_limits<float>::infinity();
  x[9] = -std::numeric_limits<float>::infinity();
  std::vector<std::byte> row(Int8Row(16));
  kv_store::QuantizeRowsInt8(reinterpret_cast<const std::byte*>(x.data()), KvDType::kF32, 1, 16,
                             row.data());
  EXPECT_EQ(kv_store::Int8RowScale(row.data(), 16), 4.0f / 127.0f);
  EXPECT_EQ(static_cast<int8_t>(row[0]), 127);
  EXPECT_EQ(static_cast<int8_t>(row[3]), 0);
  EXPECT_EQ(std::abs(static_cast<int8_t>(row[7])), 127);  // +inf clamps to the largest code
  EXPECT_EQ(std::abs(static_cast<int8_t>(row[9])), 127);
}

// What a migration between int8 nodes does: export dequantises to the session's bf16, the new
// node quantises again. With bf16 input (what workers send) the codes and the scale come back
// exactly: the largest element's bf16(127 * scale) is the original bf16 maximum, so the new
// scale is the same quotient, and every other element moves by < 2^-8 of a code.
TEST(Int8Rows, RequantisingTheExportedBf16KeepsTheCodes) {
  std::mt19937 rng(2);
  const uint32_t D = 128;
  const size_t n = 200;
  const std::vector<std::byte> rows = Quantise(RandomKv(n, D, rng, true), D);
  std::vector<std::byte> bf16(n * D * 2), again(rows.size());
  kv_store::ConvertRows(rows.data(), KvDType::kInt8, n, D, bf16.data(), KvDType::kBf16);
  kv_store::ConvertRows(bf16.data(), KvDType::kBf16, n, D, again.data(), KvDType::kInt8);
  for (size_t r = 0; r < n; ++r) {
    const std::byte* a = rows.data() + r * Int8Row(D);
    const std::byte* b = again.data() + r * Int8Row(D);
    ASSERT_EQ(std::memcmp(a, b, D), 0) << "codes of row " << r;
    const float sa = kv_store::Int8RowScale(a, D), sb = kv_store::Int8RowScale(b, D);
    ASSERT_EQ(sa, sb) << "row " << r;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels

// One kv head's data: the original bf16-exact K/V and its int8 rows.
struct Head {
  std::vector<float> k, v;        // [n, D]
  std::vector<std::byte> k8, v8;  // n_ int8 rows
  size_t n_ = 0;
};

Head MakeHead(size_t n, uint32_t D, std::mt19937& rng) {
  Head h;
  h.n_ = n;
  h.k = RandomKv(n, D, rng, /*outliers=*/true);
  h.v = RandomKv(n, D, rng, /*outliers=*/false);
  h.k8 = Quantise(h.k, D);
  h.v8 = Quantise(h.v, D);
  return h;
}

// Query rows of token t, group row j at q[(t * H + h) * G + j) * D] (the service layout).
struct Case {
  uint32_t D, G, T, H;
  std::vector<Head> heads;
  std::vector<float> q, o, lse;
  float scale;
  const float* QRow(size_t t, size_t h, size_t j) const {
    return q.data() + ((t * H + h) * G + j) * D;
  }
};

Case MakeCase(uint32_t D, uint32_t G, uint32_t T, const std::vector<size_t>& counts,
              uint32_t seed) {
  std::mt19937 rng(seed);
  Case c{D, G, T, static_cast<uint32_t>(counts.size()), {}, {}, {}, {}, 0};
  for (size_t n : counts) c.heads.push_back(MakeHead(n, D, rng));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  c.q.resize(size_t{T} * c.H * G * D);
  for (float& x : c.q) x = normal(rng);
  c.o.assign(c.q.size(), 12345.0f);
  c.lse.assign(size_t{T} * c.H * G, 12345.0f);
  c.scale = 1.0f / std::sqrt(static_cast<float>(D));
  return c;
}

// Checks head h of the case's output against (1) the reference over `k_seen`/`v_seen` (what the
// kernel computes with) within o_tol, (2) the reference over the original K/V within the bound
// of the file comment.
void CheckHead(const Case& c, size_t h, const std::vector<float>& k_seen,
               const std::vector<float>& v_seen, double o_tol) {
  const Head& head = c.heads[h];
  const size_t n = head.n_, D = c.D, G = c.G;
  std::vector<float> qh(size_t{c.T} * G * D);
  for (size_t t = 0; t < c.T; ++t) {
    for (size_t j = 0; j < G; ++j) std::copy_n(c.QRow(t, h, j), D, qh.data() + (t * G + j) * D);
  }
  std::vector<double> ref_o, ref_lse, orig_o, orig_lse;
  ReferenceAttention(qh.data(), k_seen.data(), v_seen.data(), n, c.T, G, D, c.scale, &ref_o,
                     &ref_lse);
  ReferenceAttention(qh.data(), head.k.data(), head.v.data(), n, c.T, G, D, c.scale, &orig_o,
                     &orig_lse);
  // Per-key error terms of the bound.
  double max_dv = 0, max_v = 0;
  std::vector<double> dk(n), dk_sd(n);  // worst-case and per-element standard deviation
  for (size_t i = 0; i < n; ++i) {
    double km = 0, vm = 0;
    for (size_t d = 0; d < D; ++d) {
      km = std::max(km, std::abs(double{head.k[i * D + d]}));
      vm = std::max(vm, std::abs(double{head.v[i * D + d]}));
    }
    dk[i] = km / 127 / 2;
    dk_sd[i] = km / 127 / std::sqrt(12.0);
    max_dv = std::max(max_dv, vm / 127 / 2);
    max_v = std::max(max_v, vm);
  }
  double worst_o = 0, worst_lse = 0;  // observed errors vs the original KV, for the log
  for (size_t t = 0; t < c.T; ++t) {
    for (size_t j = 0; j < G; ++j) {
      const size_t r = t * G + j;
      const float* o = c.o.data() + ((t * c.H + h) * G + j) * D;
      const float lse = c.lse[(t * c.H + h) * G + j];
      if (n == 0) {
        EXPECT_TRUE(std::isinf(lse) && lse < 0) << "empty head " << h << ": lse " << lse;
        for (size_t d = 0; d < D; ++d) ASSERT_EQ(o[d], 0.0f) << "empty head " << h;
        continue;
      }
      EXPECT_NEAR(lse, ref_lse[r], kLseTol) << "head " << h << " t " << t << " j " << j;
      EXPECT_LE(RelativeError(o, ref_o.data() + r * D, D), o_tol)
          << "head " << h << " t " << t << " j " << j;
      double q1 = 0, q2 = 0;
      for (size_t d = 0; d < D; ++d) {
        q1 += std::abs(double{qh[r * D + d]});
        q2 += double{qh[r * D + d]} * qh[r * D + d];
      }
      double eps_worst = 0, eps = 0;
      for (size_t i = 0; i < n; ++i) {
        eps_worst = std::max(eps_worst, c.scale * q1 * dk[i]);
        eps = std::max(eps, 6 * c.scale * std::sqrt(q2) * dk_sd[i]);
      }
      // Both bounds hold; at tiny D (8) six standard deviations exceed the worst case.
      eps = std::min(eps, eps_worst);
      const double lse_bound = eps + kLseTol;
      const double o_bound = std::expm1(2 * eps) * max_v + max_dv + 1e-4;
      EXPECT_LE(std::abs(lse - orig_lse[r]), lse_bound) << "head " << h << " row " << r;
      for (size_t d = 0; d < D; ++d) {
        const double err = std::abs(o[d] - orig_o[r * D + d]);
        worst_o = std::max(worst_o, err / o_bound);
        ASSERT_LE(err, o_bound) << "head " << h << " row " << r << " d " << d;
      }
      worst_lse = std::max(worst_lse, std::abs(lse - orig_lse[r]) / lse_bound);
    }
  }
  ::testing::Test::RecordProperty("worst_o_share_of_bound", std::to_string(worst_o));
  ::testing::Test::RecordProperty("worst_lse_share_of_bound", std::to_string(worst_lse));
}

using KernelParam = std::tuple<uint32_t, uint32_t, uint32_t>;  // D, G, T

class Int8KernelTest : public ::testing::TestWithParam<KernelParam> {
 protected:
  ThreadPool pool_{3};
};

// Heads: empty, one entry, a partial chunk, more than one 512-key int8 chunk with a tail.
const std::vector<size_t> kCounts = {0, 1, 37, 1100};

// The int8 scan's kernel variants: "" = what this CPU runs (AVX-512 where present), "avx2" (AVX2
// where present, else as ""), "portable" = the f32-tile path every CPU runs
// (cpu_attention/kernels/src/row_scan_kernels.h; TANDEM_CPU_ISA forces one).
using ScopedInt8Kernels = tandem::testing::ScopedCpuIsa;
constexpr const char* kInt8Variants[] = {"", "avx2", "portable"};

TEST_P(Int8KernelTest, MawPathMatchesReferences) {
  const auto [D, G, T] = GetParam();
  Case c = MakeCase(D, G, T, kCounts, 11 + D + G + T);
  AttentionParams p;
  p.dtype = KvDType::kInt8;
  p.head_dim = D;
  p.group = G;
  p.num_tokens = T;
  p.q_token_stride = size_t{c.H} * G * D;
  p.o_token_stride = p.q_token_stride;
  p.lse_token_stride = size_t{c.H} * G;
  p.chunk_keys = 2048;
  std::vector<HeadProblem> problems;
  for (uint32_t h = 0; h < c.H; ++h) {
    HeadProblem hp;
    hp.k = c.heads[h].k8.data();
    hp.v = c.heads[h].v8.data();
    hp.n = c.heads[h].n_;
    hp.q = c.QRow(0, h, 0);
    hp.o = c.o.data() + size_t{h} * G * D;
    hp.lse = c.lse.data() + size_t{h} * G;
    problems.push_back(hp);
  }
  for (const char* variant : kInt8Variants) {
    SCOPED_TRACE(absl::StrCat("TANDEM_CPU_ISA='", variant, "'"));
    ScopedInt8Kernels kernels(variant);
    std::fill(c.o.begin(), c.o.end(), 12345.0f);
    std::fill(c.lse.begin(), c.lse.end(), 12345.0f);
    ASSERT_TRUE(SparseAttention(p, problems, pool_).ok());
    for (uint32_t h = 0; h < c.H; ++h) {
      CheckHead(c, h, Dequantise(c.heads[h].k8, D, /*bf16=*/false),
                Dequantise(c.heads[h].v8, D, /*bf16=*/false), kMawOTol);
    }
  }
}

TEST_P(Int8KernelTest, PagePathMatchesReferences) {
  const auto [D, G, T] = GetParam();
  Case c = MakeCase(D, G, T, kCounts, 23 + D + G + T);
  // Each head's rows cut into runs of irregular lengths (partial blocks, pages across blocks).
  const uint32_t lengths[] = {16, 5, 64, 3, 37, 1};
  std::vector<KvRun> runs;
  std::vector<PagedProblem> problems;
  for (uint32_t h = 0; h < c.H; ++h) {
    PagedProblem pr;
    pr.run_begin = runs.size();
    const size_t row = Int8Row(D);
    for (size_t e = 0, i = 0; e < c.heads[h].n_; ++i) {
      const uint32_t len =
          static_cast<uint32_t>(std::min<size_t>(lengths[i % 6], c.heads[h].n_ - e));
      runs.push_back(KvRun{c.heads[h].k8.data() + e * row, c.heads[h].v8.data() + e * row, len});
      e += len;
    }
    pr.run_end = runs.size();
    pr.num_tokens = T;
    pr.q = c.QRow(0, h, 0);
    pr.o = c.o.data() + size_t{h} * G * D;
    pr.lse = c.lse.data() + size_t{h} * G;
    pr.q_token_stride = size_t{c.H} * G * D;
    pr.o_token_stride = pr.q_token_stride;
    pr.lse_token_stride = size_t{c.H} * G;
    problems.push_back(pr);
  }
  PagedParams p;
  p.dtype = KvDType::kInt8;
  p.head_dim = D;
  p.group = G;
  for (const char* variant : kInt8Variants) {
    SCOPED_TRACE(absl::StrCat("TANDEM_CPU_ISA='", variant, "'"));
    ScopedInt8Kernels kernels(variant);
    std::fill(c.o.begin(), c.o.end(), 12345.0f);
    std::fill(c.lse.begin(), c.lse.end(), 12345.0f);
    ASSERT_TRUE(PagedAttention(p, runs, problems, pool_).ok());
    for (uint32_t h = 0; h < c.H; ++h) {
      CheckHead(c, h, Dequantise(c.heads[h].k8, D, false), Dequantise(c.heads[h].v8, D, false),
                kPagedOTol);
    }
  }
}

// Query rows G * T <= 12 take SparseAttention's int8 scan, more the dequantised matmuls. The
// scan's AVX-512 kernels work in groups of 4 rows (then 2, then 1), 4 keys, 64 columns (then
// 16, then a half vector of 8): D 8, 40, 72 and 136 leave a half vector, rows 3, 5, 7, 10 and
// 13 (matmuls) the smaller row groups.
INSTANTIATE_TEST_SUITE_P(
    Shapes, Int8KernelTest,
    ::testing::Values(KernelParam{64, 1, 1}, KernelParam{128, 4, 1}, KernelParam{128, 8, 3},
                      KernelParam{256, 2, 2}, KernelParam{8, 7, 1}, KernelParam{72, 3, 1},
                      KernelParam{136, 5, 2}, KernelParam{40, 4, 3}, KernelParam{24, 13, 1}),
    [](const auto& info) {
      return absl::StrCat("D", std::get<0>(info.param), "_G", std::get<1>(info.param), "_T",
                          std::get<2>(info.param));
    });

// Salience of an int8 session equals that of an f32 session holding the dequantised values, with
// either int8 scoring kernel (AVX-512 scores from the codes in place, or dequantised keys).
// Shapes: 150 entries = 9 full 16-entry blocks and a tail of 6; D 72 and 8 end in a half
// vector; rows 8, 3 and 5 cover the 4-row groups and the 2- and 1-row rest.
void CheckInt8Salience(uint32_t D, uint32_t G, uint32_t T) {
  SCOPED_TRACE(absl::StrCat("D ", D, " G ", G, " T ", T));
  const uint32_t n = 150;
  std::mt19937 rng(5 + D + G + T);
  const std::vector<float> k = RandomKv(n, D, rng, true), v = RandomKv(n, D, rng, false);
  kv_store::KvStore store(kv_store::KvStore::Options{
      .capacity_bytes = 64ull << 20, .default_block_tokens = 16, .max_sessions = 8});
  kv_store::SessionOptions o;
  o.geometry = {1, G, 1, D};
  o.block_tokens = 16;
  o.dtype = KvDType::kBf16;
  o.int8_storage = true;
  auto int8_session = store.OpenSession("int8", o);
  ASSERT_TRUE(int8_session.ok()) << int8_session.status();
  EXPECT_EQ((*int8_session)->format().dtype, KvDType::kInt8);
  EXPECT_EQ((*int8_session)->format().row_bytes(), D + 4u);
  const std::vector<float> maw(n, 1.0f);
  const uint32_t head = 0;
  ASSERT_TRUE(store
                  .Append(**int8_session, 0, {&head, 1}, ToBf16Bytes(k).data(),
                          ToBf16Bytes(v).data(), maw.data(), n, 64)
                  .ok());
  const std::vector<float> k_deq = Dequantise(Quantise(k, D), D, false);
  const std::vector<float> v_deq = Dequantise(Quantise(v, D), D, false);
  o.dtype = KvDType::kF32;
  o.int8_storage = false;
  auto f32_session = store.OpenSession("f32", o);
  ASSERT_TRUE(f32_session.ok());
  ASSERT_TRUE(store
                  .Append(**f32_session, 0, {&head, 1},
                          reinterpret_cast<const std::byte*>(k_deq.data()),
                          reinterpret_cast<const std::byte*>(v_deq.data()), maw.data(), n, 64)
                  .ok());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(size_t{T} * G * D);
  for (float& x : q) x = normal(rng);
  AttentionParams p;
  p.head_dim = D;
  p.group = G;
  p.num_tokens = T;
  p.q_token_stride = G * D;
  std::vector<float> a32(n);
  p.dtype = KvDType::kF32;
  ASSERT_TRUE(ComputeSalience(p, *(*f32_session)->shard(0, 0), q.data(), a32).ok());
  for (const char* variant : kInt8Variants) {
    SCOPED_TRACE(absl::StrCat("TANDEM_CPU_ISA='", variant, "'"));
    ScopedInt8Kernels kernels(variant);
    std::vector<float> a8(n, -1.0f);
    p.dtype = KvDType::kInt8;
    ASSERT_TRUE(ComputeSalience(p, *(*int8_session)->shard(0, 0), q.data(), a8).ok());
    for (uint32_t i = 0; i < n; ++i) EXPECT_NEAR(a8[i], a32[i], 1e-6) << "entry " << i;
  }
}

TEST(Int8Salience, EqualsSalienceOverTheDequantisedValues) {
  CheckInt8Salience(64, 4, 2);
  CheckInt8Salience(72, 3, 1);
  CheckInt8Salience(8, 5, 1);
}

}  // namespace
}  // namespace tandem::cpu_attention
