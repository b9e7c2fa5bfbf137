// WindowAttention of the cpu backend (with the MAW update) against backend_reference.h, over
// head_dim, GQA ratio, cache dtype and query count, with empty slots, causal masking and
// num_slots < capacity; plus timings of the gutenberg-14m shapes (printed, not asserted).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::MakeCpuBackend;
using testing::RandomFloats;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Tolerances against the double reference (which reads the same f32 or bf16 cache values):
// outputs are convex combinations of V in [-1, 1]; f32 scores, exp and sums give ~1e-7 on o
// and MAW, ~1e-6 on lse (of magnitude ~10).
constexpr double kOutTol = 1e-6;
constexpr double kLseTol = 1e-5;
constexpr double kMawTol = 1e-6;

struct Shape {
  int64_t T, Hq, Hkv, D, num_slots, capacity;
  DType dtype;
  double empty_fraction = 0.1;  // share of slots holding -1
};

// A window as the engine builds it: query tokens at positions [base, base + T), whose own
// slots are among the cache's (causal masking inside the chunk), older positions below base,
// empty slots, all in shuffled slot order; slots >= num_slots hold garbage that must be ignored.
struct Problem {
  Shape shape;
  std::vector<float> q;  // [T, Hq, D], row stride Hq·D + 3
  int64_t q_row_stride = 0;
  std::vector<int32_t> q_pos;     // [T]
  std::vector<uint8_t> k, v;      // [Hkv, capacity, D] of dtype
  std::vector<int32_t> slot_pos;  // [capacity]
  std::vector<float> maw;         // [Hkv, capacity], some negative (fresh)
  float scale = 0.0f;
};

Problem MakeProblem(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem pr;
  pr.shape = s;
  pr.q_row_stride = s.Hq * s.D + 3;
  pr.q = RandomFloats(rng, s.T * pr.q_row_stride, -2.0f, 2.0f);
  const int32_t base = static_cast<int32_t>(std::max<int64_t>(s.num_slots, 64)) * 2;
  for (int64_t t = 0; t < s.T; ++t) pr.q_pos.push_back(base + static_cast<int32_t>(t));
  // Slot contents: the chunk's own positions (when they fit), empties, older positions.
  std::vector<int32_t> pos;
  const int64_t own = std::min<int64_t>(s.T, s.num_slots);
  for (int64_t t = 0; t < own; ++t) pos.push_back(pr.q_pos[s.T - own + t]);
  const int64_t empty = static_cast<int64_t>(s.empty_fraction * static_cast<double>(s.num_slots));
  for (int64_t i = 0; i < empty && static_cast<int64_t>(pos.size()) < s.num_slots; ++i) {
    pos.push_back(-1);
  }
  std::vector<int32_t> older(base);
  std::iota(older.begin(), older.end(), 0);
  std::shuffle(older.begin(), older.end(), rng);
  for (size_t i = 0; static_cast<int64_t>(pos.size()) < s.num_slots; ++i) pos.push_back(older[i]);
  std::shuffle(pos.begin(), pos.end(), rng);
  pr.slot_pos = pos;
  for (int64_t i = s.num_slots; i < s.capacity; ++i)
    pr.slot_pos.push_back(static_cast<int32_t>(i % 3));

  const size_t elems = static_cast<size_t>(s.Hkv * s.capacity * s.D);
  std::vector<float> k = RandomFloats(rng, elems, -1.0f, 1.0f);
  std::vector<float> v = RandomFloats(rng, elems, -1.0f, 1.0f);
  for (int64_t g = 0; g < s.Hkv; ++g) {  // garbage beyond num_slots: huge, must be ignored
    for (int64_t i = s.num_slots * s.D; i < s.capacity * s.D; ++i) {
      k[g * s.capacity * s.D + i] = 1e4f;
      v[g * s.capacity * s.D + i] = 1e4f;
    }
  }
  auto encode = [&](const std::vector<float>& x) {
    std::vector<uint8_t> out(x.size() * DTypeBytes(s.dtype));
    if (s.dtype == DType::kF32) {
      std::memcpy(out.data(), x.data(), out.size());
    } else {
      const std::vector<bf16_t> b = testing::ToBf16(x);
      std::memcpy(out.data(), b.data(), out.size());
    }
    return out;
  };
  pr.k = encode(k);
  pr.v = encode(v);
  pr.maw = RandomFloats(rng, s.Hkv * s.capacity, 0.0f, 0.5f);
  for (size_t i = 0; i < pr.maw.size(); i += 3) pr.maw[i] = -1.0f;  // never attended yet
  pr.scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  return pr;
}

