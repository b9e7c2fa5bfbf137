// The cuda backend's WindowAttention (+ MAW update) against the f64 reference, over head_dim,
// GQA ratio, cache dtype, token count and window size (empty slots, slots past num_slots,
// causal masking, rows that see nothing), and against the cpu backend where it is built; the
// Prefill suite covers the tensor-core kernels (chunks over cached prefixes, causal diagonals,
// decode steps, NaN in empty slots, split slot ranges). The batched WindowAttentionBatch and
// WriteKvBatch are compared with one call per entry.
//
// Tolerances: o abs 1e-4 and lse abs 1e-4·max(1, |lse|) against f64 (the kernels accumulate in
// f32; bf16 caches are compared with the same bf16 values on both sides); maw relative 1e-4 +
// abs 1e-7. Plans on the fast prefill kernel (window_attention_flash.cuh: bf16 q and p, taken for
// bf16 caches with head_dim <= 128, more than 16 rows per kv head and no MAW update) get
// kFastTolerance instead (see there); the PrefillFlash suite measures its error directly.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "tandem/gpu_worker/backend.h"
#include "window_attention.cuh"
#include "window_attention_flash.cuh"

namespace tandem::gpu_worker::cuda_test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kAlpha = 0.25f;

// o abs and lse abs·max(1, |lse|) bounds against the f64 reference.
struct Tolerance {
  double o;
  double lse;
};
constexpr Tolerance kExactTolerance{1e-4, 1e-4};
// The fast prefill kernel rounds q·scale and the softmax weights p to bf16 (2^-9 relative each):
// the scores move by up to ~3e-3 for these inputs (q in [-2, 2], k in [-1, 1], D 128), which
// moves lse by as much and o by a fraction of it (rows that see few slots are the worst).
// MEASURED on the H100 (PrefillFlash suite, both warp layouts): o max abs 1.5e-3, lse
// 1.7e-3·max(1, |lse|); tandem-kernel-bench at the Llama-3-8B geometry (2K-16K chunks) against
// the exact kernel: o 2.1e-3, lse 1.8e-3. The bounds leave about 2.5x margin.
constexpr Tolerance kFastTolerance{5e-3, 5e-3};

// Whether the backend plans `in` on the fast prefill kernel (a MAW update keeps the exact one).
bool UsesFastPrefill(const AttentionInputs& in, DType dtype, bool maw) {
  float maw_marker = 0.0f;  // the planner only tests the pointer
  cuda_backend::WindowAttentionArgs args;
  args.cache_dtype = dtype;
  args.num_slots = std::max<int64_t>(in.num_slots, 1);
  args.capacity = in.capacity;
  args.num_tokens = in.num_tokens;
  args.num_q_heads = in.num_q_heads;
  args.num_kv_heads = in.num_kv_heads;
  args.head_dim = in.head_dim;
  args.maw = maw ? &maw_marker : nullptr;
  cuda_backend::WindowAttentionPlan plan;
  EXPECT_EQ(cuda_backend::PlanWindowAttention(args, 1, &plan), cudaSuccess);
  return plan.flash;
}

struct AttentionCase {
  int64_t head_dim;
  int64_t num_kv_heads;
  int64_t group;  // num_q_heads / num_kv_heads
  DType dtype;
  int64_t num_tokens;
  int64_t capacity;
  int64_t num_slots;
};

std::string CaseName(const ::testing::TestParamInfo<AttentionCase>& info) {
  const AttentionCase& c = info.param;
  const std::string_view dtype = DTypeName(c.dtype);
  return absl::StrCat("d", c.head_dim, "_kv", c.num_kv_heads, "_g", c.group, "_",
                      absl::string_view(dtype.data(), dtype.size()), "_t", c.num_tokens, "_cap",
                      c.capacity, "_slots", c.num_slots);
}

// A window: slots [0, num_slots) hold distinct positions >= 10 in random order, about 10% empty
// (-1); query token t sits at position P - T + t where P exceeds every slot position by a
// little, so late slots are causally hidden from early tokens; with T >= 7 token 0 sits at
// position 5 and sees nothing. Slots past num_slots look valid (position 0) and hold huge K/V,
// so reading them would show. The q rows carry NaN padding (a fused-qkv-like stride).
AttentionInputs MakeInputs(const AttentionCase& c, uint32_t seed) {
  AttentionInputs in;
  in.num_tokens = c.num_tokens;
  in.num_kv_heads = c.num_kv_heads;
  in.num_q_heads = c.num_kv_heads * c.group;
  in.head_dim = c.head_dim;
  in.capacity = c.capacity;
  in.num_slots = c.num_slots;
  in.q_row_stride = (in.num_q_heads + 2 * in.num_kv_heads) * c.head_dim;
  in.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::mt19937 rng(seed);
  const int32_t top = static_cast<int32_t>(10 + c.num_slots + c.num_tokens / 2);
  std::vector<int32_t> positions(top - 10);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(10 + i);
  std::shuffle(positions.begin(), positions.end(), rng);
  in.slot_pos.assign(c.capacity, 0);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t s = 0; s < c.num_slots; ++s) {
    in.slot_pos[s] = unit(rng) < 0.1f ? -1 : positions[s];
  }
  in.q_pos.resize(c.num_tokens);
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    in.q_pos[t] = static_cast<int32_t>(top - c.num_tokens + t);
  }
  if (c.num_tokens >= 7) in.q_pos[0] = 5;
  in.q = RandomFloats(c.num_tokens * in.q_row_stride, -2, 2, seed + 1);
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    for (int64_t i = in.num_q_heads * c.head_dim; i < in.q_row_stride; ++i) {
      in.q[t * in.q_row_stride + i] = kNaN;
    }
  }
  const size_t cache = c.num_kv_heads * c.capacity * c.head_dim;
  in.k = RoundTo(RandomFloats(cache, -1, 1, seed + 2), c.dtype);
  in.v = RoundTo(RandomFloats(cache, -1, 1, seed + 3), c.dtype);
  for (int64_t g = 0; g < c.num_kv_heads; ++g) {
    for (int64_t s = c.num_slots; s < c.capacity; ++s) {
      for (int64_t d = 0; d < c.head_dim; ++d) {
        in.k[(g * c.capacity + s) * c.head_dim + d] = 1000.0f;
        in.v[(g * c.capacity + s) * c.head_dim + d] = 1000.0f;
      }
    }
  }
  return in;
}

