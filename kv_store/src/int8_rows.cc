#include "tandem/kv_store/int8_rows.h"

#include <bit>
#include <cmath>

#include "tandem/common/bf16.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TANDEM_INT8_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_INT8_CLONES
#endif

namespace tandem::kv_store {
namespace {

constexpr float kQMax = 127.0f;
// Adding and subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to the nearest integer,
// ties to even (the default rounding mode), and vectorises where nearbyint may not.
constexpr float kRoundMagic = 12582912.0f;

size_t Int8RowBytes(uint32_t head_dim) { return head_dim + kInt8ScaleBytes; }

// One row: x [d] f32 -> q [d] int8 and its scale at q + d.
TANDEM_INT8_CLONES
void QuantizeRowF32(const float* x, uint32_t d, std::byte* dst) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (uint32_t i = 0; i < d; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax && a <= 3.4e38f ? a : amax;  // skips NaN and inf
  }
  const float scale = amax / kQMax;
  const float inv = amax > 0.0f ? kQMax / amax : 0.0f;
  auto* q = reinterpret_cast<int8_t*>(dst);
#pragma omp simd
  for (uint32_t i = 0; i < d; ++i) {
    float r = x[i] * inv;
    r = r > kQMax ? kQMax : r;
    r = r < -kQMax ? -kQMax : r;
    r = r == r ? r : 0.0f;  // NaN
    q[i] = static_cast<int8_t>((r + kRoundMagic) - kRoundMagic);
  }
  std::memcpy(dst + d, &scale, sizeof(scale));
}

TANDEM_INT8_CLONES
void WidenBf16(const bf16_t* src, size_t n, float* dst) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
  }
}

TANDEM_INT8_CLONES
void DequantizeRowF32(const std::byte* row, uint32_t d, float* dst) {
  const float s = Int8RowScale(row, d);
  const auto* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
  for (uint32_t i = 0; i < d; ++i) dst[i] = static_cast<float>(q[i]) * s;
}

TANDEM_INT8_CLONES
void DequantizeRowBf16(const std::byte* row, uint32_t d, bf16_t* dst) {
  const float s = Int8RowScale(row, d);
  const auto* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
  for (uint32_t i = 0; i < d; ++i) {
    // Round to nearest-even (q * s is finite: no NaN case).
    const float f = static_cast<float>(q[i]) * s;
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    dst[i] = static_cast<bf16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

}  // namespace

void QuantizeRowsInt8(const std::byte* src, KvDType src_dtype, size_t rows, uint32_t head_dim,
                      std::byte* dst) {
  const size_t out_row = Int8RowBytes(head_dim);
  if (src_dtype == KvDType::kF32) {
    const auto* x = reinterpret_cast<const float*>(src);
    for (size_t r = 0; r < rows; ++r) QuantizeRowF32(x + r * head_dim, head_dim, dst + r * out_row);
    return;
  }
  float wide[256];  // head_dim <= 256 (BlockFormat::Validate)
  const auto* x = reinterpret_cast<const bf16_t*>(src);
  for (size_t r = 0; r < rows; ++r) {
    WidenBf16(x + r * head_dim, head_dim, wide);
    QuantizeRowF32(wide, head_dim, dst + r * out_row);
  }
}

void DequantizeRowsInt8(const std::byte* src, size_t rows, uint32_t head_dim, KvDType dst_dtype,
                        std::byte* dst) {
  const size_t in_row = Int8RowBytes(head_dim);
  for (size_t r = 0; r < rows; ++r) {
    if (dst_dtype == KvDType::kF32) {
      DequantizeRowF32(src + r * in_row, head_dim, reinterpret_cast<float*>(dst) + r * head_dim);
    } else {
      DequantizeRowBf16(src + r * in_row, head_dim, reinterpret_cast<bf16_t*>(dst) + r * head_dim);
    }
  }
}

void ConvertRows(const std::byte* src, KvDType src_dtype, size_t rows, uint32_t head_dim,
                 std::byte* dst, KvDType dst_dtype) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, rows * BlockFormat{16, head_dim, src_dtype}.row_bytes());
  } else if (dst_dtype == KvDType::kInt8) {
    QuantizeRowsInt8(src, src_dtype, rows, head_dim, dst);
  } else if (src_dtype == KvDType::kInt8) {
    DequantizeRowsInt8(src, rows, head_dim, dst_dtype, dst);
  } else if (src_dtype == KvDType::kBf16) {  // bf16 -> f32
    WidenBf16(reinterpret_cast<const bf16_t*>(src), rows * head_dim, reinterpret_cast<float*>(dst));
  } else {  // f32 -> bf16
    const auto* x = reinterpret_cast<const float*>(src);
    auto* y = reinterpret_cast<bf16_t*>(dst);
    for (size_t i = 0; i < rows * head_dim; ++i) y[i] = FloatToBf16(x[i]);
  }
}

}  // namespace tandem::kv_store
