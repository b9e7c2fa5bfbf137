// Shared by the cuda backend tests: the fixture that creates the backend (skipping without a
// device), upload/download helpers, host f16 conversion, and naive f64 references of the ops
// (written from backend.h's definitions, independent of both backends' code).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tandem/common/bf16.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cuda_test {

template <typename T>
DeviceBuffer UploadTo(Backend& backend, const std::vector<T>& host) {
  absl::StatusOr<DeviceBuffer> buffer =
      backend.Allocate(std::max<size_t>(host.size(), 1) * sizeof(T));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return DeviceBuffer();
  const absl::Status copied =
      backend.CopyToDevice(buffer->data(), host.data(), host.size() * sizeof(T));
  EXPECT_TRUE(copied.ok()) << copied;
  return *std::move(buffer);
}

template <typename T>
std::vector<T> DownloadFrom(Backend& backend, const DeviceBuffer& buffer, size_t count) {
  std::vector<T> host(count);
  const absl::Status copied = backend.CopyToHost(host.data(), buffer.data(), count * sizeof(T));
  EXPECT_TRUE(copied.ok()) << copied;
  return host;
}

// Every test starts by creating the cuda backend; no device -> skipped with the reason.
class CudaBackendFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(0);
    if (absl::IsUnavailable(backend.status())) {
      GTEST_SKIP() << "no CUDA device: " << backend.status();
    }
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  template <typename T>
  DeviceBuffer Upload(const std::vector<T>& host) {
    return UploadTo(*backend_, host);
  }

  // A buffer of `count` floats, every one set to `value` (NaN poisons outputs: every element
  // the op should write must be written).
  DeviceBuffer Filled(size_t count, float value) {
    return Upload(std::vector<float>(count, value));
  }

  template <typename T>
  std::vector<T> Download(const DeviceBuffer& buffer, size_t count) {
    return DownloadFrom<T>(*backend_, buffer, count);
  }

  std::unique_ptr<Backend> backend_;
};

inline std::vector<float> RandomFloats(size_t count, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(count);
  for (float& v : values) v = dist(rng);
  return values;
}

inline float RoundBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

