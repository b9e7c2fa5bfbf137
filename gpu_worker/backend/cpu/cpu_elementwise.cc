#include "cpu_elementwise.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_format.h"
#include "cpu_vector_kernels.h"

namespace tandem::gpu_worker::cpu {
namespace {

bool IsFloatType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// dst[i] = float(src[i]) for n elements of `dtype` (f32, bf16 or f16).
void ToF32(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::kBF16:
      Bf16ToF32(static_cast<const uint16_t*>(src), dst, n);
      break;
    case DType::kF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(h[i]);
      break;
    }
    case DType::kI32:
    case DType::kF8E4M3:
      break;  // rejected by the callers' validation
  }
}

}  // namespace

absl::Status RunEmbed(const EmbedParams& p) {
  if (p.ids == nullptr || p.table == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("Embed: ids, table and out must not be null");
  }
  if (p.num_tokens <= 0 || p.hidden <= 0 || p.vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Embed: num_tokens (%d), hidden (%d), vocab (%d) must be positive",
                        p.num_tokens, p.hidden, p.vocab));
  }
  if (!IsFloatType(p.table_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Embed: table dtype %s is not f32, bf16 or f16", DTypeName(p.table_dtype)));
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.ids[t] < 0 || p.ids[t] >= p.vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Embed: ids[%d] = %d is outside [0, %d)", t, p.ids[t], p.vocab));
    }
  }
  const size_t row_bytes = static_cast<size_t>(p.hidden) * DTypeBytes(p.table_dtype);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const auto* row =
        static_cast<const std::byte*>(p.table) + row_bytes * static_cast<size_t>(p.ids[t]);
    ToF32(row, p.table_dtype, p.hidden, p.out + t * p.hidden);
  }
  return absl::OkStatus();
}

absl::Status RunRmsNorm(const RmsNormParams& p, ScratchBuffer& scratch) {
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("RmsNorm: x, weight and out must not be null");
  }
  if (p.num_tokens <= 0 || p.hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RmsNorm: num_tokens (%d) and hidden (%d) must be positive", p.num_tokens, p.hidden));
  }
  if (!IsFloatType(p.weight_dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RmsNorm: weight dtype %s is not f32, bf16 or f16", DTypeName(p.weight_dtype)));
  }
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return absl::InvalidArgumentError("RmsNorm: eps must be finite and >= 0");
  }
  const int64_t per_token = p.vectors_per_token;
  if (per_token < 1 || per_token > (int64_t{1} << 20) ||
      (p.token_stride != 0 && p.token_stride < per_token * p.hidden)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RmsNorm: vectors_per_token (%d) must be in [1, 2^20] and token_stride (%d) 0 or at "
        "least vectors_per_token x hidden (%d)",
        per_token, p.token_stride, per_token * p.hidden));
  }
  const int64_t stride = p.token_stride != 0 ? p.token_stride : per_token * p.hidden;
  const float* w = static_cast<const float*>(p.weight);
  if (p.weight_dtype != DType::kF32) {
    float* wf = scratch.Get<float>(static_cast<size_t>(p.hidden));
    if (wf == nullptr) return absl::ResourceExhaustedError("RmsNorm: out of memory for weights");
    ToF32(p.weight, p.weight_dtype, p.hidden, wf);
    w = wf;
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t v = 0; v < per_token; ++v) {
      const int64_t offset = t * stride + v * p.hidden;
      const float* x = p.x + offset;
      const float mean_sq = SumSquares(x, p.hidden) / static_cast<float>(p.hidden);
      const float inv_rms = 1.0f / std::sqrt(mean_sq + p.eps);
      ScaleByWeights(x, w, inv_rms, p.hidden, p.out + offset);  // out may alias x
    }
  }
  return absl::OkStatus();
}