WindowAttentionParams BaseParams(const Problem& pr) {
  WindowAttentionParams p;
  p.q_row_stride = pr.q_row_stride;
  p.cache_dtype = pr.shape.dtype;
  p.num_slots = pr.shape.num_slots;
  p.capacity = pr.shape.capacity;
  p.num_tokens = pr.shape.T;
  p.num_q_heads = pr.shape.Hq;
  p.num_kv_heads = pr.shape.Hkv;
  p.head_dim = pr.shape.D;
  p.scale = pr.scale;
  p.alpha = 0.3f;
  return p;
}

struct Outputs {
  std::vector<float> o, lse, maw;
};

Outputs RunReference(const Problem& pr, bool with_maw) {
  Outputs out;
  out.o.assign(pr.shape.T * pr.shape.Hq * pr.shape.D, 0.0f);
  out.lse.assign(pr.shape.T * pr.shape.Hq, 0.0f);
  out.maw = pr.maw;
  WindowAttentionParams p = BaseParams(pr);
  p.q = pr.q.data();
  p.q_pos = pr.q_pos.data();
  p.k_cache = pr.k.data();
  p.v_cache = pr.v.data();
  p.slot_pos = pr.slot_pos.data();
  p.o = out.o.data();
  p.lse = out.lse.data();
  p.maw = with_maw ? out.maw.data() : nullptr;
  reference::WindowAttention(p);
  return out;
}

// Uploads the problem into `dev` and fills p's device pointers.
WindowAttentionParams Upload(const Problem& pr, DeviceArrays& dev, bool with_maw) {
  WindowAttentionParams p = BaseParams(pr);
  p.q = dev.Upload(pr.q);
  p.q_pos = dev.Upload(pr.q_pos);
  p.k_cache = dev.Upload(pr.k);
  p.v_cache = dev.Upload(pr.v);
  p.slot_pos = dev.Upload(pr.slot_pos);
  p.o = dev.Allocate<float>(pr.shape.T * pr.shape.Hq * pr.shape.D);
  p.lse = dev.Allocate<float>(pr.shape.T * pr.shape.Hq);
  p.maw = with_maw ? dev.Upload(pr.maw) : nullptr;
  return p;
}

Outputs RunBackend(Backend& backend, const Problem& pr, bool with_maw) {
  DeviceArrays dev(backend);
  const WindowAttentionParams p = Upload(pr, dev, with_maw);
  Outputs out;
  const absl::Status status = backend.WindowAttention(p);
  EXPECT_TRUE(status.ok()) << status;
  out.o = dev.Download(p.o, pr.shape.T * pr.shape.Hq * pr.shape.D);
  out.lse = dev.Download(p.lse, pr.shape.T * pr.shape.Hq);
  if (with_maw) out.maw = dev.Download(p.maw, pr.maw.size());
  return out;
}

