// Naive double-precision references of every Backend operation (backend.h), written straight
// from the contract comments with plain loops: the oracle of the backend tests (cpu and cuda).
//
// Each function takes the operation's own parameter struct with HOST pointers and writes its
// outputs (float, like the backends) through them. Math runs in double, except where backend.h
// fixes a rounding step: MatMul rounds x to the weight dtype first, Rope forms its angle in f32
// as float(pos) · inv_freq[i], WriteKv rounds to the cache dtype. O(T · slots · D) time: for
// tests only. Header-only; depends on nothing but backend.h, dtype.h and bf16.h.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "tandem/common/bf16.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::reference {

// IEEE binary16 -> binary32 (exact).
inline float F16ToFloat(uint16_t h) {
  const int sign = (h & 0x8000) != 0 ? -1 : 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  if (e == 0) return static_cast<float>(sign * std::ldexp(static_cast<double>(m), -24));
  if (e == 31) {
    return m == 0 ? sign * std::numeric_limits<float>::infinity()
                  : std::numeric_limits<float>::quiet_NaN();
  }
  return static_cast<float>(sign * std::ldexp(1.0 + m / 1024.0, e - 15));
}

// binary32 -> binary16, round to nearest even (by search over the two neighbours: slow, exact).
inline uint16_t FloatToF16(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::abs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // 65520 is halfway to 2^16: ties to even = inf
  // The largest finite half <= a, then round up if closer (or tied and its bits are odd).
  uint16_t lo = 0;
  for (int bit = 14; bit >= 0; --bit) {
    const uint16_t trial = lo | static_cast<uint16_t>(1u << bit);
    if (trial < 0x7c00 && F16ToFloat(trial) <= a) lo = trial;
  }
  const double below = F16ToFloat(lo);
  if (below == a) return sign | lo;
  const double above = F16ToFloat(static_cast<uint16_t>(lo + 1));
  const double d_lo = a - below, d_hi = above - a;
  const bool up = d_hi < d_lo || (d_hi == d_lo && (lo & 1u) != 0);
  return sign | static_cast<uint16_t>(up ? lo + 1 : lo);
}

// x rounded to `dtype` and widened back (f32: unchanged).
inline float RoundTo(float x, DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToFloat(FloatToBf16(x));
    case DType::kF16:
      return F16ToFloat(FloatToF16(x));
    default:
      return x;
  }
}

// Element i of an array of `dtype` (f32, bf16, f16) as double.
inline double Load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const bf16_t*>(base)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(base)[i];
    case DType::kF8E4M3:
      return F8E4M3ToFloat(static_cast<const uint8_t*>(base)[i]);
  }
  return 0.0;
}

inline void Embed(const EmbedParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t c = 0; c < p.hidden; ++c) {
      p.out[t * p.hidden + c] =
          static_cast<float>(Load(p.table, p.table_dtype, p.ids[t] * p.hidden + c));
    }
  }
}

inline void RmsNorm(const RmsNormParams& p) {
  const int64_t stride = p.token_stride != 0 ? p.token_stride : p.vectors_per_token * p.hidden;
  for (int64_t r = 0; r < p.num_tokens * p.vectors_per_token; ++r) {
    const int64_t offset = r / p.vectors_per_token * stride + r % p.vectors_per_token * p.hidden;
    const float* x = p.x + offset;
    double sum_sq = 0.0;
    for (int64_t c = 0; c < p.hidden; ++c) sum_sq += static_cast<double>(x[c]) * x[c];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / p.hidden + p.eps);
    std::vector<double> out(p.hidden);
    for (int64_t c = 0; c < p.hidden; ++c) {
      out[c] = x[c] * inv_rms * Load(p.weight, p.weight_dtype, c);
    }
    for (int64_t c = 0; c < p.hidden; ++c) p.out[offset + c] = static_cast<float>(out[c]);
  }
}

