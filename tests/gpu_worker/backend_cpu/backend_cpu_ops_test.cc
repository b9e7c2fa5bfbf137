// The cpu backend's memory functions and row-wise operations against backend_reference.h.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::MakeCpuBackend;
using testing::MaxAbsDiff;
using testing::RandomFloats;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<uint16_t> ToF16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = reference::FloatToF16(v[i]);
  return out;
}

TEST(CpuBackendMemory, AllocateTracksBytesAndAlignment) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_NE(backend->device_description().find("cpu: "), std::string::npos);
  EXPECT_EQ(backend->bytes_in_use(), 0u);
  {
    auto a = backend->Allocate(1000);
    auto b = backend->Allocate(24);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
    EXPECT_EQ(a->bytes(), 1000u);
    EXPECT_EQ(backend->bytes_in_use(), 1024u);
    a->Reset();
    EXPECT_EQ(backend->bytes_in_use(), 24u);
    EXPECT_EQ(backend->peak_bytes_in_use(), 1024u);
  }
  EXPECT_EQ(backend->bytes_in_use(), 0u);
  EXPECT_EQ(backend->peak_bytes_in_use(), 1024u);
}

TEST(CpuBackendMemory, HugeAllocationIsResourceExhausted) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  auto huge = backend->Allocate(size_t{1} << 50);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_EQ(backend->bytes_in_use(), 0u);
}

TEST(CpuBackendMemory, CopiesAndFill) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::vector<float> host(64);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  float* a = dev.Upload(host);
  float* b = dev.Allocate<float>(64);
  TANDEM_ASSERT_OK(backend->CopyOnDevice(b, a, 64 * sizeof(float)));
  EXPECT_EQ(dev.Download(b, 64), host);
  TANDEM_ASSERT_OK(backend->Fill(b + 8, -2.5f, 4));
  std::vector<float> expect = host;
  std::fill_n(expect.begin() + 8, 4, -2.5f);
  EXPECT_EQ(dev.Download(b, 64), expect);

  // 4 rows of 3 floats, taken every 16 floats, packed every 5 floats on the host.
  std::vector<float> packed(20, 7.0f);
  TANDEM_ASSERT_OK(backend->CopyToHost2D(packed.data(), 5 * sizeof(float), a + 2,
                                         16 * sizeof(float), 3 * sizeof(float), 4));
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 5; ++c) {
      EXPECT_EQ(packed[r * 5 + c], c < 3 ? host[2 + r * 16 + c] : 7.0f) << r << "," << c;
    }
  }
  TANDEM_EXPECT_INVALID(backend->CopyToHost2D(packed.data(), 2, a, 16, 3, 4));
  // The same copy and a whole row in one batch (Backend's default: one CopyToHost2D each).
  std::vector<float> batched(20, 7.0f), row(16, 7.0f);
  const HostCopy2D copies[] = {
      {batched.data(), 5 * sizeof(float), a + 2, 16 * sizeof(float), 3 * sizeof(float), 4},
      {row.data(), 16 * sizeof(float), a + 48, 16 * sizeof(float), 16 * sizeof(float), 1}};
  TANDEM_ASSERT_OK(backend->CopyToHostBatch(copies, 2));
  EXPECT_EQ(batched, packed);
  EXPECT_EQ(row, std::vector<float>(host.begin() + 48, host.end()));
  const HostCopy2D bad = {batched.data(), 2, a, 16, 3, 4};
  TANDEM_EXPECT_INVALID(backend->CopyToHostBatch(&bad, 1));
  // And back, into columns 9..11 of rows 0..3 (pitch 16 floats); the rest unchanged.
  const std::vector<float> before = dev.Download(a, 64);
  TANDEM_ASSERT_OK(backend->CopyToDevice2D(a + 9, 16 * sizeof(float), packed.data(),
                                           5 * sizeof(float), 3 * sizeof(float), 4));
  const std::vector<float> after = dev.Download(a, 64);
  for (int i = 0; i < 64; ++i) {
    const int r = i / 16, c = i % 16;
    EXPECT_EQ(after[i], c >= 9 && c < 12 ? packed[r * 5 + c - 9] : before[i]) << i;
  }
  TANDEM_EXPECT_INVALID(backend->CopyToDevice2D(a, 2, packed.data(), 16, 3, 4));
  // UploadAsync makes the same checks (CheckStridedCopy), and its slot's.
  const absl::Status short_pitch =
      backend->UploadAsync({a, 16, packed.data(), 2, 3 * sizeof(float), 4}, 0);
  TANDEM_EXPECT_INVALID(short_pitch);
  EXPECT_NE(std::string(short_pitch.message()).find("UploadAsync: pitches (dst 16, src 2)"),
            std::string::npos)
      << short_pitch;
  TANDEM_EXPECT_INVALID(backend->UploadAsync({nullptr, 16, packed.data(), 16, 12, 4}, 0));
  TANDEM_EXPECT_INVALID(
      backend->UploadAsync({a, 16, packed.data(), 16, 12, 4}, Backend::kUploadSlots));
  TANDEM_EXPECT_INVALID(backend->CopyToHost(nullptr, a, 4));
  TANDEM_EXPECT_INVALID(backend->Fill(nullptr, 1.0f, 4));
}

