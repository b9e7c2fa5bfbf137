// OffloadedKv: appended head-major K/V land in pages of page_tokens per layer, in order, from
// host or device memory. (The KvStreamer's attention over the pages is checked end to end by
// HybridEquivalence.OffloadEqualsGpuAtEveryStep.)
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/offloaded_kv.h"

namespace tandem::gpu_worker {
namespace {

class OffloadedKvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = testing::MakeTestBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no backend: " << why;
  }
  std::unique_ptr<Backend> backend_;
};

// Value of K (v = 1) at token t, head h, dim d of layer l.
float Value(int v, int64_t l, int64_t t, int64_t h, int64_t d) {
  return v * 0.5f + l * 1000.0f + t * 1.0f + h * 0.25f + d * 0.001f;
}

TEST_F(OffloadedKvTest, AppendsFillPagesInOrderFromHostAndDevice) {
  const WindowGeometry g{2, 3, 4, DType::kF32};
  auto kv = OffloadedKv::Create(*backend_, g, 5);
  ASSERT_TRUE(kv.ok()) << kv.status();
  int64_t t0 = 0;
  for (int64_t n : {3, 4, 6}) {   // crosses page boundaries
    for (int64_t l = 0; l < 2; ++l) {
      std::vector<float> k(3 * n * 4), v(3 * n * 4);
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t d = 0; d < 4; ++d) {
            k[(h * n + t) * 4 + d] = Value(0, l, t0 + t, h, d);
            v[(h * n + t) * 4 + d] = Value(1, l, t0 + t, h, d);
          }
        }
      }
      if (n == 4) {   // through device memory
        auto kd = backend_->Allocate(k.size() * 4);
        auto vd = backend_->Allocate(v.size() * 4);
        ASSERT_TRUE(kd.ok() && vd.ok());
        ASSERT_TRUE(backend_->CopyToDevice(kd->data(), k.data(), k.size() * 4).ok());
        ASSERT_TRUE(backend_->CopyToDevice(vd->data(), v.data(), v.size() * 4).ok());
        ASSERT_TRUE((*kv)->AppendFromDevice(l, kd->data(), vd->data(), n).ok());
      } else {
        ASSERT_TRUE((*kv)->Append(l, k.data(), v.data(), n).ok());
      }
    }
    t0 += n;
  }
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ((*kv)->tokens(l), 13);
    ASSERT_EQ((*kv)->num_pages(l), 3);
    for (int64_t t = 0; t < 13; ++t) {
      const OffloadedKv::Page page = (*kv)->page(l, t / 5);
      EXPECT_EQ(page.tokens, t / 5 < 2 ? 5 : 3);
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t d = 0; d < 4; ++d) {
          const int64_t at = (h * 5 + t % 5) * 4 + d;
          ASSERT_EQ(static_cast<const float*>(page.k)[at], Value(0, l, t, h, d));
          ASSERT_EQ(static_cast<const float*>(page.v)[at], Value(1, l, t, h, d));
        }
      }
    }
  }
  EXPECT_EQ((*kv)->Append(2, nullptr, nullptr, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OffloadedKv::Create(*backend_, g, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