absl::Status RunRope(const RopeParams& p, ScratchBuffer& scratch) {
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr) {
    return absl::InvalidArgumentError("Rope: x, positions and inv_freq must not be null");
  }
  if (p.num_tokens <= 0 || p.num_heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Rope: num_tokens (%d), num_heads (%d) must be positive and head_dim (%d) positive and "
        "even",
        p.num_tokens, p.num_heads, p.head_dim));
  }
  if (p.row_stride < p.num_heads * p.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Rope: row_stride %d is below num_heads · head_dim = %d", p.row_stride,
                        p.num_heads * p.head_dim));
  }
  const int64_t half = p.head_dim / 2;
  if (p.inv_freq_row_stride != 0 && p.inv_freq_row_stride < half) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Rope: inv_freq_row_stride %d is neither 0 nor >= head_dim / 2 = %d",
                        p.inv_freq_row_stride, half));
  }
  float* cs = scratch.Get<float>(2 * static_cast<size_t>(half));
  if (cs == nullptr) return absl::ResourceExhaustedError("Rope: out of memory for the table");
  float* sn = cs + half;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    // Angles in f32 as float(pos) · inv_freq[i] (transformers does the same), then cos/sin.
    const float pos = static_cast<float>(p.positions[t]);
    const float* inv_freq = p.inv_freq + t * p.inv_freq_row_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cs[i] = std::cos(angle) * p.attention_scaling;
      sn[i] = std::sin(angle) * p.attention_scaling;
    }
    float* row = p.x + t * p.row_stride;
    for (int64_t h = 0; h < p.num_heads; ++h) {
      float* x = row + h * p.head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i];
        const float b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i] + a * sn[i];
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RunSwiGlu(const SwiGluParams& p) {
  if (p.gate_up == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("SwiGlu: gate_up and out must not be null");
  }
  if (p.num_tokens <= 0 || p.ffn <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SwiGlu: num_tokens (%d) and ffn (%d) must be positive", p.num_tokens, p.ffn));
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* gate = p.gate_up + t * 2 * p.ffn;
    SiluMul(gate, gate + p.ffn, p.ffn, p.out + t * p.ffn);
  }
  return absl::OkStatus();
}

absl::Status RunWriteKv(const WriteKvParams& p) {
  if (p.k == nullptr || p.v == nullptr || p.slots == nullptr || p.k_cache == nullptr ||
      p.v_cache == nullptr) {
    return absl::InvalidArgumentError("WriteKv: k, v, slots and the caches must not be null");
  }
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0 || p.capacity <= 0 || p.head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "WriteKv: num_tokens (%d), num_kv_heads (%d), capacity (%d), head_dim (%d) must be "
        "positive",
        p.num_tokens, p.num_kv_heads, p.capacity, p.head_dim));
  }
  if (p.cache_dtype != DType::kF32 && p.cache_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WriteKv: cache dtype %s is not f32 or bf16", DTypeName(p.cache_dtype)));
  }
  if (p.row_stride < p.num_kv_heads * p.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("WriteKv: row_stride %d is below num_kv_heads · head_dim = %d",
                        p.row_stride, p.num_kv_heads * p.head_dim));
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.slots[t] < 0 || p.slots[t] >= p.capacity) {
      return absl::InvalidArgumentError(
          absl::StrFormat("WriteKv: slots[%d] = %d is outside [0, %d)", t, p.slots[t], p.capacity));
    }
  }
  const int64_t D = p.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const float* k = p.k + t * p.row_stride + h * D;
      const float* v = p.v + t * p.row_stride + h * D;
      const int64_t dst = (h * p.capacity + p.slots[t]) * D;  // element offset in the caches
      if (p.cache_dtype == DType::kF32) {
        std::memcpy(static_cast<float*>(p.k_cache) + dst, k,
                    static_cast<size_t>(D) * sizeof(float));
        std::memcpy(static_cast<float*>(p.v_cache) + dst, v,
                    static_cast<size_t>(D) * sizeof(float));
      } else {
        F32ToBf16(k, static_cast<uint16_t*>(p.k_cache) + dst, D);
        F32ToBf16(v, static_cast<uint16_t*>(p.v_cache) + dst, D);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker::cpu