// The cpu backend runs each op before returning: its device marks are the host clock at the call.
TEST(CpuBackendMemory, DeviceMarksAreTheHostClock) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  TANDEM_EXPECT_INVALID(backend->DeviceSeconds(0, 1).status());   // never set
  TANDEM_EXPECT_INVALID(backend->MarkDevice(Backend::kDeviceMarks));
  TANDEM_EXPECT_INVALID(backend->MarkDevice(-1));
  TANDEM_ASSERT_OK(backend->MarkDevice(0));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  TANDEM_ASSERT_OK(backend->MarkDevice(3));
  auto forward = backend->DeviceSeconds(0, 3);
  auto backward = backend->DeviceSeconds(3, 0);
  ASSERT_TRUE(forward.ok() && backward.ok());
  EXPECT_GE(*forward, 0.019);
  EXPECT_LT(*forward, 10.0);
  EXPECT_DOUBLE_EQ(*backward, -*forward);
}

// The cpu backend's ops are done when they return: its fences check their index, nothing else.
TEST(CpuBackendMemory, FencesCheckTheirIndexAndNeverWait) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  TANDEM_EXPECT_INVALID(backend->FenceDevice(Backend::kDeviceFences));
  TANDEM_EXPECT_INVALID(backend->FenceDevice(-1));
  TANDEM_EXPECT_INVALID(backend->WaitFence(Backend::kDeviceFences));
  TANDEM_ASSERT_OK(backend->WaitFence(1));   // never set
  TANDEM_ASSERT_OK(backend->FenceDevice(0));
  TANDEM_ASSERT_OK(backend->WaitFence(0));
}

class EmbedTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbedTest, MatchesReference) {
  const DType dtype = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(1);
  const int64_t vocab = 50, hidden = 24, tokens = 9;
  const std::vector<float> table = RandomFloats(rng, vocab * hidden, -2.0f, 2.0f);
  const std::vector<int32_t> ids = {0, 49, 3, 3, 17, 25, 1, 48, 0};
  EmbedParams p;
  p.table_dtype = dtype;
  p.num_tokens = tokens;
  p.hidden = hidden;
  p.vocab = vocab;
  std::vector<float> expect(tokens * hidden);
  std::vector<bf16_t> table_bf16 = testing::ToBf16(table);
  std::vector<uint16_t> table_f16 = ToF16(table);
  const void* host_table = dtype == DType::kF32    ? static_cast<const void*>(table.data())
                           : dtype == DType::kBF16 ? static_cast<const void*>(table_bf16.data())
                                                   : static_cast<const void*>(table_f16.data());
  EmbedParams ref = p;
  ref.ids = ids.data();
  ref.table = host_table;
  ref.out = expect.data();
  reference::Embed(ref);

  p.ids = dev.Upload(ids);
  p.table = dtype == DType::kF32    ? static_cast<const void*>(dev.Upload(table))
            : dtype == DType::kBF16 ? static_cast<const void*>(dev.Upload(table_bf16))
                                    : static_cast<const void*>(dev.Upload(table_f16));
  p.out = dev.Allocate<float>(tokens * hidden);
  TANDEM_ASSERT_OK(backend->Embed(p));
  EXPECT_EQ(dev.Download(p.out, tokens * hidden), expect);  // conversions are exact

  EmbedParams bad = p;
  bad.vocab = 40;  // id 49 is now out of range
  TANDEM_EXPECT_INVALID(backend->Embed(bad));
  bad = p;
  bad.table_dtype = DType::kI32;
  TANDEM_EXPECT_INVALID(backend->Embed(bad));
  bad = p;
  bad.ids = nullptr;
  TANDEM_EXPECT_INVALID(backend->Embed(bad));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmbedTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16));