inline void MatMul(const MatMulParams& p) {
  std::vector<double> w(static_cast<size_t>(p.n * p.k));
  for (int64_t i = 0; i < p.n * p.k; ++i) w[i] = Load(p.w, p.w_dtype, i);
  std::vector<double> x(static_cast<size_t>(p.k));
  for (int64_t i = 0; i < p.m; ++i) {
    // x is rounded to the weight dtype first (backend.h numerics).
    for (int64_t c = 0; c < p.k; ++c) x[c] = RoundTo(p.x[i * p.k + c], p.w_dtype);
    for (int64_t j = 0; j < p.n; ++j) {
      double sum = 0.0;
      for (int64_t c = 0; c < p.k; ++c) sum += x[c] * w[j * p.k + c];
      if (p.bias != nullptr) sum += p.bias[j];
      if (p.accumulate) sum += p.y[i * p.n + j];
      p.y[i * p.n + j] = static_cast<float>(sum);
    }
  }
}

inline void Rope(const RopeParams& p) {
  const int64_t half = p.head_dim / 2;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      float* x = p.x + t * p.row_stride + h * p.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(p.positions[t]) *
                            p.inv_freq[t * p.inv_freq_row_stride + i];  // f32, as specified
        const double c = std::cos(static_cast<double>(angle)) * p.attention_scaling;
        const double s = std::sin(static_cast<double>(angle)) * p.attention_scaling;
        const double a = x[i], b = x[i + half];
        x[i] = static_cast<float>(a * c - b * s);
        x[i + half] = static_cast<float>(b * c + a * s);
      }
    }
  }
}

inline void SwiGlu(const SwiGluParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t i = 0; i < p.ffn; ++i) {
      const double g = p.gate_up[t * 2 * p.ffn + i];
      const double u = p.gate_up[t * 2 * p.ffn + p.ffn + i];
      p.out[t * p.ffn + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
  }
}

inline void WriteKv(const WriteKvParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t d = 0; d < p.head_dim; ++d) {
        const int64_t src = t * p.row_stride + h * p.head_dim + d;
        const int64_t dst = (h * p.capacity + p.slots[t]) * p.head_dim + d;
        if (p.cache_dtype == DType::kBF16) {
          static_cast<bf16_t*>(p.k_cache)[dst] = FloatToBf16(p.k[src]);
          static_cast<bf16_t*>(p.v_cache)[dst] = FloatToBf16(p.v[src]);
        } else {
          static_cast<float*>(p.k_cache)[dst] = p.k[src];
          static_cast<float*>(p.v_cache)[dst] = p.v[src];
        }
      }
    }
  }
}

// Attention over the visible slots and the MAW update, in double.
inline void WindowAttention(const WindowAttentionParams& p) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const int64_t G = p.num_q_heads / p.num_kv_heads, D = p.head_dim;
  // a[g, s]: Σ over tokens and the group's heads of the weights (divided by T·G at the end).
  std::vector<double> a(static_cast<size_t>(p.num_kv_heads * std::max<int64_t>(p.num_slots, 1)),
                        0.0);
  std::vector<double> score(static_cast<size_t>(std::max<int64_t>(p.num_slots, 1)));
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t h = 0; h < p.num_q_heads; ++h) {
      const int64_t g = h / G;
      const float* q = p.q + t * p.q_row_stride + h * D;
      double m = kNegInf;
      for (int64_t s = 0; s < p.num_slots; ++s) {
        const bool visible = p.slot_pos[s] >= 0 && p.slot_pos[s] <= p.q_pos[t];
        score[s] = kNegInf;
        if (!visible) continue;
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          dot += static_cast<double>(q[d]) *
                 Load(p.k_cache, p.cache_dtype, (g * p.capacity + s) * D + d);
        }
        score[s] = dot * p.scale;
        m = std::max(m, score[s]);
      }
      float* o = p.o + (t * p.num_q_heads + h) * D;
      if (m == kNegInf) {  // no visible entry: the empty state
        std::fill_n(o, D, 0.0f);
        p.lse[t * p.num_q_heads + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      for (int64_t s = 0; s < p.num_slots; ++s) {
        if (score[s] != kNegInf) sum += std::exp(score[s] - m);
      }
      const double lse = m + std::log(sum);
      std::vector<double> out(D, 0.0);
      for (int64_t s = 0; s < p.num_slots; ++s) {
        if (score[s] == kNegInf) continue;
        const double w = std::exp(score[s] - lse);
        a[g * p.num_slots + s] += w;
        for (int64_t d = 0; d < D; ++d) {
          out[d] += w * Load(p.v_cache, p.cache_dtype, (g * p.capacity + s) * D + d);
        }
      }
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(out[d]);
      p.lse[t * p.num_q_heads + h] = static_cast<float>(lse);
    }
  }
  if (p.maw == nullptr) return;
  for (int64_t g = 0; g < p.num_kv_heads; ++g) {
    for (int64_t s = 0; s < p.num_slots; ++s) {
      if (p.slot_pos[s] < 0) continue;
      const double mean = a[g * p.num_slots + s] / static_cast<double>(p.num_tokens * G);
      float& maw = p.maw[g * p.capacity + s];
      maw = static_cast<float>(maw < 0.0f ? mean : (1.0 - p.alpha) * maw + p.alpha * mean);
    }
  }
}

