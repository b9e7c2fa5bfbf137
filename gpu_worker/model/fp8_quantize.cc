#include "tandem/gpu_worker/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/common/f16.h"

namespace tandem::gpu_worker {
namespace {

// Elements per thread below which splitting the rows costs more than it saves.
constexpr int64_t kElementsPerThread = int64_t{1} << 20;
constexpr unsigned kMaxThreads = 16;

// Row `r` of `w` ([rows, cols], cols elements) as floats into dst. Elements are read with memcpy:
// a view's data is only as aligned as its file made it (safetensors.h).
void DecodeRow(const TensorView& w, int64_t r, int64_t cols, float* dst) {
  const size_t n = static_cast<size_t>(cols);
  const char* src =
      static_cast<const char*>(w.data) + static_cast<size_t>(r) * n * DTypeBytes(w.dtype);
  if (w.dtype == DType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (size_t c = 0; c < n; ++c) {
    uint16_t h;
    std::memcpy(&h, src + 2 * c, sizeof(h));
    dst[c] = w.dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
  }
}

// Quantizes rows [first, last) of w; the error of the first non-finite element met.
absl::Status QuantizeRows(const TensorView& w, int64_t first, int64_t last, f8e4m3_t* codes,
                          float* scales) {
  const int64_t cols = w.shape[1];
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = first; r < last; ++r) {
    DecodeRow(w, r, cols, row.data());
    float absmax = 0.0f;
    bool finite = true;
    for (const float v : row) {
      const float a = std::fabs(v);
      finite &= a <= 3.4028235e38f;  // false for NaN and inf
      absmax = std::max(absmax, a);
    }
    if (!finite) {
      const auto bad =
          std::find_if(row.begin(), row.end(), [](float v) { return !std::isfinite(v); });
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", w.name, "\" holds ", std::isnan(*bad) ? "NaN" : (*bad > 0 ? "inf" : "-inf"),
          " at row ", r, ", column ", bad - row.begin(),
          ": a weight that is not finite cannot be quantized to FP8 (is the checkpoint intact?)"));
    }
    float scale = absmax / kF8E4M3Max;
    if (scale == 0.0f) scale = 1.0f;
    scales[r] = scale;
    f8e4m3_t* dst = codes + r * cols;
    for (int64_t c = 0; c < cols; ++c) dst[c] = FloatToF8E4M3(row[static_cast<size_t>(c)] / scale);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeFp8PerRow(const TensorView& w, f8e4m3_t* codes, float* scales) {
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && w.dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", w.name, "\" has dtype ", std::string(DTypeName(w.dtype)),
                     ": only f32, bf16 or f16 matrices are quantized to FP8"));
  }
  if (w.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", w.name, "\" has ", w.shape.size(),
                                                   " dimensions: FP8 quantization takes a matrix"));
  }
  const int64_t rows = w.shape[0];
  const int64_t elements = rows * w.shape[1];
  const unsigned threads = static_cast<unsigned>(std::clamp<int64_t>(
      std::min<int64_t>(elements / kElementsPerThread, rows), 1,
      std::min(std::max(std::thread::hardware_concurrency(), 1u), kMaxThreads)));
  if (threads == 1) return QuantizeRows(w, 0, rows, codes, scales);
  std::vector<absl::Status> status(threads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    auto part = [&, t] {
      status[t] = QuantizeRows(w, rows * t / threads, rows * (t + 1) / threads, codes, scales);
    };
    try {
      pool.emplace_back(part);
    } catch (const std::system_error&) {
      part();  // no thread to be had: this part on the caller's
    }
  }
  for (std::thread& thread : pool) thread.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;  // the first bad row's
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
