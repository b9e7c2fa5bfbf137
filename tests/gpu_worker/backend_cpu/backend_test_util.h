// Helpers of the backend tests: the backend under test, device arrays uploaded from and
// downloaded to host vectors, random data.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/backend.h"

#define TANDEM_ASSERT_OK(expr)                          \
  do {                                                  \
    const ::absl::Status tandem_test_s_ = (expr);       \
    ASSERT_TRUE(tandem_test_s_.ok()) << tandem_test_s_; \
  } while (0)

#define TANDEM_EXPECT_INVALID(expr)                                                           \
  do {                                                                                        \
    const ::absl::Status tandem_test_s_ = (expr);                                             \
    EXPECT_EQ(tandem_test_s_.code(), ::absl::StatusCode::kInvalidArgument) << tandem_test_s_; \
  } while (0)

namespace tandem::gpu_worker::testing {

// The cpu backend with the cores this process may use; fails the test when it cannot be made.
inline std::unique_ptr<Backend> MakeCpuBackend() {
  auto backend = CreateCpuBackend(0);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(*backend) : nullptr;
}

// Device copies of host vectors, freed with this object.
class DeviceArrays {
 public:
  explicit DeviceArrays(Backend& backend) : backend_(backend) {}

  // A device copy of `host` (nullptr after a test failure).
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* dst = Allocate<T>(host.size());
    if (dst != nullptr && !host.empty()) {
      const absl::Status s = backend_.CopyToDevice(dst, host.data(), host.size() * sizeof(T));
      EXPECT_TRUE(s.ok()) << s;
    }
    return dst;
  }

  // An uninitialised device array of `count` elements.
  template <typename T>
  T* Allocate(size_t count) {
    auto buffer = backend_.Allocate(count * sizeof(T));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    if (!buffer.ok()) return nullptr;
    T* data = buffer->template as<T>();
    buffers_.push_back(std::move(*buffer));
    return data;
  }

  template <typename T>
  std::vector<T> Download(const T* src, size_t count) {
    std::vector<T> host(count);
    if (count > 0) {
      const absl::Status s = backend_.CopyToHost(host.data(), src, count * sizeof(T));
      EXPECT_TRUE(s.ok()) << s;
    }
    return host;
  }

 private:
  Backend& backend_;
  std::vector<DeviceBuffer> buffers_;
};

inline std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<bf16_t> ToBf16(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

}  // namespace tandem::gpu_worker::testing