// Compares token rows [t_begin, t_end) of got against ref (the reference may hold only those).
void ExpectClose(const Outputs& got, const Outputs& ref, const Shape& s, int64_t t_begin,
                 int64_t t_end, int64_t ref_t0, const std::string& what) {
  double o_err = 0.0, lse_err = 0.0;
  int empty_mismatch = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t h = 0; h < s.Hq; ++h) {
      const float lg = got.lse[t * s.Hq + h], lr = ref.lse[(t - ref_t0) * s.Hq + h];
      if (lr == kNegInf || lg == kNegInf) {
        empty_mismatch += lr != lg;
      } else {
        lse_err = std::max(lse_err, std::abs(static_cast<double>(lg) - lr));
      }
      for (int64_t d = 0; d < s.D; ++d) {
        const double e = std::abs(static_cast<double>(got.o[(t * s.Hq + h) * s.D + d]) -
                                  ref.o[((t - ref_t0) * s.Hq + h) * s.D + d]);
        o_err = std::isnan(e) ? INFINITY : std::max(o_err, e);
      }
    }
  }
  EXPECT_EQ(empty_mismatch, 0) << what;
  EXPECT_LE(o_err, kOutTol) << what;
  EXPECT_LE(lse_err, kLseTol) << what;
}

void ExpectMawClose(const Outputs& got, const Outputs& ref, const Problem& pr,
                    const std::string& what) {
  double err = 0.0;
  int fresh_checked = 0;
  for (size_t i = 0; i < ref.maw.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got.maw[i]) - ref.maw[i]));
    const int64_t s = static_cast<int64_t>(i) % pr.shape.capacity;
    if (pr.maw[i] < 0.0f && s < pr.shape.num_slots && pr.slot_pos[s] >= 0) ++fresh_checked;
  }
  EXPECT_LE(err, kMawTol) << what;
  EXPECT_GT(fresh_checked, 0) << what << ": no fresh (negative) MAW entry was exercised";
}

using AttentionCase = std::tuple<int64_t, int64_t, DType, int64_t>;  // D, GQA, dtype, T

class WindowAttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(WindowAttentionTest, MatchesReferenceWithMaw) {
  const auto [D, gqa, dtype, T] = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  // 600 of 640 slots: several slot tiles for the larger query counts, one tile for decode.
  const Shape shape{T, 2 * gqa, 2, D, 600, 640, dtype};
  const Problem pr = MakeProblem(shape, static_cast<uint32_t>(D * 1000 + gqa * 100 + T));
  const std::string what =
      absl::StrCat("D=", D, " G=", gqa, " ", std::string(DTypeName(dtype)), " T=", T);
  const Outputs ref = RunReference(pr, /*with_maw=*/true);
  const Outputs got = RunBackend(*backend, pr, /*with_maw=*/true);
  ExpectClose(got, ref, shape, 0, T, 0, what);
  ExpectMawClose(got, ref, pr, what);
  const Outputs no_maw = RunBackend(*backend, pr, /*with_maw=*/false);
  ExpectClose(no_maw, ref, shape, 0, T, 0, what + " without MAW");
}

