// SparseAttention against the double-precision reference.
//
// Tolerances (the contract is max relative error <= 1e-3 on O): with the bf16 hi/lo split of Q
// and P the only rounding beyond the bf16 K/V values themselves is fp32 accumulation, so we
// assert much tighter bounds:
//   O:   RelativeError (max |o - ref| / max |ref| over a head's rows) <= 2e-4 (bf16 KV),
//        <= 1e-5 (f32 KV);
//   LSE: max |lse - ref| <= 1e-4 (absolute, natural log).
#include "tandem/cpu_attention/sparse_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "scoped_cpu_isa.h"
#include "tandem/cpu_attention/kernel_self_check.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/thread_pool.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;

constexpr double kBf16OTol = 2e-4;
constexpr double kF32OTol = 1e-5;
constexpr double kLseTol = 1e-4;
constexpr float kSentinel = 12345.0f;

// One call's data: q [T, H*G, D] (token-major, as the service lays it out), per kv head K/V in
// the KV dtype plus the f32 values the reference uses, and o/lse with padded token strides.
struct Problem {
  uint32_t D, G, T, H;
  KvDType dtype;
  std::vector<uint64_t> n;
  std::vector<float> q;
  std::vector<std::vector<float>> k_f32, v_f32;      // exact values the kernel sees
  std::vector<std::vector<std::byte>> k_raw, v_raw;  // [n, D] in the KV dtype
  std::vector<float> o, lse;
  size_t q_stride, o_stride, lse_stride;

  Problem(uint32_t head_dim, uint32_t group, uint32_t tokens, KvDType type,
          std::vector<uint64_t> counts, uint32_t seed, float q_scale = 1.0f, float k_offset = 0.0f)
      : D(head_dim),
        G(group),
        T(tokens),
        H(static_cast<uint32_t>(counts.size())),
        dtype(type),
        n(std::move(counts)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    q_stride = size_t{H} * G * D;
    o_stride = size_t{H} * G * D + 8;  // > group * head_dim: padding must stay untouched
    lse_stride = size_t{H} * G + 3;
    q.resize(T * q_stride);
    for (float& x : q) x = q_scale * normal(rng);
    for (uint32_t h = 0; h < H; ++h) {
      std::vector<float> k(n[h] * D), v(n[h] * D);
      for (float& x : k) x = normal(rng) + k_offset;
      for (float& x : v) x = normal(rng);
      std::vector<std::byte> kr, vr;
      if (dtype == KvDType::kBf16) {
        kr.resize(k.size() * 2);
        vr.resize(v.size() * 2);
        for (size_t i = 0; i < k.size(); ++i) {
          const bf16_t kb = FloatToBf16(k[i]), vb = FloatToBf16(v[i]);
          std::memcpy(kr.data() + 2 * i, &kb, 2);
          std::memcpy(vr.data() + 2 * i, &vb, 2);
          k[i] = Bf16ToFloat(kb);
          v[i] = Bf16ToFloat(vb);
        }
      } else {
        kr.resize(k.size() * 4);
        vr.resize(v.size() * 4);
        if (!k.empty()) {
          std::memcpy(kr.data(), k.data(), kr.size());
          std::memcpy(vr.data(), v.data(), vr.size());
        }
      }
      k_f32.push_back(std::move(k));
      v_f32.push_back(std::move(v));
      k_raw.push_back(std::move(kr));
      v_raw.push_back(std::move(vr));
    }
    o.assign(T * o_stride, kSentinel);
    lse.assign(T * lse_stride, kSentinel);
  }

  AttentionParams Params(uint32_t chunk_keys = 2048) const {
    AttentionParams p;
    p.dtype = dtype;
    p.head_dim = D;
    p.group = G;
    p.num_tokens = T;
    p.q_token_stride = q_stride;
    p.o_token_stride = o_stride;
    p.lse_token_stride = lse_stride;
    p.chunk_keys = chunk_keys;
    return p;
  }

  std::vector<HeadProblem> Heads() {
    std::vector<HeadProblem> heads(H);
    for (uint32_t h = 0; h < H; ++h) {
      heads[h].k = n[h] ? k_raw[h].data() : nullptr;
      heads[h].v = n[h] ? v_raw[h].data() : nullptr;
      heads[h].n = n[h];
      heads[h].q = q.data() + size_t{h} * G * D;
      heads[h].o = o.data() + size_t{h} * G * D;
      heads[h].lse = lse.data() + size_t{h} * G;
    }
    return heads;
  }