inline void MergeStates(const MergeParams& p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < p.rows; ++r) {
    float* o_dst = p.o_dst + r * p.head_dim;
    const float* o_src = p.o_src + r * p.head_dim;
    const float lse_a = p.lse_dst[r], lse_b = p.lse_src[r];
    if (lse_a == kNegInf && lse_b == kNegInf) {
      std::fill_n(o_dst, p.head_dim, 0.0f);
      continue;
    }
    if (lse_b == kNegInf) continue;
    if (lse_a == kNegInf) {
      std::copy_n(o_src, p.head_dim, o_dst);
      p.lse_dst[r] = lse_b;
      continue;
    }
    const double m = std::max<double>(lse_a, lse_b);
    const double w_a = std::exp(lse_a - m), w_b = std::exp(lse_b - m);
    for (int64_t d = 0; d < p.head_dim; ++d) {
      o_dst[d] = static_cast<float>((w_a * o_dst[d] + w_b * o_src[d]) / (w_a + w_b));
    }
    p.lse_dst[r] = static_cast<float>(m + std::log(w_a + w_b));
  }
}

// The sampling rule of backend.h. The top-p mass is that of the distribution renormalised over
// the top-k tokens.
inline int32_t Sample(const SampleParams& p) {
  int64_t best = 0;
  for (int64_t i = 1; i < p.vocab; ++i) {
    if (p.logits[i] > p.logits[best]) best = i;
  }
  if (p.temperature <= 0.0f) return static_cast<int32_t>(best);
  std::vector<double> prob(p.vocab);
  double total = 0.0;
  for (int64_t i = 0; i < p.vocab; ++i) {
    prob[i] = std::exp((static_cast<double>(p.logits[i]) - p.logits[best]) / p.temperature);
    total += prob[i];
  }
  for (double& x : prob) x /= total;
  std::vector<int32_t> order(p.vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return prob[a] > prob[b]; });
  int64_t keep = p.top_k > 0 ? std::min<int64_t>(p.top_k, p.vocab) : p.vocab;
  if (p.top_p < 1.0f) {
    double top_k_mass = 0.0;
    for (int64_t i = 0; i < keep; ++i) top_k_mass += prob[order[i]];
    double mass = 0.0;
    int64_t n = 0;
    while (n < keep && (n == 0 || mass < p.top_p * top_k_mass)) mass += prob[order[n++]];
    keep = n;
  }
  std::vector<bool> kept(p.vocab, false);
  double kept_mass = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    kept[order[i]] = true;
    kept_mass += prob[order[i]];
  }
  double cumulative = 0.0;
  int32_t last = static_cast<int32_t>(best);
  for (int64_t i = 0; i < p.vocab; ++i) {
    if (!kept[i]) continue;
    cumulative += prob[i];
    last = static_cast<int32_t>(i);
    if (cumulative > p.uniform * kept_mass) return last;
  }
  return last;
}

inline void TokenLogProbs(const TokenLogProbParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* row = p.logits + t * p.vocab;
    const double m = *std::max_element(row, row + p.vocab);
    double sum = 0.0;
    for (int64_t i = 0; i < p.vocab; ++i) sum += std::exp(row[i] - m);
    p.out[t] = static_cast<float>(row[p.targets[t]] - m - std::log(sum));
  }
}

}  // namespace tandem::gpu_worker::reference