INSTANTIATE_TEST_SUITE_P(Shapes, WindowAttentionTest,
                         ::testing::Combine(::testing::Values<int64_t>(8, 64, 128),
                                            ::testing::Values<int64_t>(1, 3, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values<int64_t>(1, 7, 64)),
                         [](const ::testing::TestParamInfo<AttentionCase>& info) {
                           return absl::StrCat("D", std::get<0>(info.param), "_G",
                                               std::get<1>(info.param), "_",
                                               std::string(DTypeName(std::get<2>(info.param))),
                                               "_T", std::get<3>(info.param));
                         });

// Larger problems that take the multi-threaded paths: many query units, and decode over a long
// window split across threads (partial states merged).
TEST(WindowAttentionLarge, ParallelAndSplitPathsMatchReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const Shape shapes[] = {
      {200, 6, 2, 64, 3000, 3100, DType::kF32, 0.05},
      {200, 6, 2, 64, 3000, 3100, DType::kBF16, 0.05},
      {1, 16, 2, 128, 16384, 16400, DType::kF32, 0.02},
      {2, 8, 1, 64, 20000, 20000, DType::kBF16, 0.0},
  };
  uint32_t seed = 100;
  for (const Shape& s : shapes) {
    const Problem pr = MakeProblem(s, seed++);
    const std::string what =
        absl::StrCat("T=", s.T, " slots=", s.num_slots, " ", std::string(DTypeName(s.dtype)));
    const Outputs ref = RunReference(pr, true);
    const Outputs got = RunBackend(*backend, pr, true);
    ExpectClose(got, ref, s, 0, s.T, 0, what);
    ExpectMawClose(got, ref, pr, what);
  }
}

TEST(WindowAttentionEdges, EmptyWindowsGiveEmptyStates) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const Shape s{3, 4, 2, 16, 40, 48, DType::kF32};
  Problem pr = MakeProblem(s, 7);
  // Token 0 sees nothing (every slot is later than it); tokens 1, 2 see some.
  pr.q_pos = {-5, 1000000, 1000001};
  Outputs ref = RunReference(pr, true);
  Outputs got = RunBackend(*backend, pr, true);
  ExpectClose(got, ref, s, 0, s.T, 0, "partly empty");
  ExpectMawClose(got, ref, pr, "partly empty");
  for (int64_t h = 0; h < s.Hq; ++h) EXPECT_EQ(got.lse[h], kNegInf);
  for (int64_t i = 0; i < s.Hq * s.D; ++i) EXPECT_EQ(got.o[i], 0.0f);

  // Every slot empty, and num_slots = 0: all states empty, maw untouched.
  std::fill(pr.slot_pos.begin(), pr.slot_pos.end(), -1);
  for (const int64_t num_slots : {int64_t{40}, int64_t{0}}) {
    pr.shape.num_slots = num_slots;
    got = RunBackend(*backend, pr, true);
    for (float x : got.lse) EXPECT_EQ(x, kNegInf);
    for (float x : got.o) EXPECT_EQ(x, 0.0f);
    EXPECT_EQ(got.maw, pr.maw);
  }
}

TEST(WindowAttentionValidation, BadParamsAreInvalidArgument) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const Problem pr = MakeProblem({2, 4, 2, 8, 20, 24, DType::kF32}, 9);
  DeviceArrays dev(*backend);
  const WindowAttentionParams p = Upload(pr, dev, true);
  TANDEM_ASSERT_OK(backend->WindowAttention(p));
  auto expect_invalid = [&](auto mutate) {
    WindowAttentionParams bad = p;
    mutate(bad);
    TANDEM_EXPECT_INVALID(backend->WindowAttention(bad));
  };
  expect_invalid([](WindowAttentionParams& b) { b.q = nullptr; });
  expect_invalid([](WindowAttentionParams& b) { b.slot_pos = nullptr; });
  expect_invalid([](WindowAttentionParams& b) { b.num_tokens = 0; });
  expect_invalid([](WindowAttentionParams& b) { b.head_dim = -8; });
  expect_invalid([](WindowAttentionParams& b) { b.num_kv_heads = 3; });  // 4 % 3 != 0
  expect_invalid([](WindowAttentionParams& b) { b.num_slots = 25; });    // > capacity
  expect_invalid([](WindowAttentionParams& b) { b.q_row_stride = 31; });
  expect_invalid([](WindowAttentionParams& b) { b.cache_dtype = DType::kF16; });
  expect_invalid([](WindowAttentionParams& b) { b.scale = 0.0f; });
  expect_invalid([](WindowAttentionParams& b) { b.alpha = 1.5f; });
}