  // Checks every head against the reference; returns the worst O relative error and LSE error.
  void Check(double o_tol, double* worst_o = nullptr, double* worst_lse = nullptr,
             double lse_tol = kLseTol) const {
    double max_o = 0.0, max_lse = 0.0;
    for (uint32_t h = 0; h < H; ++h) {
      std::vector<float> qh(size_t{T} * G * D);
      for (uint32_t t = 0; t < T; ++t) {
        std::memcpy(&qh[size_t{t} * G * D], &q[t * q_stride + size_t{h} * G * D],
                    size_t{G} * D * sizeof(float));
      }
      std::vector<double> ref_o, ref_lse;
      ReferenceAttention(qh.data(), k_f32[h].data(), v_f32[h].data(), n[h], T, G, D,
                         1.0 / std::sqrt(static_cast<double>(D)), &ref_o, &ref_lse);
      std::vector<float> got_o(size_t{T} * G * D), got_lse(size_t{T} * G);
      for (uint32_t t = 0; t < T; ++t) {
        for (uint32_t j = 0; j < G; ++j) {
          const size_t r = size_t{t} * G + j;
          std::memcpy(&got_o[r * D], &o[t * o_stride + (size_t{h} * G + j) * D], D * sizeof(float));
          got_lse[r] = lse[t * lse_stride + size_t{h} * G + j];
        }
      }
      if (n[h] == 0) {
        for (float x : got_o) ASSERT_EQ(x, 0.0f) << "head " << h;
        for (float x : got_lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity());
        continue;
      }
      const double err_o = RelativeError(got_o, ref_o);
      EXPECT_LE(err_o, o_tol) << "head " << h << " n=" << n[h];
      max_o = std::max(max_o, err_o);
      for (size_t r = 0; r < got_lse.size(); ++r) {
        const double e = std::abs(got_lse[r] - ref_lse[r]);
        EXPECT_LE(e, lse_tol) << "head " << h << " row " << r;
        max_lse = std::max(max_lse, std::isnan(e) ? 1e30 : e);
      }
    }
    // Padding between tokens is untouched.
    for (uint32_t t = 0; t < T; ++t) {
      for (size_t i = size_t{H} * G * D; i < o_stride; ++i) {
        ASSERT_EQ(o[t * o_stride + i], kSentinel);
      }
      for (size_t i = size_t{H} * G; i < lse_stride; ++i) {
        ASSERT_EQ(lse[t * lse_stride + i], kSentinel);
      }
    }
    if (worst_o) *worst_o = std::max(*worst_o, max_o);
    if (worst_lse) *worst_lse = std::max(*worst_lse, max_lse);
  }
};

double OTol(KvDType t) { return t == KvDType::kBf16 ? kBf16OTol : kF32OTol; }

// head_dim, group, tokens, bf16?, pool threads
using Config = std::tuple<uint32_t, uint32_t, uint32_t, bool, unsigned>;

class SparseAttentionTest : public ::testing::TestWithParam<Config> {};

TEST_P(SparseAttentionTest, MatchesReferenceAcrossUnevenHeads) {
  const auto [D, G, T, bf16, threads] = GetParam();
  const KvDType dtype = bf16 ? KvDType::kBf16 : KvDType::kF32;
  ThreadPool pool(threads);
  // Heads of very different sizes in one call: empty, tiny, odd, one chunk, several chunks.
  Problem pr(D, G, T, dtype, {0, 3, 5000, 1, 17, 2048, 0}, /*seed=*/D * 131 + G * 7 + T);
  auto heads = pr.Heads();
  ASSERT_TRUE(SparseAttention(pr.Params(), heads, pool).ok());
  double worst_o = 0, worst_lse = 0;
  pr.Check(OTol(dtype), &worst_o, &worst_lse);
  RecordProperty("worst_o_rel_err", std::to_string(worst_o));
  RecordProperty("worst_lse_abs_err", std::to_string(worst_lse));
  std::printf("  D=%u G=%u T=%u %s threads=%u: worst O rel err %.3g, LSE abs err %.3g\n", D, G, T,
              bf16 ? "bf16" : "f32", threads, worst_o, worst_lse);
}

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) {
  const Config& c = info.param;
  return absl::StrCat("D", std::get<0>(c), "_G", std::get<1>(c), "_T", std::get<2>(c),
                      std::get<3>(c) ? "_bf16" : "_f32", "_threads", std::get<4>(c));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SparseAttentionTest,
                         ::testing::Combine(::testing::Values(8u, 64u, 128u),
                                            ::testing::Values(1u, 4u, 8u),
                                            ::testing::Values(1u, 3u), ::testing::Bool(),
                                            ::testing::Values(1u, 2u, 4u)),
                         ConfigName);

