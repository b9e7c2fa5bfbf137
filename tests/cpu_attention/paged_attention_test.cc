// PagedAttention (attention over named pages read in place through a shard's block table)
// against the double-precision reference over the same entries.
//
// Tolerances: the kernel's only rounding beyond the stored K/V values is fp32 accumulation, so
//   O:   max |o - ref| / max |ref| over a problem's rows <= 1e-5;
//   LSE: max |lse - ref| <= 1e-4 (absolute, natural log).
#include "tandem/cpu_attention/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "tandem/common/bf16.h"
#include "tandem/cpu_attention/reference_attention.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;

constexpr double kOTol = 1e-5;
constexpr double kLseTol = 1e-4;

// A one-layer session of H kv heads holding `held` random entries per head, with the f32 values
// the kernel sees kept on the test side.
struct Fixture {
  uint32_t H, G, D;
  uint64_t held;
  kv_store::KvStore store{kv_store::KvStore::Options{
      .capacity_bytes = 256ull << 20, .default_block_tokens = 64, .max_sessions = 16}};
  std::shared_ptr<kv_store::Session> session;
  std::vector<std::vector<float>> k, v;  // [H][held * D]

  Fixture(uint32_t heads, uint32_t group, uint32_t dim, uint32_t block_tokens, KvDType dtype,
          uint32_t page_tokens, uint64_t entries, uint32_t seed)
      : H(heads), G(group), D(dim), held(entries), k(heads), v(heads) {
    kv_store::SessionOptions o;
    o.geometry = {1, heads * group, heads, dim};
    o.block_tokens = block_tokens;
    o.dtype = dtype;
    o.page_tokens = page_tokens;
    session = *store.OpenSession("s", o);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const bool bf16 = dtype == KvDType::kBf16;
    std::vector<std::byte> kb, vb;
    std::vector<float> maw(heads * entries, 0.0f);
    std::vector<uint32_t> ids;
    for (uint32_t h = 0; h < heads; ++h) {
      ids.push_back(h);
      for (auto* dst : {&k[h], &v[h]}) {
        for (uint64_t i = 0; i < entries * dim; ++i) {
          const float x = normal(rng);
          dst->push_back(bf16 ? Bf16ToFloat(FloatToBf16(x)) : x);
        }
      }
    }
    auto encode = [&](const std::vector<std::vector<float>>& src, std::vector<std::byte>* out) {
      for (const auto& head : src) {
        for (float x : head) {
          if (bf16) {
            const bf16_t b = FloatToBf16(x);
            const auto* p = reinterpret_cast<const std::byte*>(&b);
            out->insert(out->end(), p, p + 2);
          } else {
            const auto* p = reinterpret_cast<const std::byte*>(&x);
            out->insert(out->end(), p, p + 4);
          }
        }
      }
    };
    encode(k, &kb);
    encode(v, &vb);
    auto stats = store.Append(*session, 0, ids, kb.data(), vb.data(), maw.data(),
                              static_cast<uint32_t>(entries), 0);
    EXPECT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->entries_selected, 0u) << "a pages session selects nothing on append";
  }

  const kv_store::Shard& shard(uint32_t h) const { return *session->shard(0, h); }

  // Reference for kv head h, query rows q [T, G, D], over the entries where keep[i] != 0.
  void Reference(uint32_t h, const float* q, size_t T, const std::vector<uint8_t>& keep,
                 std::vector<double>* o, std::vector<double>* lse) const {
    std::vector<float> ks, vs;
    for (uint64_t i = 0; i < held; ++i) {
      if (!keep[i]) continue;
      ks.insert(ks.end(), k[h].begin() + i * D, k[h].begin() + (i + 1) * D);
      vs.insert(vs.end(), v[h].begin() + i * D, v[h].begin() + (i + 1) * D);
    }
    ReferenceAttention(q, ks.data(), vs.data(), ks.size() / D, T, G, D,
                       1.0 / std::sqrt(static_cast<double>(D)), o, lse);
  }
};