// A norm's f32 weights and their bf16 and f16 encodings, on the host or uploaded.
class NormWeights {
 public:
  explicit NormWeights(const std::vector<float>& w)
      : f32_(w), bf16_(testing::ToBf16(w)), f16_(ToF16(w)) {}
  const void* Host(DType dtype) const {
    return dtype == DType::kF32    ? static_cast<const void*>(f32_.data())
           : dtype == DType::kBF16 ? static_cast<const void*>(bf16_.data())
                                   : static_cast<const void*>(f16_.data());
  }
  const void* Upload(DeviceArrays& dev, DType dtype) const {
    return dtype == DType::kF32    ? static_cast<const void*>(dev.Upload(f32_))
           : dtype == DType::kBF16 ? static_cast<const void*>(dev.Upload(bf16_))
                                   : static_cast<const void*>(dev.Upload(f16_));
  }

 private:
  std::vector<float> f32_;
  std::vector<bf16_t> bf16_;
  std::vector<uint16_t> f16_;
};

class RmsNormTest : public ::testing::TestWithParam<DType> {};

TEST_P(RmsNormTest, MatchesReferenceInPlaceAndOutOfPlace) {
  const DType dtype = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(2);
  const int64_t tokens = 5, hidden = 384;
  const std::vector<float> x = RandomFloats(rng, tokens * hidden, -3.0f, 3.0f);
  const std::vector<float> w = RandomFloats(rng, hidden, 0.5f, 1.5f);
  const NormWeights weights(w);
  const void* host_w = weights.Host(dtype);
  std::vector<float> expect(x.size());
  RmsNormParams p;
  p.weight_dtype = dtype;
  p.num_tokens = tokens;
  p.hidden = hidden;
  p.eps = 1e-5f;
  RmsNormParams ref = p;
  ref.x = x.data();
  ref.weight = host_w;
  ref.out = expect.data();
  reference::RmsNorm(ref);

  p.weight = weights.Upload(dev, dtype);
  float* x_dev = dev.Upload(x);
  p.x = x_dev;
  p.out = dev.Allocate<float>(x.size());
  TANDEM_ASSERT_OK(backend->RmsNorm(p));
  // Outputs are O(3): f32 math gives ~1e-6 absolute.
  EXPECT_LE(MaxAbsDiff(dev.Download(p.out, x.size()), expect), 5e-6);
  p.out = x_dev;  // in place
  TANDEM_ASSERT_OK(backend->RmsNorm(p));
  EXPECT_LE(MaxAbsDiff(dev.Download(x_dev, x.size()), expect), 5e-6);

  RmsNormParams bad = p;
  bad.hidden = 0;
  TANDEM_EXPECT_INVALID(backend->RmsNorm(bad));
  bad = p;
  bad.weight = nullptr;
  TANDEM_EXPECT_INVALID(backend->RmsNorm(bad));
}

// Qwen3's q/k norms: each of 3 heads of 16 inside rows of 70 floats (a qkv row: the q heads,
// then 22 other floats the call must leave as they are).
TEST_P(RmsNormTest, NormsEachHeadOfAStridedRow) {
  const DType dtype = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(3);
  const int64_t tokens = 4, heads = 3, head_dim = 16, stride = 70;
  const std::vector<float> x = RandomFloats(rng, tokens * stride, -3.0f, 3.0f);
  const std::vector<float> w = RandomFloats(rng, head_dim, 0.5f, 1.5f);
  const NormWeights weights(w);
  const void* host_w = weights.Host(dtype);
  RmsNormParams p;
  p.weight_dtype = dtype;
  p.num_tokens = tokens;
  p.hidden = head_dim;
  p.eps = 1e-6f;
  p.vectors_per_token = heads;
  p.token_stride = stride;
  std::vector<float> expect = x;
  RmsNormParams ref = p;
  ref.x = x.data();
  ref.weight = host_w;
  ref.out = expect.data();
  reference::RmsNorm(ref);
  // The reference normalised exactly the 3 x 16 head floats of each row.
  size_t changed = 0;
  for (size_t i = 0; i < x.size(); ++i) changed += expect[i] != x[i];
  EXPECT_EQ(changed, static_cast<size_t>(tokens * heads * head_dim));

  p.weight = weights.Upload(dev, dtype);
  float* x_dev = dev.Upload(x);
  p.x = x_dev;
  p.out = x_dev;
  TANDEM_ASSERT_OK(backend->RmsNorm(p));
  EXPECT_LE(MaxAbsDiff(dev.Download(x_dev, x.size()), expect), 5e-6);

  RmsNormParams bad = p;
  bad.token_stride = heads * head_dim - 1;  // rows would overlap
  TANDEM_EXPECT_INVALID(backend->RmsNorm(bad));
  bad = p;
  bad.vectors_per_token = 0;
  TANDEM_EXPECT_INVALID(backend->RmsNorm(bad));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RmsNormTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16));

