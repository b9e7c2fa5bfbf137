// BackendOptions (backend.h): parsing of the prefill attention kernel's name, and the cpu
// backend's handling of it: it accepts both kernels and ignores the choice (its one attention
// kernel is f32-accurate), so a bf16 prefill chunk gives the same bits with `fast` and `exact`,
// within the f32 tolerance of the double reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::RandomFloats;

TEST(PrefillAttentionOption, ParsesTheTwoKernelsAndNamesThem) {
  absl::StatusOr<PrefillAttention> fast = ParsePrefillAttention("fast");
  absl::StatusOr<PrefillAttention> exact = ParsePrefillAttention("exact");
  ASSERT_TRUE(fast.ok()) << fast.status();
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(*fast, PrefillAttention::kFast);
  EXPECT_EQ(*exact, PrefillAttention::kExact);
  EXPECT_EQ(PrefillAttentionName(PrefillAttention::kFast), "fast");
  EXPECT_EQ(PrefillAttentionName(PrefillAttention::kExact), "exact");
  EXPECT_EQ(BackendOptions().prefill_attention, PrefillAttention::kFast);
  for (const char* bad : {"", "Fast", "f32", "exact ", "1"}) {
    absl::StatusOr<PrefillAttention> parsed = ParsePrefillAttention(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("fast or exact"), std::string_view::npos)
        << parsed.status();
  }
}

// A causal 64-token bf16 prefill chunk over its own 64 slots (GQA 2, head_dim 64): the shape
// that the cuda backend would run on the fast kernel.
TEST(PrefillAttentionOption, CpuBackendGivesTheSameResultWithEitherKernel) {
  constexpr int64_t kT = 64, kHq = 4, kHkv = 2, kD = 64;
  std::mt19937 rng(15);
  const std::vector<float> q = RandomFloats(rng, kT * kHq * kD, -2.0f, 2.0f);
  const std::vector<bf16_t> k = testing::ToBf16(RandomFloats(rng, kHkv * kT * kD, -1.0f, 1.0f));
  const std::vector<bf16_t> v = testing::ToBf16(RandomFloats(rng, kHkv * kT * kD, -1.0f, 1.0f));
  std::vector<int32_t> pos(kT);
  for (int64_t t = 0; t < kT; ++t) pos[t] = static_cast<int32_t>(t);

  WindowAttentionParams base;
  base.q_row_stride = kHq * kD;
  base.cache_dtype = DType::kBF16;
  base.num_slots = kT;
  base.capacity = kT;
  base.num_tokens = kT;
  base.num_q_heads = kHq;
  base.num_kv_heads = kHkv;
  base.head_dim = kD;
  base.scale = 1.0f / std::sqrt(static_cast<float>(kD));

  std::vector<float> want_o(kT * kHq * kD), want_lse(kT * kHq);
  WindowAttentionParams ref = base;
  ref.q = q.data();
  ref.q_pos = pos.data();
  ref.k_cache = k.data();
  ref.v_cache = v.data();
  ref.slot_pos = pos.data();
  ref.o = want_o.data();
  ref.lse = want_lse.data();
  reference::WindowAttention(ref);

  std::vector<std::vector<float>> outputs;
  for (PrefillAttention kernel : {PrefillAttention::kFast, PrefillAttention::kExact}) {
    SCOPED_TRACE(PrefillAttentionName(kernel));
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        CreateCpuBackend(0, BackendOptions{.prefill_attention = kernel});
    ASSERT_TRUE(backend.ok()) << backend.status();
    DeviceArrays dev(**backend);
    WindowAttentionParams p = base;
    p.q = dev.Upload(q);
    p.q_pos = dev.Upload(pos);
    p.k_cache = dev.Upload(k);
    p.v_cache = dev.Upload(v);
    p.slot_pos = dev.Upload(pos);
    p.o = dev.Allocate<float>(want_o.size());
    p.lse = dev.Allocate<float>(want_lse.size());
    TANDEM_ASSERT_OK((*backend)->WindowAttention(p));
    std::vector<float> o = dev.Download(p.o, want_o.size());
    const std::vector<float> lse = dev.Download(p.lse, want_lse.size());
    // f32 scores, exp and sums against the double reference (backend_cpu_attention_test's
    // bounds): ~1e-7 on o (convex combinations of V in [-1, 1]), ~1e-6 on lse.
    EXPECT_LE(testing::MaxAbsDiff(o, want_o), 1e-6);
    EXPECT_LE(testing::MaxAbsDiff(lse, want_lse), 1e-5);
    o.insert(o.end(), lse.begin(), lse.end());
    outputs.push_back(std::move(o));
  }
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_EQ(outputs[0], outputs[1]) << "the cpu backend's result depends on prefill_attention";
}

}  // namespace
}  // namespace tandem::gpu_worker