std::vector<uint8_t> KeepOf(std::span<const int32_t> row, uint32_t page_tokens, uint64_t held) {
  std::vector<uint8_t> keep(held, 0);
  for (int32_t p : row) {
    if (p < 0) break;
    for (uint64_t i = uint64_t(p) * page_tokens;
         i < std::min<uint64_t>(held, (p + 1ull) * page_tokens); ++i) {
      keep[i] = 1;
    }
  }
  return keep;
}

// Checks rows [G, D] of o (row stride D) and lse against the reference.
void ExpectRows(const float* o, const float* lse, const std::vector<double>& ref_o,
                const std::vector<double>& ref_lse, size_t rows, size_t D, bool empty) {
  for (size_t r = 0; r < rows; ++r) {
    if (empty) {
      EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << "row " << r << " lse " << lse[r];
      for (size_t d = 0; d < D; ++d) ASSERT_EQ(o[r * D + d], 0.0f);
    } else {
      EXPECT_NEAR(lse[r], ref_lse[r], kLseTol) << "row " << r;
    }
  }
  if (!empty) {
    EXPECT_LE(RelativeError(o, ref_o.data(), rows * D), kOTol);
  }
}

PagedParams Params(KvDType dtype, uint32_t G, uint32_t D, uint32_t tasks_per_thread) {
  PagedParams p;
  p.dtype = dtype;
  p.head_dim = D;
  p.group = G;
  p.tasks_per_thread = tasks_per_thread;
  return p;
}

// dtype, G, D, block_tokens, page_tokens
using Case = std::tuple<KvDType, uint32_t, uint32_t, uint32_t, uint32_t>;

class PagedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedAttentionTest, NamedPagesPerTokenMatchReference) {
  const auto [dtype, G, D, block_tokens, page_tokens] = GetParam();
  constexpr uint32_t H = 2, T = 3;
  constexpr uint64_t kHeld = 301;  // the last page (and block) is partial
  Fixture f(H, G, D, block_tokens, dtype, page_tokens, kHeld, 7 + G + D + block_tokens);
  const int32_t pages = static_cast<int32_t>((kHeld + page_tokens - 1) / page_tokens);
  const int32_t last = pages - 1;
  // Per (token, head) rows of 6 ids: token 0 has adjacent pages and the partial last page,
  // token 1 every other page, token 2 of head 1 an empty selection.
  constexpr size_t kPph = 6;
  std::vector<int32_t> ids(T * H * kPph, -1);
  auto row = [&](uint32_t t, uint32_t h) { return ids.data() + (t * H + h) * kPph; };
  const std::vector<int32_t> r00 = {0, 1, 2, last};
  const std::vector<int32_t> r01 = {1, 2, last - 1, last};
  std::copy(r00.begin(), r00.end(), row(0, 0));
  std::copy(r01.begin(), r01.end(), row(0, 1));
  for (uint32_t h = 0; h < H; ++h) {
    for (size_t i = 0; i < kPph && int32_t(2 * i + h) <= last; ++i) row(1, h)[i] = 2 * i + h;
  }
  row(2, 0)[0] = last / 2;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      ASSERT_TRUE(CheckPageRow({row(t, h), kPph}, kHeld, page_tokens, "pages").ok());
    }
  }

  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(T * H * G * D);
  for (float& x : q) x = normal(rng);
  std::vector<float> o(T * H * G * D, 99.0f), lse(T * H * G, 99.0f);
  std::vector<KvRun> runs;
  std::vector<PagedProblem> problems;
  const size_t stride = size_t{H} * G * D;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      PagedProblem p;
      p.run_begin = runs.size();
      const uint64_t n = AppendPageRuns(f.shard(h), {row(t, h), kPph}, page_tokens, &runs);
      p.run_end = runs.size();
      uint64_t expect = 0;
      for (uint8_t b : KeepOf({row(t, h), kPph}, page_tokens, kHeld)) expect += b;
      EXPECT_EQ(n, expect);
      p.q = q.data() + t * stride + h * G * D;
      p.o = o.data() + t * stride + h * G * D;
      p.lse = lse.data() + (t * H + h) * G;
      problems.push_back(p);
    }
  }
  ThreadPool pool(3);
  // More ranges than problems: long problems are split.
  ASSERT_TRUE(PagedAttention(Params(dtype, G, D, 4), runs, problems, pool).ok());
  // How far ahead the scan prefetches changes no bit of the result.
  for (uint32_t prefetch : {0u, 1u, 4096u}) {
    const std::vector<float> o_first = o, lse_first = lse;
    PagedParams params = Params(dtype, G, D, 4);
    params.prefetch_entries = prefetch;
    ASSERT_TRUE(PagedAttention(params, runs, problems, pool).ok());
    EXPECT_EQ(o, o_first) << "prefetch " << prefetch;
    EXPECT_EQ(lse, lse_first) << "prefetch " << prefetch;
  }

  // The same pages named as PageSpans (each task reads the block table for its own pieces):
  // the tasks gather the same rows in the same order, so every bit is the same.
  {
    std::vector<PagedProblem> spans = problems;
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t h = 0; h < H; ++h) {
        std::span<const int32_t> named(row(t, h), kPph);
        while (!named.empty() && named.back() < 0) named = named.first(named.size() - 1);
        PagedProblem& p = spans[t * H + h];
        p.run_begin = p.run_end = 0;
        p.pages = PageSpan{&f.shard(h), named, page_tokens,
                           PageEntries(named, page_tokens, kHeld)};
        uint64_t expect = 0;
        for (uint8_t b : KeepOf({row(t, h), kPph}, page_tokens, kHeld)) expect += b;
        EXPECT_EQ(p.pages.entries, expect);
      }
    }
    const std::vector<float> o_runs = o, lse_runs = lse;
    std::fill(o.begin(), o.end(), 99.0f);
    std::fill(lse.begin(), lse.end(), 99.0f);
    for (uint32_t tasks : {1u, 4u, 16u}) {
      ASSERT_TRUE(PagedAttention(Params(dtype, G, D, tasks), {}, spans, pool).ok());
      if (tasks != 4) continue;   // the runs' split
      EXPECT_EQ(o, o_runs);
      EXPECT_EQ(lse, lse_runs);
    }
    // Whichever thread claims which range (and resolves its pages into its own runs), repeated
    // calls give the same bits.
    const std::vector<float> o_first = o, lse_first = lse;
    for (int call = 0; call < 8; ++call) {
      std::fill(o.begin(), o.end(), 99.0f);
      ASSERT_TRUE(PagedAttention(Params(dtype, G, D, 16), {}, spans, pool).ok());
      ASSERT_EQ(o, o_first) << "call " << call;
      ASSERT_EQ(lse, lse_first) << "call " << call;
    }
  }

  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t h = 0; h < H; ++h) {
      SCOPED_TRACE(testing::Message() << "token " << t << " head " << h);
      const std::vector<uint8_t> keep = KeepOf({row(t, h), kPph}, page_tokens, kHeld);
      const bool empty = std::count(keep.begin(), keep.end(), 1) == 0;
      EXPECT_EQ(empty, t == 2 && h == 1);
      std::vector<double> ref_o, ref_lse;
      f.Reference(h, q.data() + t * stride + h * G * D, 1, keep, &ref_o, &ref_lse);
      ExpectRows(o.data() + t * stride + h * G * D, lse.data() + (t * H + h) * G, ref_o, ref_lse, G,
                 D, empty);
    }
  }
}