TEST(CpuBackendOps, RopeMatchesReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(3);
  for (const int64_t head_dim : {8, 64, 128}) {
    const int64_t tokens = 6, heads = 3, stride = heads * head_dim + 5;  // padded rows
    std::vector<float> x = RandomFloats(rng, tokens * stride, -2.0f, 2.0f);
    const std::vector<int32_t> positions = {0, 1, 17, 511, 4095, 8191};
    std::vector<float> inv_freq(head_dim / 2);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      inv_freq[i] = static_cast<float>(1.0 / std::pow(100000.0, 2.0 * i / head_dim));
    }
    RopeParams p;
    p.row_stride = stride;
    p.attention_scaling = 1.25f;
    p.num_tokens = tokens;
    p.num_heads = heads;
    p.head_dim = head_dim;
    std::vector<float> expect = x;
    RopeParams ref = p;
    ref.x = expect.data();
    ref.positions = positions.data();
    ref.inv_freq = inv_freq.data();
    reference::Rope(ref);

    p.x = dev.Upload(x);
    p.positions = dev.Upload(positions);
    p.inv_freq = dev.Upload(inv_freq);
    TANDEM_ASSERT_OK(backend->Rope(p));
    // Same f32 angles; cos/sin in f32 differ from double by ~1 ulp of the angle's cos.
    EXPECT_LE(MaxAbsDiff(dev.Download(p.x, x.size()), expect), 2e-6) << "head_dim " << head_dim;

    RopeParams bad = p;
    bad.head_dim = head_dim - 1;  // odd
    TANDEM_EXPECT_INVALID(backend->Rope(bad));
    bad = p;
    bad.row_stride = heads * head_dim - 1;
    TANDEM_EXPECT_INVALID(backend->Rope(bad));
  }
}

TEST(CpuBackendOps, SwiGluMatchesReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(4);
  const int64_t tokens = 7, ffn = 172;
  std::vector<float> gate_up = RandomFloats(rng, tokens * 2 * ffn, -12.0f, 12.0f);
  gate_up[0] = -200.0f;  // exp overflow side
  gate_up[1] = 200.0f;
  std::vector<float> expect(tokens * ffn);
  SwiGluParams p;
  p.num_tokens = tokens;
  p.ffn = ffn;
  SwiGluParams ref = p;
  ref.gate_up = gate_up.data();
  ref.out = expect.data();
  reference::SwiGlu(ref);
  p.gate_up = dev.Upload(gate_up);
  p.out = dev.Allocate<float>(expect.size());
  TANDEM_ASSERT_OK(backend->SwiGlu(p));
  const std::vector<float> got = dev.Download(p.out, expect.size());
  for (size_t i = 0; i < got.size(); ++i) {
    // Relative 2e-6 (the exp approximation and f32 rounding) plus a tiny absolute floor.
    EXPECT_NEAR(got[i], expect[i], 2e-6 * std::abs(expect[i]) + 1e-7) << i;
  }
  p.ffn = -1;
  TANDEM_EXPECT_INVALID(backend->SwiGlu(p));
}

class WriteKvTest : public ::testing::TestWithParam<DType> {};