// maw before the update: ~30% negative ("not attended yet"), the rest in [0, 0.1).
std::vector<float> InitialMaw(const AttentionCase& c, uint32_t seed) {
  std::vector<float> maw = RandomFloats(c.num_kv_heads * c.capacity, -0.05f, 0.1f, seed);
  for (float& m : maw) {
    if (m < 0.0f) m = -1.0f;
  }
  return maw;
}

struct DeviceOutputs {
  std::vector<float> o, lse, maw;
};

// Runs WindowAttention on `backend` (with the MAW update when maw0 is non-empty).
DeviceOutputs RunAttention(Backend& backend, const AttentionInputs& in, DType dtype,
                           const std::vector<float>& maw0) {
  DeviceBuffer q = UploadTo(backend, in.q);
  DeviceBuffer q_pos = UploadTo(backend, in.q_pos);
  DeviceBuffer slot_pos = UploadTo(backend, in.slot_pos);
  DeviceBuffer k = UploadTo(backend, EncodeAs(in.k, dtype));
  DeviceBuffer v = UploadTo(backend, EncodeAs(in.v, dtype));
  const size_t rows = in.num_tokens * in.num_q_heads;
  DeviceBuffer o = UploadTo(backend, std::vector<float>(rows * in.head_dim, kNaN));
  DeviceBuffer lse = UploadTo(backend, std::vector<float>(rows, kNaN));
  DeviceBuffer maw = maw0.empty() ? DeviceBuffer() : UploadTo(backend, maw0);
  const absl::Status status = backend.WindowAttention({.q = q.as<float>(),
                                                       .q_row_stride = in.q_row_stride,
                                                       .q_pos = q_pos.as<int32_t>(),
                                                       .k_cache = k.data(),
                                                       .v_cache = v.data(),
                                                       .cache_dtype = dtype,
                                                       .slot_pos = slot_pos.as<int32_t>(),
                                                       .num_slots = in.num_slots,
                                                       .capacity = in.capacity,
                                                       .num_tokens = in.num_tokens,
                                                       .num_q_heads = in.num_q_heads,
                                                       .num_kv_heads = in.num_kv_heads,
                                                       .head_dim = in.head_dim,
                                                       .scale = in.scale,
                                                       .o = o.as<float>(),
                                                       .lse = lse.as<float>(),
                                                       .maw = maw.as<float>(),
                                                       .alpha = kAlpha});
  EXPECT_TRUE(status.ok()) << status;
  DeviceOutputs out;
  out.o = DownloadFrom<float>(backend, o, rows * in.head_dim);
  out.lse = DownloadFrom<float>(backend, lse, rows);
  if (!maw0.empty()) out.maw = DownloadFrom<float>(backend, maw, maw0.size());
  return out;
}

class WindowAttentionTest : public CudaBackendFixture,
                            public ::testing::WithParamInterface<AttentionCase> {};

// token0_sees_nothing: MakeInputs places token 0 (of T >= 7) before every slot. `dtype`: the
// cache's, which with maw0 decides the kernel and so the tolerance.
void ExpectMatchesReference(const AttentionInputs& in, DType dtype, const DeviceOutputs& got,
                            const std::vector<float>& maw0, bool token0_sees_nothing = true) {
  const Tolerance tol =
      UsesFastPrefill(in, dtype, !maw0.empty()) ? kFastTolerance : kExactTolerance;
  const AttentionResult ref = ReferenceAttention(in);
  int empty_rows = 0;
  for (size_t r = 0; r < ref.lse.size(); ++r) {
    if (std::isinf(ref.lse[r])) {
      ++empty_rows;
      ASSERT_EQ(got.lse[r], -std::numeric_limits<float>::infinity()) << "row " << r;
    } else {
      ASSERT_NEAR(got.lse[r], ref.lse[r], tol.lse * std::max(1.0, std::abs(ref.lse[r])))
          << "row " << r;
    }
    for (int64_t d = 0; d < in.head_dim; ++d) {
      ASSERT_NEAR(got.o[r * in.head_dim + d], ref.o[r * in.head_dim + d], tol.o)
          << "row " << r << " dim " << d;
    }
  }
  if (token0_sees_nothing && in.num_tokens >= 7) {
    EXPECT_GE(empty_rows, in.num_q_heads) << "token 0 should see nothing";
  }
  if (maw0.empty()) return;
  for (int64_t g = 0; g < in.num_kv_heads; ++g) {
    for (int64_t s = 0; s < in.capacity; ++s) {
      const size_t i = g * in.capacity + s;
      double expected = maw0[i];
      if (s < in.num_slots && in.slot_pos[s] >= 0) {
        expected = maw0[i] < 0.0f ? ref.a[i] : (1.0 - kAlpha) * maw0[i] + kAlpha * ref.a[i];
      }
      ASSERT_NEAR(got.maw[i], expected, 1e-4 * std::abs(expected) + 1e-7)
          << "kv head " << g << " slot " << s;
    }
  }
}

TEST_P(WindowAttentionTest, MatchesReference) {
  const AttentionCase c = GetParam();
  const AttentionInputs in = MakeInputs(c, 100);
  const std::vector<float> maw0 = InitialMaw(c, 200);
  const DeviceOutputs got = RunAttention(*backend_, in, c.dtype, maw0);
  ExpectMatchesReference(in, c.dtype, got, maw0);
}