TEST_P(PagedAttentionTest, DenseOverAllRunsMatchesReference) {
  const auto [dtype, G, D, block_tokens, page_tokens] = GetParam();
  constexpr uint32_t H = 2, T = 3;
  constexpr uint64_t kHeld = 1000;
  Fixture f(H, G, D, block_tokens, dtype, page_tokens, kHeld, 11);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(T * H * G * D);
  for (float& x : q) x = normal(rng);
  std::vector<float> o(q.size()), lse(T * H * G);
  std::vector<KvRun> runs;
  std::vector<PagedProblem> problems;
  const size_t stride = size_t{H} * G * D;
  for (uint32_t h = 0; h < H; ++h) {
    PagedProblem p;
    p.run_begin = runs.size();
    EXPECT_EQ(AppendAllRuns(f.shard(h), &runs), kHeld);
    p.run_end = runs.size();
    p.num_tokens = T;  // the runs are read once for all tokens
    p.q = q.data() + h * G * D;
    p.o = o.data() + h * G * D;
    p.lse = lse.data() + h * G;
    p.q_token_stride = p.o_token_stride = stride;
    p.lse_token_stride = size_t{H} * G;
    problems.push_back(p);
  }
  const std::vector<uint8_t> all(kHeld, 1);
  // G and D are structured bindings: copied into the lambda (clang 14 cannot capture them).
  auto expect_reference = [&, G = G, D = D] {
    for (uint32_t t = 0; t < T; ++t) {
      for (uint32_t h = 0; h < H; ++h) {
        std::vector<double> ref_o, ref_lse;
        f.Reference(h, q.data() + t * stride + h * G * D, 1, all, &ref_o, &ref_lse);
        ExpectRows(o.data() + t * stride + h * G * D, lse.data() + (t * H + h) * G, ref_o,
                   ref_lse, G, D, false);
      }
    }
  };
  ThreadPool pool(2);
  ASSERT_TRUE(PagedAttention(Params(dtype, G, D, 2), runs, problems, pool).ok());
  expect_reference();

  // More ranges than threads (3 up to 8 here: at most one per 256 entries): which thread
  // claims which range changes from call to call, but the problems' partial states merge in
  // entry order, so every call gives the same bits.
  ThreadPool three(3);
  for (uint32_t tasks : {1u, 8u, 64u}) {
    SCOPED_TRACE(testing::Message() << "tasks per thread " << tasks);
    std::fill(o.begin(), o.end(), 99.0f);
    ASSERT_TRUE(PagedAttention(Params(dtype, G, D, tasks), runs, problems, three).ok());
    expect_reference();
    const std::vector<float> o_first = o, lse_first = lse;
    for (int call = 0; call < 8; ++call) {
      std::fill(o.begin(), o.end(), 99.0f);
      ASSERT_TRUE(PagedAttention(Params(dtype, G, D, tasks), runs, problems, three).ok());
      ASSERT_EQ(o, o_first) << "call " << call;
      ASSERT_EQ(lse, lse_first) << "call " << call;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PagedAttentionTest,
    ::testing::Values(Case{KvDType::kBf16, 4, 128, 64, 16}, Case{KvDType::kBf16, 1, 64, 16, 16},
                      Case{KvDType::kF32, 4, 64, 64, 16}, Case{KvDType::kF32, 1, 128, 16, 16},
                      // page_tokens that do not divide block_tokens (pages straddle blocks)
                      Case{KvDType::kBf16, 4, 128, 64, 24}, Case{KvDType::kF32, 4, 64, 16, 24},
                      Case{KvDType::kBf16, 4, 64, 16, 40},
                      // head_dim % 16 == 8: the AVX2 bf16 kernels' split blocks and a last
                      // natural block of 8, with 4-row groups (G 4) and 2- and 1-row rests (G 1)
                      Case{KvDType::kBf16, 4, 72, 64, 16}, Case{KvDType::kBf16, 1, 72, 16, 16}));

TEST(CheckPageRowTest, RejectsMalformedRows) {
  const std::vector<std::tuple<std::vector<int32_t>, const char*>> bad = {
      {{3, 2}, "strictly ascending"}, {{1, 1}, "strictly ascending"},
      {{0, -1, 2}, "follows -1"},     {{-2}, "negative"},
      {{0, 7}, "holds 100 entries"},  {{6, 7, -1}, "holds 100 entries"},
  };
  for (const auto& [row, what] : bad) {
    const absl::Status s = CheckPageRow(row, 100, 16, "pages");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  }
  EXPECT_TRUE(CheckPageRow(std::vector<int32_t>{0, 6, -1, -1}, 100, 16, "pages").ok());
  EXPECT_TRUE(CheckPageRow(std::vector<int32_t>{-1, -1}, 0, 16, "pages").ok());
  EXPECT_TRUE(CheckPageRow(std::vector<int32_t>{500}, -1, 16, "pages").ok())
      << "held < 0: no bound";
}

TEST(PageEntriesTest, OnlyTheLastPageMayBePartial) {
  EXPECT_EQ(PageEntries({}, 16, 100), 0u);
  EXPECT_EQ(PageEntries(std::vector<int32_t>{0, 2}, 16, 100), 32u);
  EXPECT_EQ(PageEntries(std::vector<int32_t>{1, 6}, 16, 100), 16u + 4u);   // page 6: 96..99
  EXPECT_EQ(PageEntries(std::vector<int32_t>{6}, 16, 97), 1u);
}

TEST(PagedAttentionValidation, RejectsPagesThatDoNotCoverTheirEntries) {
  ThreadPool pool(1);
  kv_store::KvStore store{kv_store::KvStore::Options{
      .capacity_bytes = 1ull << 20, .default_block_tokens = 16, .max_sessions = 1}};
  kv_store::SessionOptions so;
  so.geometry = {1, 1, 1, 64};
  so.page_tokens = 16;
  auto session = store.OpenSession("s", so);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<float> q(64), o(64), lse(1);
  const std::vector<int32_t> ids = {0, 1};
  PagedProblem p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  PagedParams params;
  params.head_dim = 64;
  // Two pages cover 17..32 entries; a shard without a page size or other counts are refused
  // before anything is read.
  for (const auto& [entries, page_tokens] :
       std::vector<std::pair<uint64_t, uint32_t>>{{33, 16}, {16, 16}, {0, 16}, {20, 0}}) {
    p.pages = PageSpan{(*session)->shard(0, 0), ids, page_tokens, entries};
    EXPECT_EQ(PagedAttention(params, {}, std::span<const PagedProblem>(&p, 1), pool).code(),
              absl::StatusCode::kInvalidArgument)
        << entries << " entries of pages of " << page_tokens;
  }
}

TEST(PagedAttentionValidation, RejectsBadParamsAndRunRanges) {
  ThreadPool pool(1);
  std::vector<float> q(64), o(64), lse(1);
  PagedProblem p;
  p.run_end = 1;  // no runs given
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  PagedParams params;
  params.head_dim = 64;
  EXPECT_EQ(PagedAttention(params, {}, std::span<const PagedProblem>(&p, 1), pool).code(),
            absl::StatusCode::kInvalidArgument);
  params.head_dim = 12;
  p.run_end = 0;
  EXPECT_EQ(PagedAttention(params, {}, std::span<const PagedProblem>(&p, 1), pool).code(),
            absl::StatusCode::kInvalidArgument);
  params.head_dim = 64;
  params.prefetch_entries = 4097;
  EXPECT_EQ(PagedAttention(params, {}, std::span<const PagedProblem>(&p, 1), pool).code(),
            absl::StatusCode::kInvalidArgument);
  params.prefetch_entries = 256;
  for (uint32_t tasks : {0u, 65u}) {
    params.tasks_per_thread = tasks;
    EXPECT_EQ(PagedAttention(params, {}, std::span<const PagedProblem>(&p, 1), pool).code(),
              absl::StatusCode::kInvalidArgument)
        << tasks;
  }
}

}  // namespace
}  // namespace tandem::cpu_attention