// Single heads of each size, so a range never spans heads, and ranges cut inside one head.
TEST(SparseAttention, SingleHeadSizes) {
  ThreadPool pool(4);
  for (KvDType dtype : {KvDType::kBf16, KvDType::kF32}) {
    for (uint64_t n : {0, 1, 17, 255, 256, 257, 2048, 2049, 5000}) {
      Problem pr(128, 4, 1, dtype, {n}, static_cast<uint32_t>(n) + 5);
      auto heads = pr.Heads();
      ASSERT_TRUE(SparseAttention(pr.Params(), heads, pool).ok());
      SCOPED_TRACE(absl::StrCat("n=", n));
      pr.Check(OTol(dtype));
    }
  }
}

// Chunk sizes that exercise many chunks, granule-multiple tails and runtime-size remainders.
TEST(SparseAttention, ChunkSizes) {
  ThreadPool pool(2);
  for (uint32_t chunk : {16u, 100u, 256u, 1000u, 4096u}) {
    for (KvDType dtype : {KvDType::kBf16, KvDType::kF32}) {
      Problem pr(64, 8, 2, dtype, {3001, 5, 700}, chunk);
      auto heads = pr.Heads();
      ASSERT_TRUE(SparseAttention(pr.Params(chunk), heads, pool).ok());
      SCOPED_TRACE(absl::StrCat("chunk=", chunk));
      pr.Check(OTol(dtype));
    }
  }
}

// Peaked softmax (large |q|) and large score offsets: the running max must keep exp in range.
TEST(SparseAttention, PeakedAndShiftedScores) {
  ThreadPool pool(3);
  for (KvDType dtype : {KvDType::kBf16, KvDType::kF32}) {
    Problem peaked(128, 4, 1, dtype, {4000, 3000}, 11, /*q_scale=*/6.0f);
    auto h1 = peaked.Heads();
    ASSERT_TRUE(SparseAttention(peaked.Params(256), h1, pool).ok());
    double worst_o = 0, worst_lse = 0;
    peaked.Check(OTol(dtype), &worst_o, &worst_lse);
    // k_offset shifts a row's scores by ~ sum(q) * offset / sqrt(D), tens of units: the
    // cancellation in fp32 score accumulation costs some precision, hence 5x on O.
    Problem shifted(64, 2, 1, dtype, {3000}, 12, /*q_scale=*/1.0f, /*k_offset=*/30.0f);
    auto h2 = shifted.Heads();
    ASSERT_TRUE(SparseAttention(shifted.Params(512), h2, pool).ok());
    shifted.Check(OTol(dtype) * 5, &worst_o, &worst_lse);
    std::printf("  %s: worst O rel err %.3g, LSE abs err %.3g\n",
                dtype == KvDType::kBf16 ? "bf16" : "f32", worst_o, worst_lse);
  }
}

// Decode-like: the same heads grow by one entry per call (new tail sizes every step).
TEST(SparseAttention, GrowingTails) {
  ThreadPool pool(2);
  Problem pr(128, 8, 1, KvDType::kBf16, {3100, 3100}, 21);
  for (uint64_t n = 2990; n < 3040; n += 7) {
    pr.n = {n, n - 90};
    std::fill(pr.o.begin(), pr.o.end(), kSentinel);
    std::fill(pr.lse.begin(), pr.lse.end(), kSentinel);
    auto heads = pr.Heads();
    ASSERT_TRUE(SparseAttention(pr.Params(), heads, pool).ok());
    // Reference over the first n entries: truncate copies.
    Problem view = pr;
    view.k_f32[0].resize(n * pr.D);
    view.v_f32[0].resize(n * pr.D);
    view.k_f32[1].resize((n - 90) * pr.D);
    view.v_f32[1].resize((n - 90) * pr.D);
    SCOPED_TRACE(absl::StrCat("n=", n));
    view.Check(kBf16OTol);
  }
}