TEST_P(WindowAttentionTest, WithoutMawLeavesNoTrace) {
  const AttentionCase c = GetParam();
  if (c.num_tokens * c.group * c.num_slots > (int64_t{1} << 22)) GTEST_SKIP() << "large case";
  const AttentionInputs in = MakeInputs(c, 300);
  const DeviceOutputs got = RunAttention(*backend_, in, c.dtype, {});
  ExpectMatchesReference(in, c.dtype, got, {});
}

#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
// Both backends on the same inputs: o abs 1e-4, lse abs 1e-4·max(1, |lse|), maw as above.
TEST_P(WindowAttentionTest, MatchesCpuBackend) {
  const AttentionCase c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const AttentionInputs in = MakeInputs(c, 400);
  const std::vector<float> maw0 = InitialMaw(c, 500);
  const DeviceOutputs want = RunAttention(**cpu, in, c.dtype, maw0);
  const DeviceOutputs got = RunAttention(*backend_, in, c.dtype, maw0);
  for (size_t r = 0; r < want.lse.size(); ++r) {
    if (std::isinf(want.lse[r])) {
      ASSERT_EQ(got.lse[r], want.lse[r]) << "row " << r;
    } else {
      ASSERT_NEAR(got.lse[r], want.lse[r], 1e-4 * std::max(1.0f, std::abs(want.lse[r])));
    }
  }
  for (size_t i = 0; i < want.o.size(); ++i) ASSERT_NEAR(got.o[i], want.o[i], 1e-4) << i;
  for (size_t i = 0; i < want.maw.size(); ++i) {
    ASSERT_NEAR(got.maw[i], want.maw[i], 1e-4 * std::abs(want.maw[i]) + 1e-7) << i;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Shapes, WindowAttentionTest,
                         ::testing::Values(
                             // stories260k-like: head_dim 8, 4 kv heads, GQA 2
                             AttentionCase{8, 4, 2, DType::kF32, 1, 128, 100},
                             AttentionCase{8, 4, 2, DType::kBF16, 7, 512, 300},
                             AttentionCase{8, 1, 3, DType::kF32, 64, 1024, 1000},
                             // gutenberg-14m-like: head_dim 64, 2 kv heads, GQA 3
                             AttentionCase{64, 2, 3, DType::kBF16, 1, 8192, 8192},
                             AttentionCase{64, 2, 3, DType::kF32, 7, 4096, 4000},
                             AttentionCase{64, 2, 1, DType::kBF16, 512, 2048, 2048},
                             AttentionCase{64, 1, 4, DType::kF32, 64, 8192, 8192},
                             AttentionCase{64, 2, 3, DType::kBF16, 512, 8192, 8000},
                             // Llama-style: head_dim 128, GQA 4
                             AttentionCase{128, 2, 4, DType::kBF16, 1, 8192, 8000},
                             AttentionCase{128, 2, 4, DType::kF32, 1, 65536, 65536},
                             AttentionCase{128, 1, 4, DType::kF32, 512, 1024, 1024},
                             AttentionCase{128, 2, 1, DType::kF32, 7, 8192, 8192},
                             AttentionCase{128, 1, 3, DType::kBF16, 64, 4096, 3000},
                             // other head dims: the 256 bucket and a non-power-of-two
                             AttentionCase{256, 1, 2, DType::kF32, 7, 512, 512},
                             AttentionCase{256, 2, 1, DType::kBF16, 1, 3000, 2999},
                             AttentionCase{80, 2, 2, DType::kBF16, 1, 1000, 999},
                             AttentionCase{80, 1, 4, DType::kF32, 33, 700, 650}),
                         CaseName);

// ---- Prefill shapes: a chunk of T new tokens at positions [P, P + T) over a window holding
// positions [0, P + T) (the chunk's own K/V included), so the causal diagonal runs through the
// window; these take the tensor-core kernel for bf16 caches with head_dim <= 128 (the f32 cases
// keep the f32 tiled kernel). `ring`: 4 sink slots, then the rest in ring order (rotated by a
// third). Every 17th slot is empty (-1) and, in the reference test, holds NaN K/V (an unwritten
// slot must not reach o); capacity exceeds num_slots by 37 slots of huge K/V that look valid.
struct PrefillCase {
  int64_t head_dim;
  int64_t num_kv_heads;
  int64_t group;
  DType dtype;
  int64_t chunk;
  int64_t prefix;
  bool ring;
};

std::string PrefillName(const ::testing::TestParamInfo<PrefillCase>& info) {
  const PrefillCase& c = info.param;
  const std::string_view dtype = DTypeName(c.dtype);
  return absl::StrCat("d", c.head_dim, "_kv", c.num_kv_heads, "_g", c.group, "_",
                      absl::string_view(dtype.data(), dtype.size()), "_t", c.chunk, "_p",
                      c.prefix, c.ring ? "_ring" : "");
}

AttentionInputs MakePrefillInputs(const PrefillCase& c, uint32_t seed, bool nan_in_empty) {
  AttentionInputs in;
  in.num_tokens = c.chunk;
  in.num_kv_heads = c.num_kv_heads;
  in.num_q_heads = c.num_kv_heads * c.group;
  in.head_dim = c.head_dim;
  in.num_slots = c.prefix + c.chunk;
  in.capacity = in.num_slots + 37;
  in.q_row_stride = in.num_q_heads * c.head_dim;
  in.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  constexpr int64_t kSink = 4;
  const int64_t ring = in.num_slots - kSink;
  in.slot_pos.assign(in.capacity, 0);
  for (int64_t s = 0; s < in.num_slots; ++s) {
    int64_t pos = s;
    if (c.ring && s >= kSink) pos = kSink + (s - kSink + ring / 3) % ring;
    in.slot_pos[s] = s % 17 == 5 ? -1 : static_cast<int32_t>(pos);
  }
  in.q_pos.resize(c.chunk);
  for (int64_t t = 0; t < c.chunk; ++t) in.q_pos[t] = static_cast<int32_t>(c.prefix + t);
  in.q = RandomFloats(c.chunk * in.q_row_stride, -2, 2, seed + 1);
  const size_t cache = c.num_kv_heads * in.capacity * c.head_dim;
  in.k = RoundTo(RandomFloats(cache, -1, 1, seed + 2), c.dtype);
  in.v = RoundTo(RandomFloats(cache, -1, 1, seed + 3), c.dtype);
  for (int64_t g = 0; g < c.num_kv_heads; ++g) {
    for (int64_t s = 0; s < in.capacity; ++s) {
      const bool past = s >= in.num_slots;
      if (!past && in.slot_pos[s] >= 0) continue;
      const float junk = past || !nan_in_empty ? 1000.0f : kNaN;
      for (int64_t d = 0; d < c.head_dim; ++d) {
        in.k[(g * in.capacity + s) * c.head_dim + d] = junk;
        in.v[(g * in.capacity + s) * c.head_dim + d] = junk;
      }
    }
  }
  return in;
}

class PrefillAttentionTest : public CudaBackendFixture,
                             public ::testing::WithParamInterface<PrefillCase> {};

TEST_P(PrefillAttentionTest, MatchesReference) {
  const PrefillCase c = GetParam();
  const AttentionInputs in = MakePrefillInputs(c, 600, /*nan_in_empty=*/true);
  const std::vector<float> maw0 = InitialMaw({c.head_dim, c.num_kv_heads, c.group, c.dtype,
                                              c.chunk, in.capacity, in.num_slots},
                                             700);
  ExpectMatchesReference(in, c.dtype, RunAttention(*backend_, in, c.dtype, maw0), maw0, false);
  ExpectMatchesReference(in, c.dtype, RunAttention(*backend_, in, c.dtype, {}), {}, false);
}

#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
TEST_P(PrefillAttentionTest, MatchesCpuBackend) {
  const PrefillCase c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const AttentionInputs in = MakePrefillInputs(c, 800, /*nan_in_empty=*/false);
  const Tolerance tol = UsesFastPrefill(in, c.dtype, false) ? kFastTolerance : kExactTolerance;
  const DeviceOutputs want = RunAttention(**cpu, in, c.dtype, {});
  const DeviceOutputs got = RunAttention(*backend_, in, c.dtype, {});
  for (size_t r = 0; r < want.lse.size(); ++r) {
    if (std::isinf(want.lse[r])) {
      ASSERT_EQ(got.lse[r], want.lse[r]) << "row " << r;
    } else {
      ASSERT_NEAR(got.lse[r], want.lse[r], tol.lse * std::max(1.0f, std::abs(want.lse[r])))
          << "row " << r;
    }
  }
  for (size_t i = 0; i < want.o.size(); ++i) ASSERT_NEAR(got.o[i], want.o[i], tol.o) << i;
}
#endif

INSTANTIATE_TEST_SUITE_P(Prefill, PrefillAttentionTest,
                         ::testing::Values(
                             // plain causal self-attention (prefix 0), D 128 and 64
                             PrefillCase{128, 2, 4, DType::kBF16, 300, 0, false},
                             PrefillCase{64, 2, 3, DType::kBF16, 200, 0, false},
                             // a chunk over a cached prefix, contiguous or sink + ring
                             PrefillCase{128, 2, 4, DType::kBF16, 256, 1000, true},
                             PrefillCase{64, 2, 3, DType::kBF16, 130, 700, false},
                             // few rows over a long prefix: the slots split across blocks
                             PrefillCase{128, 8, 4, DType::kBF16, 16, 4000, true},
                             PrefillCase{64, 1, 1, DType::kBF16, 70, 3000, true},
                             // head dims padded inside a bucket
                             PrefillCase{96, 1, 2, DType::kBF16, 40, 200, false},
                             PrefillCase{8, 2, 2, DType::kBF16, 33, 100, true},
                             // f32 caches (the f32 tiled kernel)
                             PrefillCase{128, 1, 4, DType::kF32, 128, 500, true},
                             PrefillCase{64, 2, 2, DType::kF32, 100, 0, false},
                             // decoding (T·G <= 16: the streaming decode kernels), NaN in the
                             // empty slots, the last tokens' own slots in the window
                             PrefillCase{128, 2, 4, DType::kBF16, 2, 3000, true},
                             PrefillCase{64, 1, 4, DType::kBF16, 4, 1500, false},
                             PrefillCase{128, 8, 4, DType::kBF16, 1, 9000, true},
                             PrefillCase{128, 1, 4, DType::kF32, 1, 700, true},
                             // a few tokens (17..32 rows): the tensor-core kernel saves its
                             // scores for the MAW update
                             PrefillCase{128, 2, 4, DType::kBF16, 8, 2000, true},
                             PrefillCase{64, 1, 3, DType::kBF16, 9, 500, false}),
                         PrefillName);

// The window-attention kernels launched directly with a plan a test sets (LaunchWindowAttention).
class DirectKernelFixture : public CudaBackendFixture {
 protected:
  // A case's inputs on the device (the cache in `dtype`), its outputs filled with NaN, and the
  // kernel's arguments over them (device pointers: valid while the buffers live).
  struct Uploaded {
    DeviceBuffer q, q_pos, slot_pos, k, v, o, lse;
    cuda_backend::WindowAttentionArgs args;
  };
  Uploaded UploadInputs(const AttentionInputs& in, DType dtype) {
    Uploaded u;
    u.q = Upload(in.q);
    u.q_pos = Upload(in.q_pos);
    u.slot_pos = Upload(in.slot_pos);
    u.k = Upload(EncodeAs(in.k, dtype));
    u.v = Upload(EncodeAs(in.v, dtype));
    const size_t rows = in.num_tokens * in.num_q_heads;
    u.o = Filled(rows * in.head_dim, kNaN);
    u.lse = Filled(rows, kNaN);
    cuda_backend::WindowAttentionArgs& a = u.args;
    a.q = u.q.as<float>();
    a.q_row_stride = in.q_row_stride;
    a.q_pos = u.q_pos.as<int32_t>();
    a.k_cache = u.k.data();
    a.v_cache = u.v.data();
    a.cache_dtype = dtype;
    a.slot_pos = u.slot_pos.as<int32_t>();
    a.num_slots = in.num_slots;
    a.capacity = in.capacity;
    a.num_tokens = in.num_tokens;
    a.num_q_heads = in.num_q_heads;
    a.num_kv_heads = in.num_kv_heads;
    a.head_dim = in.head_dim;
    a.scale = in.scale;
    a.o = u.o.as<float>();
    a.lse = u.lse.as<float>();
    return u;
  }
  // Runs `plan` over u.args on a stream of its own (with the plan's workspace) and brings o
  // ([rows, head_dim]) and lse ([rows]) back.
  void LaunchAndDownload(const Uploaded& u, const cuda_backend::WindowAttentionPlan& plan,
                         std::vector<float>* o, std::vector<float>* lse) {
    DeviceBuffer workspace;
    if (plan.workspace_bytes > 0) {
      absl::StatusOr<DeviceBuffer> ws = backend_->Allocate(plan.workspace_bytes);
      ASSERT_TRUE(ws.ok()) << ws.status();
      workspace = *std::move(ws);
    }
    ASSERT_TRUE(backend_->Synchronize().ok());  // the uploads are queued on the backend's stream
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    const cudaError_t launched =
        cuda_backend::LaunchWindowAttention(u.args, plan, workspace.data(), stream);
    const cudaError_t synced = cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    ASSERT_EQ(launched, cudaSuccess) << cudaGetErrorString(launched);
    ASSERT_EQ(synced, cudaSuccess) << cudaGetErrorString(synced);
    const size_t rows = u.args.num_tokens * u.args.num_q_heads;
    *o = Download<float>(u.o, rows * u.args.head_dim);
    *lse = Download<float>(u.lse, rows);
  }
};

// ---- The fast prefill kernel's variants (kFlashVariants), launched directly through
// LaunchWindowAttention with the plan's variant overridden (the backend takes the preferred one):
// o and lse against the f64 reference (NaN in empty slots, o/lse poisoned with NaN first), the
// measured max errors printed. Shapes: slot splits (many rows over a prefix, and few row tiles),
// plain causal, more row tiles x kv heads than a GPU has multiprocessors (several waves of
// blocks; the second with empty slots, whose tiles the Hopper kernel loads without TMA), head
// dims 64 and padded 96 and 8 in their buckets.
class PrefillFlashTest
    : public DirectKernelFixture,
      public ::testing::WithParamInterface<std::tuple<PrefillCase, int>> {};

TEST_P(PrefillFlashTest, VariantMatchesReference) {
  const auto& [c, variant] = GetParam();
  const AttentionInputs in = MakePrefillInputs(c, 900, /*nan_in_empty=*/true);
  const Uploaded u = UploadInputs(in, c.dtype);
  const cuda_backend::WindowAttentionArgs& args = u.args;
  const size_t rows = in.num_tokens * in.num_q_heads;
  cudaDeviceProp props{};
  ASSERT_EQ(cudaGetDeviceProperties(&props, 0), cudaSuccess);
  cuda_backend::WindowAttentionPlan plan;
  ASSERT_EQ(cuda_backend::PlanWindowAttention(args, props.multiProcessorCount, &plan),
            cudaSuccess);
  ASSERT_TRUE(plan.flash) << "the shape should take the fast prefill kernel";
  if (!cuda_backend::FlashVariantAvailable(args, variant)) {
    GTEST_SKIP() << "variant " << variant << " does not run here (the Hopper kernel needs an "
                 << "sm_90 build, a 9.x device and head_dim 128)";
  }
  plan.flash_variant = variant;
  std::vector<float> got_o, got_lse;
  ASSERT_NO_FATAL_FAILURE(LaunchAndDownload(u, plan, &got_o, &got_lse));
  const AttentionResult ref = ReferenceAttention(in);
  double o_err = 0.0, lse_err = 0.0;
  for (size_t r = 0; r < rows; ++r) {
    if (std::isinf(ref.lse[r])) {
      ASSERT_EQ(got_lse[r], -std::numeric_limits<float>::infinity()) << "row " << r;
    } else {
      ASSERT_TRUE(std::isfinite(got_lse[r])) << "row " << r;
      lse_err = std::max(lse_err, std::abs(got_lse[r] - ref.lse[r]) /
                                      std::max(1.0, std::abs(ref.lse[r])));
    }
    for (int64_t d = 0; d < in.head_dim; ++d) {
      const float x = got_o[r * in.head_dim + d];
      ASSERT_TRUE(std::isfinite(x)) << "row " << r << " dim " << d;
      o_err = std::max(o_err, std::abs(x - ref.o[r * in.head_dim + d]));
    }
  }
  std::printf("fast prefill kernel, variant %d, splits %d: o max abs error %.3e, lse %.3e\n",
              variant, static_cast<int>(plan.splits), o_err, lse_err);
  EXPECT_LE(o_err, kFastTolerance.o);
  EXPECT_LE(lse_err, kFastTolerance.lse);
}

INSTANTIATE_TEST_SUITE_P(
    PrefillFlash, PrefillFlashTest,
    ::testing::Combine(::testing::Values(PrefillCase{128, 2, 4, DType::kBF16, 600, 1500, true},
                                         PrefillCase{128, 1, 4, DType::kBF16, 512, 0, false},
                                         PrefillCase{128, 8, 4, DType::kBF16, 40, 3000, true},
                                         PrefillCase{128, 8, 4, DType::kBF16, 1024, 0, false},
                                         PrefillCase{128, 4, 4, DType::kBF16, 1200, 700, true},
                                         PrefillCase{64, 2, 3, DType::kBF16, 300, 500, true},
                                         PrefillCase{96, 1, 2, DType::kBF16, 200, 300, false},
                                         PrefillCase{8, 2, 2, DType::kBF16, 100, 50, true}),
                       ::testing::Range(0, cuda_backend::kFlashVariants)),
    [](const ::testing::TestParamInfo<std::tuple<PrefillCase, int>>& info) {
      return absl::StrCat(
          PrefillName(::testing::TestParamInfo<PrefillCase>(std::get<0>(info.param), 0)),
          "_variant", std::get<1>(info.param));
    });

// Decode plans at every split density the kernel bench sweeps (PlanWindowAttention's
// decode_waves, window_attention.cuh's kDecodeWaves): the streaming decode kernel with its fused
// merge off (no split counters: the combine launch) against the f64 reference. (tokens, waves).
class DecodeWavesTest : public DirectKernelFixture,
                        public ::testing::WithParamInterface<std::tuple<int64_t, int>> {};

TEST_P(DecodeWavesTest, MatchesReference) {
  const auto [tokens, waves] = GetParam();
  // Llama-3-8B's GQA (8 kv heads x 4), a ring window with empty slots, bf16 cache.
  const PrefillCase c{128, 8, 4, DType::kBF16, tokens, 9000, true};
  const AttentionInputs in = MakePrefillInputs(c, 1000 + waves, /*nan_in_empty=*/true);
  const Uploaded u = UploadInputs(in, c.dtype);
  const cuda_backend::WindowAttentionArgs& args = u.args;
  const size_t rows = in.num_tokens * in.num_q_heads;
  cudaDeviceProp props{};
  ASSERT_EQ(cudaGetDeviceProperties(&props, 0), cudaSuccess);
  cuda_backend::WindowAttentionPlan plan;
  ASSERT_EQ(cuda_backend::PlanWindowAttention(args, props.multiProcessorCount, &plan,
                                              /*allow_tensor_cores=*/true,
                                              /*exact_prefill=*/false, waves),
            cudaSuccess);
  ASSERT_TRUE(plan.decode) << "the shape should take the decode kernel";
  std::vector<float> got_o, got_lse;
  ASSERT_NO_FATAL_FAILURE(LaunchAndDownload(u, plan, &got_o, &got_lse));
  const AttentionResult ref = ReferenceAttention(in);
  for (size_t r = 0; r < rows; ++r) {
    ASSERT_NEAR(got_lse[r], ref.lse[r], kExactTolerance.lse * std::max(1.0, std::abs(ref.lse[r])))
        << "row " << r << " splits " << plan.splits;
    for (int64_t d = 0; d < in.head_dim; ++d) {
      ASSERT_NEAR(got_o[r * in.head_dim + d], ref.o[r * in.head_dim + d], kExactTolerance.o)
          << "row " << r << " dim " << d << " splits " << plan.splits;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DecodeWaves, DecodeWavesTest,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(1, 2, 4, 8)),
                         [](const ::testing::TestParamInfo<std::tuple<int64_t, int>>& info) {
                           return absl::StrCat("t", std::get<0>(info.param), "_waves",
                                               std::get<1>(info.param));
                         });

using WindowAttentionEdgeTest = CudaBackendFixture;

// An empty window (num_slots = 0): o = 0, lse = -inf, maw untouched.
TEST_F(WindowAttentionEdgeTest, EmptyWindow) {
  constexpr int64_t kTokens = 3, kHeads = 4, kDim = 64, kCapacity = 16;
  DeviceBuffer q = Upload(RandomFloats(kTokens * kHeads * kDim, -1, 1, 1));
  DeviceBuffer q_pos = Upload(std::vector<int32_t>{5, 6, 7});
  DeviceBuffer cache = Upload(RandomFloats(kHeads * kCapacity * kDim, -1, 1, 2));
  DeviceBuffer slot_pos = Upload(std::vector<int32_t>(kCapacity, 0));
  DeviceBuffer o = Filled(kTokens * kHeads * kDim, kNaN), lse = Filled(kTokens * kHeads, kNaN);
  const std::vector<float> maw0(kHeads * kCapacity, 0.5f);
  DeviceBuffer maw = Upload(maw0);
  ASSERT_TRUE(backend_
                  ->WindowAttention({.q = q.as<float>(),
                                     .q_row_stride = kHeads * kDim,
                                     .q_pos = q_pos.as<int32_t>(),
                                     .k_cache = cache.data(),
                                     .v_cache = cache.data(),
                                     .cache_dtype = DType::kF32,
                                     .slot_pos = slot_pos.as<int32_t>(),
                                     .num_slots = 0,
                                     .capacity = kCapacity,
                                     .num_tokens = kTokens,
                                     .num_q_heads = kHeads,
                                     .num_kv_heads = kHeads,
                                     .head_dim = kDim,
                                     .scale = 0.125f,
                                     .o = o.as<float>(),
                                     .lse = lse.as<float>(),
                                     .maw = maw.as<float>(),
                                     .alpha = 0.5f})
                  .ok());
  for (float x : Download<float>(o, kTokens * kHeads * kDim)) ASSERT_EQ(x, 0.0f);
  for (float x : Download<float>(lse, kTokens * kHeads)) {
    ASSERT_EQ(x, -std::numeric_limits<float>::infinity());
  }
  EXPECT_EQ(Download<float>(maw, maw0.size()), maw0);
}

// ---- WindowAttentionBatch / WriteKvBatch: the batched calls against one call per entry.

// One entry's inputs and outputs in device memory, with the params that point at them.
struct DeviceEntry {
  DeviceBuffer q, q_pos, slot_pos, k, v, o, lse, maw;
  WindowAttentionParams params;
  size_t rows = 0;
};

DeviceEntry MakeDeviceEntry(Backend& backend, const AttentionInputs& in, DType dtype,
                            const std::vector<float>& maw0) {
  DeviceEntry e;
  e.q = UploadTo(backend, in.q);
  e.q_pos = UploadTo(backend, in.q_pos);
  e.slot_pos = UploadTo(backend, in.slot_pos);
  e.k = UploadTo(backend, EncodeAs(in.k, dtype));
  e.v = UploadTo(backend, EncodeAs(in.v, dtype));
  e.rows = in.num_tokens * in.num_q_heads;
  e.o = UploadTo(backend, std::vector<float>(e.rows * in.head_dim, kNaN));
  e.lse = UploadTo(backend, std::vector<float>(e.rows, kNaN));
  if (!maw0.empty()) e.maw = UploadTo(backend, maw0);
  e.params = {.q = e.q.as<float>(),
              .q_row_stride = in.q_row_stride,
              .q_pos = e.q_pos.as<int32_t>(),
              .k_cache = e.k.data(),
              .v_cache = e.v.data(),
              .cache_dtype = dtype,
              .slot_pos = e.slot_pos.as<int32_t>(),
              .num_slots = in.num_slots,
              .capacity = in.capacity,
              .num_tokens = in.num_tokens,
              .num_q_heads = in.num_q_heads,
              .num_kv_heads = in.num_kv_heads,
              .head_dim = in.head_dim,
              .scale = in.scale,
              .o = e.o.as<float>(),
              .lse = e.lse.as<float>(),
              .maw = e.maw.as<float>(),
              .alpha = kAlpha};
  return e;
}

struct BatchCase {
  AttentionCase shape;
  bool maw;
};

// A continuous-batching layer: decode steps of 1..4 tokens (T·G <= 16: the batched kernel) over
// windows of 0 (empty), 1, 31 and up to 20,000 slots, mixed with entries that take the single
// path: 5 tokens (20 rows), a MAW update, an f32 cache, another head-dim bucket (64) and another
// kv head count than the first batched entry.
std::vector<BatchCase> MixedBatch() {
  const DType bf16 = DType::kBF16;
  return {
      {{128, 8, 4, bf16, 1, 4300, 4200}, false}, {{128, 8, 4, bf16, 1, 128, 100}, false},
      {{128, 8, 4, bf16, 1, 64, 0}, false},      {{128, 8, 4, bf16, 2, 3000, 3000}, false},
      {{128, 8, 4, bf16, 4, 9000, 9000}, false}, {{128, 8, 4, bf16, 1, 40, 31}, false},
      {{128, 8, 4, bf16, 1, 16, 1}, false},      {{128, 8, 4, bf16, 1, 20000, 20000}, false},
      {{128, 8, 4, bf16, 5, 2000, 2000}, false}, {{128, 8, 4, bf16, 1, 4300, 4200}, true},
      {{128, 8, 4, bf16, 3, 800, 700}, true},    {{128, 8, 4, DType::kF32, 1, 600, 500}, false},
      {{64, 8, 4, bf16, 1, 900, 800}, false},    {{128, 2, 4, bf16, 1, 5000, 5000}, false},
      {{128, 8, 4, bf16, 3, 2500, 2400}, false}, {{128, 8, 4, bf16, 1, 7000, 6999}, false},
      {{128, 8, 4, bf16, 1, 64, 0}, false},      {{128, 8, 2, bf16, 8, 1200, 1200}, false},
      {{128, 8, 4, bf16, 1, 300, 257}, false},   {{128, 8, 4, bf16, 2, 1000, 1000}, false},
  };
}

// o abs tol.o, lse abs tol.lse·max(1, |lse|), maw 1e-4 relative + 1e-7 (the WindowAttention
// tolerances): the batched kernel splits the slots differently from the single launch.
// `want` lives on want_backend, `got` on got_backend.
void ExpectSameOutputs(Backend& want_backend, const DeviceEntry& want, Backend& got_backend,
                       const DeviceEntry& got, int64_t head_dim, size_t maw_count, size_t entry,
                       const Tolerance& tol) {
  const std::vector<float> want_lse = DownloadFrom<float>(want_backend, want.lse, want.rows);
  const std::vector<float> got_lse = DownloadFrom<float>(got_backend, got.lse, got.rows);
  for (size_t r = 0; r < want.rows; ++r) {
    if (std::isinf(want_lse[r])) {
      ASSERT_EQ(got_lse[r], want_lse[r]) << "entry " << entry << " row " << r;
    } else {
      ASSERT_NEAR(got_lse[r], want_lse[r], tol.lse * std::max(1.0f, std::abs(want_lse[r])))
          << "entry " << entry << " row " << r;
    }
  }
  const std::vector<float> want_o =
      DownloadFrom<float>(want_backend, want.o, want.rows * head_dim);
  const std::vector<float> got_o = DownloadFrom<float>(got_backend, got.o, got.rows * head_dim);
  for (size_t i = 0; i < want_o.size(); ++i) {
    ASSERT_NEAR(got_o[i], want_o[i], tol.o) << "entry " << entry << " element " << i;
  }
  if (maw_count == 0) return;
  const std::vector<float> want_maw = DownloadFrom<float>(want_backend, want.maw, maw_count);
  const std::vector<float> got_maw = DownloadFrom<float>(got_backend, got.maw, maw_count);
  for (size_t i = 0; i < maw_count; ++i) {
    ASSERT_NEAR(got_maw[i], want_maw[i], 1e-4 * std::abs(want_maw[i]) + 1e-7)
        << "entry " << entry << " maw " << i;
  }
}

// Runs `cases` through `batch_backend`'s WindowAttentionBatch and, on the same inputs, through
// `single_backend`'s WindowAttention one entry at a time, and compares every output.
void ExpectBatchMatchesSingle(Backend& batch_backend, Backend& single_backend,
                              const std::vector<BatchCase>& cases) {
  std::vector<DeviceEntry> single, batch;
  std::vector<WindowAttentionParams> params;
  std::vector<size_t> maw_counts;
  std::vector<Tolerance> tolerances;
  for (size_t i = 0; i < cases.size(); ++i) {
    const AttentionCase& c = cases[i].shape;
    const AttentionInputs in = MakeInputs(c, 600 + static_cast<uint32_t>(i));
    tolerances.push_back(UsesFastPrefill(in, c.dtype, cases[i].maw) ? kFastTolerance
                                                                    : kExactTolerance);
    const std::vector<float> maw0 =
        cases[i].maw ? InitialMaw(c, 700 + static_cast<uint32_t>(i)) : std::vector<float>();
    maw_counts.push_back(maw0.size());
    single.push_back(MakeDeviceEntry(single_backend, in, c.dtype, maw0));
    batch.push_back(MakeDeviceEntry(batch_backend, in, c.dtype, maw0));
    params.push_back(batch.back().params);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const absl::Status status = single_backend.WindowAttention(single[i].params);
    ASSERT_TRUE(status.ok()) << "entry " << i << ": " << status;
  }
  const absl::Status status = batch_backend.WindowAttentionBatch(params.data(), params.size());
  ASSERT_TRUE(status.ok()) << status;
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(ExpectSameOutputs(single_backend, single[i], batch_backend, batch[i],
                                              cases[i].shape.head_dim, maw_counts[i], i,
                                              tolerances[i]));
  }
}

using WindowAttentionBatchTest = CudaBackendFixture;

TEST_F(WindowAttentionBatchTest, MixedBatchMatchesSingleCalls) {
  ExpectBatchMatchesSingle(*backend_, *backend_, MixedBatch());
}

// 64 decode steps over windows of 1..8K slots, every one batched (the serving shape).
TEST_F(WindowAttentionBatchTest, ManyDecodeStepsMatchSingleCalls) {
  std::vector<BatchCase> cases;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int64_t> slots(1, 8192);
  for (int i = 0; i < 64; ++i) {
    const int64_t n = slots(rng);
    cases.push_back({{128, 8, 4, DType::kBF16, 1, n + 7, n}, false});
  }
  ExpectBatchMatchesSingle(*backend_, *backend_, cases);
}

TEST_F(WindowAttentionBatchTest, EmptyBatchAndBadEntry) {
  EXPECT_TRUE(backend_->WindowAttentionBatch(nullptr, 0).ok());
  const WindowAttentionParams bad;  // null pointers
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->WindowAttentionBatch(&bad, 1)));
}