TEST_P(WriteKvTest, WritesSlotsAndLeavesOthers) {
  const DType dtype = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(5);
  const int64_t tokens = 4, heads = 2, head_dim = 8, capacity = 10, stride = 3 * heads * head_dim;
  // k and v inside one fused qkv row, as the engine passes them.
  const std::vector<float> qkv = RandomFloats(rng, tokens * stride, -1.0f, 1.0f);
  const std::vector<int32_t> slots = {7, 0, 9, 4};
  const size_t cache_elems = heads * capacity * head_dim;
  const size_t elem = DTypeBytes(dtype);
  std::vector<uint8_t> k_expect(cache_elems * elem, 0xab), v_expect(cache_elems * elem, 0xcd);
  WriteKvParams p;
  p.row_stride = stride;
  p.cache_dtype = dtype;
  p.num_tokens = tokens;
  p.num_kv_heads = heads;
  p.capacity = capacity;
  p.head_dim = head_dim;
  WriteKvParams ref = p;
  ref.k = qkv.data() + heads * head_dim;
  ref.v = qkv.data() + 2 * heads * head_dim;
  ref.slots = slots.data();
  ref.k_cache = k_expect.data();
  ref.v_cache = v_expect.data();
  reference::WriteKv(ref);

  const float* qkv_dev = dev.Upload(qkv);
  p.k = qkv_dev + heads * head_dim;
  p.v = qkv_dev + 2 * heads * head_dim;
  p.slots = dev.Upload(slots);
  p.k_cache = dev.Upload(std::vector<uint8_t>(cache_elems * elem, 0xab));
  p.v_cache = dev.Upload(std::vector<uint8_t>(cache_elems * elem, 0xcd));
  TANDEM_ASSERT_OK(backend->WriteKv(p));
  EXPECT_EQ(dev.Download(static_cast<uint8_t*>(p.k_cache), k_expect.size()), k_expect);
  EXPECT_EQ(dev.Download(static_cast<uint8_t*>(p.v_cache), v_expect.size()), v_expect);

  WriteKvParams bad = p;
  bad.capacity = 9;  // slot 9 out of range
  TANDEM_EXPECT_INVALID(backend->WriteKv(bad));
  bad = p;
  bad.cache_dtype = DType::kF16;
  TANDEM_EXPECT_INVALID(backend->WriteKv(bad));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, WriteKvTest, ::testing::Values(DType::kF32, DType::kBF16));

TEST(CpuBackendOps, MergeStatesMatchesReferenceWithEmptySides) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(6);
  const int64_t rows = 6, head_dim = 16;
  std::vector<float> o_a = RandomFloats(rng, rows * head_dim, -1.0f, 1.0f);
  std::vector<float> o_b = RandomFloats(rng, rows * head_dim, -1.0f, 1.0f);
  // rows: both full, a empty, b empty, both empty, far apart, equal.
  std::vector<float> lse_a = {1.5f, kNegInf, 2.0f, kNegInf, 80.0f, 3.0f};
  std::vector<float> lse_b = {0.5f, 4.0f, kNegInf, kNegInf, -10.0f, 3.0f};
  std::fill_n(o_a.begin() + head_dim, head_dim, 0.0f);  // empty states carry o = 0
  std::fill_n(o_b.begin() + 2 * head_dim, head_dim, 0.0f);
  std::fill_n(o_a.begin() + 3 * head_dim, head_dim, 0.0f);
  std::fill_n(o_b.begin() + 3 * head_dim, head_dim, 0.0f);
  std::vector<float> o_expect = o_a, lse_expect = lse_a;
  MergeParams ref;
  ref.o_dst = o_expect.data();
  ref.lse_dst = lse_expect.data();
  ref.o_src = o_b.data();
  ref.lse_src = lse_b.data();
  ref.rows = rows;
  ref.head_dim = head_dim;
  reference::MergeStates(ref);

  MergeParams p = ref;
  p.o_dst = dev.Upload(o_a);
  p.lse_dst = dev.Upload(lse_a);
  p.o_src = dev.Upload(o_b);
  p.lse_src = dev.Upload(lse_b);
  TANDEM_ASSERT_OK(backend->MergeStates(p));
  const std::vector<float> o = dev.Download(p.o_dst, o_a.size());
  const std::vector<float> lse = dev.Download(p.lse_dst, rows);
  EXPECT_LE(MaxAbsDiff(o, o_expect), 1e-6);
  for (int64_t r = 0; r < rows; ++r) {
    if (lse_expect[r] == kNegInf) {
      EXPECT_EQ(lse[r], kNegInf) << r;
    } else {
      EXPECT_NEAR(lse[r], lse_expect[r], 1e-5) << r;
    }
  }
  for (float x : o) EXPECT_FALSE(std::isnan(x));
  for (int64_t d = 0; d < head_dim; ++d) EXPECT_EQ(o[3 * head_dim + d], 0.0f);

  p.rows = 0;
  TANDEM_EXPECT_INVALID(backend->MergeStates(p));
  p.rows = rows;
  p.o_src = nullptr;
  TANDEM_EXPECT_INVALID(backend->MergeStates(p));
}

}  // namespace
}  // namespace tandem::gpu_worker