// IEEE binary16 <-> float, round to nearest even (finite inputs well inside the range).
inline uint16_t FloatToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs_bits = x & 0x7fffffffu;
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs_bits < 0x38800000u) {  // below 2^-14: a subnormal half, units of 2^-24
    float a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t mantissa = abs_bits & 0x7fffffu;
  const uint32_t exponent = (abs_bits >> 23) - 127 + 15;
  uint32_t h = (exponent << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float F16ToFloat(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  if (exponent == 31)
    return mantissa ? std::numeric_limits<float>::quiet_NaN()
                    : sign * std::numeric_limits<float>::infinity();
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

inline float RoundF16(float x) { return F16ToFloat(FloatToF16(x)); }

// Raw bytes of `values` in `dtype` (kF32, kBF16 or kF16), and the values as that dtype reads back.
inline std::vector<uint8_t> EncodeAs(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t bits = dtype == DType::kBF16 ? FloatToBf16(values[i]) : FloatToF16(values[i]);
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
  }
  return bytes;
}

inline std::vector<float> RoundTo(const std::vector<float>& values, DType dtype) {
  std::vector<float> rounded(values);
  for (float& v : rounded) {
    if (dtype == DType::kBF16) v = RoundBf16(v);
    if (dtype == DType::kF16) v = RoundF16(v);
  }
  return rounded;
}

// ---- Attention reference ----------------------------------------------------------------------

struct AttentionInputs {
  int64_t num_tokens = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t capacity = 0, num_slots = 0, q_row_stride = 0;
  float scale = 0.0f;
  std::vector<float> q;           // [num_tokens, q_row_stride]
  std::vector<int32_t> q_pos;     // [num_tokens]
  std::vector<float> k, v;        // [num_kv_heads, capacity, head_dim], values as stored
  std::vector<int32_t> slot_pos;  // [capacity]
};

struct AttentionResult {
  std::vector<double> o;    // [num_tokens, num_q_heads, head_dim]
  std::vector<double> lse;  // [num_tokens, num_q_heads], -inf = no visible slot
  std::vector<double> a;    // [num_kv_heads, capacity]: mean weight (the MAW update's `a`)
};

inline AttentionResult ReferenceAttention(const AttentionInputs& in) {
  const int64_t group = in.num_q_heads / in.num_kv_heads;
  const int64_t d_count = in.head_dim;
  AttentionResult out;
  out.o.assign(in.num_tokens * in.num_q_heads * d_count, 0.0);
  out.lse.assign(in.num_tokens * in.num_q_heads, -std::numeric_limits<double>::infinity());
  out.a.assign(in.num_kv_heads * in.capacity, 0.0);
  std::vector<double> scores(in.num_slots);
  for (int64_t t = 0; t < in.num_tokens; ++t) {
    for (int64_t h = 0; h < in.num_q_heads; ++h) {
      const int64_t g = h / group;
      const float* q = &in.q[t * in.q_row_stride + h * d_count];
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t s = 0; s < in.num_slots; ++s) {
        const int32_t pos = in.slot_pos[s];
        if (pos < 0 || pos > in.q_pos[t]) {
          scores[s] = -std::numeric_limits<double>::infinity();
          continue;
        }
        const float* k = &in.k[(g * in.capacity + s) * d_count];
        double dot = 0.0;
        for (int64_t d = 0; d < d_count; ++d) dot += static_cast<double>(q[d]) * k[d];
        scores[s] = dot * in.scale;
        m = std::max(m, scores[s]);
      }
      if (m == -std::numeric_limits<double>::infinity()) continue;
      double l = 0.0;
      double* o = &out.o[(t * in.num_q_heads + h) * d_count];
      for (int64_t s = 0; s < in.num_slots; ++s) {
        if (scores[s] == -std::numeric_limits<double>::infinity()) continue;
        const double p = std::exp(scores[s] - m);
        l += p;
        const float* v = &in.v[(g * in.capacity + s) * d_count];
        for (int64_t d = 0; d < d_count; ++d) o[d] += p * v[d];
      }
      for (int64_t d = 0; d < d_count; ++d) o[d] /= l;
      const double lse = m + std::log(l);
      out.lse[t * in.num_q_heads + h] = lse;
      for (int64_t s = 0; s < in.num_slots; ++s) {
        if (scores[s] == -std::numeric_limits<double>::infinity()) continue;
        out.a[g * in.capacity + s] += std::exp(scores[s] - lse) / (in.num_tokens * group);
      }
    }
  }
  return out;
}

// ---- Sampling reference ----------------------------------------------------------------------
// backend.h's SampleParams definition in f64; top_p is relative to the mass of the top-k set
// (the cpu backend's reading of "then").

struct SampleReference {
  int32_t id = -1;
  // False when the draw lies within rounding distance of a boundary: 1e-6 of the kept mass from
  // the cumulative mass at the chosen id, or 2e-7 of the top-k mass from the top_p cutoff (the
  // backends' f32 probabilities are good to ~1e-7 relative). A float backend may then
  // legitimately pick a neighbour.
  bool unambiguous = true;
};

inline SampleReference ReferenceSample(const std::vector<float>& logits, float temperature,
                                       int32_t top_k, float top_p, float uniform) {
  constexpr double kMargin = 1e-6;
  constexpr double kCutoffMargin = 2e-7;
  const int64_t vocab = static_cast<int64_t>(logits.size());
  SampleReference ref;
  if (temperature <= 0.0f) {
    ref.id = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    return ref;
  }
  double max_z = -std::numeric_limits<double>::infinity();
  for (float x : logits) max_z = std::max(max_z, static_cast<double>(x) / temperature);
  std::vector<double> p(vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += p[i] = std::exp(logits[i] / temperature - max_z);
  for (double& x : p) x /= sum;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  int64_t n = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  if (top_p < 1.0f) {  // top_p applies to the top-k set renormalised
    double top_k_mass = 0.0;
    for (int64_t r = 0; r < n; ++r) top_k_mass += p[order[r]];
    const double target = top_p * top_k_mass;
    double cum = 0.0;
    for (int64_t r = 0; r < n; ++r) {
      cum += p[order[r]];
      if (std::abs(cum - target) < kCutoffMargin * top_k_mass) ref.unambiguous = false;
      if (cum >= target) {
        n = r + 1;
        break;
      }
    }
  }
  std::vector<bool> keep(vocab, false);
  for (int64_t r = 0; r < std::max<int64_t>(n, 1); ++r) keep[order[r]] = true;
  double mass = 0.0;
  for (int64_t i = 0; i < vocab; ++i) mass += keep[i] ? p[i] : 0.0;
  const double target = uniform * mass;
  double cum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!keep[i]) continue;
    const double before = cum;
    cum += p[i];
    if (cum > target) {
      ref.id = static_cast<int32_t>(i);
      if (std::abs(cum - target) < kMargin * mass || std::abs(before - target) < kMargin * mass) {
        ref.unambiguous = false;
      }
      return ref;
    }
  }
  ref.unambiguous = false;
  for (int64_t i = vocab - 1; i >= 0; --i) {
    if (keep[i]) {
      ref.id = static_cast<int32_t>(i);
      break;
    }
  }
  return ref;
}

}  // namespace tandem::gpu_worker::cuda_test