#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
TEST_F(WindowAttentionBatchTest, MixedBatchMatchesCpuBackend) {
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ExpectBatchMatchesSingle(*backend_, **cpu, MixedBatch());
}
#endif

using WriteKvBatchTest = CudaBackendFixture;

// Decode-step writes into 12 caches (bf16; in the second round one f32 cache makes the batch
// fall back to single launches), bit-identical to one WriteKv per cache.
TEST_F(WriteKvBatchTest, MatchesSingleCalls) {
  constexpr int64_t kHeads = 8, kDim = 128, kCapacity = 64, kStride = 3 * kHeads * kDim;
  for (const bool mixed_dtypes : {false, true}) {
    std::vector<DeviceBuffer> inputs;
    std::vector<DeviceBuffer> caches[2];  // [single, batch]: k, v of every entry
    std::vector<WriteKvParams> params[2];
    std::vector<size_t> cache_bytes;
    for (int i = 0; i < 12; ++i) {
      const DType dtype = mixed_dtypes && i == 5 ? DType::kF32 : DType::kBF16;
      const int64_t tokens = 1 + i % 3;
      std::vector<int32_t> slots;
      for (int64_t t = 0; t < tokens; ++t) {
        slots.push_back(static_cast<int32_t>((7 * i + 3 * t) % kCapacity));
      }
      const size_t bytes = kHeads * kCapacity * kDim * DTypeBytes(dtype);
      cache_bytes.push_back(bytes);
      inputs.push_back(Upload(RandomFloats(tokens * kStride, -1, 1, 900 + i)));
      inputs.push_back(Upload(slots));
      const float* src = inputs[inputs.size() - 2].as<float>();
      for (int run = 0; run < 2; ++run) {
        caches[run].push_back(Upload(std::vector<uint8_t>(bytes, 0x7f)));
        caches[run].push_back(Upload(std::vector<uint8_t>(bytes, 0x7f)));
        params[run].push_back({.k = src,
                               .v = src + kHeads * kDim,
                               .row_stride = kStride,
                               .slots = inputs.back().as<int32_t>(),
                               .k_cache = caches[run][2 * i].data(),
                               .v_cache = caches[run][2 * i + 1].data(),
                               .cache_dtype = dtype,
                               .num_tokens = tokens,
                               .num_kv_heads = kHeads,
                               .capacity = kCapacity,
                               .head_dim = kDim});
      }
    }
    for (const WriteKvParams& p : params[0]) {
      const absl::Status status = backend_->WriteKv(p);
      ASSERT_TRUE(status.ok()) << status;
    }
    const absl::Status status = backend_->WriteKvBatch(params[1].data(), params[1].size());
    ASSERT_TRUE(status.ok()) << status;
    for (size_t i = 0; i < caches[0].size(); ++i) {
      EXPECT_EQ(Download<uint8_t>(caches[0][i], cache_bytes[i / 2]),
                Download<uint8_t>(caches[1][i], cache_bytes[i / 2]))
          << "entry " << i / 2 << (i % 2 == 0 ? " k" : " v") << " mixed " << mixed_dtypes;
    }
  }
}

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