// The default WindowAttentionBatch (a loop over WindowAttention): every entry's outputs equal
// its single call exactly (decode steps, a prefill chunk, an empty window, MAW updates), and a
// bad entry is INVALID_ARGUMENT.
TEST(WindowAttentionBatch, EqualsSingleCalls) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  const std::vector<Shape> shapes = {{1, 8, 2, 64, 300, 320, DType::kBF16},
                                     {4, 8, 2, 64, 1000, 1000, DType::kBF16},
                                     {1, 8, 2, 64, 0, 16, DType::kBF16},
                                     {17, 8, 2, 64, 500, 600, DType::kF32},
                                     {1, 8, 2, 64, 2000, 2048, DType::kBF16}};
  DeviceArrays dev(*backend);
  std::vector<Problem> problems;
  std::vector<WindowAttentionParams> single, batch;
  for (size_t i = 0; i < shapes.size(); ++i) {
    problems.push_back(MakeProblem(shapes[i], 40 + static_cast<uint32_t>(i)));
    const bool with_maw = i % 2 == 1;
    single.push_back(Upload(problems.back(), dev, with_maw));
    batch.push_back(Upload(problems.back(), dev, with_maw));
  }
  for (const WindowAttentionParams& p : single) TANDEM_ASSERT_OK(backend->WindowAttention(p));
  TANDEM_ASSERT_OK(backend->WindowAttentionBatch(batch.data(), batch.size()));
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const size_t rows = s.T * s.Hq;
    EXPECT_EQ(dev.Download(batch[i].o, rows * s.D), dev.Download(single[i].o, rows * s.D)) << i;
    EXPECT_EQ(dev.Download(batch[i].lse, rows), dev.Download(single[i].lse, rows)) << i;
    if (batch[i].maw != nullptr) {
      const size_t n = problems[i].maw.size();
      EXPECT_EQ(dev.Download(batch[i].maw, n), dev.Download(single[i].maw, n)) << i;
    }
  }
  WindowAttentionParams bad = batch[0];
  bad.q = nullptr;
  TANDEM_EXPECT_INVALID(backend->WindowAttentionBatch(&bad, 1));
  TANDEM_ASSERT_OK(backend->WindowAttentionBatch(nullptr, 0));
}

// gutenberg-14m shapes: a T = 512 prefill chunk over 8192 slots, and a decode step. Timings are
// printed; a sample of tokens is checked against the reference.
TEST(WindowAttentionTiming, GutenbergShapes) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const int64_t T : {int64_t{512}, int64_t{1}}) {
      const Shape s{T, 6, 2, 64, 8192, 8192, dtype, 0.0};
      const Problem pr = MakeProblem(s, 77);
      DeviceArrays dev(*backend);
      const WindowAttentionParams p = Upload(pr, dev, true);
      WindowAttentionParams p_no_maw = p;
      p_no_maw.maw = nullptr;
      const int reps = T == 1 ? 20 : 3;
      double best = INFINITY, best_maw = INFINITY;
      for (int r = 0; r < reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        TANDEM_ASSERT_OK(backend->WindowAttention(p_no_maw));
        auto t1 = std::chrono::steady_clock::now();
        best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      for (int r = 0; r < reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        TANDEM_ASSERT_OK(backend->WindowAttention(p));
        auto t1 = std::chrono::steady_clock::now();
        best_maw = std::min(best_maw, std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      std::printf(
          "[timing] WindowAttention %s T=%lld slots=8192 Hq=6 Hkv=2 D=64: %.3f ms, "
          "with MAW %.3f ms (best of %d; %s)\n",
          std::string(DTypeName(dtype)).c_str(), static_cast<long long>(T), best, best_maw, reps,
          backend->device_description().c_str());
      // Check a few tokens (o, lse) against the reference run on those tokens alone.
      Outputs got;
      got.o = dev.Download(p.o, s.T * s.Hq * s.D);
      got.lse = dev.Download(p.lse, s.T * s.Hq);
      for (const int64_t t : {int64_t{0}, T / 2, T - 1}) {
        Problem one = pr;
        one.shape.T = 1;
        one.q.assign(pr.q.begin() + t * pr.q_row_stride, pr.q.begin() + (t + 1) * pr.q_row_stride);
        one.q_pos = {pr.q_pos[t]};
        const Outputs ref = RunReference(one, false);
        ExpectClose(got, ref, s, t, t + 1, t, absl::StrCat("timing shape token ", t));
      }
    }
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