TEST(SparseAttention, ConcurrentCallersShareThePool) {
  ThreadPool pool(3);
  std::vector<Problem> problems;
  for (int i = 0; i < 4; ++i) {
    problems.emplace_back(64u + 64u * (i % 2), 1u + 3u * (i % 3), 1u + (i % 2),
                          i % 2 ? KvDType::kF32 : KvDType::kBf16,
                          std::vector<uint64_t>{1000u + 500u * i, 77u, 0u}, 100 + i);
  }
  std::vector<std::thread> callers;
  std::vector<absl::Status> statuses(problems.size());
  for (size_t i = 0; i < problems.size(); ++i) {
    callers.emplace_back([&, i] {
      for (int rep = 0; rep < 5 && statuses[i].ok(); ++rep) {
        auto heads = problems[i].Heads();
        statuses[i] = SparseAttention(problems[i].Params(512), heads, pool);
      }
    });
  }
  for (auto& t : callers) t.join();
  for (size_t i = 0; i < problems.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    problems[i].Check(OTol(problems[i].dtype));
  }
}

// Every kernel variant this CPU runs (the library picks the fastest; TANDEM_CPU_ISA forces a
// lesser set: "portable" and "avx2" take the register-widening scan for bf16 KV, as an AVX2-only
// CPU does, and the portable softmax) gives results within the same tolerance.
TEST(SparseAttention, KernelVariants) {
  ThreadPool pool(2);
  for (const char* variant : {"portable", "avx2", "avx512", ""}) {
    tandem::testing::ScopedCpuIsa isa(variant);
    for (KvDType dtype : {KvDType::kBf16, KvDType::kF32}) {
      for (uint32_t G : {1u, 3u, 8u}) {
        for (uint32_t T : {1u, 5u}) {
          Problem pr(128, G, T, dtype, {1, 15, 16, 17, 700, 4099}, 40 + G + T);
          auto heads = pr.Heads();
          ASSERT_TRUE(SparseAttention(pr.Params(1024), heads, pool).ok());
          SCOPED_TRACE(absl::StrCat("TANDEM_CPU_ISA=", variant, " G=", G, " T=", T));
          pr.Check(OTol(dtype));
        }
      }
    }
  }
}

// The node's start-up check passes on every path this CPU runs.
TEST(KernelSelfCheck, PassesOnEveryPath) {
  ThreadPool pool(2);
  for (const char* variant : {"portable", "avx2", ""}) {
    tandem::testing::ScopedCpuIsa isa(variant);
    const absl::Status status = CheckAttentionKernels(pool);
    EXPECT_TRUE(status.ok()) << "TANDEM_CPU_ISA=" << variant << ": " << status;
  }
}

TEST(SparseAttention, AllHeadsEmpty) {
  ThreadPool pool(2);
  Problem pr(64, 4, 3, KvDType::kBf16, {0, 0}, 1);
  auto heads = pr.Heads();
  ASSERT_TRUE(SparseAttention(pr.Params(), heads, pool).ok());
  pr.Check(kBf16OTol);
  // No heads at all is fine too.
  ASSERT_TRUE(SparseAttention(pr.Params(), {}, pool).ok());
}

TEST(SparseAttention, RejectsBadParams) {
  ThreadPool pool(1);
  Problem pr(64, 2, 2, KvDType::kBf16, {10}, 1);
  auto heads = pr.Heads();
  auto expect_invalid = [&](AttentionParams p, std::vector<HeadProblem> hs) {
    const absl::Status s = SparseAttention(p, hs, pool);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  };
  AttentionParams p = pr.Params();
  p.head_dim = 12;
  expect_invalid(p, heads);
  p = pr.Params();
  p.head_dim = 100;  // not a multiple of 8
  expect_invalid(p, heads);
  p = pr.Params();
  p.head_dim = 264;
  expect_invalid(p, heads);
  p = pr.Params();
  p.group = 0;
  expect_invalid(p, heads);
  p = pr.Params();
  p.num_tokens = 0;
  expect_invalid(p, heads);
  p = pr.Params();
  p.q_token_stride = 2 * 64 - 1;
  expect_invalid(p, heads);
  p = pr.Params();
  p.o_token_stride = 0;
  expect_invalid(p, heads);
  p = pr.Params();
  p.lse_token_stride = 1;
  expect_invalid(p, heads);
  p = pr.Params();
  p.chunk_keys = 0;
  expect_invalid(p, heads);
  p = pr.Params();
  p.tasks_per_thread = 0;
  expect_invalid(p, heads);
  auto bad = heads;
  bad[0].k = nullptr;
  expect_invalid(pr.Params(), bad);
  bad = heads;
  bad[0].o = nullptr;
  expect_invalid(pr.Params(), bad);
  // Output untouched by rejected calls.
  for (float x : pr.o) ASSERT_EQ(x, kSentinel);
}

}  // namespace
}  // namespace tandem::cpu_attention
